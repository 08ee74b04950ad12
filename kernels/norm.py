"""RMSNorm and LayerNorm, each fused with the residual add before it.

``add_rms_norm(x, delta, weight)`` and ``add_layer_norm(x, delta, weight, bias)`` return
``(h, y)``: ``h = x + delta`` (the new residual stream) and ``y = norm(h)``; with ``delta=None``
``h`` is ``x``. ``delta`` either has x's shape (a block's output, added where the next norm
reads it) or x's trailing shape, broadcast over the leading dims (e.g. a position embedding
shared by every slot). Rounding follows the references: the sum is rounded to the input dtype
and the statistics are taken in float32; RMSNorm rounds the normalised row to the input dtype
before the weight (as the Gemma-style reference does), LayerNorm rounds once at the end (as
``F.layer_norm`` does). A program takes several short rows; each row is read once and written
once (twice with the residual).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashrt.kernels.backend import dependent_launch, tl, triton, use_triton


def add_rms_norm_reference(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: ``h = x + delta``; ``y = (h32 * rsqrt(mean(h32^2) + eps)).to(dtype) * weight``."""
    h = x if delta is None else x + delta
    hf = h.float()
    return h, (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * weight


def add_layer_norm_reference(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: ``h = x + delta``; ``y = F.layer_norm(h, weight, bias)``."""
    h = x if delta is None else x + delta
    return h, F.layer_norm(h, h.shape[-1:], weight, bias, eps)


if triton is not None:
    from flashrt.kernels.backend import inputs_ready

    @triton.jit
    def _add_norm_kernel(
        x, delta, weight, bias, h_out, y_out, rows, delta_rows, width, eps, s_w, s_b,
        HAS_DELTA: tl.constexpr, LAYER: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
        GDC: tl.constexpr,
    ):  # fmt: skip
        inputs_ready(GDC)
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        inside = cols[None, :] < width
        m = (row < rows)[:, None] & inside
        off = row[:, None] * width + cols[None, :]
        h = tl.load(x + off, mask=m, other=0.0)
        if HAS_DELTA:  # delta's rows repeat every delta_rows rows of x (a broadcast over leading dims)
            d = tl.load(delta + (row % delta_rows)[:, None] * width + cols[None, :], mask=m, other=0.0)
            h = (h.to(tl.float32) + d.to(tl.float32)).to(h.dtype)
            tl.store(h_out + off, h, mask=m)
        hf = h.to(tl.float32)
        w = tl.load(weight + cols * s_w, mask=cols < width, other=0.0).to(tl.float32)[None, :]
        if LAYER:
            c = tl.where(inside, hf - (tl.sum(hf, axis=1) / width)[:, None], 0.0)
            r = 1.0 / tl.sqrt(tl.sum(c * c, axis=1) / width + eps)
            y = c * r[:, None] * w + tl.load(bias + cols * s_b, mask=cols < width, other=0.0).to(tl.float32)[None, :]
        else:
            r = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=1) / width + eps)
            y = (hf * r[:, None]).to(h.dtype).to(tl.float32) * w
        tl.store(y_out + off, y.to(h.dtype), mask=m)


def _add_norm_triton(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    width = x.shape[-1]
    x = x.contiguous()
    h = x if delta is None else torch.empty_like(x)
    y = torch.empty_like(x)
    rows = x.numel() // width if width else 0
    if rows:
        block = triton.next_power_of_2(width)
        per_program = max(1, min(16, 2048 // block))  # short rows: several a program
        programs = triton.cdiv(rows, per_program)
        _add_norm_kernel[(programs,)](
            x,
            x if delta is None else delta.contiguous(),
            weight,
            weight if bias is None else bias,
            h,
            y,
            rows,
            1 if delta is None else delta.numel() // width,
            width,
            eps,
            weight.stride(0),
            1 if bias is None else bias.stride(0),
            HAS_DELTA=delta is not None,
            LAYER=bias is not None,
            ROWS=per_program,
            BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
            **dependent_launch(x.device, programs),
        )
    return h, y


def add_rms_norm_triton(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (called by :func:`add_rms_norm` on CUDA)."""
    return _add_norm_triton(x, delta, weight, None, eps)


def add_layer_norm_triton(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel (called by :func:`add_layer_norm` on CUDA)."""
    return _add_norm_triton(x, delta, weight, bias, eps)


def _check(name: str, x: torch.Tensor, delta: torch.Tensor | None, *params: torch.Tensor) -> None:
    if delta is not None and (delta.dim() > x.dim() or delta.shape != x.shape[x.dim() - delta.dim() :]):
        raise ValueError(f"{name}: delta {tuple(delta.shape)} must match x {tuple(x.shape)} or its trailing dims")
    for p in params:
        if p.shape != x.shape[-1:]:
            raise ValueError(f"{name}: weight and bias must be ({x.shape[-1]},), got {tuple(p.shape)}")


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, y)``: the residual sum ``h = x + delta`` (``x`` if ``delta`` is None) and its RMSNorm
    times ``weight``, over the last dimension. x ``(..., W)``, delta x's shape or its trailing
    dims, of x's dtype; weight ``(W,)``."""
    _check("add_rms_norm", x, delta, weight)
    tensors = (x, weight) if delta is None else (x, delta, weight)
    if use_triton(*tensors) and x.dtype == weight.dtype:
        return add_rms_norm_triton(x, delta, weight, eps)
    return add_rms_norm_reference(x, delta, weight, eps)


def add_layer_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, y)``: the residual sum ``h = x + delta`` (``x`` if ``delta`` is None) and its
    LayerNorm with ``weight`` and ``bias``, over the last dimension. Shapes as :func:`add_rms_norm`."""
    _check("add_layer_norm", x, delta, weight, bias)
    tensors = (x, weight, bias) if delta is None else (x, delta, weight, bias)
    if use_triton(*tensors) and x.dtype == weight.dtype == bias.dtype:
        return add_layer_norm_triton(x, delta, weight, bias, eps)
    return add_layer_norm_reference(x, delta, weight, bias, eps)
