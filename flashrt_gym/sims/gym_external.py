"""Bring your own simulator: any Gymnasium MuJoCo env as a batched external simulator.

The pattern for wrapping a simulator as an *external* one: ``num_slots`` instances, and a
state row per slot that holds *every* input of the next step and reset, moved as bytes by
``get_state(slots)`` / ``set_state(slots, states)``. For a Gymnasium ``MujocoEnv`` that is

- MuJoCo's integration state (``mj_getState`` with ``mjSTATE_INTEGRATION``: positions,
  velocities, the solver's warm start, controls, ...; called directly, since
  ``gymnasium.envs.mujoco.utils.set_state`` passes a keyword that MuJoCo 4 renamed):
  ``MujocoEnv.set_state(qpos, qvel)`` alone drops the warm start, and contacts then make the
  continuation differ;
- the env's reset RNG (``np_random``, a PCG64 generator): without it, a restored slot's next
  episode would start elsewhere than the original's;
- whether the slot's episode has ended (a finished slot is not stepped).

Envs that keep more Python-side state (a goal outside ``qpos``, a step counter of their own)
add it to the row the same way.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import mujoco
import numpy as np
from gymnasium.envs.mujoco import MujocoEnv

STATE_SIG = int(mujoco.mjtState.mjSTATE_INTEGRATION)
_RNG_WORDS = 6  # PCG64: state and increment (128 bits each), has_uint32, uinteger
_M64 = (1 << 64) - 1


def _rng_words(rng: np.random.Generator) -> np.ndarray:
    s = rng.bit_generator.state
    if s["bit_generator"] != "PCG64":
        raise ValueError(f"only PCG64 reset generators are packed, got {s['bit_generator']}")
    st, inc = s["state"]["state"], s["state"]["inc"]
    return np.array([st & _M64, st >> 64, inc & _M64, inc >> 64, s["has_uint32"], s["uinteger"]], dtype=np.uint64)


def _set_rng(rng: np.random.Generator, w: np.ndarray) -> None:
    w = [int(x) for x in w]
    rng.bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {"state": w[0] | (w[1] << 64), "inc": w[2] | (w[3] << 64)},
        "has_uint32": w[4],
        "uinteger": w[5],
    }


class GymnasiumMujocoSim:
    """``num_slots`` copies of a Gymnasium MuJoCo env behind the external-simulator verbs.

    Args:
        env_id: a registered id whose env is a ``gymnasium.envs.mujoco.MujocoEnv``
            (e.g. ``"Hopper-v5"``).
        num_slots: parallel episodes.
        make_kwargs: passed to ``gymnasium.make``.
    """

    def __init__(self, env_id: str, num_slots: int, **make_kwargs: Any) -> None:
        if int(num_slots) < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.envs = [gym.make(env_id, **make_kwargs).unwrapped for _ in range(int(num_slots))]
        if not isinstance(self.envs[0], MujocoEnv):
            raise TypeError(f"{env_id} is a {type(self.envs[0]).__name__}, not a gymnasium MujocoEnv")
        self.num_slots = int(num_slots)
        self.action_dim = int(np.prod(self.envs[0].action_space.shape))
        self.physics_size = mujoco.mj_stateSize(self.envs[0].model, STATE_SIG)
        self.state_nbytes = 8 * (self.physics_size + _RNG_WORDS + 1)
        self._done = np.zeros(self.num_slots, dtype=bool)
        self._obs = np.stack([env.reset(seed=i)[0] for i, env in enumerate(self.envs)])

    def _slots(self, slots: Any) -> np.ndarray:
        s = np.arange(self.num_slots) if slots is None else np.asarray(slots, dtype=np.int64).reshape(-1)
        if s.size and (s.min() < 0 or s.max() >= self.num_slots or len(set(s.tolist())) != s.size):
            raise ValueError(f"slots must be distinct indices in [0, {self.num_slots}), got {s.tolist()}")
        return s

    def reset(self, mask: Any = None, seeds: Any = None) -> None:
        """Start new episodes where ``mask`` (all if None); ``seeds`` (slots,) reseed the
        slots' reset generators first (Gymnasium's ``reset(seed=)``)."""
        m = np.ones(self.num_slots, dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        for i in np.flatnonzero(m):
            seed = None if seeds is None else int(seeds[i])
            self._obs[i] = self.envs[i].reset(seed=seed)[0]
        self._done[m] = False

    def run_ticks(self, actions: Any) -> tuple[np.ndarray, np.ndarray]:
        """Step every running slot ``T`` times under ``actions`` (slots, T, action_dim); a slot
        whose episode terminates stops there. Returns summed rewards and terminated flags."""
        a = np.asarray(actions, dtype=np.float64)
        if a.shape[0] != self.num_slots or a.ndim != 3 or a.shape[2] != self.action_dim:
            raise ValueError(f"actions must have shape ({self.num_slots}, T, {self.action_dim}), got {a.shape}")
        reward = np.zeros(self.num_slots)
        for i, env in enumerate(self.envs):
            for t in range(a.shape[1]):
                if self._done[i]:
                    break
                obs, r, terminated, _, _ = env.step(a[i, t])
                self._obs[i], reward[i] = obs, reward[i] + r
                self._done[i] = terminated
        return reward, self._done.copy()

    def observation(self) -> np.ndarray:
        """(slots, obs_dim) the envs' current observations."""
        return self._obs.copy()

    def get_state(self, slots: Any = None) -> np.ndarray:
        """(len(slots), state_nbytes) uint8 rows: integration state, reset RNG, done flag."""
        s = self._slots(slots)
        rows = np.zeros((s.size, self.physics_size + _RNG_WORDS + 1), dtype=np.float64)
        words = rows[:, self.physics_size :].view(np.uint64)
        for r, i in enumerate(s):
            mujoco.mj_getState(self.envs[i].model, self.envs[i].data, rows[r, : self.physics_size], STATE_SIG)
            words[r, :_RNG_WORDS] = _rng_words(self.envs[i].np_random)
            words[r, _RNG_WORDS] = self._done[i]
        return rows.view(np.uint8)

    def set_state(self, slots: Any, states: Any) -> None:
        """Write rows of :meth:`get_state` into ``slots`` (all-or-nothing: checked first), then
        recompute each slot's observation from its restored physics."""
        s = self._slots(slots)
        rows = np.ascontiguousarray(np.asarray(states))
        if rows.dtype != np.uint8 or rows.shape != (s.size, self.state_nbytes):
            raise ValueError(f"states must be uint8 rows of shape ({s.size}, {self.state_nbytes}) from get_state")
        phys = rows.view(np.float64)[:, : self.physics_size]
        words = rows.view(np.float64)[:, self.physics_size :].view(np.uint64)
        if not np.isfinite(phys).all() or (words[:, _RNG_WORDS] > 1).any():
            raise ValueError(
                "states are not rows of get_state (non-finite physics or a bad done flag); nothing written"
            )
        for r, i in enumerate(s):
            env = self.envs[i]
            mujoco.mj_setState(env.model, env.data, phys[r].copy(), STATE_SIG)
            mujoco.mj_forward(env.model, env.data)
            _set_rng(env.np_random, words[r, :_RNG_WORDS])
            self._done[i] = bool(words[r, _RNG_WORDS])
            self._obs[i] = env._get_obs()
