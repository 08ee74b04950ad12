"""Row copies over a slot arena: a masked copy/gather (restore, autoreset) and a scatter (fork).

Masked row copy: ``dst[r] = src[r]`` for every row ``r`` with ``mask[r]``.

This is the in-graph restore of selected slots (autoreset, fork): rows are slot rows of a
:class:`flashrt.runtime.BufferSet` slot arena, so one call moves every buffer of the chosen slots.

The torch reference is one ``where`` over every row: it reads both images whole, whatever the
mask. The Triton kernel launches one program per (row, chunk) and returns at once in rows whose
mask is off, so it moves only the bytes of the rows that change.
"""

from __future__ import annotations

import torch

from flashrt.kernels.backend import check_layout, layout_problem, tl, triton, use_triton


def masked_copy_rows_reference(
    dst: torch.Tensor, src: torch.Tensor, mask: torch.Tensor, index: torch.Tensor | None = None
) -> None:
    """Torch reference: ``dst[r] = src[index[r]]`` (``src[r]`` without an index) where ``mask[r]``."""
    rows = src if index is None else src[index]
    torch.where(mask.view(-1, 1), rows, dst, out=dst)


if triton is not None:

    @triton.jit
    def _masked_copy_rows_kernel(
        dst, src, mask, index, row_len, s_dst, s_src, s_mask, s_index, HAS_INDEX: tl.constexpr, BLOCK: tl.constexpr
    ):
        # mask and index may be slot buffers' views (strided by an arena row), dst and src rows of any stride
        row = tl.program_id(0).to(tl.int64)
        if tl.load(mask + row * s_mask) != 0:
            cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            inside = cols < row_len
            src_row = tl.load(index + row * s_index).to(tl.int64) if HAS_INDEX else row
            values = tl.load(src + src_row * s_src + cols, mask=inside)
            tl.store(dst + row * s_dst + cols, values, mask=inside)


_BLOCK = 1024


def masked_copy_rows_triton(
    dst: torch.Tensor, src: torch.Tensor, mask: torch.Tensor, index: torch.Tensor | None = None
) -> None:
    """The Triton kernel (called by :func:`masked_copy_rows` on CUDA): takes the strides of the
    mask, the index and the rows of ``dst`` and ``src``, whose last stride must be 1."""
    check_layout("masked_copy_rows_triton", "dst", dst, unit=(1,))
    check_layout("masked_copy_rows_triton", "src", src, unit=(1,))
    rows, row_len = dst.shape
    if rows == 0 or row_len == 0:
        return
    grid = (rows, triton.cdiv(row_len, _BLOCK))
    idx = mask if index is None else index  # a placeholder pointer when there is no index
    _masked_copy_rows_kernel[grid](
        dst, src, mask.view(torch.uint8), idx, row_len, dst.stride(0), src.stride(0), mask.stride(0), idx.stride(0),
        HAS_INDEX=index is not None, BLOCK=_BLOCK,
    )  # fmt: skip


def masked_copy_rows(
    dst: torch.Tensor, src: torch.Tensor, mask: torch.Tensor, index: torch.Tensor | None = None
) -> None:
    """``dst[r] = src[index[r]]`` (``src[r]`` without an index) for every row with ``mask[r]``
    set; capturable (no host sync). Rows whose mask is off are neither read nor written.

    Args:
        dst: ``(rows, row_len)``, written in place.
        src: ``(src_rows, row_len)``, same dtype and device (``src_rows == rows`` without index).
        mask: ``(rows,)`` bool on the same device (any stride, e.g. a slot buffer's view).
        index: optional ``(rows,)`` int64 source row of each destination row (a gather), any stride.

    Any strides; rows with a unit last stride take the kernel on CUDA, others the reference.
    """
    if (
        dst.dim() != 2
        or src.dim() != 2
        or dst.shape[1] != src.shape[1]
        or dst.dtype != src.dtype
        or mask.shape != dst.shape[:1]
        or (index is None and src.shape[0] != dst.shape[0])
        or (index is not None and index.shape != dst.shape[:1])
        or mask.dtype != torch.bool
        or (index is not None and index.dtype != torch.int64)
    ):
        raise ValueError(
            "masked_copy_rows needs 2-D dst and src of one row length and dtype, a (rows,) bool mask and an "
            f"optional (rows,) int64 index; got dst {tuple(dst.shape)} {dst.dtype}, src {tuple(src.shape)} "
            f"{src.dtype}, mask {tuple(mask.shape)} {mask.dtype}, "
            f"index {None if index is None else (tuple(index.shape), index.dtype)}"
        )
    rows_ok = layout_problem(dst, unit=(1,)) is None and layout_problem(src, unit=(1,)) is None
    if use_triton(dst, src, mask) and rows_ok:
        masked_copy_rows_triton(dst, src, mask, index)
    else:
        masked_copy_rows_reference(dst, src, mask, index)


def scatter_rows_reference(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """Torch reference of :func:`scatter_rows`."""
    if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
        src = src.clone()  # a row of dst itself (a fork of a live slot): read it before writing
    if src.shape[0] == 1:
        src = src.expand(index.shape[0], -1)
    dst.index_put_((index,), src)


if triton is not None:

    @triton.jit
    def _scatter_rows_kernel(dst, index, src, row_len, s_dst, s_index, s_src, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < row_len
        values = tl.load(src + i * s_src + cols, mask=inside)
        tl.store(dst + tl.load(index + i * s_index) * s_dst + cols, values, mask=inside)


def scatter_rows_triton(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """The Triton kernel (called by :func:`scatter_rows` on CUDA): takes the strides of the index
    and of the rows of ``dst`` and ``src``, whose last stride must be 1."""
    check_layout("scatter_rows_triton", "dst", dst, unit=(1,))
    check_layout("scatter_rows_triton", "src", src, unit=(1,))
    k, row_len = index.shape[0], dst.shape[1]
    if k and row_len:
        s_src = 0 if src.shape[0] == 1 else src.stride(0)  # one source row broadcast to every target
        _scatter_rows_kernel[(k, triton.cdiv(row_len, _BLOCK))](
            dst, index, src, row_len, dst.stride(0), index.stride(0), s_src, BLOCK=_BLOCK
        )


def scatter_rows(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[index[i]] = src[i]`` (``src[0]`` for every i when ``src`` has one row); capturable.

    The one-row form is a fork: the source row is broadcast without being materialised. A
    source row that is also a target is safe only in that form (it is overwritten with itself).

    Args:
        dst: ``(rows, row_len)``, written in place.
        index: ``(k,)`` int64 distinct target rows, any stride.
        src: ``(k, row_len)`` or ``(1, row_len)``, same dtype and device.

    Any strides; rows with a unit last stride take the kernel on CUDA, others the reference.
    """
    if (
        dst.dim() != 2
        or src.dim() != 2
        or src.shape[1] != dst.shape[1]
        or src.dtype != dst.dtype
        or index.dim() != 1
        or index.dtype != torch.int64
        or src.shape[0] not in (1, index.shape[0])
    ):
        raise ValueError(
            "scatter_rows needs 2-D dst and src of one row length and dtype and a (k,) int64 index with k or 1 "
            f"source rows; got dst {tuple(dst.shape)} {dst.dtype}, src {tuple(src.shape)} {src.dtype}, "
            f"index {tuple(index.shape)} {index.dtype}"
        )
    rows_ok = layout_problem(dst, unit=(1,)) is None and layout_problem(src, unit=(1,)) is None
    if use_triton(dst, index, src) and rows_ok:
        scatter_rows_triton(dst, index, src)
    else:
        scatter_rows_reference(dst, index, src)
