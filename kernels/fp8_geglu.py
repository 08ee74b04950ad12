"""The FP8 gate/up projection with the GeGLU in its epilogue: ``gelu_tanh(x W_g^T) * (x W_u^T)``
of e4m3 rows and an e4m3 gate/up weight ``(2m, k)`` (gate rows first), written once as
``(rows, m)`` bf16.

``torch._scaled_mm`` has no such epilogue, so an FP8 Gemma layer writes its ``(rows, 2m)`` bf16
product and :func:`flashrt.kernels.activation.gelu_mul` reads it back: at pi0 batch 64 that trip
is 3.4 GB a layer (26.6 ms of the step, ``docs/FP8.md``). Here a program holds a gate tile and
the up tile of the same channels, so only the ``(rows, m)`` product leaves: half the bytes
written, none read back. The per-token quantisation of that product still needs the whole row,
so :func:`flashrt.kernels.fp8.quantize_rows` follows as its own pass.

The epilogue rounds the gate and the up product to bf16 before the GeGLU, as the unfused path's
bf16 GEMM output is, and takes :func:`flashrt.kernels.activation.geglu`: the same values as that
path up to the order in which the tensor cores sum ``k``.
"""

from __future__ import annotations

import torch

from flashrt.kernels.backend import tl, triton, use_triton
from flashrt.kernels.fp8 import E4M3, Fp8Weight, Rows, supported

TILE = {"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3}
"""The launch: a program a 128-row by 128-channel block of the output (a 128 x 256 product:
the gate and the up tiles), ``k`` in 128-value steps over 3 pipelined stages (48 KB of shared
memory each, beside the output tile's 32 KB), programs ordered in groups of 8 row blocks so the
weight tiles they share stay in L2."""

MIN_ROWS = 8192
"""Fewest rows :func:`takes` gives the fused kernel: where the ``(rows, 2m)`` product's trip
is a large share of the projection (the prefix from 8 to 10 slots of pi0 on). Below, cuBLAS's
GEMM and the separate GeGLU stay."""


def takes(rows: Rows, weight: Fp8Weight, dtype: torch.dtype) -> bool:
    """Whether an FP8 gate/up projection of ``rows`` in ``dtype`` runs as :func:`gate_up_geglu`:
    bf16 activations on an FP8 GPU under Triton, at least :data:`MIN_ROWS` rows. The policy,
    apart from the kernel: callers that take neither keep the unfused path."""
    q, s = rows
    n_rows = q.numel() // max(q.shape[-1], 1)
    return (
        dtype == torch.bfloat16
        and n_rows >= MIN_ROWS
        and supported(q.device)
        and use_triton(q, s, weight.data, weight.scale)
    )


if triton is not None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    from flashrt.kernels.activation import geglu

    @triton.jit
    def _gate_up_geglu_kernel(
        x_desc, w_desc, out_desc, sx, sw, M, m, K,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        # Program (i, j) in grouped order: rows i*BM.., gate channels j*BN.. and the up
        # channels m + j*BN..; k swept by the tensor-memory descriptors (out of bounds reads
        # zeros, out of bounds writes are dropped), e4m3 x e4m3 into two float32 tiles.
        pid = tl.program_id(0)
        blocks_m, blocks_n = tl.cdiv(M, BM), tl.cdiv(m, BN)
        group = pid // (GROUP_M * blocks_n)
        first = group * GROUP_M
        size = tl.minimum(blocks_m - first, GROUP_M)
        bm = first + (pid % (GROUP_M * blocks_n)) % size
        bn = (pid % (GROUP_M * blocks_n)) // size
        rows, cols = bm * BM + tl.arange(0, BM), bn * BN + tl.arange(0, BN)
        gate = tl.zeros((BM, BN), dtype=tl.float32)
        up = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            x = x_desc.load([bm * BM, k0])
            gate = tl.dot(x, tl.trans(w_desc.load([bn * BN, k0])), gate)
            up = tl.dot(x, tl.trans(w_desc.load([m + bn * BN, k0])), up)
        s_x = tl.load(sx + rows, mask=rows < M, other=0.0)[:, None]
        s_g = tl.load(sw + cols, mask=cols < m, other=0.0)[None, :]
        s_u = tl.load(sw + m + cols, mask=cols < m, other=0.0)[None, :]
        g = (gate * s_x * s_g).to(tl.bfloat16).to(tl.float32)  # as the bf16 GEMM output rounds
        u = (up * s_x * s_u).to(tl.bfloat16).to(tl.float32)
        out_desc.store([bm * BM, bn * BN], geglu(g, u, tl.bfloat16).to(tl.bfloat16))


def gate_up_geglu(rows: Rows, weight: Fp8Weight) -> torch.Tensor:
    """``gelu_mul(linear_rows(rows, weight))`` in one Triton kernel: the GeGLU of the gate and
    up products of e4m3 ``rows`` (:data:`flashrt.kernels.fp8.Rows`, ``(..., k)``) and the e4m3
    gate/up ``weight`` (``(2m, k)``, gate first) -> bf16 ``(..., m)``.

    Args:
        rows: activations quantised per row (a norm's ``fp8=True`` output).
        weight: the gate/up projection, quantised per output channel.

    Returns:
        The GeGLU output, bf16, rounded once from the float32 product of the bf16-rounded gate
        and up values.

    Raises:
        ValueError: rows that are not e4m3 of the weight's ``k``, a weight of odd ``n``, or a
            ``k`` or ``m`` that is not a multiple of 16 (the tensor-memory descriptors' rows are
            16-byte aligned).
    """
    q, s = rows
    n, k = weight.data.shape
    if q.dtype != E4M3 or q.shape[-1] != k or weight.data.dtype != E4M3:
        raise ValueError(
            f"gate_up_geglu: rows must be e4m3 (..., {k}) for a weight of k = {k}, got {q.dtype} {tuple(q.shape)} "
            f"and a {weight.data.dtype} weight"
        )
    if n % 2 or k % 16 or (n // 2) % 16:
        raise ValueError(
            f"gate_up_geglu: the gate/up weight is ({n}, {k}); it needs an even n, and k and n / 2 in multiples of 16"
        )
    m = n // 2
    q2 = q.reshape(-1, k)
    if q2.stride(-1) != 1 or q2.stride(0) != k:
        q2 = q2.contiguous()
    rows_n = q2.shape[0]
    out = torch.empty((*q.shape[:-1], m), dtype=torch.bfloat16, device=q.device)
    if rows_n == 0 or m == 0:
        return out
    t = TILE
    bm, bn, bk = t["BM"], t["BN"], t["BK"]
    grid = (triton.cdiv(rows_n, bm) * triton.cdiv(m, bn),)
    _gate_up_geglu_kernel[grid](
        TensorDescriptor.from_tensor(q2, [bm, bk]), TensorDescriptor.from_tensor(weight.data, [bn, bk]),
        TensorDescriptor.from_tensor(out.view(rows_n, m), [bm, bn]), s.reshape(-1), weight.scale, rows_n, m, k,
        BM=bm, BN=bn, BK=bk, GROUP_M=t["GROUP_M"], num_warps=t["num_warps"], num_stages=t["num_stages"],
    )  # fmt: skip
    return out
