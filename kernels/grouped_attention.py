"""Grouped-query attention over a context block and the queries' own block, no concatenation.

The policy's queries attend to keys/values of two sources that live in different buffers:
a context (instruction, history ring and newest frame: fixed during a chunk's 10 Euler steps)
and the tokens' own keys/values. The reference concatenates the two and calls
``scaled_dot_product_attention`` with a boolean mask (which rules out its fused paths); the
kernel streams both sources through one online softmax, and since all ``h / g`` query heads of a
key/value head share its keys, one program serves a whole group (rows = heads x tokens), so
each key block is read once per group. With at least as many programs as SMs (many slots) the
key blocks are narrower (32 keys) and the programs smaller (2 warps for 32 rows): more of them
fit on an SM (docs/PERFORMANCE.md has the before and after). Products run on tensor cores in the
inputs' dtype (bf16), in full float32 for float32 inputs. The output is written as
``(N, Tq, h, d)``: the layout the output projection reads. Rows with every key masked out
return zeros (SDPA: NaN).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from kernels.backend import tl, triton, use_triton


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    ctx_k: torch.Tensor | None = None,
    ctx_v: torch.Tensor | None = None,
    ctx_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference of :func:`attention` (concatenation + SDPA)."""
    if ctx_k is not None:
        n, tk = k.shape[0], k.shape[2]
        own = torch.ones(n, tk, dtype=torch.bool, device=k.device) if mask is None else mask
        ctx = torch.ones(n, ctx_k.shape[2], dtype=torch.bool, device=k.device) if ctx_mask is None else ctx_mask
        k, v, mask = torch.cat([ctx_k, k], 2), torch.cat([ctx_v, v], 2), torch.cat([ctx, own], 1)
    m = None if mask is None else mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


