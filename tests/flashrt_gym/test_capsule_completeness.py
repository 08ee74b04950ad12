"""Capsule, fork and evaluation checks that each catch one wrong implementation on the CPU.

Each test runs its comparison twice: against the real env, where it must hold, and against a
deliberately wrong one (a restore that skips one buffer, a reseed that gives every destination
the same stream, an evaluation that draws "test" from the validation starts), where it must fail.
"""

import numpy as np
import pytest
import torch

from flashrt.kernels import rng
from flashrt_gym import FlashRTVectorEnv, evaluation
from flashrt_gym.splits import VALIDATION_SEED


def make(n: int, **kw) -> FlashRTVectorEnv:
    return FlashRTVectorEnv(n, device="cpu", **kw)


def rollout(env: FlashRTVectorEnv, steps: int) -> list[tuple[np.ndarray, ...]]:
    """``steps`` steps of the base policy (residual mode, zero correction): every chunk comes from
    the policy's own per-slot noise stream, so the continuation reads the RNG counters."""
    zeros = np.zeros((env.num_envs, *env.single_action_space.shape), np.float32)
    out = []
    for _ in range(steps):
        obs, reward, term, trunc, _ = env.step(zeros)
        out.append((obs.copy(), reward.copy(), term.copy(), trunc.copy()))
    return out


def same(a: list[tuple[np.ndarray, ...]], b: list[tuple[np.ndarray, ...]]) -> bool:
    return all(np.array_equal(x, y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def restore_skipping(env: FlashRTVectorEnv, capsule, skipped: str | None) -> None:
    """Restore ``capsule``; with ``skipped``, that buffer keeps its pre-restore bytes (the mutation:
    a restore that does not write it)."""
    kept = None if skipped is None else env.engine.bufs[skipped].clone()
    env.restore(capsule)
    if kept is not None:
        env.engine.bufs[skipped].copy_(kept)


@pytest.mark.parametrize("skipped", ["policy.rng_counter", "env.episode.steps"])
def test_restore_and_continue_through_truncations_reads_every_counter(skipped):
    """Three slots, episodes of 5 chunks: the continuation after a restore runs 12 chunks, through
    two truncations and autoresets each, and repeats the uninterrupted run byte for byte. A
    restore that leaves the policy's noise counters or the episodes' step counters as they were
    (the mutation) departs from it."""
    env = make(3, action_mode="residual", max_episode_steps=5)
    env.reset(seed=21)
    rollout(env, 2)
    cap = env.snapshot()
    first = rollout(env, 12)
    rollout(env, 4)  # every counter moves on: 2 + 12 + 4 = 3 mod 5 chunks into an episode
    assert not torch.equal(env.engine.bufs[skipped], cap.tensor(skipped))  # the mutation is not vacuous
    restore_skipping(env, cap, None)
    assert same(rollout(env, 12), first)
    rollout(env, 4)
    restore_skipping(env, cap, skipped)
    assert not same(rollout(env, 12), first)


def branches(reseed: bool) -> np.ndarray:
    """Slot 0 forked into slots 1-3, then one chunk of episodes one chunk long: every slot's
    observation is the start of its next episode, drawn from its own stream."""
    env = make(4, action_mode="residual", max_episode_steps=1)
    env.reset(seed=4)
    env.fork(0, [1, 2, 3], reseed=reseed)
    obs, *_ = env.step(np.zeros((4, *env.single_action_space.shape), np.float32))
    env.close()
    return obs


def distinct(obs: np.ndarray) -> bool:
    return len({row.tobytes() for row in obs}) == len(obs)


def test_reseeded_fork_gives_every_destination_a_stream_of_its_own(monkeypatch):
    """With ``reseed`` the source and the three destinations all draw different next episodes;
    without it they draw the same one. Mutation: a reseed that salts every destination alike
    gives the destinations one stream between them, which the same check rejects."""
    assert distinct(branches(reseed=True))
    assert len({row.tobytes() for row in branches(reseed=False)}) == 1
    real = rng.reseed
    monkeypatch.setattr(rng, "reseed", lambda key, salt: real(key, torch.zeros_like(salt)))
    assert not distinct(branches(reseed=True))


def drawn_starts(split: str) -> np.ndarray:
    """The start observations (state mode: the simulator's drawn positions and instruction) of an
    8-episode evaluation of ``split``, run in two batches of 4 slots by :func:`evaluation.evaluate`."""
    env = make(4, autoreset=False, max_episode_steps=1)  # the starts are all it needs
    starts, reset = [], env.reset

    def spy(**kw):
        obs, info = reset(**kw)
        starts.append(obs.copy())
        return obs, info

    env.reset = spy
    zeros = np.zeros((4, *env.single_action_space.shape), np.float32)
    evaluation.evaluate(env, lambda obs: zeros[: len(obs)], split, 8)
    env.close()
    return np.concatenate(starts)


def shared_rows(a: np.ndarray, b: np.ndarray) -> int:
    return len({r.tobytes() for r in a} & {r.tobytes() for r in b})


def test_evaluation_draws_test_starts_that_validation_never_draws(monkeypatch):
    """The 8 test episodes start from 8 distinct states, none of them a validation start, and they
    are the starts of the test seeds. Mutation: an evaluation whose "test" seeds are the
    validation seeds shares all 8 states with validation."""
    val, test = drawn_starts("validation"), drawn_starts("test")
    assert len(test) == 8 and distinct(test) and shared_rows(test, val) == 0
    monkeypatch.setattr(evaluation, "eval_seed", lambda split, episodes: VALIDATION_SEED)
    assert shared_rows(drawn_starts("test"), val) == 8
