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


def masked_copy_rows_reference(dst: torch.Tensor, src: torch.Tensor, mask: torch.Tensor) -> None:
    """Torch reference: ``dst[r] = src[r]`` where ``mask[r]``; 2-D tensors of one shape."""
    torch.where(mask.view(-1, 1), src, dst, out=dst)


if triton is not None:

    @triton.jit
    def _masked_copy_rows_kernel(dst, src, mask, row_len, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        if tl.load(mask + row) != 0:
            cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            inside = cols < row_len
            base = row.to(tl.int64) * row_len
            tl.store(dst + base + cols, tl.load(src + base + cols, mask=inside), mask=inside)


_BLOCK = 1024


def masked_copy_rows(dst: torch.Tensor, src: torch.Tensor, mask: torch.Tensor) -> None:
    """``dst[r] = src[r]`` for every row with ``mask[r]`` set; capturable (no host sync).

    Args:
        dst: ``(rows, row_len)`` contiguous tensor, written in place.
        src: same shape, dtype and device.
        mask: ``(rows,)`` bool on the same device.
    """
    if dst.shape != src.shape or dst.dtype != src.dtype or dst.dim() != 2 or mask.shape != dst.shape[:1]:
        raise ValueError(
            f"masked_copy_rows needs dst and src of one 2-D shape and a (rows,) mask; got dst {tuple(dst.shape)} "
            f"{dst.dtype}, src {tuple(src.shape)} {src.dtype}, mask {tuple(mask.shape)}"
        )
    if triton is None or not dst.is_cuda or not (dst.is_contiguous() and src.is_contiguous()):
        masked_copy_rows_reference(dst, src, mask)
        return
    rows, row_len = dst.shape
    if rows == 0 or row_len == 0:
        return
    grid = (rows, triton.cdiv(row_len, _BLOCK))
    _masked_copy_rows_kernel[grid](dst, src, mask.view(torch.uint8), row_len, BLOCK=_BLOCK)
