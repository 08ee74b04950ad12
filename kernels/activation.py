"""The gated-MLP activation :func:`gelu_mul`, ``gelu_tanh(gate) * up`` from the fused gate/up
projection: the projection writes ``(..., 2m)`` with the gate in the first half; the kernel reads
both halves once and writes ``(..., m)``, where the reference takes a chunk, a GELU and a product
(three passes over memory). The plain MLP's ``gelu_tanh(x W^T + b)`` runs in its projection
(:func:`flashrt.kernels.matmul.linear_gelu`). With ``fp8=True`` the output leaves quantised per row
for the FP8 down projection (:data:`flashrt.kernels.fp8.Rows`): one program a row holds the row's
product, its largest magnitude, the scale and the e4m3 values. An FP8 plain MLP cannot take its
GELU in the GEMM's epilogue (``torch._scaled_mm`` has none), so :func:`gelu` does the same for it:
the GELU and the quantisation of its output in one pass, where torch's GELU and
:func:`flashrt.kernels.fp8.quantize_rows` took two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashrt.kernels.backend import tl, triton, use_triton
from flashrt.kernels.fp8 import MAX_ROW, Rows, quantize_rows


def gelu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch reference: ``gelu(gate, approximate="tanh") * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


if triton is not None:
    from flashrt.kernels.fp8 import store_row, store_values

    @triton.jit
    def geglu(gate, up, dtype: tl.constexpr):
        """``gelu_tanh(gate) * up`` in float32, of a gate and an up value each already rounded
        to ``dtype``: the GELU is rounded to ``dtype`` before the product, as the reference's
        ``F.gelu`` output is (the caller rounds the product). Every GeGLU kernel's epilogue."""
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)
        return (0.5 * gate * (1.0 + tanh)).to(dtype).to(tl.float32) * up

    @triton.jit
    def _gelu_mul_kernel(gate_up, out, m, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < m
        g = tl.load(gate_up + row * 2 * m + cols, mask=inside, other=0.0)
        u = tl.load(gate_up + row * 2 * m + m + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out + row * m + cols, geglu(g.to(tl.float32), u, g.dtype).to(g.dtype), mask=inside)

    @triton.jit
    def _gelu_mul_fp8_kernel(gate_up, q, scale, m, BLOCK: tl.constexpr):
        # kernels.fp8.quantize_rows of the product as the kernel above stores it (rounded to the
        # input's dtype), the whole row in one program
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < m
        g = tl.load(gate_up + row * 2 * m + cols, mask=inside, other=0.0)
        u = tl.load(gate_up + row * 2 * m + m + cols, mask=inside, other=0.0).to(tl.float32)
        y = geglu(g.to(tl.float32), u, g.dtype).to(g.dtype).to(tl.float32)
        store_row(y, q + row * m, scale + row, cols, inside)

    @triton.jit
    def gelu_rounded(v):
        """``gelu_tanh(v)`` in float32 as :func:`geglu` takes it (tanh through exp, within a
        float32 ulp or two of torch's), rounded to ``v``'s dtype and back."""
        f = v.to(tl.float32)
        z = 0.7978845608028654 * (f + 0.044715 * f * f * f)
        return (0.5 * f * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))).to(v.dtype).to(tl.float32)

    @triton.jit
    def _gelu_fp8_kernel(x, q, scale, m, width, s_x, HEAD: tl.constexpr, TAIL: tl.constexpr):
        # kernels.fp8.quantize_rows of gelu_tanh(x) rounded to x's dtype and zero-padded from m
        # to width columns, the whole row in one program as a block of the largest power of
        # two <= m and a block of the rest: SigLIP's 4 304-wide rows padded to 4 352 take
        # 4 096 + 256 lanes, where one 8 192-lane block left half of its lanes masked
        row = tl.program_id(0).to(tl.int64)
        head = tl.arange(0, HEAD)
        y = gelu_rounded(tl.load(x + row * s_x + head))
        amax = tl.max(tl.abs(y), axis=0)
        if TAIL > 0:
            tail = HEAD + tl.arange(0, TAIL)
            t = gelu_rounded(tl.load(x + row * s_x + tail, mask=tail < m, other=0.0))  # gelu(0) = 0
            amax = tl.maximum(amax, tl.max(tl.abs(t), axis=0))
        amax = tl.maximum(amax, 1e-12)  # MIN_AMAX
        store_values(y, amax, q + row * width, head, head < width)
        if TAIL > 0:
            store_values(t, amax, q + row * width, tail, tail < width)
        tl.store(scale + row, tl.div_rn(amax, 448.0))


