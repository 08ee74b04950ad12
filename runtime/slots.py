"""The multi-buffer slot copy: every slot buffer of a slot moves in one operation.

Because a :class:`~flashrt.runtime.buffers.BufferSet` keeps all per-slot state of slot ``s`` in one
byte row (``slot_arena[s]``), restoring or forking any set of slots is a single row copy over
the whole state, whatever the buffers' dtypes. Both functions take device tensors only (no host
synchronisation, no data-dependent shapes), so they can run inside a captured graph: a masked
restore is how finished env slots are reset in the step graph.
"""

from __future__ import annotations

import torch

from flashrt.kernels.slot_copy import masked_copy_rows, scatter_rows


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
