"""FlashRT-VLA: a frozen VLA flow policy and a simulator as one captured step, as Gymnasium envs.

An agent steers the policy (DSRL-style, by its initial diffusion noise by default); one env step
is one action chunk for every slot, replayed as a single captured graph (see
:mod:`flashrt_gym.engine`). Reset, fork, rollback and interrupts are byte copies.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, VectorEnv

from flashrt.policies import load
from flashrt.runtime import Capsule
from flashrt_gym import arguments
from flashrt_gym.assets import TINY
from flashrt_gym.devices import policy_dtype, resolve_device
from flashrt_gym.engine import Engine
from flashrt_gym.env_config import MAX_EPISODE_STEPS, EnvConfig
from flashrt_gym.sims.tabletop import Tabletop, TabletopConfig, as_tabletop_config
from flashrt_gym.simulator import ExternalSimulator, Simulator
from flashrt_gym.starts import StartCache, default_budget

Obs = np.ndarray | dict[str, np.ndarray]


class FlashRTVectorEnv(VectorEnv):
    """``num_envs`` episodes of a simulator steered through a frozen VLA, all slots in one replay.

    ## Action space
    ``Box(-1, 1, (horizon * action_dim,))`` (normalised, as SB3 recommends). ``action_mode="noise"``
    (default): the action times ``noise_bound`` is the initial diffusion noise the policy denoises
    into its next chunk (DSRL); zero is the policy's mode. ``action_mode="residual"``: the action
    times ``residual_scale`` is added to the chunk the policy denoises from its own per-slot noise.
    With ``repeat_over_horizon`` the action is ``Box(-1, 1, (action_dim,))``, one vector repeated
    over the chunk (DSRL's pi0 setting: a far smaller space to search).

    ## Observation space
    ``obs_mode="state"`` (default): the simulator's low-dimensional observation (the tabletop's:
    end-effector, objects, target and goal one-hot). ``"features"``: the policy's pooled prefix
    embedding of the newest frame plus the proprioceptive state, what a VLA-steering agent sees
    in DSRL. ``"rgb"``: the first camera's uint8 frame. ``"dict"``: all three.
    Bounds: ``state`` within the simulator's ``observation_bound``; ``features``' embedding within
    ``sqrt(width) * |scale|`` per number (a pooled RMS-normed row: no number of a row of ``width``
    exceeds ``sqrt(width)`` times its RMS), its proprioception within ``observation_bound``
    (the built-in simulators' proprioception is the end effector of their observation). Where a
    simulator gives no ``observation_bound`` those numbers are unbounded (and the checkers warn).

    ## Rewards
    Per tick, summed over the ``n_action_steps`` ticks of a chunk: the simulator's ``dense``
    shaped reward, or ``sparse``: -1 per tick until success, 0 after (DSRL's convention).

    ## Episode end
    Terminated when the simulator reports success; truncated after ``max_episode_steps`` chunks.
    A finished slot's next episode is drawn inside the step from the slot's own random stream,
    and ``autoreset_mode`` (Gymnasium's modes, reported in ``metadata["autoreset_mode"]``) says
    how :meth:`step` returns it:

    - ``SAME_STEP`` (default): the returned observation starts the new episode, and
      ``info["final_obs"]`` (masked by ``info["_final_obs"]``) holds the last one of the old.
    - ``NEXT_STEP``: the step that ends an episode returns its last observation; the slot's next
      step ignores its action and returns the new episode's first observation, reward 0, not
      terminated, not truncated (the slot's state is held at that start while the others step;
      ``waiting`` marks those slots, and a verb that writes a slot's state clears its mark).
      Gymnasium's ``NormalizeObservation`` accepts only this mode.
    - ``DISABLED`` (``autoreset=False``): finished slots are not reset; reset them with
      ``reset(options={"reset_mask": ...})``.

    :meth:`step_torch` always returns same-step autoreset (the step as the device ran it).
    ``reset(seed=s)`` gives slot i the stream of seed ``s + i``.

    ## Arguments
    num_envs: parallel slots. obs_mode, action_mode, reward_mode: see above.
    noise_bound: bound of the noise action space. residual_scale: size of a full residual.
    repeat_over_horizon: one ``action_dim`` action per step, repeated over the horizon.
    n_action_steps: actions of each chunk executed per step. max_episode_steps: chunks per episode.
    task: the built-in tabletop's :class:`TabletopConfig` (or a dict of its fields).
    simulator: a callable that takes ``num_envs`` and returns a fresh simulator, in-graph
    (:class:`~flashrt_gym.simulator.Simulator`) or external (:class:`~flashrt_gym.simulator.ExternalSimulator`)
    (default: the tabletop of ``task``). weights: a policy folder (default: the simulator's
    ``pretrained_weights`` where it has one, else the shipped tabletop ``tiny`` policy; a simulator
    whose ``pretrained_weights`` is None, as Meta-World's outside MT10, needs weights: ValueError).
    precision: ``"native"`` (the weights' own dtype, bf16 on a GPU: exact) or ``"fp8"`` (the
    policy's large projections as e4m3 GEMMs, :meth:`flashrt.policies.FlowPolicy.set_precision`;
    within the tolerance docs/FP8.md states, and emulated where the GPU has no FP8).
    device: ``"auto"`` (CUDA when present), ``"cpu"`` or ``"cuda"``. graphs: capture the step as a
    CUDA graph (eager when False or on the CPU). start_cache_bytes: device bytes of seeded episode
    starts kept for repeated ``reset(seed=...)`` (default: one set where that is at most 1/16 of the
    device's memory, else none). render_mode: ``"rgb_array"`` or None. autoreset: False for
    ``AutoresetMode.DISABLED``. autoreset_mode: an :class:`~gymnasium.vector.AutoresetMode` or its
    name (default ``SAME_STEP``, or ``DISABLED`` with ``autoreset=False``); see above.
    """

    metadata: ClassVar[dict[str, Any]] = {
        "render_modes": ["rgb_array"],
        "render_fps": 10,
        "autoreset_mode": AutoresetMode.SAME_STEP,  # the default; each instance reports its own
    }

    def __init__(
        self,
        num_envs: int = 1,
        *,
        obs_mode: str = EnvConfig.obs_mode,
        action_mode: str = EnvConfig.action_mode,
        reward_mode: str = EnvConfig.reward_mode,
        noise_bound: float = EnvConfig.noise_bound,
        residual_scale: float = EnvConfig.residual_scale,
        repeat_over_horizon: bool = EnvConfig.repeat_over_horizon,
        n_action_steps: int = EnvConfig.n_action_steps,
        max_episode_steps: int = MAX_EPISODE_STEPS,
        task: TabletopConfig | dict | None = None,
        simulator: Callable[[int], Simulator | ExternalSimulator] | None = None,
        weights: str | os.PathLike | None = None,
        precision: str = "native",
        device: str | torch.device | None = "auto",
        graphs: bool = True,
        start_cache_bytes: int | None = None,
        render_mode: str | None = None,
        autoreset: bool = True,
        autoreset_mode: AutoresetMode | str | None = None,
    ) -> None:
        self.num_envs = arguments.count("num_envs", num_envs)
        self.config = EnvConfig(
            obs_mode, action_mode, reward_mode, noise_bound, residual_scale, repeat_over_horizon, n_action_steps,
            max_episode_steps,
        )  # fmt: skip
        """The env's step options, checked (:class:`~flashrt_gym.env_config.EnvConfig`)."""
        self.obs_mode = self.config.obs_mode
        arguments.choose("render_mode", render_mode, (None, "rgb_array"))
        self.autoreset_mode = _autoreset_mode(autoreset, autoreset_mode)
        self.autoreset = self.autoreset_mode != AutoresetMode.DISABLED
        self.metadata = {**type(self).metadata, "autoreset_mode": self.autoreset_mode}
        self.render_mode, self.device = render_mode, resolve_device(device)
        if simulator is not None and task is not None:
            raise ValueError("pass task (the built-in tabletop's options) or simulator, not both")
        sim = simulator(self.num_envs) if simulator is not None else Tabletop(as_tabletop_config(task))
        if weights is None:  # the policy trained for the simulator, else the tabletop's
            weights = getattr(sim, "pretrained_weights", TINY)
            if weights is None:
                raise ValueError(
                    f"no shipped policy knows this simulator's instructions {sim.instructions}: pass weights= a "
                    "policy folder trained on them (scripts/metaworld_pretrain.py --tasks ... makes one for Meta-World)"
                )
        dtype = policy_dtype(self.device)
        model, weights_id = load(Path(weights), device=self.device, dtype=dtype, precision=precision)
        self.engine = Engine(
            sim,
            model,
            weights_id,
            self.num_envs,
            self.config,
            autoreset=self.autoreset,
            backend="auto" if graphs else "eager",
        )
        self.starts = StartCache(
            default_budget(self.engine.device, self.engine.bufs.state_nbytes)
            if start_cache_bytes is None
            else start_cache_bytes
        )
        self.started = False
        self.waiting = np.zeros(self.num_envs, np.bool_)  # NEXT_STEP: ended last step, their next step resets
        self.single_action_space = spaces.Box(-1.0, 1.0, self.engine.inputs.action.shape[1:], np.float32)
        bound = np.inf if sim.observation_bound is None else sim.observation_bound
        low, high = _feature_bounds(model.prefix_norm.scale(), sim.proprio_dim, bound)
        single = {
            "state": spaces.Box(-bound, bound, (sim.observation_dim,), np.float32),
            "features": spaces.Box(low, high, dtype=np.float32),
            "rgb": spaces.Box(0, 255, (model.cfg.image_size, model.cfg.image_size, 3), np.uint8),
        }
        self.single_observation_space = spaces.Dict(single) if self.obs_mode == "dict" else single[self.obs_mode]
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, self.num_envs)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, self.num_envs)
        pinned = self.device.type == "cuda"  # page-locked: the transfers are asynchronous copies
        self._outputs = torch.empty_like(self.engine.output_span, device="cpu", pin_memory=pinned)
        self._actions = torch.empty(self.action_space.shape, dtype=torch.float32, pin_memory=pinned)
        # NumPy views over the staging buffers and each output's place, worked out once: the
        # Gymnasium step's host path runs no torch op but the two copies and the replay
        self._outputs_np, self._actions_np = self._outputs.numpy(), self._actions.numpy()
        self._host_layout = [
            (n, off, off + spec.nbytes, torch.empty(0, dtype=spec.dtype).numpy().dtype, tuple(spec.shape))
            for n, (off, spec) in self.engine.output_layout.items()
        ]

    # -- Gymnasium API -------------------------------------------------------------------------
    def reset(
        self, *, seed: int | Sequence[int] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Obs, dict[str, Any]]:
        """Start episodes. ``seed``: slot i restarts from the stream of seed ``seed + i`` (a
        repeated seed restores its kept starts), or, given one seed a slot (a list of ``num_envs``
        ints, as Gymnasium's vector envs take), from the stream of ``seed[i]``: slots given one
        seed start alike; without one, every slot starts the next episode of its own stream.
        ``options["reset_mask"]`` (bool (num_envs,)): only those slots."""
        self._check_open()
        seed = arguments.reset_seeds(seed, self.num_envs)
        per_slot = seed if isinstance(seed, np.ndarray) else None
        if per_slot is not None:
            seed = int(per_slot[0])  # the env's own generator (Gymnasium's np_random) takes one int
        super().reset(seed=seed)
        unknown = sorted(set(options or {}) - {"reset_mask"})
        if unknown:
            raise ValueError(f"unknown reset options {unknown}; supported: ['reset_mask']")
        mask = (options or {}).get("reset_mask")
        if mask is not None:
            if not self.started:
                raise ValueError("reset(options={'reset_mask': ...}) needs a full reset() first")
            if not (isinstance(mask, np.ndarray) and mask.dtype == np.bool_ and mask.shape == (self.num_envs,)):
                raise ValueError(f"reset_mask must be a numpy bool array of shape ({self.num_envs},)")
            mask = torch.as_tensor(mask, device=self.device)
        if seed is None and not self.started:
            seed = int(self.np_random.integers(0, arguments.SEED_MAX - self.num_envs))
        if per_slot is not None:
            seeds = torch.as_tensor(per_slot, device=self.device)
        else:
            seeds = None if seed is None else torch.arange(self.num_envs, device=self.device) + seed
        keep = seed is not None and per_slot is None and mask is None  # the kept starts are by int seed
        cached = self.starts.get(seed) if keep else None
        if cached is not None:
            self.engine.restore(cached, check=False)  # made by this env's own start
        else:
            self.engine.start(seeds, mask)
            if keep:
                self.starts.put(seed, self.engine.snapshot())
        self.started = True
        self.waiting[mask.cpu().numpy() if mask is not None else slice(None)] = False
        return self._obs(), self._reset_info()

    def _reset_info(self) -> dict[str, Any]:
        return {"instruction": self.engine.sim.instruction.cpu().numpy()}

    def step(self, actions: Any) -> tuple[Obs, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """One chunk for every slot, NumPy in and out (one transfer each way).

        Args:
            actions: (num_envs, *single_action_space.shape) floats in [-1, 1].

        Returns:
            Observations, rewards, terminated, truncated and info, as ``autoreset_mode`` says
            (see the class): with ``SAME_STEP``, ``info["final_obs"]`` / ``info["final_info"]``
            (``is_success``) for the slots that finished; with ``NEXT_STEP``, ``info["is_success"]``.

        Raises:
            ValueError: actions of another shape or dtype, or out of bounds (the state is untouched).
            RuntimeError: before the first ``reset()``, or after ``close()``.
        """
        np.copyto(
            self._actions_np,
            arguments.host_actions(
                actions, (self.num_envs, *self.single_action_space.shape), self.config.repeat_over_horizon
            ),
        )
        waiting = self.waiting.copy() if self.waiting.any() else None
        held = None if waiting is None else self.engine.snapshot(np.flatnonzero(waiting).tolist())
        self._launch(self._actions)  # the previous step's read-back finished with this buffer
        if held is not None:  # NEXT_STEP: the waiting slots stay at their new episode's start
            self.engine.restore(held, check=False)
        out = self._read(host=True)
        obs, reward = self._pick(out, "obs"), out["env.out.reward"]
        term, trunc = out["env.out.terminated"], out["env.out.truncated"]
        if not self.autoreset:
            return obs, reward, term, trunc, {}
        done = out["env.out.done"]
        if self.autoreset_mode == AutoresetMode.SAME_STEP:
            info = {
                "final_obs": self._pick(out, "final"),
                "_final_obs": done,
                "final_info": {"is_success": term, "_is_success": done},
                "_final_info": done,
            }
            return obs, reward, term, trunc, info if done.any() else {}
        if waiting is not None:  # their step was the reset: no reward, no end
            for x in (reward, term, trunc, done):
                x[waiting] = 0
        self.waiting = done.copy()
        obs = self._where(done, self._pick(out, "final"), obs)
        return obs, reward, term, trunc, {"is_success": term, "_is_success": done} if done.any() else {}

    def step_torch(self, actions: torch.Tensor) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """The step on tensors, for learners that keep everything on the device: observation(s),
        reward, terminated, truncated as device tensors (copies), and a tensor info.

        Its autoreset is always the step's own, same-step (``info["final_obs"]`` masked by
        ``info["_final_obs"]``), whatever ``autoreset_mode`` says; an env in ``NEXT_STEP`` mode
        refuses it (the two would disagree on which slots wait for their reset).

        Device actions are checked on the device by the step's guard, in the same launch: the
        call waits until the guard has run (not for the step) to know whether the step ran; a
        bad action raises and leaves the state untouched."""
        if not isinstance(actions, torch.Tensor):
            raise TypeError(f"step_torch takes a torch.Tensor of actions, got {type(actions).__name__}; use step()")
        if self.autoreset_mode == AutoresetMode.NEXT_STEP:
            raise RuntimeError("step_torch autoresets in the same step; this env is NEXT_STEP: use step()")
        want = (self.num_envs, *self.single_action_space.shape)
        arguments.check_actions(actions, want, self.config.repeat_over_horizon)
        host = actions.device.type == "cpu" and self.device.type != "cpu"
        if host:
            arguments.check_action_bounds(actions.numpy(force=True))
        self._launch(actions.to(self.device))  # a host tensor of the caller's: a synchronous copy
        if not host and not self.engine.held():
            arguments.reject_actions(actions)
        out = self._read(host=False)
        info = {"final_obs": self._pick(out, "final"), "_final_obs": out["env.out.done"]} if self.autoreset else {}
        return self._pick(out, "obs"), out["env.out.reward"], out["env.out.terminated"], out["env.out.truncated"], info

    def render(self) -> tuple[np.ndarray, ...] | None:
        """One (H, W, 3) uint8 frame per slot (the vector-render convention), if rendering."""
        if self.render_mode != "rgb_array":
            return None
        self._check_open()
        return tuple(self.engine.policy.state.image[:, 0].cpu().numpy())

    def close_extras(self, **kwargs: Any) -> None:
        """Release the buffers, and the simulator's own resources where it has a ``close()`` (the
        worker processes of :class:`~flashrt_gym.sims.processes.Processes`); the env refuses
        every later call."""
        engine, self.engine, self.starts = self.engine, None, None  # type: ignore[assignment]
        if engine is not None:
            engine.close()

    # -- capsule verbs -------------------------------------------------------------------------
    def snapshot(self, slots: Sequence[int] | None = None) -> Capsule:
        """The state of all slots (or of ``slots``) at this step boundary, as a capsule."""
        self._check_open()
        return self.engine.snapshot(None if slots is None else self._slot_list(slots, "snapshot"))

    def restore(self, capsule: Capsule, slots: Sequence[int] | None = None) -> Obs:
        """Restore a capsule of this env's configuration (all-or-nothing: everything is checked
        before the first byte moves); returns the observations, valid at once."""
        self._check_open()
        if not isinstance(capsule, Capsule):
            raise TypeError(f"restore takes a Capsule (from snapshot() or Capsule.load), got {type(capsule).__name__}")
        targets = None if slots is None else self._slot_list(slots, "restore")
        self.engine.restore(capsule, targets)
        self.started = True
        self.waiting[list(targets or capsule.slots or range(self.num_envs))] = False
        return self._obs()

    def rollback(self, capsule: Capsule) -> Obs:
        """Return to an earlier boundary of this env; returns the observations."""
        self._check_open()
        self.engine.rollback(capsule)
        self.waiting[list(capsule.slots or range(self.num_envs))] = False
        return self._obs()

    def fork(self, src_slot: int, dst_slots: Sequence[int], reseed: bool = False) -> Obs:
        """Copy slot ``src_slot``'s boundary into ``dst_slots``. With ``reseed`` each destination
        gets its own random streams (residual-mode noise and later episodes then differ)."""
        self._check_open()
        (src,) = self._slot_list([src_slot], "fork source")
        dst = self._slot_list(dst_slots, "fork")
        self.engine.fork(src, dst, reseed=bool(reseed))
        self.waiting[dst] = False
        return self._obs()

    @property
    def instructions(self) -> tuple[str, ...]:
        """The instructions this env's simulator knows, in its index order: what
        :meth:`set_instruction` accepts, and what ``info["instruction"]`` (from ``reset``) indexes."""
        self._check_open()
        return tuple(self.engine.instructions.texts)

    def set_instruction(self, text: str, slots: Sequence[int] | None = None) -> Obs:
        """Hard interrupt: give ``slots`` (all if None) a new instruction between steps; its
        keys/values come from the instruction table, nothing is recaptured. Rewards and success
        follow the new instruction from the next step."""
        self._check_open()
        texts = self.instructions
        if text not in texts:
            raise ValueError(f"unknown instruction {text!r}; instructions (the env's .instructions) are {list(texts)}")
        idx = None if slots is None else torch.tensor(self._slot_list(slots, "set_instruction"), device=self.device)
        self.engine.set_instruction(texts.index(text), idx)
        return self._obs()

    # -- helpers -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this env is closed; make a new one")

    def _slot_list(self, slots: Any, what: str) -> list[int]:
        return arguments.slot_list(slots, self.num_envs, what)

    def _launch(self, actions: torch.Tensor) -> None:
        self._check_open()
        if not self.started:
            raise RuntimeError("call reset() before step()")
        self.engine.launch(actions)

    def _read(self, host: bool) -> dict[str, Any]:
        """The step's outputs: device copies, or NumPy arrays over one fresh host buffer (one
        transfer into page-locked memory behind the step, one host copy the caller keeps)."""
        if not host:
            return self.engine.read_outputs()
        self._outputs.copy_(self.engine.output_span, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        host = self._outputs_np.copy()
        return {n: host[lo:hi].view(dtype).reshape(shape) for n, lo, hi, dtype, shape in self._host_layout}

    def _pick(self, out: dict[str, Any], prefix: str) -> Any:
        parts = {f: out[f"env.{prefix}.{f}"] for f in self.config.obs_forms}
        return parts if self.obs_mode == "dict" else parts[self.obs_mode]

    def _obs(self) -> Obs:
        return self._pick(self._read(host=True), "obs")

    def _where(self, mask: np.ndarray, a: Obs, b: Obs) -> Obs:
        """Slot i's observation from ``a`` where ``mask[i]``, else from ``b``."""
        if isinstance(a, dict):
            return {k: self._where(mask, a[k], b[k]) for k in a}
        return np.where(mask.reshape(-1, *[1] * (a.ndim - 1)), a, b)


def _feature_bounds(scale: torch.Tensor, proprio_dim: int, proprio_bound: float) -> tuple[np.ndarray, np.ndarray]:
    """Low and high of the ``features`` observation: the pooled embedding's guaranteed bound (with
    room for bf16 rounding of the normed row and of its scaling), then the proprioception's."""
    width = scale.numel()
    high = np.concatenate(
        [
            np.sqrt(width) * scale.detach().float().abs().cpu().numpy() * (1 + 2**-6),
            np.full(proprio_dim, proprio_bound),
        ]
    ).astype(np.float32)
    return -high, high


def _autoreset_mode(autoreset: bool, mode: AutoresetMode | str | None) -> AutoresetMode:
    """The env's autoreset mode from its two arguments (``autoreset=False`` is ``DISABLED``)."""
    if mode is None:
        return AutoresetMode.SAME_STEP if autoreset else AutoresetMode.DISABLED
    names = [m.name for m in AutoresetMode]
    if isinstance(mode, str) and mode.upper() in names:
        mode = AutoresetMode[mode.upper()]
    if not isinstance(mode, AutoresetMode):
        raise ValueError(f"autoreset_mode must be a gymnasium.vector.AutoresetMode or one of {names}, got {mode!r}")
    if not autoreset and mode != AutoresetMode.DISABLED:
        raise ValueError(f"autoreset=False is autoreset_mode=DISABLED, got autoreset_mode={mode.name}: pass one")
    return mode
