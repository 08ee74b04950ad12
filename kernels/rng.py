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

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit hash of the low 32 bits of ``x`` (int64 in, int64 in [0, 2**32) out)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


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
