"""The seed split: training runs, their ranks, demonstrations, validation and test draw disjoint
episode starts, as seed ranges and as drawn start states."""

import itertools

import pytest
import torch

from flashrt.kernels import rng
from flashrt.runtime import BufferSet
from flashrt_gym.evaluation import TEST_SEED, VALIDATION_SEED
from flashrt_gym.sims.tabletop import Tabletop, TabletopConfig
from flashrt_gym.splits import (
    DEMO_SEED,
    DEMO_STRIDE,
    EVAL_SPAN,
    MAX_DEMO_SEED,
    MAX_RUN_SEED,
    SPLITS,
    TRAIN_STRIDE,
    demo_seed,
    eval_seed,
    train_seed,
)


def ranges(num_envs: int, world: int, runs: list[int]) -> list[tuple[int, int]]:
    """Every rank's ``[first, end)`` reset seeds in each of ``runs``, then the two splits'."""
    out = [
        (train_seed(r, num_envs, k, world), train_seed(r, num_envs, k, world) + num_envs // world)
        for r in runs
        for k in range(world)
    ]
    out += [(demo_seed(c), demo_seed(c) + DEMO_STRIDE) for c in (0, 1, MAX_DEMO_SEED)]
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


# -- drawn start states: every block's episodes start from states no other block draws ---------------
RUNS = [0, 1, 2, 3, 4, 1024]  # five headline seeds, and the run whose block began at 2**32
"""Training runs whose starts are drawn (seed 1024's block starts at 2**32, where a 32-bit fold
of the seed wrapped onto run 0's)."""


def seed_blocks() -> dict[str, torch.Tensor]:
    """The reset seeds of every use of the env the protocol names: both splits at more episodes
    than any evaluation here runs, the five headline runs and run 1024 at 2 048 slots over two
    ranks, and a 4 000-episode demonstration collection's seeds (failed episodes included)."""
    blocks = {
        "validation": torch.arange(1024) + eval_seed("validation", 1024),
        "test": torch.arange(2048) + eval_seed("test", 2048),
        "demonstrations": torch.arange(8192) + demo_seed(0),
    }
    for r in RUNS:
        for rank in range(2):
            blocks[f"run {r} rank {rank}"] = torch.arange(1024) + train_seed(r, 2048, rank, 2)
    return blocks


def tabletop_starts(seeds: torch.Tensor, episodes: int) -> torch.Tensor:
    """The tabletop's first ``episodes`` starts of each seed's stream as drawn by its ``reset``:
    rows of (instruction, end-effector, objects)."""
    sim = Tabletop(TabletopConfig(split="all"))
    sim.bind(BufferSet(sim.specs(), len(seeds), "cpu"))
    sim.seed(seeds)
    rows = []
    for _ in range(episodes):
        sim.reset()
        s = sim.state
        rows.append(torch.cat([s.instruction[:, None].double(), s.ee.double(), s.obj.flatten(1).double()], 1))
    return torch.cat(rows)


def push_starts(seeds: torch.Tensor, episodes: int) -> torch.Tensor:
    """The MuJoCo push task's starts (both its simulators draw through :meth:`PushTask.draw`);
    skips the calling test where the mujoco extra is not installed."""
    pytest.importorskip("mujoco")
    from flashrt_gym.sims import MujocoPush, PushConfig

    task = MujocoPush(1, PushConfig(TabletopConfig(split="all"))).task
    counter = torch.zeros_like(seeds)
    rows = []
    for _ in range(episodes):
        drawn, ee, obj = task.draw(seeds, counter)
        rows.append(torch.cat([drawn[:, None].double(), ee.double(), obj.flatten(1).double()], 1))
        counter = counter + 1
    return torch.cat(rows)


def coinciding(draw, blocks: dict[str, torch.Tensor]) -> set[tuple[str, str]]:
    """The pairs of blocks (a block with itself too) that share a drawn start state. Training
    slots draw two episodes each (an autoreset continues the slot's stream), the others one."""
    names, rows = [], []
    for name, seeds in blocks.items():
        states = draw(seeds, 2 if name.startswith("run") else 1)
        names += [name] * len(states)
        rows.append(states)
    _, inverse, counts = torch.unique(torch.cat(rows), dim=0, return_inverse=True, return_counts=True)
    shared = (counts > 1).nonzero().flatten()
    out = set()
    for u in shared.tolist():
        who = sorted({names[i] for i in (inverse == u).nonzero().flatten().tolist()})
        out.update((a, b) for a in who for b in who if a < b or len(who) == 1)
    return out


def folded_to_32_bits(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mutation: the key folded to 32 bits before mixing (the RNG before kernels 0.21)."""
    return rng._mix32(key ^ (key >> 32)), torch.zeros_like(key)


@pytest.mark.parametrize("draw", [tabletop_starts, push_starts], ids=["tabletop", "mujoco_push"])
def test_splits_runs_and_demonstrations_draw_disjoint_start_states(draw, monkeypatch):
    blocks = seed_blocks()
    assert coinciding(draw, blocks) == set()
    monkeypatch.setattr(rng, "_mix64", folded_to_32_bits)
    leaks = coinciding(draw, blocks)
    assert {("run 0 rank 0", "test"), ("test", "validation"), ("demonstrations", "run 0 rank 0")} <= leaks
    assert ("run 0 rank 0", "run 1024 rank 0") in leaks


def test_the_blocks_are_named_in_one_place_and_demo_seeds_are_checked():
    assert TEST_SEED == eval_seed("test", 1) and VALIDATION_SEED == eval_seed("validation", 1)
    assert DEMO_SEED == demo_seed(0) >= TEST_SEED + EVAL_SPAN
    assert demo_seed(MAX_DEMO_SEED, DEMO_STRIDE - 1) < 2**63
    for call in (lambda: demo_seed(-1), lambda: demo_seed(MAX_DEMO_SEED + 1), lambda: demo_seed(0, DEMO_STRIDE)):
        with pytest.raises(ValueError, match="demonstration"):
            call()
