"""FP8 (e4m3) projections: weights quantised per output channel, activations per token.

A weight ``W`` (n, k) becomes :class:`Fp8Weight`: e4m3 values and one float32 scale per output
channel (row), ``W ~ data * scale[:, None]`` with ``scale = max|W[i]| / 448`` (448: e4m3's
largest finite value), so each row uses e4m3's whole range. An activation ``x`` (m, k) is
quantised the same way per token (row) when the projection runs (:func:`quantize_rows`: dynamic
scales, nothing calibrated), and the product is

    y[i, j] = (sum_k xq[i, k] * wq[j, k]) * sx[i] * sw[j] (+ bias[j]), rounded once,

one Hopper/Ada FP8 tensor-core GEMM with row-wise scales in its epilogue: ``torch._scaled_mm``
(capturable in a CUDA graph), with fast accumulation (``use_fast_accum``: the tensor cores'
own accumulator over the whole sweep of ``k``, not promoted to float32 every few steps: faster
at pi0's shapes, for an error far below the quantisation's own; measured in docs/FP8.md). Its
layout rules, checked here: the first operand row-major, the second column-major (a row-major
weight's transpose), ``k`` and ``n`` multiples of 16, scales float32 of shapes (m, 1) and
(1, n), bf16 output. Where that GEMM cannot run (a CPU, a GPU below
compute capability 8.9, an activation that is not bf16) :func:`linear` computes the same
quantised product from the dequantised operands in float32 (:func:`linear_emulated`), so every
machine runs the FP8 numerics; the two differ only in summation order and the final rounding.

:func:`quantize_rows` is one Triton kernel on CUDA (a row's max, its scale and its e4m3 values
in one pass; float32 math that rounds as the torch reference does, so the two agree to the bit).
Over at most :data:`FEW_ROWS` rows (the action expert at one slot) the product is one Triton
kernel of its own (:func:`linear_rows_triton`), where ``torch._scaled_mm`` is slower than even
bf16 cuBLAS: the same quantised product, summed in another order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashrt.kernels.backend import check_layout, dependent_launch, tl, triton, use_triton

VERSION = "5"
"""Bump when the FP8 numerics change (the quantisation, or which projections it takes):
deployment digests of FP8 policies name it."""
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
"""e4m3's largest finite magnitude: a row's largest element maps onto it."""
MIN_AMAX = 1e-12
"""A row of zeros (or nearly) gets this amax instead of 0, so its scale is never 0 (its values
quantise to 0 all the same)."""
ALIGN = 16
"""``torch._scaled_mm`` takes ``k`` and ``n`` in multiples of 16."""
MAX_ROW = 1 << 16
"""The longest row a quantising kernel holds in one program; longer rows quantise in torch."""
FEW_ROWS = 64
"""Most rows a product takes the few-row Triton kernel for (:func:`linear_rows_triton`: the
action expert's 50 tokens at one slot); more take ``torch._scaled_mm``."""
K_STEP = 128
"""The ``k`` that ``torch._scaled_mm`` takes fastest is a multiple of this: SigLIP's fc2 (``k`` 4 304)
runs faster with its weight zero-padded to 4 352 (:func:`pad_k`)."""
FEW_BK = 256
"""The few-row kernel's ``k`` step: 256 e4m3 values, the bytes of the bf16 kernels' 128."""


Rows = tuple[torch.Tensor, torch.Tensor]
"""Activations quantised per row, :func:`quantize_rows`'s ``(q, scale)``: e4m3 ``(..., k)`` and
float32 ``(..., 1)``. The norms and the gated activation before a projection write them in
their own kernels (their ``fp8=True`` forms), and :func:`linear_rows` multiplies them."""


class Fp8Weight(NamedTuple):
    """A weight (n, k) quantised per output channel: ``data`` (n, k) e4m3 (row-major, so its
    transpose is the column-major operand ``torch._scaled_mm`` takes) and ``scale`` (n,) float32."""

    data: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale[:, None]`` (computed in float32) as ``dtype``."""
        return (self.data.float() * self.scale[:, None]).to(dtype)


def supported(device: torch.device | str) -> bool:
    """Whether ``device`` runs FP8 tensor-core GEMMs (``torch._scaled_mm`` with row-wise scales):
    a CUDA GPU of compute capability 8.9 (Ada) or later."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _amax_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) ``448 / amax`` and ``amax / 448``, float32, each rounded once."""
    amax = x.abs().amax(-1, keepdim=True).float().clamp_min(MIN_AMAX)
    # Tensor over tensor: IEEE division on every device. On CUDA, torch divides by a Python scalar
    # as a multiply by its reciprocal (a bit off the rounded quotient the Triton kernel computes).
    full = torch.full_like(amax, E4M3_MAX)
    return full / amax, amax / full


def quantize_weight(weight: torch.Tensor, name: str = "weight") -> Fp8Weight:
    """Quantise ``weight`` (n, k) per output channel to e4m3 (:class:`Fp8Weight`).

    Args:
        weight: a finite floating-point matrix whose ``n`` and ``k`` are multiples of 16.
        name: what the error messages call it (e.g. ``"prefix.3.gate_up"``).

    Returns:
        The e4m3 values (each row's largest magnitude maps onto 448) and the per-row scales.

    Raises:
        ValueError: ``weight`` is not a 2-D floating-point matrix, has a dimension that is not a
            multiple of 16, or holds NaN or infinity.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_weight: {name} must be a 2-D floating-point matrix, got {weight.dtype} "
                         f"{tuple(weight.shape)}")  # fmt: skip
    n, k = weight.shape
    if n % ALIGN or k % ALIGN:
        raise ValueError(
            f"quantize_weight: {name} is ({n}, {k}); FP8 GEMMs (torch._scaled_mm) take both dimensions in "
            f"multiples of {ALIGN}: keep this projection in bf16 or pad it"
        )
    if not torch.isfinite(weight).all():
        raise ValueError(f"quantize_weight: {name} holds NaN or infinity; quantise finite weights only")
    inv, scale = _amax_scale(weight.detach())
    data = (weight.detach().float() * inv).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return Fp8Weight(data.contiguous(), scale[:, 0].contiguous())


def pad_k(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (n, k) with zero columns up to the next multiple of :data:`K_STEP` (itself
    when ``k`` is one): the same product for an input zero-padded alike (the GELU's ``width``),
    on a ``k`` that ``torch._scaled_mm`` takes faster. The zeros change no row's scale."""
    return torch.nn.functional.pad(weight, (0, -weight.shape[-1] % K_STEP))


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`quantize_rows`."""
    inv, scale = _amax_scale(x)
    return (x.float() * inv).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


if triton is not None:
    from flashrt.kernels.backend import inputs_ready

    @triton.jit
    def store_values(y, amax, q_row, cols, inside):
        """Values ``y`` (float32) of a row whose largest magnitude is ``amax`` (at least
        ``MIN_AMAX``), as e4m3 to ``q_row + cols`` where ``inside``: :func:`quantize_rows`'s
        values, for a kernel that holds its row in more than one block."""
        v = tl.minimum(tl.maximum(y * tl.div_rn(448.0, amax), -448.0), 448.0)  # rounded as torch divides
        tl.store(q_row + cols, v.to(tl.float8e4nv), mask=inside)

    @triton.jit
    def store_row(y, q_row, scale_row, cols, inside):
        """One row ``y`` (float32, zeros outside ``inside``) quantised as :func:`quantize_rows`
        does, its e4m3 values to ``q_row + cols`` and its scale to ``scale_row``: the tail of
        every kernel that quantises whole rows of its own output."""
        amax = tl.maximum(tl.max(tl.abs(y), axis=0), 1e-12)  # MIN_AMAX
        store_values(y, amax, q_row, cols, inside)
        tl.store(scale_row, tl.div_rn(amax, 448.0))

    @triton.jit
    def _quantize_rows_kernel(x, q, scale, K, s_x, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, BLOCK)
        v = tl.load(x + row * s_x + ks, mask=ks < K, other=0.0).to(tl.float32)
        store_row(v, q + row * K, scale + row, ks, ks < K)

    @triton.jit
    def _few_rows_kernel(
        q, sx, w, sw, bias, out, rows, K, N,
        HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        # Program j: every row (at most BM) by weight rows j*BN.., k swept in BK blocks
        # (pipelined), e4m3 x e4m3 on the tensor cores into float32; the scales, then the bias,
        # in the epilogue, rounded once to the output dtype.
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        row = tl.arange(0, BM)
        live = row < rows
        ks = tl.arange(0, BK)
        s_w = tl.load(sw + cols, mask=cols < N, other=0.0)  # constants of the graph: before the wait
        if HAS_BIAS:
            b = tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)
        inputs_ready(GDC)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        w_rows = w + cols[:, None].to(tl.int64) * K
        for k0 in range(0, K, BK):
            kin = (k0 + ks) < K
            x = tl.load(q + row[:, None] * K + (k0 + ks)[None, :], mask=live[:, None] & kin[None, :], other=0.0)
            wt = tl.load(w_rows + (k0 + ks)[None, :], mask=(cols < N)[:, None] & kin[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(wt))
        acc = acc * tl.load(sx + row, mask=live, other=0.0)[:, None] * s_w[None, :]
        if HAS_BIAS:
            acc += b[None, :]
        dst = out + row[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(dst, acc.to(out.dtype.element_ty), mask=live[:, None] & (cols < N)[None, :])


def few_rows(rows: Rows, weight: Fp8Weight) -> bool:
    """Whether :func:`linear_rows` takes the few-row Triton kernel for ``rows``: at most
    :data:`FEW_ROWS` of them, on Triton."""
    q, s = rows
    m = q.numel() // max(q.shape[-1], 1)
    return 0 < m <= FEW_ROWS and use_triton(q, s, weight.data, weight.scale)


def linear_rows_triton(
    rows: Rows, weight: Fp8Weight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The product of :func:`linear_rows` over few rows (:func:`few_rows`) as one Triton kernel:
    a program a block of output channels holds every row and sweeps ``k``, so each weight row is
    read once; the scales and the bias in its epilogue. Over a few dozen rows a projection's cost
    is its weight's trip and its chain of steps, where ``torch._scaled_mm``'s tiles (with the
    row-wise scales) are slower than even bf16 cuBLAS (docs/FP8.md). Inside a graph it launches
    dependent (:func:`flashrt.kernels.backend.dependent_launch`)."""
    q, s = rows
    n, k = weight.data.shape
    q2 = q.reshape(-1, k)
    if q2.stride(-1) != 1 or q2.stride(0) != k:
        q2 = q2.contiguous()
    m = q2.shape[0]
    out = torch.empty((*q.shape[:-1], n), dtype=dtype, device=q.device)
    bn = next((bn for bn in (64, 32) if n >= 64 * bn), 16)  # >= 64 programs where n allows
    grid = (triton.cdiv(n, bn),)
    _few_rows_kernel[grid](
        q2, s.reshape(-1), weight.data, weight.scale, out if bias is None else bias, out, m, k, n,
        HAS_BIAS=bias is not None, BM=max(16, triton.next_power_of_2(m)), BN=bn, BK=FEW_BK, num_warps=4,
        num_stages=3, **dependent_launch(q.device, grid[0]),
    )  # fmt: skip
    return out


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` as one Triton kernel (a program a row)."""
    x2 = x.reshape(-1, x.shape[-1])
    m, k = x2.shape
    q = torch.empty((m, k), dtype=E4M3, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m,)](x2, q, scale, k, x2.stride(0), BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return q.view(*x.shape), scale.view(*x.shape[:-1], 1)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations ``x`` (..., k) per row (token) to e4m3 with dynamic scales:
    ``(q, scale)``, q (..., k) e4m3 and scale (..., 1) float32, ``x ~ q * scale``.

    Raises:
        ValueError: ``x`` is not floating point, or its last dimension is not contiguous.
    """
    if not x.is_floating_point() or x.dtype == E4M3:
        raise ValueError(f"quantize_rows: x must be bf16/fp16/fp32 activations, got {x.dtype}")
    check_layout("quantize_rows", "x", x, unit=(-1,))
    if use_triton(x) and x.shape[-1] <= MAX_ROW:
        return quantize_rows_triton(x)
    return quantize_rows_reference(x)


def _check(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None) -> None:
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError(
            "fp8 linear: FP8 projections are for inference (no gradient flows through e4m3 rounding or to the "
            "weights): run under torch.no_grad(), or train with set_precision('native')"
        )
    n, k = weight.data.shape
    if weight.data.dtype != E4M3 or weight.scale.shape != (n,) or weight.scale.dtype != torch.float32:
        raise ValueError(
            f"fp8 linear: the weight must be e4m3 (n, k) with float32 (n,) scales, got {weight.data.dtype} "
            f"{tuple(weight.data.shape)} and {weight.scale.dtype} {tuple(weight.scale.shape)}; use quantize_weight"
        )
    if x.shape[-1] != k:
        raise ValueError(f"fp8 linear: x's last dim {x.shape[-1]} must match the weight's k ({n}, {k})")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"fp8 linear: bias must be ({n},), got {tuple(bias.shape)}")


def _product(rows: Rows, weight: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype, gemm: bool) -> torch.Tensor:
    """The product of quantised rows and a quantised weight, ``(..., n)`` in ``dtype``: with
    ``gemm`` one FP8 tensor-core kernel (bf16; the scales in its epilogue): over few rows
    :func:`linear_rows_triton`, else ``torch._scaled_mm``; without, from the dequantised
    operands in float32, rounded once."""
    q, s = rows
    n, k = weight.data.shape
    if not gemm:
        out = (q.float() * s) @ weight.dequantize().t()
        if bias is not None:
            out = out + bias.float()
        return out.to(dtype)
    if few_rows(rows, weight):
        return linear_rows_triton(rows, weight, bias, dtype)
    out = torch._scaled_mm(
        q.reshape(-1, k),
        weight.data.t(),  # column-major (k, n)
        scale_a=s.reshape(-1, 1),
        scale_b=weight.scale.view(1, n),
        bias=None if bias is None else bias.to(torch.bfloat16),
        out_dtype=torch.bfloat16,
        use_fast_accum=True,
    )
    return out.view(*q.shape[:-1], n)


def linear_emulated(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`linear`'s product from the dequantised operands: ``x`` quantised per row as the
    GEMM's input is, both sides dequantised, multiplied in float32, the bias added, rounded once
    to x's dtype. What runs where the FP8 GEMM cannot (and its reference)."""
    _check(x, weight, bias)
    return _product(quantize_rows(x), weight, bias, x.dtype, gemm=False)


def runs_scaled_mm(x: torch.Tensor) -> bool:
    """Whether :func:`linear` on ``x`` takes the FP8 tensor-core GEMM: bf16 activations on a
    GPU that has it (:func:`supported`)."""
    return x.dtype == torch.bfloat16 and supported(x.device)


def linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with ``W`` quantised per output channel and ``x`` (..., k) quantised
    per token (see the module docstring) -> (..., n) in x's dtype. One ``torch._scaled_mm`` on
    an FP8 GPU for bf16 ``x`` (:func:`runs_scaled_mm`), :func:`linear_emulated` elsewhere.

    Raises:
        ValueError: shapes that do not fit, a weight that is not an :class:`Fp8Weight`, or ``x``
            that autograd records through (FP8 is for inference).
    """
    if not runs_scaled_mm(x):
        return linear_emulated(x, weight, bias)
    _check(x, weight, bias)
    return _product(quantize_rows(x), weight, bias, x.dtype, gemm=True)


def linear_rows(
    rows: Rows, weight: Fp8Weight, bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """:func:`linear` of activations already quantised per row (:data:`Rows`, e.g. a norm's
    ``fp8=True`` output) -> ``(..., n)`` in ``dtype``, the dtype of the activations they came
    from: the same product as :func:`linear` of those activations, with no quantise kernel of its
    own.

    Raises:
        ValueError: rows that are not e4m3 with float32 (..., 1) scales, or shapes that do not fit.
    """
    q, s = rows
    if q.dtype != E4M3 or s.dtype != torch.float32 or s.shape != (*q.shape[:-1], 1):
        raise ValueError(
            f"linear_rows: rows must be e4m3 (..., k) values with float32 (..., 1) scales (quantize_rows's output), "
            f"got {q.dtype} {tuple(q.shape)} and {s.dtype} {tuple(s.shape)}"
        )
    _check(torch.empty((*q.shape[:-1], q.shape[-1]), dtype=dtype, device="meta"), weight, bias)
    return _product(rows, weight, bias, dtype, gemm=dtype == torch.bfloat16 and supported(q.device))
