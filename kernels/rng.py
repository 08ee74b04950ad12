"""Per-slot counter-based random numbers: a pure function of (key, counter, element index).

The whole generator state of a slot is two int64 numbers that live in its buffers (so they are
part of every capsule): a ``key`` fixed per slot and a ``counter`` bumped by the caller after
each draw. Draws need no host synchronisation and no generator object, so they run inside a
captured graph and give the same bits on the CPU and the GPU.

The mixer is a 32-bit integer hash (xor-shift-multiply, "lowbias32") evaluated in int64
arithmetic: products are taken modulo 2**64 and masked back to 32 bits, which is exact.
"""

from __future__ import annotations

import math

import torch

from flashrt.kernels.backend import check_layout, layout_problem, tl, triton, use_triton

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit hash of the low 32 bits of ``x`` (int64 in, int64 in [0, 2**32) out)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def slot_key(seed: torch.Tensor) -> torch.Tensor:
    """The stream key of a slot seeded with ``seed`` (int64, any shape): ``seed * 2654435761 + 1``.

    The multiplier is odd, so the map is a bijection of int64 (two's-complement wrap-around, as
    torch's int64 arithmetic gives on the CPU and the GPU): distinct seeds give distinct keys.
    :func:`random_bits` hashes a key to a 32-bit stream, so two seeds share a stream with the
    odds of a 32-bit collision (about one pair in 2**32). Elementwise torch, so capturable.
    """
    return _int64("slot_key", "seed", seed) * 2654435761 + 1


def reseed(key: torch.Tensor, salt: torch.Tensor) -> torch.Tensor:
    """A new key from ``key`` and a per-destination ``salt`` (int64, broadcastable):
    ``key * 6364136223846793005 + salt + 1`` (Knuth's MMIX LCG step, salted).

    For a fork with a reseed: the forked slots share the source's key, and each destination's
    own salt (e.g. its slot index) gives it a stream of its own; for a fixed key, distinct salts
    give distinct keys. Elementwise torch with int64 wrap-around, so capturable and the same on
    the CPU and the GPU.
    """
    return _int64("reseed", "key", key) * 6364136223846793005 + _int64("reseed", "salt", salt) + 1


