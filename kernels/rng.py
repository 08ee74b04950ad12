"""Per-slot counter-based random numbers: a pure function of (key, counter, element index).

The whole generator state of a slot is two int64 numbers that live in its buffers (so they are
part of every capsule): a ``key`` fixed per slot and a ``counter`` bumped by the caller after
each draw. Draws need no host synchronisation and no generator object, so they run inside a
captured graph and give the same bits on the CPU and the GPU.

A key is first mixed as a whole 64-bit number (splitmix64's finaliser, a bijection of int64), so
that keys differing anywhere, the high bits included, give unrelated streams (the evaluation
splits' seeds differ from the training runs' in their high bits; a key folded to 32 bits before
mixing would give ``2**40 + i`` the stream of ``i ^ 256``). The low half of the mixed key and the counter
pick a 32-bit stream through a 32-bit integer hash (xor-shift-multiply, "lowbias32"); the high half
is added into every element's hash, so two distinct keys share no stream even where their low
halves collide (at odds of about 2**-64 a pair). All of it is int64 arithmetic: products wrap
modulo 2**64 (two's complement, as torch and Triton give on the CPU and the GPU) or are masked
back to 32 bits, which is exact.
"""

from __future__ import annotations

import math

import torch

from flashrt.kernels.backend import check_layout, layout_problem, tl, triton, use_triton

_M32 = 0xFFFFFFFF
# splitmix64's constants as signed int64 (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
_SM_GAMMA, _SM_M1, _SM_M2 = -7046029254386353131, -4658895280553007687, -7723592293110705685


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``k`` (torch's ``>>`` is arithmetic on signed ints)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """splitmix64's finaliser of the whole int64 ``key``, as its (low, high) 32-bit halves."""
    z = key + _SM_GAMMA
    z = (z ^ _srl(z, 30)) * _SM_M1
    z = (z ^ _srl(z, 27)) * _SM_M2
    z = z ^ _srl(z, 31)
    return z & _M32, _srl(z, 32)


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
    :func:`random_bits` mixes all 64 bits of a key, so distinct seeds draw unrelated streams
    (module docstring). Elementwise torch, so capturable.
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
    lo, hi = _mix64(key)
    stream = _mix32(lo + counter * 0x9E3779B1)  # (slots,)
    return _mix32((stream[:, None] ^ _mix32(idx * 0x85EBCA6B + 1)[None, :]) + hi[:, None])


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
    def _mix64_tl(key):
        # splitmix64's finaliser (constants as signed int64; masks make the shifts logical)
        z = key + -7046029254386353131
        z = (z ^ ((z >> 30) & 0x3FFFFFFFF)) * -4658895280553007687
        z = (z ^ ((z >> 27) & 0x1FFFFFFFFF)) * -7723592293110705685
        z = z ^ ((z >> 31) & 0x1FFFFFFFF)
        return z & 0xFFFFFFFF, (z >> 32) & 0xFFFFFFFF

    @triton.jit
    def uniform_tl(key, counter, j):
        """Element ``j`` of :func:`uniform`'s ``(key, counter)`` stream, inside a Triton kernel:
        the same float32 bits as the torch function (int64 keys, counters and indices, any
        broadcastable shapes)."""
        j = key * 0 + j  # int64 (a literal index would be int32, too narrow for the mixer)
        lo, hi = _mix64_tl(key)
        stream = _mix32_tl(lo + counter * 0x9E3779B1)
        bits = _mix32_tl((stream ^ _mix32_tl(j * 0x85EBCA6B + 1)) + hi)
        return (bits >> 8).to(tl.float32) * (1.0 / 16777216.0)

    @triton.jit
    def _draw_normal_kernel(out, key, counter, n, half, s_out, s_key, s_counter, BLOCK: tl.constexpr):
        # key, counter and out's rows are slot buffers: strided by the arena's row, not contiguous
        s = tl.program_id(0).to(tl.int64)
        k = tl.load(key + s * s_key)
        c = tl.load(counter + s * s_counter)
        lo, hi = _mix64_tl(k)
        stream = _mix32_tl(lo + c * 0x9E3779B1)
        j = tl.arange(0, BLOCK).to(tl.int64)
        live = j < half
        b1 = _mix32_tl((stream ^ _mix32_tl(j * 0x85EBCA6B + 1)) + hi)
        b2 = _mix32_tl((stream ^ _mix32_tl((j + half) * 0x85EBCA6B + 1)) + hi)
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
