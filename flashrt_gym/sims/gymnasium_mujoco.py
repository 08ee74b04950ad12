"""Bring your own simulator: any Gymnasium MuJoCo env as a batched external simulator.

:class:`GymnasiumMujocoSim` runs ``num_slots`` copies of a Gymnasium ``MujocoEnv`` (``Pusher-v5``,
``Hopper-v5``, ... or one's own) behind every member of
:class:`~flashrt_gym.simulator.ExternalSimulator`, so ``register_simulator`` and ``make_vec`` take it
as they take the built-in MuJoCo push task. What the env does not have, the user names:

- the instruction the policy reads (default: words of the env id, ``"Pusher-v5"`` -> ``"pusher"``);
- success: a key of the env's ``info`` or a rule ``(obs, info) -> bool`` (default: none, episodes
  end by truncation); a slot that succeeds, or whose env terminates, is frozen until its reset;
- proprioception: a slice or indices of the observation (default: all of it);
- the camera: one image per slot at the policy's resolution from ``mujoco.Renderer`` (shadows,
  reflections and skybox off), from MuJoCo's default free camera or a camera of the model.

A slot's state row holds everything its next step, reset and outputs read, as 8-byte words:

- MuJoCo's integration state (``mj_getState`` with ``mjSTATE_INTEGRATION``: time, positions,
  velocities, the solver's warm start, controls, applied forces, ...; every input of ``mj_step``).
  ``MujocoEnv.set_state(qpos, qvel)`` alone drops the warm start, and contacts then make the
  continuation differ;
- the env's reset generator (``np_random``, PCG64: 128-bit state and increment, the cached word):
  without it a restored slot's next episode would start elsewhere than the original's;
- the wrapper's fields: instruction index, success and terminated flags;
- the env's last observation, as it returned it (Gymnasium's MuJoCo envs compute observations
  from the kinematics of the step's start, which a restore could not recompute).

The wrapped env's episode length is the FlashRT env's ``max_episode_steps`` (the Gymnasium
``TimeLimit`` is not used), so no step counter of the env's own needs to travel. Envs whose
``step`` reads Python attributes that ``reset`` writes (none of Gymnasium's v5 envs do) would add
them to the row the same way.

On Linux without a display, importing this module sets ``MUJOCO_GL=egl`` unless it is set or
``mujoco`` was already imported: ``mujoco`` picks its OpenGL platform when first imported, and
its default (GLFW) needs a display.
"""

from __future__ import annotations

import os
import re
import sys

if sys.platform.startswith("linux") and "mujoco" not in sys.modules and not os.environ.get("DISPLAY"):
    os.environ.setdefault("MUJOCO_GL", "egl")

from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import mujoco
import numpy as np
from gymnasium.envs.mujoco import MujocoEnv

from flashrt_gym.sims.push.task import model_digest

SuccessRule = Callable[[np.ndarray, dict[str, Any]], bool]
"""A user's success rule: the env's observation and ``info`` after a step -> whether the task is done."""

FIELDS = ("instruction", "success", "terminated")
"""The wrapper's int64 fields in a state row, after the physics and the reset generator."""

_RNG_WORDS = 6  # PCG64: state and increment (128 bits each), has_uint32, uinteger
_M64 = (1 << 64) - 1


def default_instruction(env_id: str) -> str:
    """The words of an env id's name: ``"Pusher-v5"`` -> ``"pusher"``, ``"HalfCheetah-v5"`` ->
    ``"half cheetah"`` (a namespace and the version are dropped)."""
    name = re.sub(r"-v\d+$", "", env_id.split("/")[-1])
    return " ".join(w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)) or env_id


def _rng_words(rng: np.random.Generator) -> np.ndarray:
    s = rng.bit_generator.state
    if s["bit_generator"] != "PCG64":
        raise ValueError(f"only PCG64 reset generators are packed into a state row, got {s['bit_generator']}")
    st, inc = s["state"]["state"], s["state"]["inc"]
    return np.array([st & _M64, st >> 64, inc & _M64, inc >> 64, s["has_uint32"], s["uinteger"]], dtype=np.uint64)


