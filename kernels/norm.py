"""RMSNorm, optionally fused with the residual add before it.

``add_rms_norm(x, delta, weight)`` returns ``(h, y)`` with ``h = x + delta`` (the new residual
stream) and ``y = rms_norm(h) * weight``; with ``delta=None`` it is a plain RMSNorm and ``h`` is
``x``. Rounding follows the reference: the sum is rounded to the input dtype, the statistics
are taken in float32, the normalised row is rounded to the input dtype before the weight.
One program per row; the row is read once and written once (twice with the residual).
"""

from __future__ import annotations

import torch

from kernels.backend import tl, triton, use_triton


def add_rms_norm_reference(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: ``h = x + delta``; ``y = (h32 * rsqrt(mean(h32^2) + eps)).to(dtype) * weight``."""
    h = x if delta is None else x + delta
    hf = h.float()
    return h, (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * weight


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x, delta, weight, h_out, y_out, width, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < width
        h = tl.load(x + row * width + cols, mask=inside, other=0.0)
        if HAS_DELTA:
            h = (h.to(tl.float32) + tl.load(delta + row * width + cols, mask=inside, other=0.0).to(tl.float32)).to(
                h.dtype
            )
            tl.store(h_out + row * width + cols, h, mask=inside)
        hf = h.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / width + eps)
        w = tl.load(weight + cols, mask=inside, other=0.0).to(tl.float32)
        y = (hf * r).to(h.dtype).to(tl.float32) * w
        tl.store(y_out + row * width + cols, y.to(h.dtype), mask=inside)


def add_rms_norm_triton(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (contiguous rows; called by :func:`add_rms_norm` on CUDA)."""
    width = x.shape[-1]
    x = x.contiguous()
    h = x if delta is None else torch.empty_like(x)
    y = torch.empty_like(x)
    rows = x.numel() // width
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x,
            x if delta is None else delta.contiguous(),
            weight,
            h,
            y,
            width,
            eps,
            HAS_DELTA=delta is not None,
            BLOCK=triton.next_power_of_2(width),
            num_warps=4 if width <= 2048 else 8,
        )
    return h, y


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, y)``: the residual sum ``h = x + delta`` (``x`` if ``delta`` is None) and its RMSNorm
    times ``weight``, over the last dimension. x, delta ``(..., W)`` of one dtype, weight ``(W,)``."""
    if delta is not None and delta.shape != x.shape:
        raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} must match x {tuple(x.shape)}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"add_rms_norm: weight {tuple(weight.shape)} must be ({x.shape[-1]},)")
    tensors = (x, weight) if delta is None else (x, delta, weight)
    if use_triton(*tensors) and x.dtype == weight.dtype:
        return add_rms_norm_triton(x, delta, weight, eps)
    return add_rms_norm_reference(x, delta, weight, eps)
