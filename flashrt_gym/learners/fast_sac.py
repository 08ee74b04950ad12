"""FastSAC: soft actor-critic for thousands of env slots, resident on the learner's device.

SB3's loop moves every transition through NumPy and a host replay buffer and launches each
update from Python; on this env that caps learning at a small fraction of what the env can
step. FastSAC keeps everything on the device, in the manner of FastTD3 and LeanRL:

* the whole learner state (actor, twin critics, target critics, Adam moments, the entropy
  coefficient, a static replay ring) is one :class:`~flashrt.runtime.BufferSet`, so a
  checkpoint is a set of named tensors (safetensors) and nothing is ever reallocated;
* a gradient step (sample, critic, actor and entropy losses, one backward pass, one Adam step,
  the Polyak update) is captured by :class:`flashrt.runtime.Graph` ``updates_per_step`` times
  over into one graph, replayed once per env step; the twin critics run as one batched MLP;
* gradients, critic parameters and target parameters each lie in one contiguous span of the
  arena: zeroing the gradients, the Polyak update (one ``lerp_``) and the data-parallel
  all-reduce are one operation each;
* sampling draws its rows on the device; nothing reads a value back to the host except
  :meth:`FastSAC.stats`, which the training loop calls at its logging points.

The update follows SB3's SAC (clipped double Q, automatic entropy coefficient, squashed
Gaussian actor, LayerNorm networks as in DSRL), with one difference of order: the actor's loss
uses the critics from before this step's critic update, so that all three losses share one
backward pass and, under data parallelism, one all-reduce.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save
from torch import nn

from flashrt import runtime
from flashrt.runtime import BufferSet, atomic_write, scratch, shared
from flashrt_gym.learners import CPU_BUDGET

LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0  # SB3's bounds on the actor's log standard deviation
REPLAY = ("obs", "action", "reward", "next_obs", "not_done")
STATS = ("critic_loss", "actor_loss", "alpha", "entropy", "q")
FORMAT = "flashrt_gym.fast_sac/1"  # the checkpoint format's name (not a module path)
GPU_BUDGET: Mapping[str, Any] = {
    "env.num_envs": 2048,
    "total_steps": 10_000_000,
    "time_limit_s": 540,
    "time_limit_includes_eval": False,
    "eval.every": 500_000,
    "eval.episodes": 512,
    "eval.test_episodes": 1024,
    "agent.kwargs.batch_size": 4096,
    "agent.kwargs.buffer_size": 1 << 20,
}
"""FastSAC's run on a GPU: thousands of slots, large batches, the run inside ten minutes."""


