"""A toy stateful computation over a BufferSet, used to test the runtime's verbs.

Every state buffer influences the next state, so restoring only part of the state diverges;
noise comes from a counter-based hash of per-slot keys held in the buffers (as a policy's RNG
will be), so a continuation is a pure function of the buffers.
"""

import torch

from flashrt.runtime import BufferSet, scratch, shared, slot

SPECS = [
    slot("pos", (3,)),
    slot("vel", (3,)),
    slot("hist", (4, 3), torch.bfloat16),
    slot("key", (), torch.int64),
    slot("counter", (), torch.int64),
    slot("done", (), torch.bool),
    shared("tick", (), torch.int64),
    scratch("tmp", (3,)),
]


def make(num_slots: int = 8, device: str | torch.device = "cpu", deployment: str = "toy-v1") -> BufferSet:
    b = BufferSet(SPECS, num_slots, device, deployment=deployment)
    seed(b, 0)
    return b


def seed(b: BufferSet, s: int) -> None:
    g = torch.Generator().manual_seed(s)
    n = b.num_slots
    b["pos"].copy_(torch.randn(n, 3, generator=g))
    b["vel"].copy_(torch.randn(n, 3, generator=g))
    b["hist"].copy_(torch.randn(n, 4, 3, generator=g))
    b["key"].copy_(torch.randint(0, 2**31, (n,), generator=g))
    b["counter"].zero_()
    b["done"].zero_()
    b["tick"].zero_()


def step(b: BufferSet) -> None:
    """One tick for every slot; capturable (in-place, fixed shapes, no host sync)."""
    b["counter"].add_(1)
    h = (b["key"] * 6364136223846793005 + b["counter"] * 1442695040888963407) & 0xFFFFFF
    noise = torch.sin(h.float()[:, None] * torch.arange(1, 4, device=h.device, dtype=torch.float32))
    b["tmp"].copy_(b["hist"].float().mean(dim=1).mean(dim=0))
    b["vel"].mul_(0.9).add_(0.05 * noise - 0.01 * b["pos"] + 0.001 * b["tmp"])
    b["vel"].masked_fill_(b["done"][:, None], 0.0)
    b["pos"].add_(b["vel"] * 0.1 + 0.001 * b["tick"].float())
    b["hist"].copy_(torch.cat([b["hist"][:, 1:], b["pos"][:, None].bfloat16()], dim=1))
    b["done"].copy_(b["pos"].norm(dim=1) > 4.0)
    b["tick"].add_(1)


def scramble(b: BufferSet, s: int = 123) -> None:
    """Overwrite every state byte with something unrelated."""
    g = torch.Generator().manual_seed(s)
    b.slot_arena.copy_(torch.randint(0, 256, b.slot_arena.shape, generator=g, dtype=torch.uint8))
    b.shared_arena.copy_(torch.randint(0, 256, b.shared_arena.shape, generator=g, dtype=torch.uint8))
    b["done"].copy_(b["done"].view(torch.uint8) & 1)  # keep bools valid


def state_bytes(b: BufferSet) -> tuple[torch.Tensor, torch.Tensor]:
    return b.slot_arena.clone(), b.shared_arena.clone()


def same_state(b: BufferSet, other: BufferSet | tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether ``b``'s state arenas hold the bytes of ``other`` (a set, or :func:`state_bytes`)."""
    want = state_bytes(other) if isinstance(other, BufferSet) else other
    return torch.equal(b.slot_arena, want[0]) and torch.equal(b.shared_arena, want[1])
