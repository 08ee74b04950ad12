"""Flash attention for the long prefix: many query rows over many keys, grouped heads, a key mask.

pi0's block B (3 x 256 image tokens and 48 language tokens, 8 query heads on one key/value head
of dim 256) runs a bidirectional self-attention of ~800 queries over ~800 keys in each of 18
layers. :func:`flashrt.kernels.attention` is built for few query rows (the expert, ``tiny``):
at head dim 256 it tiles 32 x 32 and reached ~60 TFLOP/s there. This kernel is the FlashAttention-2
schedule for that shape: the ``h / g`` query heads sharing a key/value head are one sequence of
``(h / g) x T`` query rows (each key block is read once for all of them), a program holds a
64- or 128-row block of queries with its float32 accumulator and sweeps 64-key blocks through
one online softmax, and the key mask (``(N, T)``, language padding) is applied per block. Products run on
tensor cores in the inputs' dtype with float32 accumulation (full float32 for float32 inputs);
the probabilities are rounded to the value dtype before ``P @ V``, as flash kernels do. Rows with
every key masked out return zeros, like :func:`flashrt.kernels.attention`. Deterministic: one
program owns each output row, so eager calls and graph replays agree byte for byte.

:func:`fits` says which calls take it (CUDA, Triton, no autograd, power-of-two head dim from 32
to 256, at least :data:`MIN_ROWS` query rows per key/value head); the model routes every other
call to :func:`flashrt.kernels.attention` unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from flashrt.kernels import attention as few_row_attention
from flashrt.kernels.backend import sm_count, tl, triton, use_triton
from flashrt.kernels.grouped_attention import Rope, Segment
from flashrt.kernels.rotary import rotate

VERSION = 2
"""Bumped when this kernel's numerics or routing change: deployment digests name it (a capsule
made with another version is refused, as with ``flashrt.kernels.__version__``)."""

MIN_ROWS = 2048
"""Query rows per key/value head (``h / g`` x tokens) from which a call takes this kernel: pi0's
block B (8 x ~800); the expert's 8 x 50 rows and every ``tiny`` call stay on the few-row kernel."""