def _int64(fn: str, name: str, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{fn}: {name} must be an int64 tensor, got {got}")
    return t


def random_bits(key: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """``(slots, n)`` int64 values in [0, 2**32), one independent stream per (key, counter).

    Args:
        key: ``(slots,)`` int64 per-slot keys.
        counter: ``(slots,)`` int64 per-slot counters (bump them after each draw).
        n: numbers per slot.
    """
    idx = torch.arange(n, device=key.device, dtype=torch.int64)
    stream = _mix32(_mix32(key ^ (key >> 32)) + counter * 0x9E3779B1)  # (slots,)
    return _mix32(stream[:, None] ^ _mix32(idx * 0x85EBCA6B + 1)[None, :])


def uniform(key: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """``(slots, n)`` float32 uniform in [0, 1), 24 bits of resolution."""
    return (random_bits(key, counter, n) >> 8).to(torch.float32) * (1.0 / (1 << 24))


def normal(key: torch.Tensor, counter: torch.Tensor, n: int) -> torch.Tensor:
    """``(slots, n)`` float32 standard normal (Box-Muller over two uniform streams)."""
    half = (n + 1) // 2
    u = uniform(key, counter, 2 * half)
    u1, u2 = u[:, :half], u[:, half:]
    r = torch.sqrt(-2.0 * torch.log1p(-u1))  # 1 - u1 in (0, 1]: log is finite
    theta = (2.0 * math.pi) * u2
    return torch.cat([r * torch.cos(theta), r * torch.sin(theta)], dim=1)[:, :n]


def draw_normal_reference(out: torch.Tensor, key: torch.Tensor, counter: torch.Tensor) -> None:
    """Torch reference of :func:`draw_normal_`."""
    out.copy_(normal(key, counter, out.shape[1]))
    counter.add_(1)


if triton is not None:

    @triton.jit
    def _mix32_tl(x):
        x = x & 0xFFFFFFFF
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def uniform_tl(key, counter, j):
        """Element ``j`` of :func:`uniform`'s ``(key, counter)`` stream, inside a Triton kernel:
        the same float32 bits as the torch function (int64 keys, counters and indices, any
        broadcastable shapes)."""
        j = key * 0 + j  # int64 (a literal index would be int32, too narrow for the mixer)
        stream = _mix32_tl(_mix32_tl(key ^ (key >> 32)) + counter * 0x9E3779B1)
        bits = _mix32_tl(stream ^ _mix32_tl(j * 0x85EBCA6B + 1))
        return (bits >> 8).to(tl.float32) * (1.0 / 16777216.0)

    @triton.jit
    def _draw_normal_kernel(out, key, counter, n, half, s_out, s_key, s_counter, BLOCK: tl.constexpr):
        # key, counter and out's rows are slot buffers: strided by the arena's row, not contiguous
        s = tl.program_id(0).to(tl.int64)
        k = tl.load(key + s * s_key)
        c = tl.load(counter + s * s_counter)
        stream = _mix32_tl(_mix32_tl(k ^ (k >> 32)) + c * 0x9E3779B1)
        j = tl.arange(0, BLOCK).to(tl.int64)
        live = j < half
        b1 = _mix32_tl(stream ^ _mix32_tl(j * 0x85EBCA6B + 1))
        b2 = _mix32_tl(stream ^ _mix32_tl((j + half) * 0x85EBCA6B + 1))
        u1 = (b1 >> 8).to(tl.float32) * (1.0 / 16777216.0)
        u2 = (b2 >> 8).to(tl.float32) * (1.0 / 16777216.0)
        r = tl.sqrt(-2.0 * tl.log(1.0 - u1))
        theta = 6.283185307179586 * u2
        tl.store(out + s * s_out + j, r * tl.cos(theta), mask=live)
        tl.store(out + s * s_out + half + j, r * tl.sin(theta), mask=live & (half + j < n))
        tl.store(counter + s * s_counter, c + 1)


def draw_normal_triton(out: torch.Tensor, key: torch.Tensor, counter: torch.Tensor) -> None:
    """The Triton kernel (called by :func:`draw_normal_` on CUDA): one program per slot. Takes
    the strides of ``key``, ``counter`` and ``out``'s rows; ``out`` needs a unit last stride."""
    check_layout("draw_normal_triton", "out", out, unit=(1,))
    slots, n = out.shape
    half = (n + 1) // 2
    if slots and n:
        _draw_normal_kernel[(slots,)](
            out, key, counter, n, half, out.stride(0), key.stride(0), counter.stride(0),
            BLOCK=triton.next_power_of_2(half),
        )  # fmt: skip


def draw_normal_(out: torch.Tensor, key: torch.Tensor, counter: torch.Tensor) -> None:
    """``out = normal(key, counter, n)`` and ``counter += 1``, in place (one kernel on CUDA).

    Args:
        out: ``(slots, n)`` float32, any strides (e.g. a slot buffer's view; a unit last
            stride takes the kernel, others the reference).
        key, counter: ``(slots,)`` int64, any strides (the counter is bumped).
    """
    if out.dim() != 2 or out.dtype != torch.float32 or key.shape != out.shape[:1] or counter.shape != key.shape:
        raise ValueError(
            f"draw_normal_: out (slots, n) float32 with (slots,) key and counter; got {tuple(out.shape)} "
            f"{out.dtype}, {tuple(key.shape)}, {tuple(counter.shape)}"
        )
    if key.dtype != torch.int64 or counter.dtype != torch.int64:
        raise ValueError(f"draw_normal_: key and counter must be int64, got {key.dtype} and {counter.dtype}")
    if use_triton(out, key, counter) and layout_problem(out, unit=(1,)) is None:
        draw_normal_triton(out, key, counter)
    else:
        draw_normal_reference(out, key, counter)
