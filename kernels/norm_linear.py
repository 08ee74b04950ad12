"""RMSNorm, then a linear layer, then its consumer: one kernel where a decoder layer ran three.

A decoder layer's two projections out of its residual stream each run norm -> matmul -> a
pointwise consumer; this module fuses each chain into one pass:

- :func:`rms_norm_qkv_rope`: ``rms_norm(x) @ W_qkv^T``, split into heads and rotated, queries
  written as ``(N, h, T, d)`` and keys/values into a caller-given cache view (what
  :func:`flashrt.kernels.qkv_rope` does after a separate norm and matmul);
- :func:`rms_norm_geglu`: ``gelu_tanh(rms_norm(x) @ W_gate^T) * (rms_norm(x) @ W_up^T)``, the
  gated MLP's input half (what :func:`flashrt.kernels.gelu_mul` does after a separate norm and matmul).

A program loads a block of rows whole (the width is at most :data:`FUSED_MAX_WIDTH`), takes the
norm in registers and multiplies it by two weight blocks: the halves of one head (rotary pairs
element ``i`` with ``i + d/2``) or matching gate and up columns. Neither the normed rows nor the
projection's output is written to memory. Rounding follows the unfused chain: the normed row as
:func:`flashrt.kernels.add_rms_norm` rounds it, the product rounded to the input dtype before the
rotation or the GELU; only the order of the matmul's sums differs (as between any two GEMMs).
Wider rows (``pi0``) and calls over many rows take the norm apart, then the matmul and its
consumer: :func:`flashrt.kernels.linear_geglu` (the GELU in the epilogue of Triton tiles over many
narrow rows and of the blocked-k kernel at pi0's expert, 50 rows; cuBLAS and
:func:`flashrt.kernels.gelu_mul` for pi0's wide rows over many), :func:`flashrt.kernels.linear`
then :func:`flashrt.kernels.qkv_rope`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashrt.kernels.activation import gelu_mul_reference
from flashrt.kernels.backend import check_layout, dependent_launch, tl, triton, use_triton
from flashrt.kernels.matmul import linear, linear_geglu
from flashrt.kernels.norm import add_rms_norm, add_rms_norm_reference
from flashrt.kernels.rotary import check_frequencies, check_positions, kv_destination, qkv_rope, qkv_rope_reference

FUSED_MAX_WIDTH = 256
"""Widest rows the fused kernels take: a block of rows is held whole in registers."""

GEGLU_MAX_ROWS = 256
QKV_ROPE_MAX_ROWS = 2048
"""Most rows (tokens) a call takes the fused kernel for. Below these the calls are latency-bound
and one launch beats three; above them the unfused chain was measured faster with cuBLAS's matmul
(docs/PERFORMANCE.md, "Kernels: the measurements behind their design"), whose GeGLU form now runs
:func:`flashrt.kernels.linear_geglu`'s tiles."""


def _check(x: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor, name: str) -> None:
    k = x.shape[-1]
    if norm_weight.shape != (k,):
        raise ValueError(
            f"{name}: the norm weight must be ({k},) for rows of width {k}, got {tuple(norm_weight.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(
            f"{name}: the projection weight must be (out, {k}) as nn.Linear stores it, got {tuple(weight.shape)}"
        )


def rms_norm_geglu_reference(
    x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor
) -> torch.Tensor:
    """Torch reference of :func:`rms_norm_geglu`."""
    return gelu_mul_reference(F.linear(add_rms_norm_reference(x, None, norm_weight, eps)[1], weight))


