"""Batched evaluation: one episode per slot from seeded starts, and the seeds' named splits.

Every evaluation runs ``num_envs`` episodes at once in an env built with ``autoreset=False``:
``reset(seed=s)`` gives slot i the start of seed ``s + i``, finished slots stop counting, and the
loop ends when every slot has finished. The splits' seeds are named in :mod:`flashrt_gym.splits`
(re-exported here): what a choice is made on (validation) is never what a result is reported on
(test), and neither overlaps training runs or demonstrations, as drawn start states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.splits import TEST_SEED, VALIDATION_SEED

__all__ = ["TEST_SEED", "VALIDATION_SEED", "EpisodeStats", "base_policy", "run_episodes"]


@dataclass(frozen=True)
class EpisodeStats:
    """What a batch of episodes gave: success rate, mean return and mean length (env steps)."""

    success: float
    mean_return: float
    mean_length: float
    episodes: int


def run_episodes(env: FlashRTVectorEnv, act: Callable[[Any], np.ndarray], seed: int) -> EpisodeStats:
    """One episode per slot of ``env`` (``autoreset=False``) from ``reset(seed=seed)``, acting
    with ``act(obs) -> actions``."""
    if env.autoreset:
        raise ValueError("run_episodes needs an env built with autoreset=False (one episode per slot)")
    obs, _ = env.reset(seed=seed)
    alive = np.ones(env.num_envs, dtype=bool)
    ret, length = np.zeros(env.num_envs), np.zeros(env.num_envs)
    success = np.zeros(env.num_envs, dtype=bool)
    while alive.any():
        obs, reward, term, trunc, _ = env.step(act(obs))
        ret += reward * alive
        length += alive
        success |= term & alive
        alive &= ~(term | trunc)
    return EpisodeStats(float(success.mean()), float(ret.mean()), float(length.mean()), env.num_envs)


def base_policy(env: FlashRTVectorEnv, seed: int) -> EpisodeStats:
    """The unsteered policy (its own per-slot noise, no correction) from ``seed``'s starts: ``env``
    must be built with ``action_mode="residual"`` and ``autoreset=False``."""
    if env.step_config.action_mode != "residual":
        raise ValueError("the base policy runs on its own noise: build the env with action_mode='residual'")
    zeros = np.zeros((env.num_envs, *env.single_action_space.shape), np.float32)
    return run_episodes(env, lambda _: zeros, seed)