_BLOCK = 1024


def gelu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """The Triton kernel (called by :func:`gelu_mul` on CUDA)."""
    m = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    out = gate_up.new_empty((*gate_up.shape[:-1], m))
    rows = gate_up.numel() // (2 * m) if m else 0
    if rows:
        _gelu_mul_kernel[(rows, triton.cdiv(m, _BLOCK))](gate_up, out, m, BLOCK=_BLOCK)
    return out


def gelu_mul_fp8_triton(gate_up: torch.Tensor) -> Rows:
    """The Triton kernel of ``gelu_mul(gate_up, fp8=True)`` (a program a row)."""
    m = gate_up.shape[-1] // 2
    gate_up = gate_up.contiguous()
    q = torch.empty((*gate_up.shape[:-1], m), dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty((*gate_up.shape[:-1], 1), dtype=torch.float32, device=gate_up.device)
    rows = gate_up.numel() // (2 * m) if m else 0
    if rows:
        block = triton.next_power_of_2(m)
        _gelu_mul_fp8_kernel[(rows,)](gate_up, q, scale, m, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return q, scale


def gelu_mul(gate_up: torch.Tensor, *, fp8: bool = False) -> torch.Tensor | Rows:
    """``gelu_tanh(gate) * up`` for ``gate_up (..., 2m)`` (gate first) -> ``(..., m)``; with
    ``fp8``, that output quantised per row (:func:`flashrt.kernels.fp8.quantize_rows`'s
    ``(q, scale)``) in the same kernel."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gelu_mul needs an even last dimension (gate and up halves), got {gate_up.shape[-1]}")
    if not use_triton(gate_up):
        out = gelu_mul_reference(gate_up)
        return quantize_rows(out) if fp8 else out
    if not fp8:
        return gelu_mul_triton(gate_up)
    if gate_up.shape[-1] // 2 <= MAX_ROW:
        return gelu_mul_fp8_triton(gate_up)
    return quantize_rows(gelu_mul_triton(gate_up))


def gelu_fp8_triton(x: torch.Tensor, width: int) -> Rows:
    """The Triton kernel of ``gelu(x, fp8=True, width=width)`` (a program a row; rows at any
    stride)."""
    m = x.shape[-1]
    x2 = x.reshape(-1, m)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    q = torch.empty((*x.shape[:-1], width), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    if x2.shape[0] and m:
        head = 1 << (m.bit_length() - 1)
        tail = triton.next_power_of_2(width - head) if width > head else 0
        _gelu_fp8_kernel[(x2.shape[0],)](x2, q, scale, m, width, x2.stride(0), HEAD=head, TAIL=tail,
                                         num_warps=min(16, max(1, (head + tail) // 256)))  # fmt: skip
    return q, scale


def gelu(x: torch.Tensor, *, fp8: bool = False, width: int | None = None) -> torch.Tensor | Rows:
    """``gelu_tanh(x)`` (torch's ``F.gelu(x, approximate="tanh")``); with ``fp8``, that output
    quantised per row (:func:`flashrt.kernels.fp8.quantize_rows`'s ``(q, scale)``), on CUDA in
    one kernel that takes the GELU and the quantisation together (rows up to
    :data:`flashrt.kernels.fp8.MAX_ROW` long).

    Args:
        x: floating-point activations ``(..., m)``.
        fp8: return the output quantised per row.
        width: the output's last dimension, zeros past ``m`` (default ``m``): the ``k`` of the
            projection after it when that projection's weight is zero-padded
            (:func:`flashrt.kernels.fp8.pad_k`). The zeros change no row's scale.

    Raises:
        ValueError: ``x`` is not floating point, or ``width`` is below ``m``.
    """
    if not x.is_floating_point():
        raise ValueError(f"gelu: x must be floating-point activations, got {x.dtype}")
    m = x.shape[-1]
    width = m if width is None else width
    if width < m:
        raise ValueError(f"gelu: width {width} is below the input's {m} columns; pass at least {m}")
    if fp8 and use_triton(x) and 0 < m and width <= MAX_ROW:
        return gelu_fp8_triton(x, width)
    out = F.gelu(x, approximate="tanh")
    if width > m:
        out = F.pad(out, (0, width - m))
    return quantize_rows(out) if fp8 else out