def _set_rng(env: MujocoEnv, w: np.ndarray) -> None:
    w = [int(x) for x in w]
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {"state": w[0] | (w[1] << 64), "inc": w[2] | (w[3] << 64)},
        "has_uint32": w[4],
        "uinteger": w[5],
    }
    env.np_random = rng


class GymnasiumMujocoSim:
    """``num_slots`` copies of a Gymnasium MuJoCo env behind the external-simulator protocol.

    Actions are the policy's, in ``[-1, 1]`` (clipped), mapped linearly onto the env's action box.
    Per step the dense reward is the env's reward summed over the ticks, the sparse one 1 on the
    tick the slot succeeds.

    Args:
        env_id: a registered id whose env is a ``gymnasium.envs.mujoco.MujocoEnv`` with a 1-D
            observation (e.g. ``"Pusher-v5"``).
        num_slots: parallel episodes (the env's ``num_envs``).
        instruction: the instruction text, or several (``set_instruction`` picks one per slot;
            a reset keeps a slot's). Default: :func:`default_instruction` of ``env_id``.
        success: a key of the env's ``info`` whose value says success, or a rule
            ``(obs, info) -> bool`` (:data:`SuccessRule`). Default: no success.
        proprio: the observation's numbers the policy reads as its state, a slice or indices
            (default: the whole observation).
        image_size: the camera images' height and width: the policy's ``image_size``.
        camera: a camera of the model (name or id), or -1 for MuJoCo's default free camera.
        observation_bound: every observation number lies in ``[-bound, bound]`` (None: unbounded).
        **make_kwargs: passed to ``gymnasium.make``.

    Raises:
        ValueError: an argument is out of range (the message names it and what it takes).
        TypeError: ``env_id``'s env is not a ``MujocoEnv``, or ``success`` is neither a key nor a callable.
    """

    num_cameras = 1
    physics_signature = int(mujoco.mjtState.mjSTATE_INTEGRATION)
    """What a state row holds of MuJoCo's state (an ``mjtState`` signature)."""

    def __init__(
        self,
        env_id: str,
        num_slots: int,
        *,
        instruction: str | Sequence[str] | None = None,
        success: str | SuccessRule | None = None,
        proprio: slice | Sequence[int] | None = None,
        image_size: int = 64,
        camera: int | str = -1,
        observation_bound: float | None = None,
        **make_kwargs: Any,
    ) -> None:
        if isinstance(num_slots, bool) or int(num_slots) < 1:
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if success is not None and not isinstance(success, str) and not callable(success):
            raise TypeError(
                f"success must be a key of the env's info or a callable (obs, info) -> bool, got {success!r}"
            )
        self.env_id, self.num_slots, self._make_kwargs = env_id, int(num_slots), make_kwargs
        self.envs: list[MujocoEnv] = [gym.make(env_id, **make_kwargs).unwrapped for _ in range(self.num_slots)]
        env = self.envs[0]
        if not isinstance(env, MujocoEnv):
            raise TypeError(f"{env_id} is a {type(env).__name__}, not a gymnasium MujocoEnv")
        space = env.observation_space
        if not isinstance(space, gym.spaces.Box) or len(space.shape) != 1:
            raise ValueError(f"{env_id}'s observation space must be a 1-D Box, got {space}")
        texts = default_instruction(env_id) if instruction is None else instruction
        self.instructions = (texts,) if isinstance(texts, str) else tuple(texts)
        if not self.instructions or not all(isinstance(t, str) and t.strip() for t in self.instructions):
            raise ValueError(f"instruction must be a non-empty text or a non-empty list of them, got {instruction!r}")
        self._success = success
        self.observation_dim = int(space.shape[0])
        every = np.arange(self.observation_dim)
        try:
            self._proprio = (
                every[proprio] if isinstance(proprio, slice) else every[every if proprio is None else list(proprio)]
            )
        except (IndexError, TypeError) as e:
            raise ValueError(
                f"proprio must index the {self.observation_dim} observation numbers, got {proprio!r}"
            ) from e
        if self._proprio.size == 0:
            raise ValueError(f"proprio selects no observation number ({proprio!r}); give a non-empty slice or indices")
        self.proprio_dim = int(self._proprio.size)
        self.action_dim = int(np.prod(env.action_space.shape))
        box = env.action_space
        low, high = (np.asarray(b, dtype=np.float64).reshape(-1) for b in (box.low, box.high))
        self._center, self._half = (high + low) / 2, (high - low) / 2  # [-1, 1] -> the box; exact on [-1, 1]
        self.observation_bound = observation_bound
        model = env.model
        limit = min(model.vis.global_.offwidth, model.vis.global_.offheight)
        if isinstance(image_size, bool) or not isinstance(image_size, int) or not 1 <= image_size <= limit:
            raise ValueError(
                f"image_size must be an int in [1, {limit}] (the model's offscreen buffer), got {image_size!r}"
            )
        self.image_size = image_size
        self._camera = self._camera_of(camera)
        self._renderer: mujoco.Renderer | None = None
        self.physics_size = mujoco.mj_stateSize(model, self.physics_signature)
        self._words = self.physics_size + _RNG_WORDS + len(FIELDS) + self.observation_dim
        self.state_nbytes = 8 * self._words
        self._digest = model_digest(model)
        self._fields = np.zeros((self.num_slots, len(FIELDS)), dtype=np.int64)
        self._obs = np.zeros((self.num_slots, self.observation_dim), dtype=np.float64)
        self.seed(np.arange(self.num_slots))
        self.reset()

    def _camera_of(self, camera: int | str) -> int | str:
        model = self.envs[0].model
        names = [mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(model.ncam)]
        if isinstance(camera, str) and camera in names:
            return camera
        if isinstance(camera, int) and not isinstance(camera, bool) and -1 <= camera < model.ncam:
            return camera
        raise ValueError(
            f"camera must be -1 (the free camera), an id below {model.ncam} or one of {names}, got {camera!r}"
        )

    def identity(self) -> str:
        """The env id and its options, the compiled model, the row's layout and the instructions."""
        return (
            f"gymnasium-mujoco|{self.env_id}|{sorted(self._make_kwargs.items())!r}|model={self._digest}|"
            f"signature={self.physics_signature}|observation_dim={self.observation_dim}|{self.instructions!r}"
        )

    # -- slots ---------------------------------------------------------------------------------
    def _slots(self, slots: Any) -> np.ndarray:
        if slots is None:
            return np.arange(self.num_slots)
        s = np.asarray(slots)
        if s.ndim != 1 or (s.size and s.dtype.kind not in "iu"):
            raise ValueError(f"slots must be a 1-D sequence of slot indices, got {s.dtype} {s.shape}")
        s = s.astype(np.int64)
        if s.size and (s.min() < 0 or s.max() >= self.num_slots or len(set(s.tolist())) != s.size):
            raise ValueError(f"slots must be distinct indices in [0, {self.num_slots}), got {s.tolist()}")
        return s

    def _mask(self, mask: Any) -> np.ndarray:
        if mask is None:
            return np.ones(self.num_slots, dtype=bool)
        m = np.asarray(mask)
        if m.dtype != np.bool_ or m.shape != (self.num_slots,):
            raise ValueError(f"mask must be a bool array of shape ({self.num_slots},), got {m.dtype} {m.shape}")
        return m

    def _field(self, name: str) -> np.ndarray:
        return self._fields[:, FIELDS.index(name)]

    # -- episodes ------------------------------------------------------------------------------
    def seed(self, seeds: Any, slots: Any = None) -> None:
        """Restart the reset generator of each slot (all, or ``slots``) from its int64 seed, whole:
        seed ``s`` gives the generator ``env.reset(seed=s mod 2**64)`` makes (NumPy's
        ``SeedSequence`` of all 64 bits), so the slot's next reset draws that episode."""
        s = self._slots(slots)
        k = np.asarray(seeds)
        if k.shape != (s.size,) or (k.size and k.dtype.kind not in "iu"):
            raise ValueError(f"seeds must be {s.size} integers, one per slot, got {k.dtype} {k.shape}")
        for i, seed in zip(s.tolist(), k.tolist(), strict=True):
            self.envs[i].np_random = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed & _M64)))

    def reset(self, mask: Any = None, seeds: Any = None) -> None:
        """Start the next episode of each slot's generator where ``mask`` (all if None); ``seeds``
        (slots,) int64 restart the masked slots' generators first (:meth:`seed`). A slot keeps its
        instruction."""
        m = self._mask(mask)
        where = np.flatnonzero(m)
        if seeds is not None:
            self.seed(np.asarray(seeds)[where], where)
        for i in where:
            self._obs[i] = self.envs[i].reset()[0]
        self._field("success")[m] = 0
        self._field("terminated")[m] = 0

    def set_instruction(self, index: int, slots: Any = None) -> None:
        """Give ``slots`` (all if None) the instruction ``index`` from the next step on."""
        if isinstance(index, bool) or not 0 <= int(index) < len(self.instructions):
            raise ValueError(f"instruction index must be an int in [0, {len(self.instructions)}), got {index!r}")
        self._fields[self._slots(slots), FIELDS.index("instruction")] = int(index)

    def _succeeded(self, obs: np.ndarray, info: dict[str, Any]) -> bool:
        if self._success is None:
            return False
        if callable(self._success):
            return bool(self._success(obs, info))
        if self._success not in info:
            raise ValueError(
                f"{self.env_id}'s info has no key {self._success!r} (it has {sorted(info)}): name one of them as "
                f"success, or give a rule (obs, info) -> bool"
            )
        return bool(info[self._success])

    def run_ticks(self, actions: Any) -> tuple[np.ndarray, np.ndarray]:
        """Advance every running slot ``T`` env steps under ``actions`` (slots, T, action_dim) in
        [-1, 1]; a slot that succeeds or terminates stops there and stays frozen until its reset.

        Returns:
            (dense, sparse) rewards summed over the ticks, each (slots,) float32.

        Raises:
            ValueError: ``actions`` has another shape, or NaN or infinity.
        """
        a = np.asarray(actions, dtype=np.float64)
        if a.ndim != 3 or a.shape[0] != self.num_slots or a.shape[2] != self.action_dim:
            raise ValueError(f"actions must have shape ({self.num_slots}, T, {self.action_dim}), got {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError("actions contain NaN or infinity")
        a = self._center + self._half * np.clip(a, -1.0, 1.0)
        dense, sparse = np.zeros(self.num_slots), np.zeros(self.num_slots)
        success, terminated = self._field("success"), self._field("terminated")
        for i, env in enumerate(self.envs):
            for t in range(a.shape[1]):
                if success[i] or terminated[i]:
                    break
                obs, reward, term, _, info = env.step(a[i, t])
                self._obs[i] = obs
                dense[i] += reward
                terminated[i] = bool(term)
                if self._succeeded(obs, info):
                    success[i], sparse[i] = 1, 1.0
        return dense.astype(np.float32), sparse.astype(np.float32)

    # -- outputs -------------------------------------------------------------------------------
    def success(self) -> np.ndarray:
        """(slots,) bool: the slot's episode has succeeded (it is frozen until reset)."""
        return self._field("success") != 0

    def instruction(self) -> np.ndarray:
        """(slots,) int64 index into :attr:`instructions` (a copy)."""
        return self._field("instruction").copy()

    def observation(self) -> np.ndarray:
        """(slots, observation_dim) float32: the envs' last observations."""
        return self._obs.astype(np.float32)

    def proprio(self) -> np.ndarray:
        """(slots, proprio_dim) float32: the chosen numbers of the observations."""
        return self._obs[:, self._proprio].astype(np.float32)

    def render(self) -> np.ndarray:
        """(slots, 1, image_size, image_size, 3) uint8 camera images of the current positions.

        Raises:
            RuntimeError: MuJoCo cannot open an OpenGL context (the message says how to choose one).
        """
        if self._renderer is None:
            try:
                self._renderer = mujoco.Renderer(self.envs[0].model, self.image_size, self.image_size)
            except Exception as e:
                raise RuntimeError(
                    f"mujoco.Renderer could not open an OpenGL context ({type(e).__name__}: {e}); without a display "
                    f"set MUJOCO_GL=egl (or osmesa) in the environment before mujoco is first imported"
                ) from e
            for flag in (
                mujoco.mjtRndFlag.mjRND_SHADOW,
                mujoco.mjtRndFlag.mjRND_REFLECTION,
                mujoco.mjtRndFlag.mjRND_SKYBOX,
            ):
                self._renderer.scene.flags[flag] = 0
        out = np.empty((self.num_slots, 1, self.image_size, self.image_size, 3), dtype=np.uint8)
        for i, env in enumerate(self.envs):
            # kinematics of the current positions (a step leaves them at its start); mj_step reads
            # none of what this writes, so the dynamics do not change
            mujoco.mj_forward(env.model, env.data)
            self._renderer.update_scene(env.data, camera=self._camera)
            self._renderer.render(out=out[i, 0])
        return out

    # -- state rows ----------------------------------------------------------------------------
    def get_state(self, slots: Any = None) -> np.ndarray:
        """(len(slots), state_nbytes) uint8 rows of the slots' whole state (all slots if None)."""
        s = self._slots(slots)
        rows = np.zeros((s.size, self._words), dtype=np.float64)
        p = self.physics_size
        words = rows[:, p : p + _RNG_WORDS].view(np.uint64)
        for r, i in enumerate(s):
            env = self.envs[i]
            mujoco.mj_getState(env.model, env.data, rows[r, :p], self.physics_signature)
            words[r] = _rng_words(env.np_random)
        rows[:, p + _RNG_WORDS : p + _RNG_WORDS + len(FIELDS)].view(np.int64)[:] = self._fields[s]
        rows[:, p + _RNG_WORDS + len(FIELDS) :] = self._obs[s]
        return rows.view(np.uint8)

    def set_state(self, slots: Any, states: Any) -> None:
        """Write rows of :meth:`get_state` (of this env and options) into ``slots`` (all if None).

        Raises:
            ValueError: a row is not one of :meth:`get_state`'s (shape, non-finite numbers, a
                generator PCG64 cannot hold, an instruction index or flag out of range); every row
                is checked before any slot changes, so nothing was written.
        """
        s = self._slots(slots)
        rows = np.asarray(states)
        if rows.dtype != np.uint8 or rows.shape != (s.size, self.state_nbytes):
            raise ValueError(
                f"states must be uint8 of shape ({s.size}, {self.state_nbytes}) (rows of get_state), got "
                f"{rows.dtype} {rows.shape}; nothing written"
            )
        words = np.ascontiguousarray(rows).view(np.float64)
        p, f = self.physics_size, self.physics_size + _RNG_WORDS
        physics, obs = words[:, :p], words[:, f + len(FIELDS) :]
        rng, fields = words[:, p:f].view(np.uint64), words[:, f : f + len(FIELDS)].view(np.int64)
        instr, flags = fields[:, FIELDS.index("instruction")], fields[:, 1:]
        bad = []
        if not (np.isfinite(physics).all() and np.isfinite(obs).all()):
            bad.append("non-finite physics or observation values")
        if ((rng[:, 2] & 1) == 0).any() or (rng[:, 4] > 1).any():
            bad.append("reset generator words PCG64 cannot hold (an even increment or a bad cache flag)")
        if ((instr < 0) | (instr >= len(self.instructions))).any():
            bad.append(f"instruction indices outside [0, {len(self.instructions)})")
        if ((flags != 0) & (flags != 1)).any():
            bad.append("success or terminated flags other than 0/1")
        if bad:
            raise ValueError(f"states are not rows of this simulator's get_state: {', '.join(bad)}; nothing written")
        for r, i in enumerate(s):
            env = self.envs[i]
            mujoco.mj_setState(env.model, env.data, physics[r].copy(), self.physics_signature)
            _set_rng(env, rng[r])
        self._fields[s] = fields
        self._obs[s] = obs