def _concat(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, context: Sequence[Segment]):
    """One key sequence of the context segments then the own keys (a copy; the long calls here
    have at most a short instruction in front)."""
    if not context:
        return k, v, mask
    segs = [*context, (k, v, mask)]
    ones = lambda t: torch.ones(t.shape[0], t.shape[2], dtype=torch.bool, device=t.device)  # noqa: E731
    masks = (
        None if all(m is None for _, _, m in segs) else torch.cat([ones(a) if m is None else m for a, _, m in segs], 1)
    )
    return torch.cat([s[0] for s in segs], 2), torch.cat([s[1] for s in segs], 2), masks


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
         context: Sequence[Segment] = ()) -> bool:  # fmt: skip
    """Whether :func:`attention` takes the call (else :func:`flashrt.kernels.attention` does)."""
    _, h, tq, d = q.shape
    extra = [t for s in context for t in s if t is not None] + ([] if mask is None else [mask])
    return (
        use_triton(q, k, v, *extra)
        and 32 <= d <= 256
        and not d & (d - 1)
        and h % k.shape[1] == 0
        and (h // k.shape[1]) * tq >= MIN_ROWS
        and q.dtype == k.dtype == v.dtype
        and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


if triton is not None:

    @triton.jit
    def _flash_kernel(
        q, k, v, mask, out,
        sq_n, sq_h, sq_t, sk_n, sk_g, sk_t, sv_n, sv_g, sv_t, sm_n, sm_t, so_n, so_t, so_h,
        TQ, TK, GROUP, KV_HEADS, scale,
        HAS_MASK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(1)
        n, g = pid // KV_HEADS, pid % KV_HEADS
        rows = tl.program_id(0) * BM + tl.arange(0, BM)  # rows of the group: head-major, then token
        live = rows < GROUP * TQ
        head = g * GROUP + rows // TQ
        tok = rows % TQ
        cols = tl.arange(0, D)
        qp = q + n.to(tl.int64) * sq_n + head[:, None] * sq_h + tok[:, None] * sq_t + cols[None, :]
        qb = tl.load(qp, mask=live[:, None], other=0.0)
        kbase = k + n.to(tl.int64) * sk_n + g * sk_g
        vbase = v + n.to(tl.int64) * sv_n + g * sv_g
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        for start in range(0, TK, BN):
            keys = start + tl.arange(0, BN)
            kin = keys < TK
            kb = tl.load(kbase + keys[:, None] * sk_t + cols[None, :], mask=kin[:, None], other=0.0)
            s = tl.dot(qb, tl.trans(kb), input_precision=PRECISION) * scale  # (BM, BN) float32, log2 units
            ok = kin
            if HAS_MASK:
                ok = ok & (tl.load(mask + n.to(tl.int64) * sm_n + keys * sm_t, mask=kin, other=0) != 0)
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no valid key yet
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vb = tl.load(vbase + keys[:, None] * sv_t + cols[None, :], mask=kin[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION)
            m_i = m_new
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # no valid key: zeros
        op = out + n.to(tl.int64) * so_n + tok[:, None] * so_t + head[:, None] * so_h + cols[None, :]
        tl.store(op, o.to(out.dtype.element_ty), mask=live[:, None])


def _tiles(d: int, itemsize: int, rows: int, sms: int) -> tuple[int, int, int, int]:
    """Launch shape ``(BM, BN, num_warps, num_stages)`` for ``rows`` query rows (all heads'
    blocks together) on ``sms`` SMs: 64 x 64 tiles in 16-bit dtypes, at head dim 256 as 128-row
    blocks of 8 warps where those still fill every SM (pi0 from batch 8), else as 64-row blocks
    of 4 warps in 3 stages (batch 1; docs/PERFORMANCE.md). float32 tiles shrink so the query block
    and two stages of key and value blocks stay within ~100 KB of shared memory (an H100 block has
    227 KB)."""
    if itemsize <= 2 and d > 128:
        return (128, 64, 8, 2) if triton.cdiv(rows, 128) >= sms else (64, 64, 4, 3)
    if itemsize <= 2 or d <= 64:
        return 64, 64, 8 if d > 64 else 4, 2
    return (64, 32, 8, 2) if d <= 128 else (32, 32, 8, 1)


def attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    context: Sequence[Segment] = (),
) -> torch.Tensor:
    """The kernel. Runs on CUDA, and on CPU tensors under Triton's interpreter (the tests)."""
    k, v, mask = _concat(k, v, mask, context)
    n, h, tq, d = q.shape
    g, tk = k.shape[1], k.shape[2]
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = q.new_empty((n, tq, h, d))
    m8 = q if mask is None else mask.view(torch.uint8)  # any tensor stands in for an absent mask
    sm = (0, 0) if mask is None else m8.stride()
    group = h // g
    block_m, block_n, warps, stages = _tiles(d, q.element_size(), n * h * tq, sm_count(q.device))
    grid = (triton.cdiv(group * tq, block_m), n * g)
    if n * tq:
        _flash_kernel[grid](
            q, k, v, m8, out, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *sm, *out.stride()[:3],
            tq, tk, group, g, math.log2(math.e) / math.sqrt(d),
            HAS_MASK=mask is not None, BM=block_m, BN=block_n, D=d,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    context: Sequence[Segment] = (),
    rope: Rope | None = None,
) -> torch.Tensor:
    """Softmax attention of ``q`` (N, h, Tq, d) over [context segments; own keys/values]
    (N, g, T, d) with bool key masks (N, T) (None: all valid), q and the own keys rotated by
    ``rope``'s tables where given: :func:`flashrt.kernels.attention`'s contract (returns
    (N, Tq, h, d)), through this kernel where :func:`fits` (rotated first), else through it."""
    if fits(q, k, v, mask, context):
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        return attention_triton(q, k, v, mask, context)
    return few_row_attention(q, k, v, mask, context, rope)
