"""The seed split: training runs, their ranks, validation and test draw disjoint episode starts."""

import itertools

import pytest

from flashrt_gym.splits import EVAL_SPAN, MAX_RUN_SEED, SPLITS, TRAIN_STRIDE, eval_seed, train_seed


def ranges(num_envs: int, world: int, runs: list[int]) -> list[tuple[int, int]]:
    """Every rank's ``[first, end)`` reset seeds in each of ``runs``, then the two splits'."""
    out = [
        (train_seed(r, num_envs, k, world), train_seed(r, num_envs, k, world) + num_envs // world)
        for r in runs
        for k in range(world)
    ]
    return out + [(eval_seed(s, EVAL_SPAN), eval_seed(s, EVAL_SPAN) + EVAL_SPAN) for s in SPLITS]


@pytest.mark.parametrize(("num_envs", "world"), [(1, 1), (2048, 1), (4096, 4), (TRAIN_STRIDE, 2)])
def test_runs_ranks_and_splits_never_overlap(num_envs, world):
    spans = sorted(ranges(num_envs, world, [0, 1, 2, 7, MAX_RUN_SEED]))
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
    # the mutation: a second run placed one slot into the first one's block is caught by the same check
    bad = sorted([*spans, (num_envs - 1, num_envs + 1)])
    assert not all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(bad))


def test_a_runs_ranks_tile_its_block_in_rank_order():
    assert [train_seed(3, 8, k, 4) for k in range(4)] == [3 * TRAIN_STRIDE + 2 * k for k in range(4)]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: train_seed(-1, 4), "seed must lie"),
        (lambda: train_seed(MAX_RUN_SEED + 1, 4), "seed must lie"),
        (lambda: train_seed(0, TRAIN_STRIDE + 1), "num_envs must lie"),
        (lambda: train_seed(0, 6, 0, 4), "split evenly"),
        (lambda: eval_seed("train", 4), "split must be one of"),
        (lambda: eval_seed("test", EVAL_SPAN + 1), "evaluation episodes"),
    ],
)
def test_bad_requests_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()
