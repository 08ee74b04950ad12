"""The multi-buffer slot copy: every slot buffer of a slot moves in one operation.

Because a :class:`~flashrt.runtime.buffers.BufferSet` keeps all per-slot state of slot ``s`` in one
byte row (``slot_arena[s]``), restoring or forking any set of slots is a single row copy over
the whole state, whatever the buffers' dtypes. Both functions take device tensors only (no host
synchronisation, no data-dependent shapes), so they can run inside a captured graph: a masked
restore is how finished env slots are reset in the step graph.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Sequence

import torch

from flashrt.kernels.slot_copy import masked_copy_rows, scatter_rows
from flashrt.runtime.buffers import BufferSet


def _words(rows: torch.Tensor) -> torch.Tensor:
    # Rows are ALIGN-byte multiples: move them as int64 words (8x fewer elements than bytes).
    return rows.view(torch.int64) if rows.shape[-1] % 8 == 0 and rows.is_contiguous() else rows


def copy_rows(arena: torch.Tensor, dst_slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``arena[dst_slots[i]] = rows[i]`` for every i, in one op.

    Args:
        arena: a slot arena, ``(num_slots, row_bytes)`` uint8.
        dst_slots: int64 slot indices on the arena's device, ``(k,)``, no duplicates.
        rows: ``(k, row_bytes)`` or ``(1, row_bytes)`` uint8 on the arena's device; one row is
            broadcast to every target (a fork), without materialising the copies.
    """
    if rows.shape[0] == 1 or rows.stride(0) == 0:
        rows = rows[:1]
    elif rows.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr():
        rows = rows.clone()  # rows of the same arena: read them all before writing
    scatter_rows(_words(arena), dst_slots, _words(rows.contiguous()))


def masked_restore(
    arena: torch.Tensor, src_rows: torch.Tensor, mask: torch.Tensor, index: torch.Tensor | None = None
) -> None:
    """``arena[s] = src_rows[index[s]]`` (``src_rows[s]`` without an index) where ``mask[s]``,
    for all slots at once (capturable).

    Args:
        arena: a slot arena, ``(num_slots, row_bytes)`` uint8.
        src_rows: ``(n, row_bytes)`` rows of the same layout, e.g. a pool of episode starts.
        mask: ``(num_slots,)`` bool on the arena's device.
        index: ``(num_slots,)`` int64 row of ``src_rows`` for each slot (needed when ``n`` is
            not ``num_slots``).
    """
    masked_copy_rows(_words(arena), _words(src_rows), mask, index)


def slot_index(bufs: BufferSet, slots: Sequence[int] | torch.Tensor, what: str) -> tuple[int, ...]:
    """``slots`` as a tuple of ints, checked against ``bufs`` (integers, at least one, in range,
    no duplicates); ``what`` names the verb in the error."""
    # Host cost matters here (a fork's copy is a few microseconds of device work): builtins over
    # the whole list, no per-element Python loop.
    if isinstance(slots, torch.Tensor):
        slots = slots.tolist()
    try:
        out = tuple(map(operator.index, slots))
    except TypeError:
        raise TypeError(f"{what}: slots must be integers, got {slots!r:.80}") from None
    if not out:
        raise ValueError(f"{what}: empty slot list; name at least one slot")
    if min(out) < 0 or max(out) >= bufs.num_slots:
        bad = [s for s in out if not 0 <= s < bufs.num_slots]
        raise IndexError(
            f"{what}: slots {bad} out of range for a set of {bufs.num_slots} slots; use 0..{bufs.num_slots - 1}"
        )
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: duplicate slots in {list(out)}; name each slot once")
    return out


def index_tensor(bufs: BufferSet, slots: tuple[int, ...]) -> torch.Tensor:
    """The int64 index tensor of ``slots`` on the set's device (asynchronous from the host)."""
    # array('q') packs the ints in C, far faster than torch.tensor(tuple) for many slots.
    return torch.frombuffer(array("q", slots), dtype=torch.int64).to(bufs.device, non_blocking=True)