def rms_norm_qkv_rope_reference(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    pos0: torch.Tensor,
    inv_freq: torch.Tensor,
    heads: int,
    kv_heads: int,
    kv_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rms_norm_qkv_rope`."""
    y = add_rms_norm_reference(x, None, norm_weight, eps)[1]
    return qkv_rope_reference(F.linear(y, weight), pos0, inv_freq, heads, kv_heads, kv_out)


if triton is not None:
    from flashrt.kernels.activation import geglu
    from flashrt.kernels.backend import inputs_ready
    from flashrt.kernels.rotary import store_head

    @triton.jit
    def _weight_blocks(weight, m, width, ks, kin, ROPE: tl.constexpr, BN: tl.constexpr):
        """Program j's two (BN, BK) weight blocks, rows ``first`` and ``second``; returns ``first`` too."""
        j = tl.program_id(1)
        cols = tl.arange(0, BN)
        if ROPE:  # program j: head j among h + 2g, its two halves
            first = j * 2 * BN + cols
            second = first + BN
            wm = kin[None, :]
        else:  # program j: gate columns j*BN.. and the up columns m apart
            first = j * BN + cols
            second = first + m
            wm = (first < m)[:, None] & kin[None, :]
        w1 = tl.load(weight + first[:, None] * width + ks[None, :], mask=wm, other=0.0)
        w2 = tl.load(weight + second[:, None] * width + ks[None, :], mask=wm, other=0.0)
        return first, w1, w2

    @triton.jit
    def _norm_linear_kernel(
        x, norm_w, weight, out, pos0, inv_freq, k_out, v_out,
        rows, width, eps, m, T, HEADS, KV_HEADS,
        sk_n, sk_g, sk_t, sv_n, sv_g, sv_t, s_nw, s_pos, s_freq,
        ROPE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        live = row < rows
        ks = tl.arange(0, BK)
        kin = ks < width
        if GDC:  # a grid that fits at once: its weights (constants of the graph) before the wait
            first, w1, w2 = _weight_blocks(weight, m, width, ks, kin, ROPE, BN)
            nw = tl.load(norm_w + ks * s_nw, mask=kin, other=0.0).to(tl.float32)
            inputs_ready(GDC)
        a = tl.load(x + row[:, None] * width + ks[None, :], mask=live[:, None] & kin[None, :], other=0.0)
        af = a.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(af * af, axis=1) / width + eps)
        if not GDC:  # programs in waves: each load where it is used (faster than weights first there)
            nw = tl.load(norm_w + ks * s_nw, mask=kin, other=0.0).to(tl.float32)
        y = ((af * r[:, None]).to(a.dtype).to(tl.float32) * nw[None, :]).to(a.dtype)  # (BM, BK) normed rows
        if not GDC:
            first, w1, w2 = _weight_blocks(weight, m, width, ks, kin, ROPE, BN)
        p = tl.dot(y, tl.trans(w1), input_precision=PRECISION).to(a.dtype)  # (BM, BN), rounded as F.linear
        q = tl.dot(y, tl.trans(w2), input_precision=PRECISION).to(a.dtype)
        if ROPE:  # queries and keys rotated, rounded as the unfused kernel; values as projected
            store_head(
                p, q, row // T, row % T, live, tl.program_id(1), T, pos0, inv_freq, out, k_out, v_out, HEADS, KV_HEADS,
                sk_n, sk_g, sk_t, sv_n, sv_g, sv_t, s_pos, s_freq, BN,
            )  # fmt: skip
        else:  # gelu_tanh(gate) * up, rounded as kernels.gelu_mul
            dst = out + row[:, None] * m + first[None, :]
            act = geglu(p.to(tl.float32), q.to(tl.float32), a.dtype)
            tl.store(dst, act.to(a.dtype), mask=live[:, None] & (first < m)[None, :])


def _fits(max_rows: int, x: torch.Tensor, weight: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether a call takes the fused kernel (else the unfused chain, which reports dtype mismatches)."""
    width = x.shape[-1]
    few = 16 <= width <= FUSED_MAX_WIDTH and x.numel() <= max_rows * width
    return few and weight.dtype == x.dtype and weight.is_contiguous() and use_triton(x, weight, *tensors)


def _launch(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor, blocks: int, bn: int,
            out: torch.Tensor, rope: tuple | None) -> None:  # fmt: skip
    """One program per 16 rows and column block: the rows are few (see :data:`GEGLU_MAX_ROWS`
    and :data:`QKV_ROPE_MAX_ROWS`)."""
    for name, tensor in (("x", x), ("weight", weight), ("out", out)):
        check_layout("kernels.norm_linear", name, tensor, contiguous=True)
    width = x.shape[-1]
    rows = x.numel() // width
    if not rows:
        return
    if rope is None:
        pos0 = inv_freq = k_out = v_out = out  # unused by the GeGLU form
        t = heads = kv_heads = 1
        m = out.shape[-1]
        sk = sv = (0, 0, 0)
        s_pos = s_freq = 1
    else:
        pos0, inv_freq, k_out, v_out, t, heads, kv_heads = rope
        m = 0
        sk, sv = k_out.stride()[:3], v_out.stride()[:3]
        s_pos, s_freq = pos0.stride(0), inv_freq.stride(0)
    grid = (triton.cdiv(rows, 16), blocks)
    _norm_linear_kernel[grid](
        x, norm_weight, weight, out, pos0, inv_freq, k_out, v_out,
        rows, width, eps, m, t, heads, kv_heads, *sk, *sv, norm_weight.stride(0), s_pos, s_freq,
        ROPE=rope is not None, BM=16, BN=bn, BK=max(16, triton.next_power_of_2(width)),
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, **dependent_launch(x.device, grid[0] * grid[1]),
    )  # fmt: skip


def rms_norm_geglu_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """The fused Triton kernel (called by :func:`rms_norm_geglu` on CUDA for rows up to
    :data:`FUSED_MAX_WIDTH` wide): x any strides (read through a contiguous copy), the norm
    weight any stride, the projection weight contiguous (loaded before the wait of a dependent
    launch, so never a copy made just ahead)."""
    m = weight.shape[0] // 2
    x = x.contiguous()
    out = x.new_empty((*x.shape[:-1], m))
    rows = x.numel() // x.shape[-1]
    bn = 32 if rows <= 16 else 64  # one slot's rows: narrower column blocks, more programs
    _launch(x, norm_weight, eps, weight, triton.cdiv(m, bn), bn, out, None)
    return out


def rms_norm_qkv_rope_triton(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    pos0: torch.Tensor,
    inv_freq: torch.Tensor,
    heads: int,
    kv_heads: int,
    kv_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused Triton kernel (called by :func:`rms_norm_qkv_rope` on CUDA for rows up to
    :data:`FUSED_MAX_WIDTH` wide and a power-of-two head dim). Takes the strides of ``pos0``,
    ``inv_freq``, the norm weight and ``kv_out`` (unit last stride); x as :func:`rms_norm_geglu_triton`."""
    n, t, _ = x.shape
    kv_out = kv_destination(n, t, weight.shape[0], x.dtype, x.device, heads, kv_heads, kv_out)
    check_layout("rms_norm_qkv_rope_triton", "kv_out", kv_out, unit=(-1,))
    d = kv_out.shape[-1]
    check_frequencies(inv_freq, d, "rms_norm_qkv_rope")
    k_out, v_out = kv_out[:, 0], kv_out[:, 1]
    q = x.new_empty((n, heads, t, d))
    rope = (pos0, inv_freq, k_out, v_out, t, heads, kv_heads)
    _launch(x.contiguous(), norm_weight, eps, weight, heads + 2 * kv_heads, d // 2, q, rope)
    return q, k_out, v_out


def rms_norm_geglu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(y @ W_gate^T) * (y @ W_up^T)`` with ``y = rms_norm(x)``.

    Args:
        x: ``(..., k)`` rows (the residual stream).
        norm_weight: ``(k,)`` RMSNorm weight; ``eps`` its epsilon.
        weight: ``(2m, k)`` fused gate/up projection, gate rows first.

    Returns:
        ``(..., m)``.
    """
    _check(x, norm_weight, weight, "rms_norm_geglu")
    if weight.shape[0] % 2:
        raise ValueError(
            f"rms_norm_geglu: the weight needs an even row count (gate and up halves), got {weight.shape[0]}"
        )
    if _fits(GEGLU_MAX_ROWS, x, weight, norm_weight):
        return rms_norm_geglu_triton(x, norm_weight, eps, weight)
    return linear_geglu(add_rms_norm(x, None, norm_weight, eps)[1], weight)


def rms_norm_qkv_rope(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    pos0: torch.Tensor,
    inv_freq: torch.Tensor,
    heads: int,
    kv_heads: int,
    kv_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, keys and values of ``rms_norm(x) @ weight^T``, split into heads and rotated.

    Args:
        x: ``(N, T, k)`` rows (the residual stream).
        norm_weight: ``(k,)`` RMSNorm weight; ``eps`` its epsilon.
        weight: ``((h + 2g) d, k)`` fused projection: query heads, then key heads, then value heads.
        pos0, inv_freq, heads, kv_heads, kv_out: as for :func:`flashrt.kernels.qkv_rope`.

    Returns:
        q ``(N, h, T, d)``, and k, v ``(N, g, T, d)`` (views of ``kv_out`` when given).
    """
    _check(x, norm_weight, weight, "rms_norm_qkv_rope")
    check_positions(pos0, x.shape[0], "rms_norm_qkv_rope")
    outs = [] if kv_out is None else [kv_out]
    d = weight.shape[0] // (heads + 2 * kv_heads)
    fused_layout = d >= 32 and not d & (d - 1) and (kv_out is None or kv_out.stride(-1) == 1)
    if fused_layout and _fits(QKV_ROPE_MAX_ROWS, x, weight, norm_weight, pos0, inv_freq, *outs):
        return rms_norm_qkv_rope_triton(x, norm_weight, eps, weight, pos0, inv_freq, heads, kv_heads, kv_out)
    qkv = linear(add_rms_norm(x, None, norm_weight, eps)[1], weight)
    return qkv_rope(qkv, pos0, inv_freq, heads, kv_heads, kv_out)
