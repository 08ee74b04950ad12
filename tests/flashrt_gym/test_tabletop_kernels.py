"""The tabletop's Triton kernels (all ticks of a chunk; the render) against the torch references.

Run on the GPU, and on the CPU through Triton's interpreter where it is installed. States are
drawn fresh, pushed into contact by the scripted expert, and include slots that have already
succeeded (frozen).
"""

import pytest
import torch

from flashrt.runtime import BufferSet
from flashrt_gym.tasks import Tabletop, TabletopConfig
from flashrt_gym.tasks.tabletop_kernels import render_triton, ticks_triton
from tests.kernels.kernel_devices import DEVICES


def state(device: str, n: int, objects: tuple[str, ...], seed: int) -> tuple[Tabletop, BufferSet]:
    task = Tabletop(TabletopConfig(objects=objects))
    b = BufferSet(task.specs(), n, device)
    task.seed(b, torch.arange(n, device=device) + 100 * seed)
    task.reset(b)
    g = torch.Generator(device=device).manual_seed(seed)
    for _ in range(12):  # into contact: the expert pushes, with noise
        task.step(b, (task.expert(b) + 0.3 * torch.randn(n, 2, device=device, generator=g)).clamp(-1, 1))
    return task, b


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("objects", [("red square", "green circle", "blue triangle"), ("red square",)])
@pytest.mark.parametrize("n", [95, 301])  # two slots a program; blocks of 16 (more programs than SMs)
def test_chunk_of_ticks_matches_the_reference(device, objects, n):
    task, b = state(device, n, objects, seed=len(objects))
    assert b["sim.success"].any() and not b["sim.success"].all()  # frozen and live slots both
    g = torch.Generator(device=device).manual_seed(1)
    actions = (1.5 * torch.randn(n, 8, 2, device=device, generator=g))[:, :5]  # strided, some beyond [-1, 1]
    ref = BufferSet(task.specs(), n, device)
    ref.slot_arena.copy_(b.slot_arena)
    rewards = torch.full((n, 3), float("nan"), device=device)  # written into strided views
    dense, sparse = ticks_triton(task, b, actions, out=(rewards[:, 0], rewards[:, 2]))
    assert dense.data_ptr() == rewards.data_ptr() and rewards[:, 1].isnan().all()
    dense_ref = torch.zeros(n, device=device)
    sparse_ref = torch.zeros(n, device=device)
    for t in range(5):
        d, s = task.step(ref, actions[:, t])
        dense_ref, sparse_ref = dense_ref + d, sparse_ref + s
    for name in ("sim.ee", "sim.obj", "sim.obj_vel"):
        torch.testing.assert_close(b[name], ref[name], atol=1e-5, rtol=1e-5)
    for name in ("sim.success", "sim.tick", "sim.instruction", "sim.key", "sim.counter"):
        assert torch.equal(b[name], ref[name]), name
    torch.testing.assert_close(dense, dense_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(sparse, sparse_ref)


@pytest.mark.parametrize("device", DEVICES)
def test_render_matches_the_reference(device):
    task, b = state(device, 6, ("red square", "green circle", "blue triangle"), seed=3)
    out = torch.full((6, 2, 64, 64, 3), 7, dtype=torch.uint8, device=device)  # render into [:, 1]
    render_triton(task, b, out[:, 1])
    want = task._render_reference(b)
    differ = int((out[:, 1] != want).any(-1).sum())
    assert differ <= 3, f"{differ} pixels differ"  # float rounding may flip a boundary pixel, no more
    assert (out[:, 0] == 7).all()
