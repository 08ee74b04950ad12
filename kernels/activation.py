"""The gated-MLP activation :func:`gelu_mul`, ``gelu_tanh(gate) * up`` from the fused gate/up
projection: the projection writes ``(..., 2m)`` with the gate in the first half; the kernel reads
both halves once and writes ``(..., m)``, where the reference takes a chunk, a GELU and a product
(three passes over memory). The plain MLP's ``gelu_tanh(x W^T + b)`` runs in its projection
(:func:`flashrt.kernels.matmul.linear_gelu`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashrt.kernels.backend import tl, triton, use_triton


def gelu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Torch reference: ``gelu(gate, approximate="tanh") * up``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


if triton is not None:

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


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``gate_up (..., 2m)`` (gate first) -> ``(..., m)``."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gelu_mul needs an even last dimension (gate and up halves), got {gate_up.shape[-1]}")
    if use_triton(gate_up):
        return gelu_mul_triton(gate_up)
    return gelu_mul_reference(gate_up)