if triton is not None:

    @triton.jit
    def _source(
        acc, m_i, l_i, qb, k, v, mask, n, kvh, tk,
        sk_n, sk_g, sk_t, sv_n, sv_g, sv_t, sm_n, scale,
        HAS_MASK: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        dims = tl.arange(0, D)
        for start in range(0, tk, BN):
            cols = start + tl.arange(0, BN)
            inside = cols < tk
            kb = tl.load(
                k + n * sk_n + kvh * sk_g + cols[:, None] * sk_t + dims[None, :], mask=inside[:, None], other=0.0
            )
            s = tl.dot(qb, tl.trans(kb), input_precision=PRECISION) * scale  # (BM, BN), log2 units
            valid = inside
            if HAS_MASK:
                valid = valid & (tl.load(mask + n * sm_n + cols, mask=inside, other=0) != 0)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = tl.load(
                v + n * sv_n + kvh * sv_g + cols[:, None] * sv_t + dims[None, :], mask=inside[:, None], other=0.0
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _attention_kernel(
        q, k, v, mask, ck, cv, cmask, out,
        TQ, H, G, TK, TC, scale,
        sq_n, sq_h, sq_t, sk_n, sk_g, sk_t, sv_n, sv_g, sv_t, sm_n,
        sck_n, sck_g, sck_t, scv_n, scv_g, scv_t, scm_n,
        HAS_CTX: tl.constexpr, HAS_MASK: tl.constexpr, HAS_CMASK: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        pid_nk = tl.program_id(1)
        n = (pid_nk // (H // G)).to(tl.int64)  # G = h / g query heads per key/value head
        kvh = pid_nk % (H // G)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)  # (head in group, token)
        live = rows < G * TQ
        head = kvh * G + rows // TQ
        t = rows % TQ
        dims = tl.arange(0, D)
        qb = tl.load(
            q + n * sq_n + head[:, None] * sq_h + t[:, None] * sq_t + dims[None, :], mask=live[:, None], other=0.0
        )
        acc = tl.zeros((BM, D), dtype=tl.float32)
        m_i = tl.full((BM,), float("-inf"), tl.float32)
        l_i = tl.zeros((BM,), dtype=tl.float32)
        if HAS_CTX:
            acc, m_i, l_i = _source(
                acc, m_i, l_i, qb, ck, cv, cmask, n, kvh, TC,
                sck_n, sck_g, sck_t, scv_n, scv_g, scv_t, scm_n, scale, HAS_CMASK, BN, D, PRECISION,
            )  # fmt: skip
        acc, m_i, l_i = _source(
            acc, m_i, l_i, qb, k, v, mask, n, kvh, TK, sk_n, sk_g, sk_t, sv_n, sv_g, sv_t, sm_n, scale, HAS_MASK, BN, D,
            PRECISION,
        )  # fmt: skip
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        dst = out + ((n * TQ + t[:, None]) * H + head[:, None]) * D + dims[None, :]
        tl.store(dst, o.to(out.dtype.element_ty), mask=live[:, None])


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (Triton's CPU interpreter: an H100's 132)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    ctx_k: torch.Tensor | None = None,
    ctx_v: torch.Tensor | None = None,
    ctx_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernel (called by :func:`attention` on CUDA)."""
    n, h, tq, d = q.shape
    g, tk = k.shape[1], k.shape[2]
    if d & (d - 1) or d < 16 or any(x is not None and x.stride(-1) != 1 for x in (q, k, v, ctx_k, ctx_v)):
        return attention_reference(q, k, v, mask, ctx_k, ctx_v, ctx_mask)
    out = q.new_empty((n, tq, h, d))
    group = h // g
    bm = max(16, min(64 if d <= 128 else 32, triton.next_power_of_2(group * tq)))
    grid = (triton.cdiv(group * tq, bm), n * g)
    bn, warps = (64, 4) if d <= 128 else (32, 8)
    if d <= 64 and grid[0] * grid[1] >= _sm_count(q.device):  # throughput-bound: many programs
        bn, warps = 32, 2 if bm <= 32 else 4  # the fastest launch shape at 1024 and 4096 slots on an H200
    has_ctx = ctx_k is not None
    ck, cv = (ctx_k, ctx_v) if has_ctx else (k, v)
    u8 = lambda m: None if m is None else m.view(torch.uint8)  # noqa: E731
    m8, cm8 = u8(mask), u8(ctx_mask)
    if n * tq:
        _attention_kernel[grid](
            q, k, v, q if m8 is None else m8, ck, cv, q if cm8 is None else cm8, out,
            tq, h, group, tk, ck.shape[2] if has_ctx else 0, math.log2(math.e) / math.sqrt(d),
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], 0 if m8 is None else m8.stride(0),
            *ck.stride()[:3], *cv.stride()[:3], 0 if cm8 is None else cm8.stride(0),
            HAS_CTX=has_ctx, HAS_MASK=m8 is not None, HAS_CMASK=cm8 is not None,
            BM=bm, BN=bn, D=d, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=warps,
        )  # fmt: skip
    return out


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    ctx_k: torch.Tensor | None = None,
    ctx_v: torch.Tensor | None = None,
    ctx_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of queries over [context; own] keys/values.

    Args:
        q: ``(N, h, Tq, d)`` queries (any strides, unit last stride).
        k, v: ``(N, g, Tk, d)`` the queries' own keys/values; ``h`` a multiple of ``g``.
        mask: ``(N, Tk)`` bool, True where an own key may be attended (None: all).
        ctx_k, ctx_v: optional ``(N, g, Tc, d)`` context keys/values, attended before the own.
        ctx_mask: ``(N, Tc)`` bool for the context (None: all).

    Returns:
        ``(N, Tq, h, d)`` (a view with that shape from the reference).
    """
    n, h, _, d = q.shape
    if k.shape[0] != n or k.shape[3] != d or v.shape != k.shape or h % k.shape[1]:
        raise ValueError(f"attention: q {tuple(q.shape)} does not fit k {tuple(k.shape)} / v {tuple(v.shape)}")
    if (ctx_k is None) != (ctx_v is None):
        raise ValueError("attention: give both ctx_k and ctx_v, or neither")
    if ctx_k is not None and (ctx_k.shape[:2] != k.shape[:2] or ctx_k.shape[3] != d or ctx_v.shape != ctx_k.shape):
        raise ValueError(f"attention: context {tuple(ctx_k.shape)} does not fit k {tuple(k.shape)}")
    extra = [x for x in (mask, ctx_k, ctx_v, ctx_mask) if x is not None]
    if use_triton(q, k, v, *extra):
        return attention_triton(q, k, v, mask, ctx_k, ctx_v, ctx_mask)
    return attention_reference(q, k, v, mask, ctx_k, ctx_v, ctx_mask)
