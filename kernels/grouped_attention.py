"""Grouped-query attention over context segments and the queries' own block, no concatenation.

The policy's queries attend to keys/values that live in different buffers: context segments
(instruction, history ring and newest frame: fixed during a chunk's 10 Euler steps) and the
tokens' own keys/values. The reference concatenates them and calls
``scaled_dot_product_attention`` with a boolean mask (which rules out its fused paths); the
kernel reads up to three context segments and the own block as one sequence of keys through one
online softmax: a block of keys may span segments, each key's row is looked up in its own buffer
with that buffer's strides and mask, so a 65-token frame does not cost a block of its own for
its last key. Since all ``h / g`` query heads of a key/value head share its keys, one program
serves a whole group (rows = heads x tokens), so each key block is read once per group. With at
least as many programs as SMs (many slots) the key blocks are narrower (32 keys) and the
programs smaller (2 warps for 32 rows): more of them fit on an SM (docs/PERFORMANCE.md has the
before and after). Products run on tensor cores in the inputs' dtype (bf16), in full float32 for
float32 inputs. The output is written as ``(N, Tq, h, d)``: the layout the output projection
reads. Rows with every key masked out return zeros (SDPA: NaN).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kernels.backend import tl, triton, use_triton

Segment = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""A context segment: keys and values ``(N, g, T, d)`` and a bool mask ``(N, T)`` (None: all
keys valid; any strides, e.g. an expanded per-slot flag)."""

MAX_SEGMENTS = 3  # context segments one kernel launch reads in place; more are concatenated first


def _concat(context: Sequence[Segment]) -> Segment:
    """One segment holding ``context``'s keys, values and masks in order."""
    cat = lambda i: torch.cat([seg[i] for seg in context], 2)  # noqa: E731
    if all(m is None for _, _, m in context):
        return cat(0), cat(1), None
    ones = lambda k: torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)  # noqa: E731
    return cat(0), cat(1), torch.cat([ones(k) if m is None else m for k, _, m in context], 1)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    context: Sequence[Segment] = (),
) -> torch.Tensor:
    """Torch reference of :func:`attention` (concatenation + SDPA)."""
    if context:
        k, v, mask = _concat([*context, (k, v, mask)])
    m = None if mask is None else mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


