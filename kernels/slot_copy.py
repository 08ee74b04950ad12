"""Masked row copy: ``dst[r] = src[r]`` for every row ``r`` with ``mask[r]``.

This is the in-graph restore of selected slots (autoreset, fork): rows are slot rows of a
:class:`runtime.BufferSet` slot arena, so one call moves every buffer of the chosen slots.

The torch reference is one ``where`` over every row: it reads both images whole, whatever the
mask. The Triton kernel launches one program per (row, chunk) and returns at once in rows whose
mask is off, so it moves only the bytes of the rows that change.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference is used
    triton = None


def masked_copy_rows_reference(
    dst: torch.Tensor, src: torch.Tensor, mask: torch.Tensor, index: torch.Tensor | None = None
) -> None:
    """Torch reference: ``dst[r] = src[index[r]]`` (``src[r]`` without an index) where ``mask[r]``."""
    rows = src if index is None else src[index]
    torch.where(mask.view(-1, 1), rows, dst, out=dst)


if triton is not None:

    @triton.jit
    def _masked_copy_rows_kernel(dst, src, mask, index, row_len, HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        if tl.load(mask + row) != 0:
            cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            inside = cols < row_len
            src_row = tl.load(index + row).to(tl.int64) if HAS_INDEX else row.to(tl.int64)
            values = tl.load(src + src_row * row_len + cols, mask=inside)
            tl.store(dst + row.to(tl.int64) * row_len + cols, values, mask=inside)


_BLOCK = 1024


def masked_copy_rows(
    dst: torch.Tensor, src: torch.Tensor, mask: torch.Tensor, index: torch.Tensor | None = None
) -> None:
    """``dst[r] = src[index[r]]`` (``src[r]`` without an index) for every row with ``mask[r]``
    set; capturable (no host sync). Rows whose mask is off are neither read nor written.

    Args:
        dst: ``(rows, row_len)`` contiguous tensor, written in place.
        src: ``(src_rows, row_len)``, same dtype and device (``src_rows == rows`` without index).
        mask: ``(rows,)`` bool on the same device.
        index: optional ``(rows,)`` int64 source row of each destination row (a gather).
    """
    if (
        dst.dim() != 2
        or src.dim() != 2
        or dst.shape[1] != src.shape[1]
        or dst.dtype != src.dtype
        or mask.shape != dst.shape[:1]
        or (index is None and src.shape[0] != dst.shape[0])
        or (index is not None and index.shape != dst.shape[:1])
    ):
        raise ValueError(
            "masked_copy_rows needs 2-D dst and src of one row length and dtype, a (rows,) mask and an optional "
            f"(rows,) index; got dst {tuple(dst.shape)} {dst.dtype}, src {tuple(src.shape)} {src.dtype}, "
            f"mask {tuple(mask.shape)}, index {None if index is None else tuple(index.shape)}"
        )
    if triton is None or not dst.is_cuda or not (dst.is_contiguous() and src.is_contiguous()):
        masked_copy_rows_reference(dst, src, mask, index)
        return
    rows, row_len = dst.shape
    if rows == 0 or row_len == 0:
        return
    grid = (rows, triton.cdiv(row_len, _BLOCK))
    idx = mask if index is None else index  # a placeholder pointer when there is no index
    _masked_copy_rows_kernel[grid](
        dst, src, mask.view(torch.uint8), idx, row_len, HAS_INDEX=index is not None, BLOCK=_BLOCK
    )
