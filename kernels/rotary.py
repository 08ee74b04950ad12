"""QKV split + rotary embedding: one pass from the fused q/k/v projection to rotated heads.

The projection writes ``(N, T, (h + 2g) d)``: h query heads, then g key heads, then g value
heads. The kernel computes each token's angles from its position (``pos0[n] + t`` times the
inverse frequencies), rotates queries and keys (rotate-half convention) and writes queries as
``(N, h, T, d)`` and keys/values straight into a caller-given ``(N, 2, g, T, d)`` view, e.g. one
layer of a key/value cache, so no table, split, concatenation or cache copy runs apart from it.
Rounding follows the reference: tables rounded to the input dtype, each product and the sum
rounded as bf16 torch arithmetic does.

Where the queries' attention rotates queries and own keys as it loads them
(:func:`flashrt.kernels.grouped_attention.rotates_on_load`), the projection is only viewed as
heads (:func:`split_heads`) and the rotation's tables are made once (:func:`rope_tables`), with
the same rounding (:func:`rotated`).
"""

from __future__ import annotations

import torch

from flashrt.kernels.backend import layout_problem, tl, triton, use_triton


def rope_angles(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``(N, 1, T, d/2)`` in ``dtype`` for integer positions ``pos (N, T)``."""
    ang = pos.float()[:, None, :, None] * inv_freq
    return ang.cos().to(dtype), ang.sin().to(dtype)


def rope_tables(
    pos0: torch.Tensor, length: int, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``(N, 1, T, d/2)`` in ``dtype`` for tokens ``t < length`` at positions
    ``pos0 + t``: what attention rotates queries and own keys by as it loads them (made once
    for a whole Euler loop, whose token positions do not change)."""
    check_positions(pos0, pos0.shape[0], "rope_tables")
    return rope_angles(pos0[:, None] + torch.arange(length, device=pos0.device), inv_freq, dtype)


def split_heads(qkv: torch.Tensor, heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views of ``qkv (N, T, (h + 2g) d)`` as q ``(N, h, T, d)`` and k, v ``(N, g, T, d)``,
    unrotated (no copy): :func:`qkv_rope` without the rotation, for an attention that rotates
    on load."""
    n, t, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    if width != (heads + 2 * kv_heads) * d:
        raise ValueError(f"split_heads: last dim {width} is not (heads + 2 kv_heads) * head dim")
    x = qkv.view(n, t, heads + 2 * kv_heads, d).transpose(1, 2)
    return x[:, :heads], x[:, heads : heads + kv_heads], x[:, heads + kv_heads :]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``(N, heads, T, d)`` by the tables (rotate-half convention)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def kv_destination(
    n: int,
    t: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    heads: int,
    kv_heads: int,
    kv_out: torch.Tensor | None,
) -> torch.Tensor:
    """Where keys/values of ``(N, T)`` tokens projected to ``width = (h + 2g) d`` go: ``kv_out``
    checked to be ``(N, 2, g, T, d)`` of ``dtype``, or a new tensor of that shape."""
    d = width // (heads + 2 * kv_heads)
    if width != (heads + 2 * kv_heads) * d or d % 2:
        raise ValueError(f"qkv_rope: last dim {width} is not (heads + 2 kv_heads) * an even head dim")
    if kv_out is None:
        return torch.empty((n, 2, kv_heads, t, d), dtype=dtype, device=device)
    if kv_out.shape != (n, 2, kv_heads, t, d) or kv_out.dtype != dtype:
        raise ValueError(f"qkv_rope: kv_out must be ({n}, 2, {kv_heads}, {t}, {d}) {dtype}, got {kv_out.shape}")
    return kv_out


def check_positions(pos0: torch.Tensor, n: int, name: str) -> None:
    """``pos0`` must be ``(N,)`` int64: each slot's position of its token 0."""
    if pos0.shape != (n,) or pos0.dtype != torch.int64:
        raise ValueError(f"{name}: pos0 must be ({n},) int64, got {tuple(pos0.shape)} {pos0.dtype}")


def check_frequencies(inv_freq: torch.Tensor, d: int, name: str) -> None:
    """``inv_freq`` must be ``(d/2,)`` floating point: the kernels read that many."""
    if inv_freq.shape != (d // 2,) or not inv_freq.is_floating_point():
        raise ValueError(
            f"{name}: inv_freq must be ({d // 2},) floating point for head dim {d}, got "
            f"{tuple(inv_freq.shape)} {inv_freq.dtype}"
        )


def qkv_rope_reference(
    qkv: torch.Tensor,
    pos0: torch.Tensor,
    inv_freq: torch.Tensor,
    heads: int,
    kv_heads: int,
    kv_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`qkv_rope`."""
    kv_out = kv_destination(*qkv.shape, qkv.dtype, qkv.device, heads, kv_heads, kv_out)
    q, k, v = split_heads(qkv, heads, kv_heads)
    cos, sin = rope_tables(pos0, qkv.shape[1], inv_freq, qkv.dtype)
    kv_out[:, 0].copy_(rotate(k, cos, sin))
    kv_out[:, 1].copy_(v)
    return rotate(q, cos, sin), kv_out[:, 0], kv_out[:, 1]


if triton is not None:

    @triton.jit
    def rotated(a, b, c, s):
        """Halves ``a``, ``b`` of rows rotated by ``c``, ``s`` (cos and sin in ``a``'s dtype):
        ``(a c - b s, b c + a s)`` rounded as :func:`rotate` rounds in that dtype, each product
        and then the sum (never contracted into a fused multiply-add)."""
        af, bf, cf, sf = a.to(tl.float32), b.to(tl.float32), c.to(tl.float32), s.to(tl.float32)
        ra = ((af * cf).to(a.dtype).to(tl.float32) - (bf * sf).to(a.dtype).to(tl.float32)).to(a.dtype)
        rb = ((bf * cf).to(a.dtype).to(tl.float32) + (af * sf).to(a.dtype).to(tl.float32)).to(a.dtype)
        return ra, rb

    @triton.jit
    def store_head(
        a, b, n, t, live, j, T, pos0, inv_freq, q_out, k_out, v_out, HEADS, KV_HEADS,
        sk_n, sk_g, sk_t, sv_n, sv_g, sv_t, s_pos, s_freq, HALF: tl.constexpr,
    ):  # fmt: skip
        """Head ``j`` (among h + 2g) of tokens ``t`` of slots ``n`` (``live`` ones), as its two
        halves ``a``, ``b`` (BT, HALF): queries and keys rotated (rounded as the reference) and
        written to ``q_out`` ``(N, h, T, d)`` or ``k_out``, values written to ``v_out`` as they are."""
        cols = tl.arange(0, HALF)
        m = live[:, None]
        if j < HEADS + KV_HEADS:
            pos = (tl.load(pos0 + n * s_pos, mask=live, other=0) + t).to(tl.float32)
            ang = pos[:, None] * tl.load(inv_freq + cols * s_freq)[None, :]
            ra, rb = rotated(a, b, tl.cos(ang).to(a.dtype), tl.sin(ang).to(a.dtype))
            if j < HEADS:
                dst = q_out + ((n * HEADS + j) * T + t)[:, None] * 2 * HALF + cols[None, :]
            else:
                dst = k_out + (n * sk_n + (j - HEADS) * sk_g + t * sk_t)[:, None] + cols[None, :]
            tl.store(dst, ra, mask=m)
            tl.store(dst + HALF, rb, mask=m)
        else:
            dst = v_out + (n * sv_n + (j - HEADS - KV_HEADS) * sv_g + t * sv_t)[:, None] + cols[None, :]
            tl.store(dst, a, mask=m)
            tl.store(dst + HALF, b, mask=m)

    @triton.jit
    def _qkv_rope_kernel(
        qkv, pos0, inv_freq, q_out, k_out, v_out,
        rows, T, HEADS, KV_HEADS,
        sk_n, sk_g, sk_t, sv_n, sv_g, sv_t, s_pos, s_freq,
        HALF: tl.constexpr, BT: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)  # n * T + t, BT tokens
        live = row < rows
        j = tl.program_id(1)  # head among h + 2g
        n = row // T
        t = row % T
        cols = tl.arange(0, HALF)
        m = live[:, None]
        src = qkv + row[:, None] * (HEADS + 2 * KV_HEADS) * 2 * HALF + j * 2 * HALF + cols[None, :]
        a = tl.load(src, mask=m)
        b = tl.load(src + HALF, mask=m)
        store_head(
            a, b, n, t, live, j, T, pos0, inv_freq, q_out, k_out, v_out, HEADS, KV_HEADS,
            sk_n, sk_g, sk_t, sv_n, sv_g, sv_t, s_pos, s_freq, HALF,
        )  # fmt: skip


def qkv_rope_triton(
    qkv: torch.Tensor,
    pos0: torch.Tensor,
    inv_freq: torch.Tensor,
    heads: int,
    kv_heads: int,
    kv_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Triton kernel (called by :func:`qkv_rope` on CUDA): takes the strides of ``pos0``,
    ``inv_freq`` and ``kv_out``; qkv any strides (read through a contiguous copy). A head dim
    off a power of two, or a ``kv_out`` without a unit last stride, takes the reference."""
    n, t, _ = qkv.shape
    kv_out = kv_destination(*qkv.shape, qkv.dtype, qkv.device, heads, kv_heads, kv_out)
    d = kv_out.shape[-1]
    check_frequencies(inv_freq, d, "qkv_rope")
    if d & (d - 1) or layout_problem(kv_out, unit=(-1,)) is not None:
        return qkv_rope_reference(qkv, pos0, inv_freq, heads, kv_heads, kv_out)
    k_out, v_out = kv_out[:, 0], kv_out[:, 1]
    q = qkv.new_empty((n, heads, t, d))
    if n * t:
        bt = 16 if n * t >= 2048 else 1  # tokens per program: more work each at large batch, most programs at small
        _qkv_rope_kernel[(triton.cdiv(n * t, bt), heads + 2 * kv_heads)](
            qkv.contiguous(), pos0, inv_freq, q, k_out, v_out,
            n * t, t, heads, kv_heads,
            k_out.stride(0), k_out.stride(1), k_out.stride(2), v_out.stride(0), v_out.stride(1), v_out.stride(2),
            pos0.stride(0), inv_freq.stride(0), HALF=d // 2, BT=bt, num_warps=2 if d <= 128 else 4,
        )  # fmt: skip
    return q, k_out, v_out


def qkv_rope(
    qkv: torch.Tensor,
    pos0: torch.Tensor,
    inv_freq: torch.Tensor,
    heads: int,
    kv_heads: int,
    kv_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``qkv (N, T, (h + 2g) d)`` into heads and rotate queries and keys.

    Args:
        qkv: the fused projection output.
        pos0: ``(N,)`` int64 position of each slot's token 0 (token t sits at ``pos0 + t``).
        inv_freq: ``(d/2,)`` float32 inverse frequencies.
        heads, kv_heads: query and key/value head counts.
        kv_out: optional ``(N, 2, g, T, d)`` destination of keys and values (a view with unit
            last stride, e.g. one layer of a cache).

    Returns:
        q ``(N, h, T, d)``, and k, v ``(N, g, T, d)`` (views of ``kv_out`` when given).
    """
    check_positions(pos0, qkv.shape[0], "qkv_rope")
    outs = [] if kv_out is None else [kv_out]
    if use_triton(qkv, pos0, inv_freq, *outs):
        return qkv_rope_triton(qkv, pos0, inv_freq, heads, kv_heads, kv_out)
    return qkv_rope_reference(qkv, pos0, inv_freq, heads, kv_heads, kv_out)
