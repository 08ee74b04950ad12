"""Where things run: the one place that resolves ``"auto"`` devices and the policy's dtype, and
what a process holds there."""

from __future__ import annotations

import sys

import torch


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` or None: the current CUDA device where there is one, else the CPU; anything
    else as given, refused with a clear error when it names a GPU this machine does not have."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        out = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from e
    if out.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but no CUDA GPU is visible; use device='cpu' or 'auto'")
    return out


def policy_dtype(device: torch.device) -> torch.dtype:
    """The policy's dtype on ``device``: bf16 on a GPU (the kernels' and the shipped weights'
    precision), float32 on the CPU (where bf16 matmuls are slow and the tests compare exactly)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def peak_gpu_memory_mb() -> dict[str, float] | None:
    """This process's peak GPU memory on the current device, MB (2**20 bytes): torch's caching
    allocator at its most reserved (captured graphs' pools included) and, where Warp is in use
    (MuJoCo Warp), the high-water mark of Warp's memory pool, and their sum. What a run holds
    decides how many fit on one GPU, so the run's summary reports it.

    Returns:
        ``{"torch_max_reserved", "warp_pool_high", "total"}`` (no Warp entry without Warp), or None
        when this process has not used CUDA.
    """
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    out = {"torch_max_reserved": torch.cuda.max_memory_reserved() / 2**20}
    wp = sys.modules.get("warp")
    device = f"cuda:{torch.cuda.current_device()}"
    if wp is not None and wp.is_mempool_enabled(device):
        out["warp_pool_high"] = wp.get_mempool_used_mem_high(device) / 2**20
    out["total"] = sum(out.values())
    return out
