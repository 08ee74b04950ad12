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
before and after). With few query rows (a group of at most 32) and few slots, the rows are split
into 16-row programs, so the group's heads run on separate SMs, and each reads all its keys (up
to a 32 KB block) at once. At head dims above 128 (pi0's 256) each source instead starts on a
key block of its own and is swept by a loop of its own, whose rows are one buffer's: a partial
block per source costs less there than looking each key's row up in its source. There, with
at most as many programs as SMs, the queries and each key block are held as their two halves,
the product over the second half accumulated onto the first's; and from a few slots on a
program holds 64 or 128 query rows: each program of a group reads all of the group's keys, so
taller programs read them fewer times (docs/PERFORMANCE.md). With few
programs and many key blocks (pi0's expert at one slot: 13 programs, 15 blocks of 64 keys each)
the keys are split over more programs (two blocks each at head dim 256), whose softmax states a
second kernel merges. With 3 or more key blocks after the last per-token-masked source, those
blocks are swept by a second loop without mask loads, and a mask that is one flag per slot (an
expanded ``(N, 1)``, stride 0) is read once per program rather than per key. Products run on
tensor cores in the inputs' dtype (bf16), in full float32 for float32 inputs. The output is
written as ``(N, Tq, h, d)``: the layout the output projection reads. Rows with every key masked
out return zeros (SDPA: NaN).

With ``rope`` tables, the queries and own keys arrive unrotated (views of the q/k/v projection,
:func:`flashrt.kernels.rotary.split_heads`) and are rotated here: where the own keys are swept by
a loop of their own (head dims above 128, :func:`rotates_on_load`) the kernel rotates each query
row and own key row as it loads it, with :func:`flashrt.kernels.rotary.rotated`'s rounding, so no
rotary kernel runs between the projection and the attention (pi0's expert: one a layer, 180 a
step); elsewhere they are rotated by torch ops first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from flashrt.kernels.backend import dependent_launch, layout_problem, sm_count, tl, triton, use_triton
from flashrt.kernels.rotary import rotate

Segment = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""A context segment: keys and values ``(N, g, T, d)`` and a bool mask ``(N, T)`` (None: all
keys valid; any strides, e.g. an expanded per-slot flag)."""

MAX_SEGMENTS = 3  # context segments one kernel launch reads in place; more are concatenated first
PER_SOURCE_DIM = 128  # head dims above this sweep each source by a loop of its own
COMBINE_DIMS = 64  # head dims one program of the split-merge kernel takes


Rope = tuple[torch.Tensor, torch.Tensor]
"""cos and sin tables ``(N, 1, T, d/2)`` in the queries' dtype for the queries' T tokens
(:func:`flashrt.kernels.rotary.rope_tables`)."""


def rotates_on_load(d: int) -> bool:
    """Whether the Triton kernel rotates queries and own keys as it loads them at head dim ``d``:
    where the own keys are swept by a loop of their own, so a loaded key row is a token's row.
    Elsewhere :func:`attention`'s ``rope`` costs torch ops (a caller rotates with
    :func:`flashrt.kernels.qkv_rope` instead)."""
    return d > PER_SOURCE_DIM


def _split_blocks(d: int) -> int:
    """Fewest key blocks a program of a split call sweeps: at head dim 256 a block of 64 keys is
    4 times the work of a 32-key block at 128, so two blocks a program suffice."""
    return 4 if d <= 128 else 2


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
    rope: Rope | None = None,
) -> torch.Tensor:
    """Torch reference of :func:`attention` (rotation, concatenation + SDPA)."""
    if rope is not None:
        q, k = rotate(q, *rope), rotate(k, *rope)
    if context:
        k, v, mask = _concat([*context, (k, v, mask)])
    m = None if mask is None else mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


if triton is not None:
    from flashrt.kernels.backend import inputs_ready
    from flashrt.kernels.rotary import rotated

    @triton.jit
    def _halves(rows, tokens, live, cs, sn, sc_t, ROPE: tl.constexpr, D: tl.constexpr):
        """The two halves (R, D/2) of the rows at pointers ``rows`` (R,), zeros where not
        ``live``; with ROPE each row rotated by its token's row of the cos / sin tables
        (``tokens`` (R,), table rows ``sc_t`` apart)."""
        half = tl.arange(0, D // 2)
        m = live[:, None]
        a = tl.load(rows[:, None] + half[None, :], mask=m, other=0.0)
        b = tl.load(rows[:, None] + D // 2 + half[None, :], mask=m, other=0.0)
        if ROPE:
            at = tokens[:, None] * sc_t + half[None, :]
            a, b = rotated(a, b, tl.load(cs + at, mask=m, other=0.0), tl.load(sn + at, mask=m, other=0.0))
        return a, b

    @triton.jit
    def _joined(a, b, R: tl.constexpr, D: tl.constexpr):
        """Rows (R, D) whose halves are ``a`` and ``b`` (R, D/2)."""
        return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (R, D))

    @triton.jit
    def _row(rows, seg, i: tl.constexpr, base, local, s_t):
        """Row pointers (BN,) with the keys of source ``i`` (``seg == i``) pointed into ``base``."""
        return tl.where(seg == i, base + local * s_t, rows)

    @triton.jit
    def _token_mask(valid, seg, i: tl.constexpr, mask, local, s_t):
        """``valid`` and, for the keys of source ``i``, that source's per-token mask."""
        return valid & (tl.load(mask + local * s_t, mask=valid & (seg == i), other=1) != 0)

    @triton.jit
    def _sweep(
        acc, m_i, l_i, q0, q1, lo, hi, TK, scale,
        k0, v0, m0, f0, sk0, sv0, sm0,
        k1, v1, m1, f1, e1, sk1, sv1, sm1,
        k2, v2, m2, f2, e2, sk2, sv2, sm2,
        k3, v3, m3, f3, e3, sk3, sv3, sm3, cs, sn, sc_t,
        SOURCES: tl.constexpr, TOKENS: tl.constexpr, FLAGS: tl.constexpr, ALIGNED: tl.constexpr,
        HALVES: tl.constexpr, ROPE: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # Keys lo .. hi of the sources' one sequence through the online softmax (with HALVES the
        # queries come as their two halves q0, q1 and each key block is read as its halves, so
        # a rotation never joins them; else q0 is the queries). k_i / v_i / m_i:
        # source i's rows and mask of this program's slot and key/value head; it starts at key
        # e_i (e_0 = 0). Bit i of TOKENS: load source i's per-token mask here; of FLAGS: source
        # i's mask is one per-slot flag, f_i, loaded once by the caller. With ROPE (one source,
        # the own keys: key i is token i) each key row is rotated by the tables cs / sn.
        dims = tl.arange(0, D)
        for start in range(lo, hi, BN):
            cols = start + tl.arange(0, BN)
            inside = cols < TK
            kr, vr = k0 + cols * sk0, v0 + cols * sv0
            seg = tl.zeros((BN,), dtype=tl.int32)
            if SOURCES > 1:
                seg = (cols >= e1).to(tl.int32)
            if SOURCES > 2:
                seg += (cols >= e2).to(tl.int32)
            if SOURCES > 3:
                seg += (cols >= e3).to(tl.int32)
            if SOURCES > 1:
                kr = _row(kr, seg, 1, k1, cols - e1, sk1)
                vr = _row(vr, seg, 1, v1, cols - e1, sv1)
            if SOURCES > 2:
                kr = _row(kr, seg, 2, k2, cols - e2, sk2)
                vr = _row(vr, seg, 2, v2, cols - e2, sv2)
            if SOURCES > 3:
                kr = _row(kr, seg, 3, k3, cols - e3, sk3)
                vr = _row(vr, seg, 3, v3, cols - e3, sv3)
            if ALIGNED:  # every key/value row starts on 16 bytes: vector loads, pipelined (cp.async)
                kr = tl.multiple_of(kr, 16)
                vr = tl.multiple_of(vr, 16)
            if HALVES:  # the product over the second half accumulates onto the first's
                ka, kb = _halves(kr, cols, inside, cs, sn, sc_t, ROPE, D)
                s = tl.dot(q0, tl.trans(ka), input_precision=PRECISION)
                s = tl.dot(q1, tl.trans(kb), s, input_precision=PRECISION)
            elif ROPE:
                ka, kb = _halves(kr, cols, inside, cs, sn, sc_t, True, D)
                s = tl.dot(q0, tl.trans(_joined(ka, kb, BN, D)), input_precision=PRECISION)
            else:
                s = tl.dot(q0, tl.trans(tl.load(kr[:, None] + dims[None, :], mask=inside[:, None], other=0.0)),
                           input_precision=PRECISION)  # fmt: skip
            s = s * scale  # (BM, BN), log2 units
            valid = inside
            if TOKENS & 1:
                valid = _token_mask(valid, seg, 0, m0, cols, sm0)
            if TOKENS & 2:
                valid = _token_mask(valid, seg, 1, m1, cols - e1, sm1)
            if TOKENS & 4:
                valid = _token_mask(valid, seg, 2, m2, cols - e2, sm2)
            if TOKENS & 8:
                valid = _token_mask(valid, seg, 3, m3, cols - e3, sm3)
            if FLAGS & 1:
                valid = valid & ((seg != 0) | f0)
            if FLAGS & 2:
                valid = valid & ((seg != 1) | f1)
            if FLAGS & 4:
                valid = valid & ((seg != 2) | f2)
            if FLAGS & 8:
                valid = valid & ((seg != 3) | f3)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = tl.load(vr[:, None] + dims[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _flag(m, FLAGS: tl.constexpr, i: tl.constexpr):
        """Source ``i``'s per-slot flag (True when its mask is per token or absent)."""
        if FLAGS & (1 << i):
            return tl.load(m) != 0
        return True

    @triton.jit
    def _one_source(
        acc, m_i, l_i, q0, q1, lo, hi, start, length, scale, k, v, m, f, sk, sv, sm, cs, sn, sc_t,
        TOKENS: tl.constexpr, FLAGS: tl.constexpr, ALIGNED: tl.constexpr, HALVES: tl.constexpr,
        ROPE: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """The keys of one source, which starts at key ``start`` of the block-padded sequence,
        that fall in this program's keys lo .. hi: a sweep whose rows are one buffer's (read as
        halves with HALVES), rotated as they load with ROPE. Rotated rows joined whole are swept
        in half-width blocks: a block's halves, tables and joined rows are held at once."""
        a = tl.maximum(lo - start, 0)
        b = tl.minimum(hi - start, length)
        return _sweep(
            acc, m_i, l_i, q0, q1, a, b, length, scale, k, v, m, f, sk, sv, sm,
            k, v, m, f, length, sk, sv, sm, k, v, m, f, length, sk, sv, sm, k, v, m, f, length, sk, sv, sm,
            cs, sn, sc_t, 1, TOKENS, FLAGS, ALIGNED, HALVES, ROPE, BN // 2 if ROPE and not HALVES else BN, D, PRECISION,
        )  # fmt: skip

    @triton.jit
    def _attention_kernel(
        q, out, part, TQ, H, G, scale, sq_n, sq_h, sq_t,
        k0, v0, m0, sk0_n, sk0_g, sk0_t, sv0_n, sv0_g, sv0_t, sm0_n, sm0_t,
        k1, v1, m1, e1, sk1_n, sk1_g, sk1_t, sv1_n, sv1_g, sv1_t, sm1_n, sm1_t,
        k2, v2, m2, e2, sk2_n, sk2_g, sk2_t, sv2_n, sv2_g, sv2_t, sm2_n, sm2_t,
        k3, v3, m3, e3, sk3_n, sk3_g, sk3_t, sv3_n, sv3_g, sv3_t, sm3_n, sm3_t, TK, TM, CHUNK,
        n0, n1, n2, n3, cs, sn, sc_n, sc_t,
        SOURCES: tl.constexpr, TOKENS: tl.constexpr, FLAGS: tl.constexpr, ALIGNED: tl.constexpr,
        TWO_LOOPS: tl.constexpr, PER_SOURCE: tl.constexpr, HALVES: tl.constexpr, ROPE: tl.constexpr,
        SPLIT: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, GDC: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # Sources 0 .. SOURCES-1 (context segments, then the own block) form one sequence of TK
        # keys. With TWO_LOOPS, keys below TM (a multiple of BN) are swept with the per-token
        # masks and the rest by a second loop without them; else one loop loads them all. With
        # PER_SOURCE, each source (n_i keys) starts on a block of its own, at key e_i of a
        # sequence of TK padded keys, and is swept by a loop of its own.
        # Program (i, j, s) takes keys s*CHUNK .. (s+1)*CHUNK; with SPLIT its softmax state
        # (acc, max, sum) goes to ``part`` for _combine_kernel, else the output to ``out``.
        # With ROPE (PER_SOURCE only) the queries and the own keys are rotated as they are
        # loaded, by the slot's rows of the cos / sin tables cs / sn (token t at row t). With
        # HALVES (PER_SOURCE only) queries and key blocks are held as their two halves.
        inputs_ready(GDC)  # every input is an earlier kernel's output
        pid_nk = tl.program_id(1)
        n = (pid_nk // (H // G)).to(tl.int64)  # G = h / g query heads per key/value head
        kvh = pid_nk % (H // G)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)  # (head in group, token)
        live = rows < G * TQ
        head = kvh * G + rows // TQ
        t = rows % TQ
        dims = tl.arange(0, D)
        cs, sn = cs + n * sc_n, sn + n * sc_n
        q_rows = q + n * sq_n + head * sq_h + t * sq_t
        if HALVES:  # the queries as halves: rotated ones are never joined
            q0, q1 = _halves(q_rows, t, live, cs, sn, sc_t, ROPE, D)
        elif ROPE:
            qa, qb = _halves(q_rows, t, live, cs, sn, sc_t, True, D)
            q0 = _joined(qa, qb, BM, D)
            q1 = q0
        else:
            q0 = tl.load(q_rows[:, None] + dims[None, :], mask=live[:, None], other=0.0)
            q1 = q0
        k0, v0, m0 = k0 + n * sk0_n + kvh * sk0_g, v0 + n * sv0_n + kvh * sv0_g, m0 + n * sm0_n
        k1, v1, m1 = k1 + n * sk1_n + kvh * sk1_g, v1 + n * sv1_n + kvh * sv1_g, m1 + n * sm1_n
        k2, v2, m2 = k2 + n * sk2_n + kvh * sk2_g, v2 + n * sv2_n + kvh * sv2_g, m2 + n * sm2_n
        k3, v3, m3 = k3 + n * sk3_n + kvh * sk3_g, v3 + n * sv3_n + kvh * sv3_g, m3 + n * sm3_n
        f0, f1, f2, f3 = _flag(m0, FLAGS, 0), _flag(m1, FLAGS, 1), _flag(m2, FLAGS, 2), _flag(m3, FLAGS, 3)
        acc = tl.zeros((BM, D), dtype=tl.float32)
        m_i = tl.full((BM,), float("-inf"), tl.float32)
        l_i = tl.zeros((BM,), dtype=tl.float32)
        lo, hi = 0, TK
        if SPLIT:
            lo = tl.program_id(2) * CHUNK
            hi = tl.minimum(lo + CHUNK, TK)
        sources = (
            k0, v0, m0, f0, sk0_t, sv0_t, sm0_t,
            k1, v1, m1, f1, e1, sk1_t, sv1_t, sm1_t,
            k2, v2, m2, f2, e2, sk2_t, sv2_t, sm2_t,
            k3, v3, m3, f3, e3, sk3_t, sv3_t, sm3_t,
        )  # fmt: skip
        if PER_SOURCE:
            own = (
                (k0, v0, m0, f0, 0, n0, sk0_t, sv0_t, sm0_t), (k1, v1, m1, f1, e1, n1, sk1_t, sv1_t, sm1_t),
                (k2, v2, m2, f2, e2, n2, sk2_t, sv2_t, sm2_t), (k3, v3, m3, f3, e3, n3, sk3_t, sv3_t, sm3_t),
            )  # fmt: skip
            for i in tl.static_range(SOURCES):
                k, v, m, f, e, length, sk, sv, sm = own[i]
                acc, m_i, l_i = _one_source(
                    acc, m_i, l_i, q0, q1, lo, hi, e, length, scale, k, v, m, f, sk, sv, sm, cs, sn, sc_t,
                    TOKENS >> i & 1, FLAGS >> i & 1, ALIGNED, HALVES, ROPE and i == SOURCES - 1, BN, D, PRECISION,
                )  # fmt: skip
        elif TWO_LOOPS:
            acc, m_i, l_i = _sweep(
                acc, m_i, l_i, q0, q1, lo, tl.minimum(hi, TM), TK, scale, *sources, cs, sn, sc_t,
                SOURCES, TOKENS, FLAGS, ALIGNED, False, False, BN, D, PRECISION,
            )  # fmt: skip
            lo = tl.maximum(lo, TM)
        if not PER_SOURCE:
            acc, m_i, l_i = _sweep(
                acc, m_i, l_i, q0, q1, lo, hi, TK, scale, *sources, cs, sn, sc_t,
                SOURCES, 0 if TWO_LOOPS else TOKENS, FLAGS, ALIGNED, False, False, BN, D, PRECISION,
            )  # fmt: skip
        if SPLIT:  # part: (splits, N*g, rows, D + 2) float32, rows padded to BM
            at = part + ((tl.program_id(2) * tl.num_programs(1) + pid_nk) * tl.num_programs(0) * BM + rows) * (D + 2)
            tl.store(at[:, None] + dims[None, :], acc)
            tl.store(at + D, m_i)
            tl.store(at + D + 1, l_i)
        else:
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            dst = out + ((n * TQ + t[:, None]) * H + head[:, None]) * D + dims[None, :]
            tl.store(dst, o.to(out.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _combine_kernel(
        part, out, TQ, H, G,
        SPLITS: tl.constexpr, BM: tl.constexpr, D: tl.constexpr, DB: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        """Merge the SPLITS softmax states of _attention_kernel's split programs into ``out``;
        program (i, j, c) takes dims c*DB .. (c+1)*DB of its rows, so that a wide head (pi0's
        256) is merged by more programs, each holding a (BM, DB) accumulator in registers."""
        inputs_ready(GDC)
        pid_nk = tl.program_id(1)
        n = (pid_nk // (H // G)).to(tl.int64)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        live = rows < G * TQ
        head = (pid_nk % (H // G)) * G + rows // TQ
        t = rows % TQ
        dims = tl.program_id(2) * DB + tl.arange(0, DB)
        acc = tl.zeros((BM, DB), dtype=tl.float32)
        m_i = tl.full((BM,), float("-inf"), tl.float32)
        l_i = tl.zeros((BM,), dtype=tl.float32)
        for s in tl.static_range(SPLITS):  # unrolled: every split's loads in flight at once
            at = part + ((s * tl.num_programs(1) + pid_nk) * tl.num_programs(0) * BM + rows) * (D + 2)
            m_s = tl.load(at + D)
            m_new = tl.maximum(m_i, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha, beta = tl.exp2(m_i - m_safe), tl.exp2(m_s - m_safe)
            l_i = l_i * alpha + tl.load(at + D + 1) * beta
            acc = acc * alpha[:, None] + tl.load(at[:, None] + dims[None, :]) * beta[:, None]
            m_i = m_new
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        dst = out + ((n * TQ + t[:, None]) * H + head[:, None]) * D + dims[None, :]
        tl.store(dst, o.to(out.dtype.element_ty), mask=live[:, None])


def _tiles(rows: int, groups: int, keys: int, d: int, itemsize: int, sms: int) -> tuple[int, int, int, int]:
    """Launch shape ``(BM, BN, num_warps, num_stages)`` of :func:`attention_triton` for ``groups``
    (slots x key/value heads) of ``rows`` query rows (heads in a group x tokens) over ``keys``
    keys of head dim ``d``, on a GPU with ``sms`` SMs: the shapes measured fastest
    (docs/PERFORMANCE.md)."""
    one_block = max(16, triton.next_power_of_2(keys))
    bm = max(16, min(64 if d <= 128 else 32, triton.next_power_of_2(rows)))
    if rows <= 32 and 2 * groups <= sms and one_block * d * itemsize <= 32768:
        # Few query rows (tiny's expert at up to 64 slots): 16-row programs, so a group's heads run
        # on separate SMs, each reading every key in one block of at most 32 KB (nothing to
        # pipeline), which shortens each program's chain of dependent steps.
        return 16, one_block, 4 if d <= 128 else 8, 1
    if d <= 64 and triton.cdiv(rows, bm) * groups >= sms:  # throughput-bound: many programs
        return bm, 32, 2 if bm <= 32 else 4, 3  # the fastest launch shape at 1024 and 4096 slots
    if d <= 128:  # few programs
        return bm, 128 if d <= 64 and bm > 32 else 64, 4, 3
    if itemsize > 2:  # float32: two stages of 64-key blocks exceed shared memory
        return bm, 32, 4, 2
    # Head dim 256 (pi0's expert: 8 heads x 50 tokens a group). Every program of a group reads all
    # of its keys, so taller programs read them fewer times: 128 rows on 8 warps once those fill
    # half the SMs (pi0 from 32 slots), 64 rows on 4 from a few slots on; at one or two slots the
    # 32-row programs, split over the keys, keep the chain short.
    if rows >= 128 and 2 * triton.cdiv(rows, 128) * groups >= sms:
        return 128, 64, 8, 2
    if rows >= 64 and 8 * triton.cdiv(rows, 64) * groups >= sms:
        return 64, 64, 4, 2
    return bm, 64, 4, 2


def attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    context: Sequence[Segment] = (),
    rope: Rope | None = None,
) -> torch.Tensor:
    """The Triton kernel (called by :func:`attention` on CUDA): takes the strides of q, of every
    segment's keys, values and mask, of the own ones (e.g. slot buffers' views, a mask expanded
    from a per-slot flag) and of the ``rope`` tables; keys or tables without a unit last stride,
    and cos and sin tables of different strides, take the reference."""
    n, h, tq, d = q.shape
    g = k.shape[1]
    if len(context) > MAX_SEGMENTS:
        context = [_concat(context)]
    sources = [*context, (k, v, mask)]
    tables = () if rope is None else rope
    if (
        d & (d - 1)
        or d < 16
        or any(layout_problem(x, unit=(-1,)) for x in (q, *tables, *(t for s in sources for t in s[:2])))
        or (rope is not None and rope[0].stride() != rope[1].stride())  # the kernel takes one table stride
    ):
        return attention_reference(q, k, v, mask, context, rope)
    if rope is not None and not rotates_on_load(d):
        q, k, rope = rotate(q, *rope), rotate(k, *rope), None
        sources[-1] = (k, v, mask)
    out = q.new_empty((n, tq, h, d))
    group, sms = h // g, sm_count(q.device)
    keys = sum(src[0].shape[2] for src in sources)
    bm, bn, warps, stages = _tiles(group * tq, n * g, keys, d, q.element_size(), sms)
    per_source = d > PER_SOURCE_DIM  # each source on blocks of its own: its rows are one buffer's
    args, tokens, flags, start, token_end, lengths = [], 0, 0, 0, 0, []
    for i, (sk, sv, sm) in enumerate([*sources, *[sources[-1]] * (MAX_SEGMENTS + 1 - len(sources))]):
        real = i < len(sources)
        m8 = q if sm is None else sm.view(torch.uint8)  # any tensor stands in for an absent mask
        if sm is not None and real and (sm.shape[1] == 1 or sm.stride(1) == 0):
            flags |= 1 << i  # one flag per slot, expanded over the tokens
        elif sm is not None and real:
            tokens |= 1 << i
            token_end = start + sk.shape[2]
        sm_strides = (0, 0) if sm is None else m8.stride()
        args += [sk, sv, m8, *([start] if i else []), *sk.stride()[:3], *sv.stride()[:3], *sm_strides]
        lengths.append(sk.shape[2] if real else 0)
        start += (triton.cdiv(sk.shape[2], bn) * bn if per_source else sk.shape[2]) if real else 0
    grid = (triton.cdiv(group * tq, bm), n * g)
    rows = [x for src in sources for x in src[:2]]
    aligned = all(
        x.data_ptr() % 16 == 0 and all(st * x.element_size() % 16 == 0 for st in x.stride()[:3]) for x in rows
    )
    # Few programs, many key blocks: each program's keys are a long serial chain, so the keys are
    # split over more programs (at least _split_blocks(d) blocks each), their softmax states merged after.
    blocks, programs = triton.cdiv(start, bn), grid[0] * grid[1]
    # Per-token masks in the first blocks only, flags read once before the keys: pays from 3
    # unmasked blocks on. With fewer, the second loop's set-up and the flags' load before the
    # first block cost more than they save.
    two_loops = not per_source and blocks - triton.cdiv(token_end, bn) >= 3
    if not two_loops and not per_source:
        tokens, flags = tokens | flags, 0
    least = _split_blocks(d)
    splits = min(blocks // least, sms // programs) if 2 * programs <= sms and blocks >= 2 * least else 1
    chunk = triton.cdiv(max(blocks, 1), splits) * bn
    splits = triton.cdiv(start, chunk)
    part = out if splits == 1 else q.new_empty((splits, grid[1], grid[0] * bm, d + 2), dtype=torch.float32)
    # Halves pay where programs are few (a chain of blocks each, latency-bound); with more programs
    # than SMs every program sweeps every block, and one full-width product a block is faster.
    halves = per_source and programs * splits <= sms
    cs, sn = rope if rope is not None else (q, q)  # any tensor stands in for absent tables
    sc = (cs.stride(0), cs.stride(2)) if rope is not None else (0, 0)
    if n * tq:
        _attention_kernel[(*grid, splits)](
            q, out, part, tq, h, group, math.log2(math.e) / math.sqrt(d), *q.stride()[:3], *args, start,
            triton.cdiv(token_end, bn) * bn, chunk, *lengths, cs, sn, *sc, SOURCES=len(sources), TOKENS=tokens,
            FLAGS=flags, ALIGNED=aligned, TWO_LOOPS=two_loops, PER_SOURCE=per_source, HALVES=halves,
            ROPE=rope is not None, SPLIT=splits > 1, BM=bm, BN=bn, D=d,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
            **dependent_launch(q.device, programs * splits),
        )  # fmt: skip
        if splits > 1:
            db = min(d, COMBINE_DIMS)
            _combine_kernel[(*grid, d // db)](
                part, out, tq, h, group, SPLITS=splits, BM=bm, D=d, DB=db, num_warps=4,
                **dependent_launch(q.device, programs * (d // db)),
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
    """Softmax attention of queries over [context segments; own] keys/values.

    Args:
        q: ``(N, h, Tq, d)`` queries (any strides, unit last stride).
        k, v: ``(N, g, Tk, d)`` the queries' own keys/values; ``h`` a multiple of ``g``.
        mask: ``(N, Tk)`` bool, True where an own key may be attended (None: all).
        context: segments ``(k_i, v_i, mask_i)`` with ``(N, g, T_i, d)`` keys/values and an
            ``(N, T_i)`` bool mask or None, attended before the own keys, in order; each is read
            in place (up to three per launch, more are concatenated first).
        rope: cos and sin tables ``(N, 1, Tq, d/2)`` in q's dtype
            (:func:`flashrt.kernels.rotary.rope_tables`): q and the own keys (the same Tq tokens)
            arrive unrotated, and are rotated by them (token t by row t), as
            :func:`flashrt.kernels.qkv_rope` would have; context keys are used as they are.

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
    if rope is not None:
        want = (n, 1, q.shape[2], d // 2)
        if k.shape[2] != q.shape[2]:
            raise ValueError(
                f"attention: rope rotates the own keys at the queries' positions, but there are {k.shape[2]} own "
                f"keys for {q.shape[2]} queries; rotate them apart (flashrt.kernels.qkv_rope) and pass rope=None"
            )
        for name, table in zip(("cos", "sin"), rope, strict=True):
            if table.shape != want or table.dtype != q.dtype:
                raise ValueError(
                    f"attention: the rope {name} table is {tuple(table.shape)} {table.dtype}; it must be {want} "
                    f"{q.dtype} (flashrt.kernels.rotary.rope_tables for the queries' tokens in their dtype)"
                )
    masks = [("the own mask", mask)] + [(f"context segment {i}'s mask", cm) for i, (_, _, cm) in enumerate(context)]
    for what, m in masks:
        if m is not None and m.dtype != torch.bool:  # SDPA would read a float mask as an additive bias
            raise ValueError(f"attention: {what} must be bool (True = may attend), got {m.dtype}")
    extra = [x for seg in context for x in seg if x is not None] + ([] if mask is None else [mask])
    # Plain self-attention (no context, no mask) over as many heads as SMs or more is left to
    # SDPA's fused kernels (the vision tower at many frames); below that, where each call is a
    # launch's latency, this kernel runs, launched dependent inside a graph.
    plain_at_scale = not context and mask is None and n * h > sm_count(q.device)
    tables = () if rope is None else rope
    if use_triton(q, k, v, *extra, *tables) and not plain_at_scale:
        return attention_triton(q, k, v, mask, context, rope)
    return attention_reference(q, k, v, mask, context, rope)
