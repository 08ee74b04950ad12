"""The push task on MuJoCo Warp (in-graph: its whole state is slot buffers). Skipped without
``mujoco_warp``. On CUDA it runs the captured graph too; Warp's CPU backend (eager, a minute or
more to compile and run) only with ``FLASHRT_WARP_CPU=1``, to check the logic where there is no
GPU."""

import os

import numpy as np
import pytest
import torch

pytest.importorskip("mujoco_warp")

from flashrt.runtime import BufferSet, fork, restore, snapshot
from flashrt_gym.sims import MujocoPush
from flashrt_gym.sims.mujoco_warp import WarpPush

N = 3
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(os.environ.get("FLASHRT_WARP_CPU") != "1", reason="set FLASHRT_WARP_CPU=1"),
    ),
    pytest.param(
        "cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
    ),
]


@pytest.fixture(scope="module", params=DEVICES)
def sim(request) -> WarpPush:
    return WarpPush(N, device=request.param)


def start(sim: WarpPush, seed: int = 11) -> BufferSet:
    b = BufferSet(sim.specs(), N, sim.device)
    sim.seed(b, torch.arange(N, device=sim.device) + seed)
    sim.reset(b)
    return b


def chunks(sim: WarpPush, count: int, ticks: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [(torch.rand(N, ticks, 2, generator=g) * 2 - 1).to(sim.device) for _ in range(count)]


def drive(sim: WarpPush, b: BufferSet, actions: list[torch.Tensor]) -> list[bytes]:
    out = []
    for a in actions:
        dense, sparse = sim.run_ticks(b, a)
        out += [dense.cpu().numpy().tobytes(), sparse.cpu().numpy().tobytes(), b.slot_arena.cpu().numpy().tobytes()]
    return out


def test_starts_and_rewards_follow_the_cpu_backend(sim):
    """Same seeds -> the same episode (positions equal to float32 rounding); the same actions -> rewards within
    float32's drift of MuJoCo's C library. Mutation: other actions give other rewards."""
    b = start(sim)
    cpu = MujocoPush(N)
    cpu.seed(np.arange(N) + 11)
    cpu.reset()
    assert np.allclose(sim.observation(b).cpu().numpy(), cpu.observation(), atol=1e-6)  # an ulp on CUDA
    other = MujocoPush(N)
    other.set_state(None, cpu.get_state())
    for a in chunks(sim, 3):
        dense, sparse = sim.run_ticks(b, a)
        want = cpu.run_ticks(a.cpu().numpy())
        wrong = other.run_ticks(np.clip(a.cpu().numpy()[:, ::-1] * -1, -1, 1))
        assert np.allclose(dense.cpu().numpy(), want[0], atol=2e-3)
        assert np.array_equal(sparse.cpu().numpy(), want[1])
    assert not np.allclose(dense.cpu().numpy(), wrong[0], atol=2e-3)
    assert np.allclose(sim.observation(b).cpu().numpy(), cpu.observation(), atol=5e-3)


def test_capsule_restore_and_fork_are_exact_and_qpos_qvel_alone_is_not(sim):
    """Restore a snapshot of the slot buffers and continue: byte-identical to the first
    continuation. Fork slot 0 into every slot: equal actions keep them equal. Keeping only
    time, qpos and qvel of the rows (warm start dropped) diverges."""
    b = start(sim)
    sim.run_ticks(b, sim.expert(b)[:, None].repeat(1, 2, 1))  # into contact
    cap = snapshot(b)
    actions = chunks(sim, 2)
    want = drive(sim, b, actions)
    restore(b, cap)
    assert drive(sim, b, actions) == want

    restore(b, cap)
    nq, nv = sim.mjm.nq, sim.mjm.nv
    rows = b["sim.physics"]
    rows[:, 1 + nq + nv :] = sim._cold[1 + nq + nv :]
    got = drive(sim, b, actions)
    assert got[-1] != want[-1]

    restore(b, cap)
    fork(b, 0, list(range(1, N)))
    same = [a[:1].expand(N, -1, -1).contiguous() for a in actions]
    drive(sim, b, same)
    arena = b.slot_arena.cpu()
    assert all(torch.equal(arena[i], arena[0]) for i in range(1, N))


def test_masked_reset_and_frozen_success(sim):
    b = start(sim, seed=5)
    before = b.slot_arena.clone()
    mask = torch.tensor([True, False, True], device=sim.device)
    sim.reset(b, mask)
    after = b.slot_arena
    assert torch.equal(before[1], after[1]) and not torch.equal(before[0], after[0])
    b["sim.success"][0] = True
    row = b["sim.physics"][0].clone()
    dense, sparse = sim.run_ticks(b, torch.ones(N, 2, 2, device=sim.device))
    assert torch.equal(b["sim.physics"][0], row) and dense[0] == 0 and sparse[0] == 0
    assert int(b["sim.tick"][0]) == 0 and int(b["sim.tick"][1]) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_equals_eager_byte_for_byte():
    """The physics replayed as Warp's captured graph equals its eager launches, every byte of
    the slot buffers and rewards; a changed action (the mutation) departs."""
    eager, graph = WarpPush(N, graph=False), WarpPush(N, graph=True)
    b1, b2 = start(eager), start(graph)
    assert torch.equal(b1.slot_arena, b2.slot_arena)
    actions = chunks(eager, 4, ticks=4)
    assert drive(eager, b1, actions) == drive(graph, b2, actions)
    bent = [a.clone() for a in actions]
    bent[0][0, 0, 0] = -bent[0][0, 0, 0]
    b3 = start(graph)
    assert drive(graph, b3, bent)[-1] != drive(eager, start(eager), actions)[-1]