@dataclass(frozen=True)
class FastSACConfig:
    """Hyper-parameters of :class:`FastSAC` (sizes are per data-parallel rank)."""

    hidden: tuple[int, ...] = (256, 256, 256)
    """Hidden widths of the actor and of each critic (LayerNorm + ReLU after each)."""
    gamma: float = 0.9
    """Discount per env step (one action chunk)."""
    tau: float = 0.005
    """Polyak rate of the target critics, per gradient step."""
    lr: float = 3e-4
    """Adam learning rate of the actor, the critics and the entropy coefficient."""
    batch_size: int = 4096
    """Transitions per gradient step."""
    buffer_size: int = 1 << 20
    """Replay capacity in transitions (rounded up to a whole number of env steps)."""
    updates_per_step: int = 8
    """Gradient steps per env step of all slots."""
    target_entropy: float = 0.0
    """Entropy the coefficient steers to (DSRL's 0 keeps the noise near the policy's own)."""
    init_alpha: float = 1.0
    """Initial entropy coefficient."""
    learning_starts: int = 0
    """Transitions stored before the first update (at least one batch is always waited for)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "hidden", tuple(int(h) for h in self.hidden))
        checks = {
            "hidden": bool(self.hidden) and min(self.hidden) > 0,
            "gamma": 0 <= self.gamma < 1,
            "tau": 0 < self.tau <= 1,
            "lr": self.lr > 0,
            "batch_size": self.batch_size > 0,
            "buffer_size": self.buffer_size > 0,
            "updates_per_step": self.updates_per_step > 0,
            "init_alpha": self.init_alpha > 0,
            "learning_starts": self.learning_starts >= 0,
        }
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"FastSACConfig: out of range: {', '.join(f'{k}={getattr(self, k)!r}' for k in bad)}")


def mlp(d_in: int, hidden: tuple[int, ...]) -> nn.Sequential:
    """Linear -> LayerNorm -> ReLU for each hidden width."""
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(d_in, h), nn.LayerNorm(h), nn.ReLU()]
        d_in = h
    return nn.Sequential(*layers)


class Actor(nn.Module):
    """A tanh-squashed Gaussian policy: ``obs -> (action in [-1, 1], log-probability)``."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: tuple[int, ...]) -> None:
        super().__init__()
        self.trunk = mlp(obs_dim, hidden)
        self.mean = nn.Linear(hidden[-1], act_dim)
        self.log_std = nn.Linear(hidden[-1], act_dim)

    def forward(self, obs: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.trunk(obs)
        mean = self.mean(h)
        if deterministic:
            return torch.tanh(mean), None
        log_std = self.log_std(h).clamp(LOG_STD_MIN, LOG_STD_MAX)
        eps = torch.randn_like(mean)
        u = mean + log_std.exp() * eps
        log_prob = (-0.5 * eps.square() - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        log_prob = log_prob - (2 * (math.log(2) - u - F.softplus(-2 * u))).sum(-1)  # log |d tanh(u) / du|
        return torch.tanh(u), log_prob


class EnsembleLinear(nn.Module):
    """``n`` independent linear layers applied to ``(n, batch, d_in)`` in one batched GEMM
    (initialised as ``nn.Linear``)."""

    def __init__(self, n: int, d_in: int, d_out: int) -> None:
        super().__init__()
        bound = 1 / math.sqrt(d_in)
        self.weight = nn.Parameter(torch.empty(n, d_in, d_out).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(n, 1, d_out).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.baddbmm(self.bias, x, self.weight)


class EnsembleLayerNorm(nn.Module):
    """LayerNorm over the last dimension with a scale and shift per ensemble member."""

    def __init__(self, n: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, 1, d))
        self.bias = nn.Parameter(torch.zeros(n, 1, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.bias, F.layer_norm(x, x.shape[-1:]), self.weight)


class Critics(nn.Module):
    """``n`` Q-networks (LayerNorm MLPs) evaluated together: ``(obs, action) -> (n, batch)``."""

    def __init__(self, obs_dim: int, act_dim: int, hidden: tuple[int, ...], n: int = 2) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d_in = obs_dim + act_dim
        for h in hidden:
            layers += [EnsembleLinear(n, d_in, h), EnsembleLayerNorm(n, h), nn.ReLU()]
            d_in = h
        self.net = nn.Sequential(*layers, EnsembleLinear(n, d_in, 1))
        self.n = n

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        x = torch.cat([obs, action], -1)
        return self.net(x.expand(self.n, *x.shape)).squeeze(-1)


def _span(bufs: BufferSet, names: list[str]) -> torch.Tensor:
    """The float32 view of the arena bytes from the first to the last of ``names`` (declared
    back to back, so that the span holds them and only alignment padding between them)."""
    first, last = bufs.placements[names[0]], bufs.placements[names[-1]]
    arena = bufs.shared_arena if first.spec.kind == "shared" else bufs.scratch_arena
    return arena[first.offset : last.offset + last.spec.nbytes].view(torch.float32)


class FastSAC:
    """SAC over ``num_envs`` slots whose transitions arrive as device tensors.

    Args:
        obs_dim, act_dim: sizes of the (flat) observation and of the action in [-1, 1].
        num_envs: slots stored per :meth:`store` call (this rank's).
        cfg: hyper-parameters.
        device: where the state lives and the update runs.
        seed: seeds the network initialisation (the same on every rank).
        graphs: capture the update as a CUDA graph on CUDA (eager otherwise, and on the CPU).
        world_size: data-parallel ranks; above 1, gradients are averaged over the default
            ``torch.distributed`` process group and rank 0's initial state is broadcast.

    Example:
        >>> sac = FastSAC(15, 16, num_envs=1024, cfg=FastSACConfig(), device="cuda")
        >>> action = sac.act(obs)
        >>> sac.store(obs, action, reward, next_obs, ~terminated)
        >>> sac.update()  # cfg.updates_per_step captured gradient steps, once enough is stored
    """

    config_class: ClassVar[type] = FastSACConfig

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        num_envs: int,
        cfg: FastSACConfig,
        device: torch.device | str = "cpu",
        *,
        seed: int = 0,
        graphs: bool = True,
        world_size: int = 1,
    ) -> None:
        self.obs_dim, self.act_dim, self.num_envs, self.cfg = int(obs_dim), int(act_dim), int(num_envs), cfg
        self.device, self.world_size = torch.device(device), int(world_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.actor = Actor(obs_dim, act_dim, cfg.hidden)
            self.critic = Critics(obs_dim, act_dim, cfg.hidden)
        self.target = copy.deepcopy(self.critic).requires_grad_(False)
        self.log_alpha = nn.Parameter(torch.tensor(math.log(cfg.init_alpha), device=self.device))
        for m in (self.actor, self.critic, self.target):
            m.to(self.device)
        params = {
            **{f"actor.{k}": p for k, p in self.actor.named_parameters()},
            **{f"critic.{k}": p for k, p in self.critic.named_parameters()},
            "log_alpha": self.log_alpha,
        }
        targets = {f"target.{k}": p for k, p in self.target.named_parameters()}
        self.ring_steps = -(-cfg.buffer_size // self.num_envs)
        rows = self.ring_steps * self.num_envs
        specs = [shared(f"param.{k}", p.shape) for k, p in params.items()]
        specs += [shared(k, p.shape) for k, p in targets.items()]
        specs += [shared(f"adam.{m}.{k}", p.shape) for m in ("exp_avg", "exp_avg_sq") for k, p in params.items()]
        specs += [shared(f"adam.step.{k}", ()) for k in params]
        specs += [shared("stats", (len(STATS) + 1,))]  # sums since the last read; the last entry counts updates
        specs += [
            shared("replay.obs", (rows, obs_dim)),
            shared("replay.action", (rows, act_dim)),
            shared("replay.reward", (rows,)),
            shared("replay.next_obs", (rows, obs_dim)),
            shared("replay.not_done", (rows,)),  # 0 where the episode terminated (a time-limit cut bootstraps)
            shared("replay.pos", (), torch.int64),  # the env step the next store writes, mod ring_steps
            shared("replay.filled", (), torch.float64),  # rows holding data (float64: uniforms times it stay below)
        ]
        specs += [scratch(f"grad.{k}", p.shape) for k, p in params.items()]
        self.bufs = BufferSet(specs, 1, self.device)
        b = self.bufs
        for k, p in params.items():
            b[f"param.{k}"].copy_(p.detach())
            p.data, p.grad = b[f"param.{k}"], b[f"grad.{k}"]
        for k, p in targets.items():
            b[k].copy_(p)
            p.data = b[k]
        critic_names = [f"param.critic.{k}" for k, _ in self.critic.named_parameters()]
        self._critic, self._target = _span(b, critic_names), _span(b, list(targets))
        self._grads = _span(b, [f"grad.{k}" for k in params])
        self._frozen_critic = {k: p.detach() for k, p in self.critic.named_parameters()}
        cuda = self.device.type == "cuda"
        self.opt = torch.optim.Adam(list(params.values()), lr=cfg.lr, capturable=cuda, fused=True if cuda else None)
        for k, p in params.items():
            self.opt.state[p] = {m: b[f"adam.{m}.{k}"] for m in ("step", "exp_avg", "exp_avg_sq")}
        self.graph = runtime.Graph("fast_sac.update", backend="auto" if graphs else "eager").bind(b)
        self._slots = torch.arange(self.num_envs, device=self.device)
        self.stored = 0  # transitions stored by this rank (a host count: no read-back to know it)
        self.updates = 0
        if self.world_size > 1:
            dist.broadcast(self.state_bytes(), 0)

    @classmethod
    def budget(cls, device: str) -> Mapping[str, Any]:
        """The ``auto`` values of a FastSAC run on ``device``: :data:`GPU_BUDGET` on ``"cuda"``,
        :data:`~flashrt_gym.learners.CPU_BUDGET` on ``"cpu"``."""
        return CPU_BUDGET if device == "cpu" else GPU_BUDGET

    # -- acting and storing --------------------------------------------------------------------
    @torch.no_grad()
    def act(self, obs: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """Actions in [-1, 1] for a batch of observations (sampled, or the mean's tanh)."""
        return self.actor(obs, deterministic)[0]

    @torch.no_grad()
    def store(
        self,
        obs: torch.Tensor,
        action: torch.Tensor,
        reward: torch.Tensor,
        next_obs: torch.Tensor,
        not_done: torch.Tensor,
    ) -> None:
        """Write one env step of every slot into the replay ring (device-side position)."""
        b = self.bufs
        rows = b["replay.pos"] * self.num_envs + self._slots
        for name, value in zip(REPLAY, (obs, action, reward, next_obs, not_done), strict=True):
            dst = b[f"replay.{name}"]
            dst.index_copy_(0, rows, value.reshape(self.num_envs, *dst.shape[1:]).to(dst.dtype))
        b["replay.pos"].add_(1).remainder_(self.ring_steps)
        b["replay.filled"].add_(self.num_envs).clamp_(max=self.ring_steps * self.num_envs)
        self.stored += self.num_envs

    @property
    def ready(self) -> bool:
        """Whether enough is stored for :meth:`update` to run."""
        return self.stored >= max(self.cfg.batch_size, self.cfg.learning_starts)

    # -- the update ----------------------------------------------------------------------------
    def _backward(self) -> None:
        """Sample a batch; the three losses' gradients into the gradient span; sum the stats."""
        b, c = self.bufs, self.cfg
        rows = (torch.rand(c.batch_size, device=self.device, dtype=torch.float64) * b["replay.filled"]).long()
        obs, action, reward, next_obs, not_done = (b[f"replay.{k}"][rows] for k in REPLAY)
        alpha = self.log_alpha.detach().exp()
        with torch.no_grad():
            next_action, next_log_prob = self.actor(next_obs)
            next_q = self.target(next_obs, next_action).min(0).values - alpha * next_log_prob
            target_q = reward + c.gamma * not_done * next_q
        q = self.critic(obs, action)
        critic_loss = 0.5 * (q - target_q).square().mean(-1).sum()
        action_pi, log_prob = self.actor(obs)
        q_pi = torch.func.functional_call(self.critic, self._frozen_critic, (obs, action_pi)).min(0).values
        actor_loss = (alpha * log_prob - q_pi).mean()
        alpha_loss = -(self.log_alpha * (log_prob.detach() + c.target_entropy)).mean()
        self._grads.zero_()
        (critic_loss + actor_loss + alpha_loss).backward()
        one = torch.ones((), device=self.device)
        stats = [critic_loss, actor_loss, alpha, -log_prob.mean(), q.mean(), one]
        b["stats"].add_(torch.stack(stats).detach())

    def _step(self) -> None:
        """Adam on every parameter, then the Polyak update of the target critics (with several
        ranks, the all-reduced gradient sums are first made means)."""
        if self.world_size > 1:
            self._grads.div_(self.world_size)
        self.opt.step()
        self._target.lerp_(self._critic, self.cfg.tau)

    def local_updates(self) -> None:
        """``updates_per_step`` whole gradient steps on this rank's replay, run eagerly: the
        program that :meth:`update` replays as one graph on a single rank (benchmarks count its
        operations)."""
        for _ in range(self.cfg.updates_per_step):
            self._backward()
            self._step()

    def capture(self) -> None:
        """Capture the update now rather than at the first :meth:`update` (warm-up included,
        capturing leaves the learner's state as it was)."""
        g = self.graph
        if self.world_size == 1:
            if "steps" not in g:
                g.capture("steps", self.local_updates, warmup=2)
        elif "backward" not in g:
            g.capture("backward", self._backward, warmup=3)
            g.capture("apply", self._step, warmup=3)

    def update(self) -> None:
        """``updates_per_step`` gradient steps, once a batch is stored: one replay of a graph
        that holds them all. With several ranks each step's gradients are averaged by one
        all-reduce between two captured halves (the collective itself stays outside the graphs)."""
        if not self.ready:
            return
        self.capture()
        if self.world_size == 1:
            self.graph.replay("steps")
        else:
            for _ in range(self.cfg.updates_per_step):
                self.graph.replay("backward")
                dist.all_reduce(self._grads)
                self.graph.replay("apply")
        self.updates += self.cfg.updates_per_step

    def stats(self) -> dict[str, float]:
        """Mean losses and coefficients over the updates since the last call (one read-back)."""
        values = self.bufs["stats"].tolist()
        self.bufs["stats"].zero_()
        n = max(values[-1], 1.0)
        return {k: v / n for k, v in zip(STATS, values, strict=False)} if values[-1] else {}

    # -- state on disk (safetensors) -----------------------------------------------------------
    def state_bytes(self) -> torch.Tensor:
        """The learner's state as one byte view of its buffer set: parameters, target critics
        and Adam state (declared first, back to back), not the replay ring. What rank 0
        broadcasts at the start, and what two learners compare to be equal."""
        last = self.bufs.placements[self._names(replay=False)[-1]]
        return self.bufs.shared_arena[: last.offset + last.spec.nbytes]

    def _names(self, replay: bool) -> list[str]:
        if replay:
            return [f"replay.{k}" for k in (*REPLAY, "pos", "filled")]
        return [n for n in self.bufs.names("shared") if n.split(".", 1)[0] in ("param", "target", "adam")]

    def _meta(self) -> dict[str, str]:
        layout = {"obs_dim": self.obs_dim, "act_dim": self.act_dim, "num_envs": self.num_envs, **asdict(self.cfg)}
        return {"format": FORMAT, "layout": json.dumps(layout)}

    def save(self, path: str | Path, *, replay: bool = False, metadata: dict[str, Any] | None = None) -> Path:
        """Write the learner state (or, with ``replay``, this rank's replay ring) to a
        safetensors file, atomically; ``metadata`` (JSON-able) rides along."""
        tensors = {n: self.bufs[n].to("cpu", copy=True) for n in self._names(replay)}
        meta = {**self._meta(), "stored": str(self.stored), "updates": str(self.updates)}
        meta["user"] = json.dumps(metadata or {})
        data = save(tensors, metadata=meta)
        return atomic_write(path, lambda f: f.write(data))

    def load(self, path: str | Path, *, replay: bool = False) -> dict[str, Any]:
        """Read a file written by :meth:`save` (all-or-nothing: every name, shape and dtype is
        checked before anything is copied); returns its ``metadata``."""
        names = self._names(replay)
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{path}: not a FastSAC file (format {meta.get('format')!r}, expected {FORMAT!r})")
            mine, theirs = json.loads(self._meta()["layout"]), json.loads(meta.get("layout", "{}"))
            sizes = ("obs_dim", "act_dim", "hidden") + (("num_envs", "buffer_size") if replay else ())
            differ = {k: (theirs.get(k), mine[k]) for k in sizes if theirs.get(k) != mine[k]}
            if differ:
                raise ValueError(f"{path}: saved for other sizes ({{key: (saved, here)}}): {differ}")
            missing, extra = sorted(set(names) - set(f.keys())), sorted(set(f.keys()) - set(names))
            if missing or extra:
                raise ValueError(f"{path}: tensors missing {missing[:4]}, unexpected {extra[:4]}")
            tensors = {n: f.get_tensor(n) for n in names}
        for n, t in tensors.items():
            want = self.bufs[n]
            if t.shape != want.shape or t.dtype != want.dtype:
                raise ValueError(
                    f"{path}: {n} is {t.dtype} {tuple(t.shape)}, expected {want.dtype} {tuple(want.shape)}"
                )
        for n, t in tensors.items():
            self.bufs[n].copy_(t)
        if replay:
            self.stored = int(meta["stored"])
        else:
            self.updates = int(meta["updates"])
        return json.loads(meta.get("user", "{}"))
