"""The tabletop's Triton kernels (all ticks of a chunk; the render) against the torch references.

Run on the GPU, and on the CPU through Triton's interpreter where it is installed. The state is
the slot buffers of a real arena (strided views whose slot stride is the row, other buffers
around them), drawn fresh, pushed into contact by the scripted expert, and includes slots that
have already succeeded (frozen). Each comparison has a mutation check beside it: the same
comparison against a deliberately wrong reference (actions shifted by a tick, the state read as
if contiguous) must fail.
"""

import pytest
import torch

from flashrt import kernels
from flashrt.runtime import BufferSet
from flashrt_gym.sims.tabletop import Tabletop, TabletopConfig, triton_kernels
from flashrt_gym.sims.tabletop.triton_kernels import render_triton, reset_triton, ticks_triton
from tests.kernels.kernel_devices import DEVICES

STATE = ("sim.ee", "sim.obj", "sim.obj_vel")
EXACT = ("sim.success", "sim.tick", "sim.instruction", "sim.key", "sim.counter")


def state(device: str, n: int, objects: tuple[str, ...], seed: int) -> tuple[Tabletop, BufferSet]:
    task = Tabletop(TabletopConfig(objects=objects))
    b = BufferSet(task.specs(), n, device)
    task.bind(b)
    task.seed(torch.arange(n, device=device) + 100 * seed)
    task.reset()
    g = torch.Generator(device=device).manual_seed(seed)
    for _ in range(12):  # into contact: the expert pushes, with noise
        task.step((task.expert() + 0.3 * torch.randn(n, 2, device=device, generator=g)).clamp(-1, 1))
    return task, b


def twin(task: Tabletop, b: BufferSet) -> tuple[Tabletop, BufferSet]:
    """A second simulator over a copy of ``b``'s arena."""
    other = Tabletop(task.cfg)
    copy = BufferSet(task.specs(), b.num_slots, b.device)
    other.bind(copy)
    copy.slot_arena.copy_(b.slot_arena)
    return other, copy


def reference_ticks(task: Tabletop, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = actions.shape[0]
    dense, sparse = torch.zeros(n, device=actions.device), torch.zeros(n, device=actions.device)
    for t in range(actions.shape[1]):
        d, s = task.step(actions[:, t])
        dense, sparse = dense + d, sparse + s
    return dense, sparse


def ticks_match(b: BufferSet, ref: BufferSet, rewards, ref_rewards) -> bool:
    close = lambda x, y: torch.allclose(x, y, atol=1e-5, rtol=1e-5)  # noqa: E731
    return (
        all(close(b[k], ref[k]) for k in STATE)
        and all(torch.equal(b[k], ref[k]) for k in EXACT)
        and close(rewards[0], ref_rewards[0])
        and torch.equal(rewards[1], ref_rewards[1])
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("objects", [("red square", "green circle", "blue triangle"), ("red square",)])
@pytest.mark.parametrize(
    ("n", "cpu_n"), [(95, 15), (301, 37)]
)  # two slots a program; blocks of 16 (more programs than SMs)
def test_chunk_of_ticks_matches_the_reference(device, objects, n, cpu_n, monkeypatch):
    if device == "cpu":  # the interpreter runs every program in Python: both launch shapes over a stand-in of 8 SMs
        n = cpu_n
        monkeypatch.setattr(triton_kernels, "sm_count", lambda _: 8)
    task, b = state(device, n, objects, seed=len(objects))
    assert b["sim.success"].any() and not b["sim.success"].all()  # frozen and live slots both
    g = torch.Generator(device=device).manual_seed(1)
    actions = (1.5 * torch.randn(n, 8, 2, device=device, generator=g))[:, :5]  # strided, some beyond [-1, 1]
    ref_task, ref = twin(task, b)
    shifted_task, shifted = twin(task, b)
    rewards = torch.full((3, n), float("nan"), device=device)  # written into strided views
    ticks_triton(task.state, task.tables, task.scene, actions, rewards[0], rewards[2])
    assert rewards[1].isnan().all()
    want = reference_ticks(ref_task, actions)
    assert ticks_match(b, ref, (rewards[0], rewards[2]), want)
    wrong = reference_ticks(shifted_task, actions.roll(1, dims=1))  # mutation: actions a tick late
    assert not ticks_match(b, shifted, (rewards[0], rewards[2]), wrong)


@pytest.mark.parametrize("device", DEVICES)
def test_render_matches_the_reference(device):
    task, b = state(device, 6, ("red square", "green circle", "blue triangle"), seed=3)
    out = torch.full((6, 2, 64, 64, 3), 7, dtype=torch.uint8, device=device)  # render into [:, 1]
    render_triton(task.state, task.tables, task.scene, out[:, 1])
    want = task.render_reference()

    def differ(got: torch.Tensor, ref: torch.Tensor) -> int:
        return int((got != ref).any(-1).sum())

    assert differ(out[:, 1], want) <= 3  # float rounding may flip a boundary pixel, no more
    assert (out[:, 0] == 7).all()
    # mutation: the end-effector and objects read as if slot buffers were contiguous (slot s at
    # element offset s * 2 of slot 0's row), as a kernel that ignored the arena's stride would
    misread, misread_b = twin(task, b)
    for name in ("sim.ee", "sim.obj"):
        flat = b[name].reshape(6, -1)
        row0 = b.slot_arena[0].view(torch.float32)
        offset = (b[name].data_ptr() - b.slot_arena.data_ptr()) // 4
        misread_b[name].copy_(row0[offset : offset + flat.numel()].view_as(b[name]))
    assert differ(out[:, 1], misread.render_reference()) > 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("objects", [("red square", "green circle", "blue triangle"), ("red square",)])
def test_masked_reset_matches_the_reference(device, objects):
    """The masked reset kernel draws what the torch reference draws (instruction, counters and
    flags exactly, positions to float32 rounding) into strided arena views, touching only masked
    slots; beside it, the reference one draw later (the counter bumped first) must be rejected."""
    n = 37
    task, b = state(device, n, objects, seed=5)
    g = torch.Generator(device=device).manual_seed(2)
    mask = torch.rand(n, device=device, generator=g) < 0.6
    force = torch.where(torch.rand(n, device=device, generator=g) < 0.3, 1, -1).to(torch.int64)
    ref_task, ref = twin(task, b)
    late_task, late = twin(task, b)
    reset_triton(task.state, task.tables, task.scene, task.cfg.spawn, mask, force)
    with kernels.reference_only():
        ref_task.reset(mask, force)
        late["sim.counter"].add_(1)
        late_task.reset(mask, force)

    def matches(x: BufferSet, y: BufferSet) -> bool:
        close = all(torch.allclose(x[k], y[k], atol=1e-5, rtol=1e-5) for k in STATE)
        return close and all(
            torch.equal(x[k], y[k]) for k in ("sim.instruction", "sim.tick", "sim.success", "sim.counter")
        )

    assert matches(b, ref)
    late["sim.counter"].sub_(1)  # the same counters, another draw
    assert not matches(b, late)
