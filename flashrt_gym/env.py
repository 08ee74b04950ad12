"""FlashRT-VLA: a frozen VLA flow policy and the tabletop as one captured step over one buffer set.

An agent steers the shipped policy (DSRL-style, by its initial diffusion noise by default); one
env step is one action chunk for every slot, replayed as a single captured graph: the agent's
action -> denoise over the current prefix -> ``n_action_steps`` simulator ticks (rewards summed)
-> render -> encode the next observation -> autoreset finished slots by a masked restore from
a pool of pre-encoded episode starts. Reset, fork, rollback and interrupts are byte copies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

from flashrt import runtime
from flashrt.policies import load
from flashrt.runtime import BufferSpec, Capsule, CapsuleRegistry, masked_restore, scratch, shared
from flashrt_gym.assets import TINY
from flashrt_gym.engine import Engine
from flashrt_gym.tasks import Tabletop, TabletopConfig

OBS_MODES = ("state", "features", "rgb", "dict")
ACTION_MODES = ("noise", "residual")
REWARD_MODES = ("dense", "sparse")


def _choose(name: str, value: str, options: Sequence[str]) -> str:
    if value not in options:
        raise ValueError(f"{name} must be one of {list(options)}, got {value!r}")
    return value


class FlashRTVectorEnv(VectorEnv):
    """``num_envs`` tabletop episodes steered through a frozen VLA, all slots in one graph replay.

    ## Action space
    ``Box(-1, 1, (horizon * action_dim,))`` (normalised, as SB3 recommends). ``action_mode="noise"``
    (default): the action times ``noise_bound`` is the initial diffusion noise the policy denoises
    into its next chunk (DSRL); zero is the policy's mode, and the bound keeps the agent near the
    noise the policy was trained on. ``action_mode="residual"``: the action times
    ``residual_scale`` is added to the chunk the policy denoises from its own per-slot noise.
    With ``repeat_over_horizon`` the action is ``Box(-1, 1, (action_dim,))``, one vector repeated
    over the chunk's ``horizon`` steps (DSRL's pi0 setting: a far smaller space to search).

    ## Observation space
    ``obs_mode="state"`` (default): float32 end-effector (2), objects (2K), target one-hot (K),
    goal one-hot (G). ``"features"``: the policy's pooled prefix embedding of the newest frame
    plus the end-effector (D + 2), what a VLA-steering agent sees in DSRL. ``"rgb"``: the 64x64
    uint8 frame the policy sees. ``"dict"``: all three. SB3 users should start from ``state``
    (12 numbers: an ``MlpPolicy`` learns fastest there); ``features`` is the choice when the task
    state is not available, as on a real robot.

    ## Rewards
    Per tick, summed over the ``n_action_steps`` ticks of a chunk. ``dense``: progress of the
    target object towards its goal, a smaller progress of the end-effector towards the object,
    and +2 on success. ``sparse``: -1 per tick until success, 0 after (DSRL's convention).

    ## Episode end
    Terminated when the named object is in the named goal; truncated after ``max_episode_steps``
    chunks. Finished slots are reset in the same step (``AutoresetMode.SAME_STEP``): the returned
    observation starts the new episode and ``info["final_obs"]`` (masked by
    ``info["_final_obs"]``) holds the last observation of the old one. ``final_obs`` is a
    batched array (rows of slots that did not finish are not meaningful), not an object array.

    ## Arguments
    num_envs: parallel slots. obs_mode, action_mode, reward_mode: see above.
    noise_bound: bound of the noise action space. residual_scale: size of a full residual.
    repeat_over_horizon: one ``action_dim`` action per step, repeated over the horizon.
    n_action_steps: actions of each chunk executed per step. max_episode_steps: chunks per episode.
    task: a :class:`TabletopConfig` or a dict of its fields. weights: a policy folder (default:
    the shipped ``tiny`` policy). device: default CUDA when present. graphs: capture the step as a
    CUDA graph (eager when False or on the CPU). pool_size: episode starts kept encoded (default
    ``max(4 * num_envs, 16)``). render_mode: ``"rgb_array"`` or None.
    """

    metadata: ClassVar[dict[str, Any]] = {
        "render_modes": ["rgb_array"],
        "render_fps": 10,
        "autoreset_mode": AutoresetMode.SAME_STEP,
    }

    def __init__(
        self,
        num_envs: int = 1,
        *,
        obs_mode: str = "state",
        action_mode: str = "noise",
        reward_mode: str = "dense",
        noise_bound: float = 1.5,
        residual_scale: float = 0.5,
        repeat_over_horizon: bool = False,
        n_action_steps: int = 4,
        max_episode_steps: int = 40,
        task: TabletopConfig | dict | None = None,
        weights: str | Path | None = None,
        device: str | torch.device | None = None,
        graphs: bool = True,
        pool_size: int | None = None,
        render_mode: str | None = None,
        autoreset: bool = True,
    ) -> None:
        if int(num_envs) < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.obs_mode = _choose("obs_mode", obs_mode, OBS_MODES)
        self.action_mode = _choose("action_mode", action_mode, ACTION_MODES)
        self.reward_mode = _choose("reward_mode", reward_mode, REWARD_MODES)
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        if noise_bound <= 0 or residual_scale <= 0:
            raise ValueError("noise_bound and residual_scale must be > 0")
        self.num_envs = int(num_envs)
        self.render_mode = render_mode
        self.autoreset = autoreset
        self.noise_bound, self.residual_scale = float(noise_bound), float(residual_scale)
        self.repeat_over_horizon = bool(repeat_over_horizon)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        task_cfg = task if isinstance(task, TabletopConfig) else TabletopConfig(**(task or {}))
        self.task = Tabletop(task_cfg)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        model, weights_id = load(weights or TINY, device=self.device, dtype=dtype)
        c = model.cfg
        self.horizon, self.action_dim = c.horizon, c.action_dim
        backend = "auto" if graphs else "eager"
        n, sd = self.num_envs, self.task.state_dim
        agent_dim = c.action_dim if self.repeat_over_horizon else c.horizon * c.action_dim
        self._obs_forms = ("state", "features", "rgb") if obs_mode == "dict" else (obs_mode,)
        forms = {
            "state": ((n, sd), torch.float32),
            "features": ((n, c.width + 2), torch.float32),
            "rgb": ((n, c.image_size, c.image_size, 3), torch.uint8),
        }
        # What a step returns lies back to back (one copy reads it out): the outputs, then the
        # observation forms obs_mode returns, then (with autoreset) their final forms.
        flags = ["env.out_terminated", "env.out_truncated"] + (["env.out_done"] if autoreset else [])
        views = [f"env.{p}_{k}" for p in (("obs", "final") if autoreset else ("obs",)) for k in self._obs_forms]
        out_specs = [
            scratch("env.out_reward", (n,)),
            *(scratch(name, (n,), torch.bool) for name in flags),
            *(scratch(name, *forms[name.rsplit("_", 1)[1]]) for name in views),
        ]
        self._out_names = tuple(spec.name for spec in out_specs)
        self._extra: list[BufferSpec] = [
            scratch("env.action", (n, agent_dim)),  # the agent's actions, as given
            scratch("env.action_ok", (1,), torch.bool),  # the step's guard: every action in bounds
            shared("env.next_start", (n,), torch.int64),
            *out_specs,
        ]
        kw = {"n_action_steps": n_action_steps, "max_episode_steps": max_episode_steps, "backend": backend}
        self.engine = Engine(self.task, model, weights_id, n, extra_specs=self._extra, **kw)
        self.bufs = self.engine.bufs
        self.pool_size = int(pool_size or max(4 * n, 16))
        if self.pool_size < n:
            raise ValueError(f"pool_size ({self.pool_size}) must be >= num_envs ({n})")
        pool_extra = [  # outputs are per slot of the pool; shared state must keep its shape (one layout)
            dataclasses.replace(s, shape=(self.pool_size, *s.shape[1:])) if s.kind == "scratch" else s
            for s in self._extra
        ]
        self._pool = Engine(self.task, model, weights_id, self.pool_size, extra_specs=pool_extra, **kw)
        if self._pool.bufs.layout_digest != self.bufs.layout_digest:
            raise AssertionError("the start pool and the live slots must share one row layout")
        pool_bytes = self._pool.bufs.state_nbytes  # start pools per seed block: a few on the GPU, more on the host
        self.registry = CapsuleRegistry(gpu_bytes=4 * pool_bytes, host_bytes=16 * pool_bytes)
        self._pool_base: int | None = None

        self.single_action_space = spaces.Box(-1.0, 1.0, (agent_dim,), np.float32)
        state = spaces.Box(-1.0, 1.0, (sd,), np.float32)
        features = spaces.Box(-np.inf, np.inf, (c.width + 2,), np.float32)
        rgb = spaces.Box(0, 255, (c.image_size, c.image_size, 3), np.uint8)
        self.single_observation_space = {
            "state": state,
            "features": features,
            "rgb": rgb,
            "dict": spaces.Dict({"state": state, "features": features, "rgb": rgb}),
        }[obs_mode]
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, n)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, n)
        self._graph = runtime.Graph("env.step", backend=backend).bind(self.bufs)
        self._key = (n, action_mode, autoreset)
        self._started = False
        # An upper bound on max(env.next_start), kept on the host so that a step need not read
        # the buffer back to know the pool still holds every slot's next start (None: unknown).
        self._next_start_bound: int | None = None

    # -- the step program (captured) -----------------------------------------------------------
    def _write_obs(self, prefix: str) -> None:
        """Write the observation forms ``obs_mode`` returns (only those) under ``env.{prefix}_*``."""
        b = self.bufs
        if "state" in self._obs_forms:
            self.task.state(b, out=b[f"env.{prefix}_state"])
        if "features" in self._obs_forms:
            b[f"env.{prefix}_features"][:, :-2].copy_(b["policy.features"])
            b[f"env.{prefix}_features"][:, -2:].copy_(b["sim.ee"])
        if "rgb" in self._obs_forms:
            b[f"env.{prefix}_rgb"].copy_(b["policy.image"][:, 0])

    def _action_guard(self) -> torch.Tensor:
        """The step's guard (captured before the step): whether every action lies in the
        symmetric action space; NaN fails it. The step runs only where it holds."""
        b, hi = self.bufs, float(self.single_action_space.high[0])
        ok = b["env.action_ok"]
        torch.le(torch.linalg.vector_norm(b["env.action"], float("inf")), hi + 1e-6, out=ok[0])
        return ok

    def _program(self) -> None:
        b, n = self.bufs, self.num_envs
        a = b["env.action"].view(n, -1, self.action_dim).expand(n, self.horizon, self.action_dim)
        if self.action_mode == "noise":
            torch.mul(a, self.noise_bound, out=b["policy.noise"])
            self.engine.step()
        else:
            self.engine.step(draw_noise=True, residual=a * self.residual_scale)
        b["env.out_reward"].copy_(b["env.reward_dense" if self.reward_mode == "dense" else "env.reward_sparse"])
        b["env.out_terminated"].copy_(b["env.terminated"])
        b["env.out_truncated"].copy_(b["env.truncated"])
        if self.autoreset:
            self._write_obs("final")
            self._take_starts(torch.logical_or(b["env.terminated"], b["env.truncated"], out=b["env.out_done"]))
        self._write_obs("obs")

    def _take_starts(self, mask: torch.Tensor) -> None:
        """Restore the next pool start into every slot in ``mask`` (capturable)."""
        b = self.bufs
        index = b["env.next_start"] % self.pool_size
        masked_restore(b.slot_arena, self._pool.bufs.slot_arena, mask, index)
        b["env.next_start"].add_(mask, alpha=self.num_envs)

    # -- the start pool ------------------------------------------------------------------------
    def _use_pool(self, base: int) -> None:
        """Make the pool hold the encoded starts of seeds ``base .. base + pool_size - 1``
        (a registry hit is a byte copy; a miss runs the cold path once)."""
        if base == self._pool_base:
            return
        name = f"starts-{base}"
        if name in self.registry:
            runtime.restore(self._pool.bufs, self.registry.get(name))
        else:
            self._pool.start(torch.arange(self.pool_size) + base)
            self.registry.put(name, runtime.snapshot(self._pool.bufs, meta={"seed": base}))
        if self._pool_base is not None:  # the pool in use stays pinned; earlier ones may be demoted
            self.registry.unpin(f"starts-{self._pool_base}")
        self.registry.pin(name)
        self._pool_base = base

    def _advance_next_start_bound(self) -> None:
        """A _take_starts ran: every slot's next start grew by at most num_envs."""
        if self._next_start_bound is not None:
            self._next_start_bound += self.num_envs

    def _refresh_pool(self) -> None:
        """Move to the next block of seeds once some slot has used up the pool; every slot then
        starts over at its own row of the new pool (rows a slot had not reached are skipped)."""
        if self._next_start_bound is not None and self._next_start_bound < self.pool_size:
            return  # no slot can have reached the pool's end: no read-back
        nxt = self.bufs["env.next_start"]
        self._next_start_bound = int(nxt.max())
        if self._next_start_bound >= self.pool_size:
            self._use_pool(self._pool_base + self.pool_size)
            nxt.copy_(torch.arange(self.num_envs, device=self.device))
            self._next_start_bound = self.num_envs - 1

    # -- Gymnasium API -------------------------------------------------------------------------
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Restore episode-start capsules. With a seed every slot restarts from the pool of that
        seed (slot i draws ``seed + i``; the pool is encoded once and kept in the registry);
        without one every slot takes its next start from the current pool; with
        ``options["reset_mask"]`` only the masked slots do."""
        if seed is not None and not isinstance(seed, (int, np.integer)):
            raise ValueError(f"seed must be an int (slot i uses seed + i) or None, got {type(seed).__name__}")
        super().reset(seed=None if seed is None else int(seed))
        options = options or {}
        unknown = sorted(set(options) - {"reset_mask"})
        if unknown:
            raise ValueError(f"unknown reset options {unknown}; supported: ['reset_mask']")
        mask = options.get("reset_mask")
        if mask is None and seed is None and self._started:  # no seed: the next starts, no cold path
            mask = np.ones(self.num_envs, dtype=np.bool_)
        if mask is not None:
            if not self._started:
                raise ValueError("reset(options={'reset_mask': ...}) needs a full reset() first")
            if not (isinstance(mask, np.ndarray) and mask.dtype == np.bool_ and mask.shape == (self.num_envs,)):
                raise ValueError(f"reset_mask must be a numpy bool array of shape ({self.num_envs},)")
            if seed is not None:
                self._use_pool(int(seed))
            self._take_starts(torch.as_tensor(mask, device=self.device))
            self._advance_next_start_bound()
            self._refresh_pool()
        else:
            base = int(seed) if seed is not None else int(self.np_random.integers(0, 2**31 - 1))
            self._use_pool(base)
            b = self.bufs
            everyone = torch.ones(self.num_envs, dtype=torch.bool, device=self.device)
            b["env.next_start"].copy_(torch.arange(self.num_envs, device=self.device))
            self._take_starts(everyone)
            self._next_start_bound = 2 * self.num_envs - 1
            self._started = True
        self._write_obs("obs")
        return self._obs("obs"), self._reset_info()

    def _reset_info(self) -> dict[str, Any]:
        return {"instruction": self.bufs["sim.instruction"].cpu().numpy()}

    def _check_action(self, actions: Any) -> tuple[torch.Tensor, bool]:
        """The actions as a tensor of the right shape and a floating dtype, and whether their
        bounds were checked here: host actions for a GPU env are (never a wait on the GPU); the
        others are checked by the step's guard, where they are, before anything of the step runs."""
        a = torch.as_tensor(np.asarray(actions) if not isinstance(actions, torch.Tensor) else actions)
        want = (self.num_envs, *self.single_action_space.shape)
        if tuple(a.shape) != want:
            what = "action_dim, repeated over the horizon" if self.repeat_over_horizon else "horizon * action_dim"
            raise ValueError(f"actions must have shape {want} (num_envs, {what}), got {tuple(a.shape)}")
        if not a.is_floating_point():
            raise ValueError(f"actions must be floating point, got {a.dtype}")
        if a.device.type != "cpu" or self.device.type == "cpu":
            return a, False
        # The space is symmetric (lo = -hi): one reduction, the largest magnitude. NaN fails it.
        if not float(torch.linalg.vector_norm(a.flatten(), float("inf"))) <= self.single_action_space.high[0] + 1e-6:
            self._reject(a)
        return a, True

    def _reject(self, actions: torch.Tensor) -> None:
        if not torch.isfinite(actions).all():
            raise ValueError("actions contain NaN or infinity")
        lo, hi = float(self.single_action_space.low[0]), float(self.single_action_space.high[0])
        raise ValueError(f"actions must lie in [{lo}, {hi}] (the action space); clip them first")

    def step_torch(self, actions: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """The step on device tensors (for learners that keep everything on the GPU): returns
        observation(s), reward, terminated, truncated as tensors (copies) and a tensor info.

        Device actions are checked on the device by the step's guard, in the same launch: the
        call waits until the guard has run (not for the step) to know whether the step runs; a
        bad action raises and leaves the state untouched. Host actions are checked before the
        upload."""
        out = self._step(actions)
        info: dict[str, Any] = {}
        if self.autoreset:
            info = {"final_obs": self._pick(out, "final"), "_final_obs": out["env.out_done"]}
        return self._pick(out, "obs"), out["env.out_reward"], out["env.out_terminated"], out["env.out_truncated"], info

    def step(self, actions: Any):
        out = {k: v.numpy() for k, v in self._step(torch.as_tensor(np.asarray(actions)), host=True).items()}
        info: dict[str, Any] = {}
        if self.autoreset:
            done = out["env.out_done"]
            if done.any():
                info = {
                    "final_obs": self._pick(out, "final"),
                    "_final_obs": done,
                    "final_info": {"is_success": out["env.out_terminated"], "_is_success": done},
                    "_final_info": done,
                }
        return self._pick(out, "obs"), out["env.out_reward"], out["env.out_terminated"], out["env.out_truncated"], info

    def _step(self, actions: Any, host: bool = False) -> dict[str, torch.Tensor]:
        """One replay; copies of what it returns (``self._out_names``), on the host in one transfer
        if ``host``."""
        if not self._started:
            raise RuntimeError("call reset() before step()")
        a, checked = self._check_action(actions)
        self.bufs["env.action"].copy_(a)
        if self._key not in self._graph:
            self._graph.capture(self._key, self._program, guard=self._action_guard)
        self._graph.replay(self._key)
        out = self.bufs.clone(self._out_names, "cpu" if host else None)  # one copy, queued behind the step
        if not checked and not self._graph.held(self._key):
            self._reject(a)
        if self.autoreset:  # the program's _take_starts
            self._advance_next_start_bound()
            self._refresh_pool()
        return out

    def _pick(self, out: Mapping[str, torch.Tensor], prefix: str) -> Any:
        """The observation (``obs_mode``'s form, or the dict of forms) among ``out``'s copies."""
        parts = {k: out[f"env.{prefix}_{k}"] for k in self._obs_forms}
        return parts if self.obs_mode == "dict" else parts[self.obs_mode]

    def _obs(self, prefix: str) -> Any:
        """The current observation as NumPy arrays (one transfer)."""
        out = self.bufs.clone([f"env.{prefix}_{k}" for k in self._obs_forms], "cpu")
        return self._pick({k: v.numpy() for k, v in out.items()}, prefix)

    def render(self) -> np.ndarray | None:
        """(num_envs, H, W, 3) uint8 frames of the current observations."""
        if self.render_mode != "rgb_array":
            return None
        return self.bufs["policy.image"][:, 0].cpu().numpy()

    # -- capsule verbs -------------------------------------------------------------------------
    def snapshot(self, slots: Sequence[int] | None = None) -> Capsule:
        """The state of all slots (or of ``slots``) at this step boundary, as a capsule."""
        return runtime.snapshot(self.bufs, slots, meta={"pool_base": self._pool_base, "pool_size": self.pool_size})

    def _after_restore(self, capsule: Capsule) -> None:
        self._next_start_bound = None  # env.next_start came with the capsule
        base = capsule.meta.get("pool_base")
        if base is not None and capsule.slots is None:
            self._use_pool(int(base))
        self._started = True
        self._write_obs("obs")

    def restore(self, capsule: Capsule, slots: Sequence[int] | None = None) -> Any:
        """Restore a capsule of this env's configuration (all-or-nothing); returns the current
        observations, valid at once."""
        runtime.restore(self.bufs, capsule, slots)
        self._after_restore(capsule)
        return self._obs("obs")

    def rollback(self, capsule: Capsule) -> Any:
        """Return to an earlier boundary of this env; returns the current observations."""
        runtime.rollback(self.bufs, capsule)
        self._after_restore(capsule)
        return self._obs("obs")

    def fork(self, src_slot: int, dst_slots: Sequence[int], reseed: bool = False) -> Any:
        """Copy slot ``src_slot``'s boundary into ``dst_slots``. With ``reseed`` each destination
        gets its own policy RNG stream (residual-mode branches then diverge)."""
        dst = list(dst_slots)
        runtime.fork(self.bufs, int(src_slot), dst)  # slot rows only: env.next_start is shared
        if reseed:
            idx = torch.tensor(dst, device=self.device)
            key = self.bufs["policy.rng_key"]
            key[idx] = key[idx] * 6364136223846793005 + idx + 1
        self._write_obs("obs")
        return self._obs("obs")

    def set_instruction(self, text: str, slots: Sequence[int] | None = None) -> Any:
        """Hard interrupt: give ``slots`` (all if None) a new instruction between steps. The
        instruction buffer is overwritten and its keys/values re-encoded; nothing is recaptured.
        Rewards and success follow the new instruction from the next step."""
        if text not in self.task.instructions:
            raise ValueError(f"unknown instruction {text!r}; this task's instructions are {self.task.instructions}")
        idx = self.task.instructions.index(text)
        instr = self.bufs["sim.instruction"]
        if slots is None:
            instr.fill_(idx)
        else:
            instr[torch.as_tensor(list(slots), device=self.device)] = idx
        self.engine.set_text(instr)
        self._write_obs("obs")
        return self._obs("obs")


class FlashRTEnv(gym.Env):
    """The single-env form of :class:`FlashRTVectorEnv` (``gym.make("FlashRT-VLA")``): one slot,
    no autoreset (call ``reset`` after an episode ends). Same arguments except ``num_envs``."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, render_mode: str | None = None, **kwargs: Any) -> None:
        self.vec = FlashRTVectorEnv(1, render_mode=render_mode, autoreset=False, **kwargs)
        self.render_mode = render_mode
        self.action_space = self.vec.single_action_space
        self.observation_space = self.vec.single_observation_space

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        if seed is None and not self.vec._started:
            seed = int(self.np_random.integers(0, 2**31 - 1))
        obs, info = self.vec.reset(seed=seed, options=options)
        return _first(obs), {k: v[0] for k, v in info.items()}

    def step(self, action: Any):
        obs, reward, term, trunc, _ = self.vec.step(np.asarray(action)[None])
        return _first(obs), float(reward[0]), bool(term[0]), bool(trunc[0]), {"is_success": bool(term[0])}

    def render(self) -> np.ndarray | None:
        frames = self.vec.render()
        return None if frames is None else frames[0]

    # the capsule verbs of the one slot, as on the vector env
    def snapshot(self) -> Capsule:
        return self.vec.snapshot()

    def restore(self, capsule: Capsule) -> Any:
        return _first(self.vec.restore(capsule))

    def rollback(self, capsule: Capsule) -> Any:
        return _first(self.vec.rollback(capsule))

    def set_instruction(self, text: str) -> Any:
        return _first(self.vec.set_instruction(text))


def _first(obs: Any) -> Any:
    return {k: v[0] for k, v in obs.items()} if isinstance(obs, dict) else obs[0]
