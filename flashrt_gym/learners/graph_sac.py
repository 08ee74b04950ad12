"""Stable-baselines3's SAC with its gradient step captured once as a CUDA graph.

SB3's ``SAC.train`` launches a few hundred small kernels per gradient step from Python and
reads every loss back to the host (``.item()``), so on a GPU one update costs milliseconds
whatever the network size, and DSRL's update-to-data ratios (about 20) are out of reach.
:class:`GraphSAC` keeps SB3's SAC (policy, losses, entropy tuning, target networks,
``save`` / ``load`` / ``predict``, callbacks) and changes only where the gradient step runs:

* :class:`DeviceReplayBuffer` holds the transitions in tensors on the learner's device and
  draws minibatch indices there (the fill level is a device tensor), so sampling needs no
  host round trip;
* every tensor the gradient step reads or writes (parameters, target parameters, gradients,
  Adam state, learning rates, the replay storage, the loss sums) is a view of one
  :class:`~flashrt.runtime.BufferSet`; whatever SB3 replaces (``load``, ``set_parameters``,
  ``load_replay_buffer``) is copied back into those views before the next update, so the views
  never move;
* one gradient step (sample, entropy coefficient, critic, actor, Polyak update) is captured once
  by :class:`flashrt.runtime.Graph` (warm-up on a side stream, then capture; the state is put
  back afterwards, so capturing changes nothing) and replayed ``gradient_steps`` times; the Adam
  optimizers run fused and capturable with their learning rates in device tensors (schedules
  still apply);
* the losses are summed on the device and read once per ``train`` call.

On the CPU (and with ``use_graphs=False``) the same program runs through the graph's eager
backend, so the CPU path is the captured path's logic without the capture. The update is SB3's,
term for term; only its order of random draws differs (indices are drawn on the device).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from gymnasium import spaces
from stable_baselines3 import SAC
from stable_baselines3.common.buffers import BaseBuffer, ReplayBuffer
from stable_baselines3.common.policies import ContinuousCritic
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.utils import get_device, polyak_update
from stable_baselines3.sac.policies import Actor, SACPolicy
from torch import nn
from torch.distributions import Distribution

from flashrt import runtime
from flashrt.runtime import BufferSet, scratch, shared

WARMUP_STEPS = 3  # gradient steps run (and undone) on a side stream before a capture
ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")


class DeviceReplayBuffer(ReplayBuffer):
    """SB3's :class:`ReplayBuffer` with its storage in torch tensors on ``device``.

    Rows are ``pos * n_envs + env``; ``sample`` draws uniform rows below the fill level on the
    device, so it can run inside a captured graph. Pickles (``save_replay_buffer``) with its
    tensors on the CPU; assigning ``device`` moves the storage.
    """

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: torch.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
    ) -> None:
        if optimize_memory_usage:
            raise ValueError("DeviceReplayBuffer stores next observations explicitly: set optimize_memory_usage=False")
        if not isinstance(observation_space, spaces.Box):
            raise ValueError(
                f"DeviceReplayBuffer needs a Box observation space, got {type(observation_space).__name__}: "
                "use obs_mode='state' or 'features'"
            )
        self._store: dict[str, torch.Tensor] = {}
        BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device, n_envs=n_envs)
        self.buffer_size = max(buffer_size // n_envs, 1)
        self.optimize_memory_usage = False
        self.handle_timeout_termination = handle_timeout_termination
        rows = self.buffer_size * self.n_envs
        obs_dtype = torch.from_numpy(np.zeros(0, observation_space.dtype)).dtype
        act_dtype = torch.from_numpy(np.zeros(0, self._maybe_cast_dtype(action_space.dtype))).dtype
        self._store = {
            "observations": torch.zeros(rows, *self.obs_shape, dtype=obs_dtype),
            "next_observations": torch.zeros(rows, *self.obs_shape, dtype=obs_dtype),
            "actions": torch.zeros(rows, self.action_dim, dtype=act_dtype),
            "rewards": torch.zeros(rows, 1),
            "not_done": torch.zeros(rows, 1),  # 1 - done * (1 - timeout): what the TD target bootstraps on
            "filled": torch.zeros((), dtype=torch.float64),  # rows holding data (float64: uniforms x it stay below it)
        }
        self.device = self.device  # moves the storage

    @property
    def storage(self) -> dict[str, torch.Tensor]:
        """The stored transitions by name, on the device: ``observations``, ``next_observations``,
        ``actions``, ``rewards``, ``not_done`` (rows of ``buffer_size * n_envs``) and ``filled``."""
        return self._store

    @property
    def device(self) -> torch.device:
        return self._device

    @device.setter
    def device(self, device: torch.device | str) -> None:
        self._device = get_device(device)
        self._store = {k: v.to(self._device) for k, v in self._store.items()}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_store"] = {k: v.to("cpu", copy=True) for k, v in self._store.items()}  # compact copies, not arena views
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)  # the loader assigns ``device`` next, which moves the storage

    def add(
        self,
        obs: np.ndarray,
        next_obs: np.ndarray,
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        rows = slice(self.pos * self.n_envs, (self.pos + 1) * self.n_envs)
        timeout = np.zeros(self.n_envs, np.float32)
        if self.handle_timeout_termination:
            timeout = np.array([info.get("TimeLimit.truncated", False) for info in infos], np.float32)
        not_done = 1.0 - np.asarray(done, np.float32) * (1.0 - timeout)
        for name, value in (
            ("observations", obs),
            ("next_observations", next_obs),
            ("actions", action),
            ("rewards", np.asarray(reward, np.float32)),
            ("not_done", not_done),
        ):
            dst = self._store[name][rows]
            dst.copy_(torch.tensor(np.asarray(value)).reshape(dst.shape))  # a copy: env arrays are read-only
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full, self.pos = True, 0
        self._store["filled"].fill_(float(self.size() * self.n_envs))

    def reset(self) -> None:
        super().reset()
        self._store["filled"].zero_()

    def sample(self, batch_size: int, env: Any = None) -> ReplayBufferSamples:
        """``batch_size`` uniform rows, drawn on the device (capturable: no host synchronisation)."""
        if env is not None:
            raise ValueError("DeviceReplayBuffer does not normalise samples: GraphSAC does not support VecNormalize")
        s = self._store
        rows = (torch.rand(batch_size, device=self._device, dtype=torch.float64) * s["filled"]).long()
        return ReplayBufferSamples(
            s["observations"][rows],
            s["actions"][rows],
            s["next_observations"][rows],
            1.0 - s["not_done"][rows],  # SB3's ``dones`` field, timeouts already removed
            s["rewards"][rows],
        )


def _set_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Fused, capturable Adam with a device-tensor learning rate on CUDA (one kernel per step,
    not a dozen per parameter); plain Adam elsewhere."""
    on_cuda = device.type == "cuda"
    for group in optimizer.param_groups:
        lr = float(group["lr"])
        group["capturable"] = group["fused"] = on_cuda
        group["foreach"] = None if on_cuda else group.get("foreach")
        group["lr"] = torch.tensor(lr, device=device) if on_cuda else lr
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if "step" in state:
                state["step"] = state["step"].to(device if on_cuda else "cpu", torch.float32)


