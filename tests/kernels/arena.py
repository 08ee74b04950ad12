"""Kernel inputs laid out as the pipeline passes them: views of a slot arena.

A :class:`flashrt.runtime.BufferSet` keeps every slot buffer of slot ``s`` in one byte row, so a
slot buffer is strided along the slot dimension by the arena's row, not by its own size. A
kernel that indexes such a view as if it were contiguous reads (and writes) other buffers'
bytes: here every byte of the arena that the test did not set is random, so such a misread
gives a different answer, and a stray write shows as a changed byte outside the output.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from flashrt.policies import FlowPolicy, PolicyConfig, policy_specs
from flashrt.runtime import BufferSet, BufferSpec, slot
from tests.kernels.kernel_devices import close


def arena(specs: Sequence[BufferSpec], slots: int, device: str, seed: int = 0) -> BufferSet:
    """A buffer set holding ``specs`` between guard buffers, every byte random in [0, 64): read
    as any dtype those bytes are finite (float32 and bf16 below 2, small ints), so a misread gives
    a wrong but finite answer. Callers write the values of the buffers they use."""
    guarded = [slot("guard.first", (3,), torch.float32)]
    for i, spec in enumerate(specs):
        guarded += [spec, slot(f"guard.{i}", (5,), torch.int32)]
    bufs = BufferSet(guarded, slots, device)
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same bytes on every device
    bufs.slot_arena.copy_(torch.randint(0, 64, bufs.slot_arena.shape, generator=g, dtype=torch.uint8))
    return bufs


def fill(bufs: BufferSet, seed: int = 1, **kinds: float) -> None:
    """Random values for the named buffers: float buffers ``scale * randn`` (``kinds[name]`` the
    scale), bool buffers true with probability ``kinds[name]``, int64 buffers in [0, kinds[name])."""
    g = torch.Generator().manual_seed(seed)
    for name, k in kinds.items():
        t = bufs[name]
        if t.dtype == torch.bool:
            t.copy_(torch.rand(t.shape, generator=g) < k)
        elif t.dtype.is_floating_point:
            t.copy_(k * torch.randn(t.shape, generator=g))
        else:
            t.copy_(torch.randint(0, int(k), t.shape, generator=g))


def misread(view: torch.Tensor) -> torch.Tensor:
    """What a kernel that assumes ``view`` is contiguous reads: its shape, row-major, from its
    first element on (slot 0's row, then whatever follows it in the arena)."""
    return torch.as_strided(view, view.shape, torch.empty(view.shape, device="meta").stride(), view.storage_offset())


def written(bufs: BufferSet, *views: torch.Tensor) -> torch.Tensor:
    """A bool mask over the slot arena's bytes: True at every byte of an element of ``views``."""
    total = bufs.slot_arena.numel()
    hit = torch.zeros(total, dtype=torch.bool, device=bufs.device)
    for v in views:
        assert v.untyped_storage().data_ptr() == bufs.slot_arena.untyped_storage().data_ptr(), "not an arena view"
        size = v.element_size()
        elements = torch.arange(total // size, device=bufs.device)
        first = torch.as_strided(elements, v.shape, v.stride(), v.storage_offset()).flatten() * size
        hit[(first[:, None] + torch.arange(size, device=bufs.device)).flatten()] = True
    return hit.view(bufs.slot_arena.shape)


def assert_only_written(before: torch.Tensor, after: torch.Tensor, mask: torch.Tensor) -> None:
    """Every arena byte outside ``mask`` is unchanged between the two images."""
    changed = (before != after) & ~mask
    assert not changed.any(), f"{int(changed.sum())} bytes outside the output changed, first at {changed.nonzero()[0]}"


def unit(t: torch.Tensor) -> torch.Tensor:
    """A bool tensor read from arbitrary bytes, as a kernel reads it: nonzero bytes are True."""
    return t.view(torch.uint8) != 0


def policy_arena(cfg: PolicyConfig, slots: int, device: str, dtype: torch.dtype) -> BufferSet:
    """A policy's ``policy.*`` buffers (:func:`flashrt.policies.policy_specs`: instruction, ring
    and newest-frame keys/values, masks, frame counters ...) among guards, filled as after a few
    frames: keys/values of unit scale, some tokens, ring frames and newest frames masked out."""
    with torch.device("meta"):
        model = FlowPolicy(cfg).to(dtype)
    bufs = arena(policy_specs(model), slots, device, seed=4)
    kinds = {"policy.kv_text": 1.0, "policy.kv_ring": 1.0, "policy.kv_obs": 1.0, "policy.text_mask": 0.7,
             "policy.ring_valid": 0.5, "policy.obs_valid": 0.7, "policy.frame": 500}  # fmt: skip
    fill(bufs, **kinds)
    bufs["policy.text_mask"][:, 0] = True
    return bufs


def pipeline_prefix(cfg: PolicyConfig, bufs: BufferSet) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The prefix segments in place, as ``PolicyPipeline`` builds them for the expert: the
    instruction with its token mask, the ring with one flag per frame, the newest frame with one
    flag per slot (expanded, stride 0)."""
    n = bufs.num_slots
    ring = bufs["policy.ring_valid"][:, :, None].expand(-1, -1, cfg.frame_tokens).reshape(n, cfg.ring_tokens)
    return [
        (bufs["policy.kv_text"], bufs["policy.text_mask"]),
        (bufs["policy.kv_ring"], ring),
        (bufs["policy.kv_obs"], bufs["policy.obs_valid"][:, None].expand(-1, cfg.frame_tokens)),
    ]


def rebase(view: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
    """The same view (shape, strides, offset) into another image of its arena, e.g. a copy."""
    flat = image.view(-1).view(view.dtype)
    return torch.as_strided(flat, view.shape, view.stride(), view.storage_offset())


def rejects(got: torch.Tensor, wrong: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """Mutation check: the comparison of :func:`close` fails against a wrong but finite answer."""
    assert torch.isfinite(wrong.float()).all(), "the wrong answer must be finite, so the tolerance is what rejects it"
    with pytest.raises(AssertionError):
        close(got, wrong, dtype, scale)
