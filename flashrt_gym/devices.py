"""Where things run: the one place that resolves ``"auto"`` devices and the policy's dtype."""

from __future__ import annotations

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