def _zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """Zero the gradients in place (static addresses for the graph), in one multi-tensor kernel."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if grads:
        torch._foreach_zero_(grads)


class LayerNormSACPolicy(SACPolicy):
    """SAC's MLP policy with a LayerNorm after every hidden linear layer of the actor and the
    critics (DSRL's networks). Normalised critics keep Q-values from running away on actions
    the replay buffer never holds, where high update-to-data ratios otherwise overestimate."""

    def make_actor(self, features_extractor: BaseFeaturesExtractor | None = None) -> Actor:
        actor = super().make_actor(features_extractor)
        _normalise_hidden(actor.latent_pi, last_is_output=False)
        return actor

    def make_critic(self, features_extractor: BaseFeaturesExtractor | None = None) -> ContinuousCritic:
        critic = super().make_critic(features_extractor)
        for q in critic.q_networks:
            _normalise_hidden(q, last_is_output=True)
        return critic


def _normalise_hidden(mlp: nn.Sequential, last_is_output: bool) -> None:
    """Insert ``LayerNorm`` after each hidden ``Linear`` of ``mlp``, in place."""
    linears = [i for i, m in enumerate(mlp) if isinstance(m, nn.Linear)]
    hidden = linears[:-1] if last_is_output else linears
    for i in reversed(hidden):
        mlp.insert(i + 1, nn.LayerNorm(mlp[i].out_features))


class GraphSAC(SAC):
    """SB3's :class:`~stable_baselines3.SAC` whose gradient step runs as one captured CUDA graph.

    Takes SAC's arguments, plus ``use_graphs`` (capture on CUDA; default True). The replay
    buffer is always a :class:`DeviceReplayBuffer`. Learning-rate schedules apply (the rates
    live in device tensors). On the CPU the same gradient step runs eagerly.

    Example:
        >>> model = GraphSAC("MlpPolicy", SB3VecEnv(num_envs=64), gradient_steps=64)
        >>> model.learn(200_000)
    """

    def __init__(self, policy: Any, env: Any, *, use_graphs: bool = True, **kwargs: Any) -> None:
        given = kwargs.pop("replay_buffer_class", None)
        if given not in (None, DeviceReplayBuffer):
            raise ValueError(
                f"GraphSAC samples on the device: replay_buffer_class must be DeviceReplayBuffer, got {given}"
            )
        if kwargs.get("optimize_memory_usage"):
            raise ValueError("GraphSAC does not support optimize_memory_usage=True")
        self.use_graphs = use_graphs
        super().__init__(policy, env, replay_buffer_class=DeviceReplayBuffer, **kwargs)

    def _setup_model(self) -> None:
        super()._setup_model()
        self._prepare_optimizers()
        live = self._live()
        grads = {f"grad.{k.removeprefix('param.')}": t for k, t in live.items() if t.requires_grad}
        specs = [shared(k, t.shape, t.dtype) for k, t in live.items()] + [shared("stats", (4,))]
        specs += [scratch(k, t.shape, t.dtype) for k, t in grads.items()]
        self.bufs = BufferSet(specs, 1, self.device)
        """Every tensor an update touches (parameters, Adam state, replay ring, gradients): the
        one buffer set the captured update reads and writes."""
        for k, t in grads.items():
            t.grad = self.bufs[k]
        backend = "auto" if self.use_graphs else "eager"
        self._graph = runtime.Graph("graph_sac.step", backend=backend).bind(self.bufs)
        self._bind()

    def _prepare_optimizers(self) -> None:
        """Fused, capturable Adam on CUDA, with its state present from the start (zeros before
        the first step, as Adam would make it) so that it can be bound."""
        on = self.device if self.device.type == "cuda" else torch.device("cpu")
        for opt in self._optimizers():
            _set_capturable(opt, self.device)
            for group in opt.param_groups:
                for p in group["params"]:
                    if not opt.state.get(p):
                        step = torch.zeros((), dtype=torch.float32, device=on)
                        opt.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        opts = [self.actor.optimizer, self.critic.optimizer]
        return opts + ([self.ent_coef_optimizer] if self.ent_coef_optimizer is not None else [])

    def _live(self) -> dict[str, torch.Tensor]:
        """Every tensor the gradient step reads or writes, by buffer name, where SB3 holds it now."""
        named = dict(self.policy.named_parameters())
        if self.ent_coef_optimizer is not None:
            named["log_ent_coef"] = self.log_ent_coef
        live = {f"param.{k}": p for k, p in named.items()}
        live |= {f"module_buffer.{k}": t for k, t in self.policy.named_buffers()}
        if self.ent_coef_optimizer is None:
            live["ent_coef"] = self.ent_coef_tensor
        name_of = {id(p): k for k, p in named.items()}
        for i, opt in enumerate(self._optimizers()):
            for j, group in enumerate(opt.param_groups):
                if isinstance(group["lr"], torch.Tensor):
                    live[f"opt{i}.lr{j}"] = group["lr"]
                for p in group["params"]:
                    live |= {f"opt{i}.{s}.{name_of[id(p)]}": opt.state[p][s] for s in ADAM_STATE}
        live |= {f"replay.{k}": t for k, t in self.replay_buffer.storage.items()}
        return live

    def _bind(self) -> None:
        """Point every tensor the step touches at its view in ``self.bufs``, copying in what SB3
        put elsewhere since (a loaded model, optimizer state or replay buffer)."""
        for name, t in self._live().items():
            view = self.bufs[name]
            if t.data_ptr() == view.data_ptr():
                continue
            if t.shape != view.shape or t.dtype != view.dtype:
                raise ValueError(
                    f"GraphSAC: {name} is {t.dtype} {tuple(t.shape)} but this model holds {view.dtype} "
                    f"{tuple(view.shape)}; load files saved with the same buffer_size, env and network"
                )
            view.copy_(t.detach())
            t.data = view

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), "bufs", "_graph"]

    def save(self, *args: Any, **kwargs: Any) -> None:
        """SB3's ``save``. While it pickles, every bound tensor points at a compact copy of its
        view (a view would take the whole arena into the file)."""
        live = self._live()
        for t in live.values():
            t.data = t.data.clone()
        try:
            super().save(*args, **kwargs)
        finally:
            for name, t in live.items():
                t.data = self.bufs[name]

    def set_parameters(self, *args: Any, **kwargs: Any) -> None:
        super().set_parameters(*args, **kwargs)
        self._prepare_optimizers()
        self._bind()

    def load_replay_buffer(self, *args: Any, **kwargs: Any) -> None:
        super().load_replay_buffer(*args, **kwargs)
        self.replay_buffer.device = self.device  # unpickled on the CPU
        self._bind()

    def _update_learning_rate(self, optimizers: list[torch.optim.Optimizer] | torch.optim.Optimizer) -> None:
        lr = self.lr_schedule(self._current_progress_remaining)
        self.logger.record("train/learning_rate", lr)
        for opt in optimizers if isinstance(optimizers, list) else [optimizers]:
            for group in opt.param_groups:
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(lr)  # in place: captured graphs read this tensor
                else:
                    group["lr"] = lr

    def _gradient_step(self, batch_size: int, update_target: bool) -> None:
        """One SAC update, SB3's terms in SB3's order; adds its losses to the ``stats`` buffer."""
        data = self.replay_buffer.sample(batch_size, env=self._vec_normalize_env)
        actions_pi, log_prob = self.actor.action_log_prob(data.observations)
        log_prob = log_prob.reshape(-1, 1)
        if self.ent_coef_optimizer is not None:
            ent_coef = torch.exp(self.log_ent_coef.detach())
            ent_coef_loss = -(self.log_ent_coef * (log_prob + self.target_entropy).detach()).mean()
            _zero_grad(self.ent_coef_optimizer)
            ent_coef_loss.backward()
            self.ent_coef_optimizer.step()
        else:
            ent_coef, ent_coef_loss = self.ent_coef_tensor, torch.zeros((), device=self.device)
        with torch.no_grad():
            next_actions, next_log_prob = self.actor.action_log_prob(data.next_observations)
            next_q = torch.cat(self.critic_target(data.next_observations, next_actions), dim=1)
            next_q = next_q.min(dim=1, keepdim=True).values - ent_coef * next_log_prob.reshape(-1, 1)
            target_q = data.rewards + (1 - data.dones) * self.gamma * next_q
        current_q = self.critic(data.observations, data.actions)
        critic_loss = 0.5 * sum(F.mse_loss(q, target_q) for q in current_q)
        _zero_grad(self.critic.optimizer)
        critic_loss.backward()
        self.critic.optimizer.step()
        q_pi = torch.cat(self.critic(data.observations, actions_pi), dim=1)
        actor_loss = (ent_coef * log_prob - q_pi.min(dim=1, keepdim=True).values).mean()
        _zero_grad(self.actor.optimizer)
        actor_loss.backward()
        self.actor.optimizer.step()
        if update_target:  # SB3's polyak_update, one multi-tensor kernel per op instead of two per parameter
            with torch.no_grad():
                target = list(self.critic_target.parameters())
                torch._foreach_mul_(target, 1 - self.tau)
                torch._foreach_add_(target, list(self.critic.parameters()), alpha=self.tau)
            polyak_update(self.batch_norm_stats, self.batch_norm_stats_target, 1.0)
        losses = torch.stack([ent_coef.reshape(()), ent_coef_loss.detach(), critic_loss.detach(), actor_loss.detach()])
        self.bufs["stats"].add_(losses)

    def capture(self, batch_size: int | None = None) -> None:
        """Capture the gradient step at ``batch_size`` (default: the model's) now rather than at
        the first ``train`` call; capturing leaves the model's state as it was."""
        batch_size = self.batch_size if batch_size is None else batch_size
        self._bind()
        for update_target in (True, False):
            key = (batch_size, update_target)
            if key not in self._graph:
                step = partial(self._gradient_step, batch_size, update_target)
                self._graph.capture(key, _without_validation(step), warmup=WARMUP_STEPS)

    def train(self, gradient_steps: int, batch_size: int = 64) -> None:
        self.policy.set_training_mode(True)
        self.capture(batch_size)
        self._update_learning_rate(self._optimizers())
        self.bufs["stats"].zero_()
        with _no_validation():
            for i in range(gradient_steps):
                self._graph.replay((batch_size, (self._n_updates + i) % self.target_update_interval == 0))
        self._n_updates += gradient_steps
        ent_coef, ent_coef_loss, critic_loss, actor_loss = (self.bufs["stats"] / gradient_steps).tolist()
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        self.logger.record("train/ent_coef", ent_coef)
        self.logger.record("train/actor_loss", actor_loss)
        self.logger.record("train/critic_loss", critic_loss)
        if self.ent_coef_optimizer is not None:
            self.logger.record("train/ent_coef_loss", ent_coef_loss)


@contextmanager
def _no_validation() -> Iterator[None]:
    """Distribution argument checks off (they read tensors back to the host)."""
    validate = Distribution._validate_args
    Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        Distribution.set_default_validate_args(validate)


def _without_validation(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with _no_validation():
            fn()

    return run
