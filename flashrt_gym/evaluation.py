"""Batched evaluation: one episode per slot from seeded starts, the seeds' named splits, and
:func:`evaluate`, a split's episodes in batches of the env's slots.

Every evaluation runs ``num_envs`` episodes at once in an env built with ``autoreset=False``:
``reset(seed=s)`` gives slot i the start of seed ``s + i``, finished slots stop counting, and the
loop ends when every slot has finished. The splits' seeds are named in :mod:`flashrt_gym.splits`
(re-exported here): what a choice is made on (validation) is never what a result is reported on
(test), and neither overlaps training runs or demonstrations, as drawn start states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.splits import TEST_SEED, VALIDATION_SEED, eval_seed

__all__ = [
    "TEST_SEED",
    "VALIDATION_SEED",
    "EpisodeStats",
    "EvalResult",
    "base_policy",
    "evaluate",
    "run_episodes",
    "torch_policy",
]


@dataclass(frozen=True)
class EpisodeStats:
    """What a batch of episodes gave: success rate, mean return and mean length (env steps), and
    per instruction index (each slot's at its reset) the episodes that succeeded and the episodes."""

    success: float
    mean_return: float
    mean_length: float
    episodes: int
    by_instruction: dict[int, tuple[int, int]] = field(default_factory=dict)


def run_episodes(env: FlashRTVectorEnv, act: Callable[[Any], np.ndarray], seed: int) -> EpisodeStats:
    """One episode per slot of ``env`` (``autoreset=False``) from ``reset(seed=seed)``, acting
    with ``act(obs) -> actions``."""
    if env.autoreset:
        raise ValueError("run_episodes needs an env built with autoreset=False (one episode per slot)")
    obs, info = env.reset(seed=seed)
    instruction = np.asarray(info["instruction"])
    alive = np.ones(env.num_envs, dtype=bool)
    ret, length = np.zeros(env.num_envs), np.zeros(env.num_envs)
    success = np.zeros(env.num_envs, dtype=bool)
    while alive.any():
        obs, reward, term, trunc, _ = env.step(act(obs))
        ret += reward * alive
        length += alive
        success |= term & alive
        alive &= ~(term | trunc)
    by_instruction = {int(i): (int(success[instruction == i].sum()), int((instruction == i).sum())) for i in
                      np.unique(instruction)}  # fmt: skip
    return EpisodeStats(float(success.mean()), float(ret.mean()), float(length.mean()), env.num_envs, by_instruction)


def base_policy(env: FlashRTVectorEnv, seed: int) -> EpisodeStats:
    """The unsteered policy (its own per-slot noise, no correction) from ``seed``'s starts: ``env``
    must be built with ``action_mode="residual"`` and ``autoreset=False``."""
    if env.config.action_mode != "residual":
        raise ValueError("the base policy runs on its own noise: build the env with action_mode='residual'")
    zeros = np.zeros((env.num_envs, *env.single_action_space.shape), np.float32)
    return run_episodes(env, lambda _: zeros, seed)


@dataclass
class EvalResult:
    """What :func:`evaluate` gave: success rate and mean return over ``episodes`` episodes, and per
    instruction (its text: one a task on Meta-World's MT10) the episodes that succeeded and the
    episodes that began with it."""

    success: float
    mean_return: float
    episodes: int
    by_instruction: dict[str, tuple[int, int]] = field(default_factory=dict)

    def success_by_instruction(self) -> dict[str, float]:
        """Each instruction's success rate, in the env's instruction order."""
        return {text: won / n for text, (won, n) in self.by_instruction.items()}


def evaluate(env: FlashRTVectorEnv, act: Callable[[np.ndarray], np.ndarray], split: str, episodes: int) -> EvalResult:
    """``episodes`` episodes of ``split``'s starts, one per slot of ``env``, in batches of
    :func:`run_episodes`, under a progress bar.

    Args:
        env: an env built with ``autoreset=False``.
        act: the policy, a batch of observations to a batch of actions.
        split: ``"validation"`` or ``"test"`` (:mod:`flashrt_gym.splits`).
        episodes: how many, a multiple of ``env``'s slots.

    Returns:
        The success rate and the mean return over the episodes, and the successes and episodes of
        each instruction the episodes began with.

    Raises:
        ValueError: ``episodes`` is not a multiple of the env's slots.
    """
    n = env.num_envs
    if episodes % n:
        raise ValueError(f"episodes ({episodes}) must be a multiple of the evaluation env's slots ({n})")
    first = eval_seed(split, episodes)
    horizon = env.config.max_episode_steps
    batches = []
    # env steps (slot-chunks) at most: every slot of a batch steps until the batch's last episode ends
    with tqdm(total=episodes * horizon, desc=f"{split}, {episodes} episodes", unit="env step", leave=False) as bar:

        def counted(obs: np.ndarray) -> np.ndarray:
            bar.update(n)
            return act(obs)

        for i, start in enumerate(range(first, first + episodes, n)):
            batches.append(run_episodes(env, counted, start))
            bar.update((i + 1) * n * horizon - bar.n)  # a batch whose episodes all ended early
    counts = np.zeros((len(env.instructions), 2), dtype=np.int64)
    for b in batches:
        for i, (won, begun) in b.by_instruction.items():
            counts[i] += (won, begun)
    by_instruction = {text: (int(won), int(n)) for text, (won, n) in zip(env.instructions, counts, strict=True) if n}
    return EvalResult(
        sum(b.success for b in batches) / len(batches),
        sum(b.mean_return for b in batches) / len(batches),
        episodes,
        by_instruction,
    )


def torch_policy(
    act: Callable[[torch.Tensor], torch.Tensor], device: torch.device
) -> Callable[[np.ndarray], np.ndarray]:
    """A NumPy policy for :func:`evaluate` from one on device tensors.

    Args:
        act: the policy on tensors. device: where ``act`` reads its observations.

    Returns:
        The same policy on NumPy arrays.
    """
    return lambda obs: act(torch.tensor(obs, device=device)).cpu().numpy()