if triton is not None:

    @triton.jit
    def _select(rows, seg, i: tl.constexpr, base, n, kvh, local, s_n, s_g, s_t):
        """Row pointers (BN,) with the keys of source ``i`` (``seg == i``) pointed into ``base``."""
        return tl.where(seg == i, base + n * s_n + kvh * s_g + local * s_t, rows)

    @triton.jit
    def _valid(valid, seg, i: tl.constexpr, mask, n, local, sm_n, sm_t):
        """``valid`` and, for the keys of source ``i``, that source's mask."""
        return valid & (tl.load(mask + n * sm_n + local * sm_t, mask=valid & (seg == i), other=1) != 0)

    @triton.jit
    def _attention_kernel(
        q, out, TQ, H, G, scale, sq_n, sq_h, sq_t,
        k0, v0, m0, sk0_n, sk0_g, sk0_t, sv0_n, sv0_g, sv0_t, sm0_n, sm0_t,
        k1, v1, m1, e1, sk1_n, sk1_g, sk1_t, sv1_n, sv1_g, sv1_t, sm1_n, sm1_t,
        k2, v2, m2, e2, sk2_n, sk2_g, sk2_t, sv2_n, sv2_g, sv2_t, sm2_n, sm2_t,
        k3, v3, m3, e3, sk3_n, sk3_g, sk3_t, sv3_n, sv3_g, sv3_t, sm3_n, sm3_t, TK,
        SOURCES: tl.constexpr, MASKED: tl.constexpr, ALIGNED: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # Sources 0 .. SOURCES-1 (context segments, then the own block) form one sequence of TK
        # keys; source i starts at key e_i (e_0 = 0). A block of BN keys may span sources: each
        # key's row is looked up in its own source (a selected pointer, whose alignment Triton 3.9
        # no longer infers, so ALIGNED states it). Bit i of MASKED: source i has a mask.
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
        for start in range(0, TK, BN):
            cols = start + tl.arange(0, BN)
            inside = cols < TK
            seg = (cols >= e1).to(tl.int32)
            if SOURCES > 2:
                seg += (cols >= e2).to(tl.int32)
            if SOURCES > 3:
                seg += (cols >= e3).to(tl.int32)
            kr = k0 + n * sk0_n + kvh * sk0_g + cols * sk0_t
            vr = v0 + n * sv0_n + kvh * sv0_g + cols * sv0_t
            kr = _select(kr, seg, 1, k1, n, kvh, cols - e1, sk1_n, sk1_g, sk1_t)
            vr = _select(vr, seg, 1, v1, n, kvh, cols - e1, sv1_n, sv1_g, sv1_t)
            if SOURCES > 2:
                kr = _select(kr, seg, 2, k2, n, kvh, cols - e2, sk2_n, sk2_g, sk2_t)
                vr = _select(vr, seg, 2, v2, n, kvh, cols - e2, sv2_n, sv2_g, sv2_t)
            if SOURCES > 3:
                kr = _select(kr, seg, 3, k3, n, kvh, cols - e3, sk3_n, sk3_g, sk3_t)
                vr = _select(vr, seg, 3, v3, n, kvh, cols - e3, sv3_n, sv3_g, sv3_t)
            if ALIGNED:  # every key/value row starts on 16 bytes: vector loads, pipelined (cp.async)
                kr = tl.multiple_of(kr, 16)
                vr = tl.multiple_of(vr, 16)
            kb = tl.load(kr[:, None] + dims[None, :], mask=inside[:, None], other=0.0)
            s = tl.dot(qb, tl.trans(kb), input_precision=PRECISION) * scale  # (BM, BN), log2 units
            valid = inside
            if MASKED & 1:
                valid = _valid(valid, seg, 0, m0, n, cols, sm0_n, sm0_t)
            if MASKED & 2:
                valid = _valid(valid, seg, 1, m1, n, cols - e1, sm1_n, sm1_t)
            if MASKED & 4:
                valid = _valid(valid, seg, 2, m2, n, cols - e2, sm2_n, sm2_t)
            if MASKED & 8:
                valid = _valid(valid, seg, 3, m3, n, cols - e3, sm3_n, sm3_t)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = tl.load(vr[:, None] + dims[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION)
            m_i = m_new
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
    context: Sequence[Segment] = (),
) -> torch.Tensor:
    """The Triton kernel (called by :func:`attention` on CUDA)."""
    n, h, tq, d = q.shape
    g = k.shape[1]
    if len(context) > MAX_SEGMENTS:
        context = [_concat(context)]
    sources = [*context, (k, v, mask)]
    if d & (d - 1) or d < 16 or any(x.stride(-1) != 1 for x in (q, *(t for s in sources for t in s[:2]))):
        return attention_reference(q, k, v, mask, context)
    out = q.new_empty((n, tq, h, d))
    group = h // g
    bm = max(16, min(64 if d <= 128 else 32, triton.next_power_of_2(group * tq)))
    grid = (triton.cdiv(group * tq, bm), n * g)
    bn, warps = (128 if d <= 64 and bm > 32 else 64, 4) if d <= 128 else (32, 8)  # few programs: wide blocks
    if d <= 64 and grid[0] * grid[1] >= _sm_count(q.device):  # throughput-bound: many programs
        bn, warps = 32, 2 if bm <= 32 else 4  # the fastest launch shape at 1024 and 4096 slots on an H200
    args, masked, start = [], 0, 0
    for i, (sk, sv, sm) in enumerate([*sources, *[sources[-1]] * (MAX_SEGMENTS + 1 - len(sources))]):
        m8 = q if sm is None else sm.view(torch.uint8)  # any tensor stands in for an absent mask
        masked |= (sm is not None and i < len(sources)) << i
        sm_strides = (0, 0) if sm is None else m8.stride()
        args += [sk, sv, m8, *([start] if i else []), *sk.stride()[:3], *sv.stride()[:3], *sm_strides]
        start += sk.shape[2] if i < len(sources) else 0
    rows = [x for src in sources for x in src[:2]]
    aligned = all(
        x.data_ptr() % 16 == 0 and all(st * x.element_size() % 16 == 0 for st in x.stride()[:3]) for x in rows
    )
    if n * tq:
        _attention_kernel[grid](
            q, out, tq, h, group, math.log2(math.e) / math.sqrt(d), *q.stride()[:3], *args, start,
            SOURCES=len(sources), MASKED=masked, ALIGNED=aligned, BM=bm, BN=bn, D=d,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps,
        )  # fmt: skip
    return out


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    context: Sequence[Segment] = (),
) -> torch.Tensor:
    """Softmax attention of queries over [context segments; own] keys/values.

    Args:
        q: ``(N, h, Tq, d)`` queries (any strides, unit last stride).
        k, v: ``(N, g, Tk, d)`` the queries' own keys/values; ``h`` a multiple of ``g``.
        mask: ``(N, Tk)`` bool, True where an own key may be attended (None: all).
        context: segments ``(k_i, v_i, mask_i)`` with ``(N, g, T_i, d)`` keys/values and an
            ``(N, T_i)`` bool mask or None, attended before the own keys, in order; each is read
            in place (up to three per launch, more are concatenated first).

    Returns:
        ``(N, Tq, h, d)`` (a view with that shape from the reference).
    """
    n, h, _, d = q.shape
    if k.shape[0] != n or k.shape[3] != d or v.shape != k.shape or h % k.shape[1]:
        raise ValueError(f"attention: q {tuple(q.shape)} does not fit k {tuple(k.shape)} / v {tuple(v.shape)}")
    for i, (ck, cv, cm) in enumerate(context):
        if ck.shape[:2] != k.shape[:2] or ck.shape[3] != d or cv.shape != ck.shape:
            raise ValueError(f"attention: context segment {i} {tuple(ck.shape)} does not fit k {tuple(k.shape)}")
        if cm is not None and cm.shape != ck.shape[:1] + ck.shape[2:3]:
            want = (ck.shape[0], ck.shape[2])
            raise ValueError(f"attention: context segment {i}'s mask is {tuple(cm.shape)}; it must be {want}")
    masks = [("the own mask", mask)] + [(f"context segment {i}'s mask", cm) for i, (_, _, cm) in enumerate(context)]
    for what, m in masks:
        if m is not None and m.dtype != torch.bool:  # SDPA would read a float mask as an additive bias
            raise ValueError(f"attention: {what} must be bool (True = may attend), got {m.dtype}")
    extra = [x for seg in context for x in seg if x is not None] + ([] if mask is None else [mask])
    if use_triton(q, k, v, *extra):
        return attention_triton(q, k, v, mask, context)
    return attention_reference(q, k, v, mask, context)
