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

``delta`` may also be a :class:`flashrt.kernels.matmul.PartialProduct`: a projection's float32
partial sums over slices of its input, summed here in order (the norm's kernel reads them in
place of a reduce kernel). :func:`add_rms_norm` adds the sum to ``x`` in float32 and rounds once,
as :func:`flashrt.kernels.add_matmul` accumulates; a gated add (pi0.5) first rounds it to the
input dtype, as :func:`flashrt.kernels.linear` rounds its product.

pi0.5's time-conditioned expert takes the adaptive forms (:func:`add_ada_rms_norm`,
:func:`gated_add`): the residual add scales its delta by a gate, and the norm's scale and
shift come from a modulation (``policies.layers.AdaRMSNorm``), shared by every slot or one per
slot. Rounding follows LeRobot's ``PiGemmaRMSNorm``: the gated delta and the sum each rounded to
the input dtype, the normalised row scaled and shifted in float32 and rounded once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashrt.kernels.backend import dependent_launch, tl, triton, use_triton
from flashrt.kernels.fp8 import Rows, quantize_rows
from flashrt.kernels.matmul import PartialProduct

Delta = torch.Tensor | PartialProduct | None
"""A residual add's delta: a tensor, a projection's partial products, or none."""


def _residual(x: torch.Tensor, delta: Delta) -> torch.Tensor:
    """``x + delta``, rounded once to x's dtype (a partial product summed in order first)."""
    if delta is None:
        return x
    if isinstance(delta, PartialProduct):
        return (x.float() + delta.total()).to(x.dtype)
    return x + delta


def add_rms_norm_reference(
    x: torch.Tensor, delta: Delta, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: ``h = x + delta``; ``y = (h32 * rsqrt(mean(h32^2) + eps)).to(dtype) * weight``."""
    h = _residual(x, delta)
    hf = h.float()
    return h, (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype) * weight


def add_layer_norm_reference(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    delta_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: ``h = x + delta`` (``x + (delta + delta_bias)`` in float32, rounded once,
    with a ``delta_bias``); ``y = F.layer_norm(h, weight, bias)``."""
    if delta is None:
        h = x
    elif delta_bias is None:
        h = x + delta
    else:
        h = (x.float() + (delta.float() + delta_bias.float())).to(x.dtype)
    return h, F.layer_norm(h, h.shape[-1:], weight, bias, eps)


def add_ada_rms_norm_reference(
    x: torch.Tensor, delta: Delta, gate: torch.Tensor | None, mod: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`add_ada_rms_norm`."""
    if isinstance(delta, PartialProduct):
        delta = delta.total().to(x.dtype)
    h = x if delta is None else gated_add_reference(x, delta, gate)
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    scale, shift = (mod[:, None, 0], mod[:, None, 1]) if mod.dim() == 3 else (mod[0], mod[1])
    return h, (y * scale + shift).to(h.dtype)


def gated_add_reference(x: torch.Tensor, delta: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`gated_add`."""
    return x + delta * (gate[:, None] if gate.dim() == 2 else gate).to(x.dtype)


if triton is not None:
    from flashrt.kernels.backend import inputs_ready

    @triton.jit
    def _rounded(v, dtype: tl.constexpr):
        """float32 ``v`` rounded to ``dtype`` (nearest, ties to even), as float32. For bfloat16 the
        rounding is taken on the bits, where the compiler cannot fold the conversion pair away."""
        if dtype == tl.bfloat16:
            u = v.to(tl.uint32, bitcast=True)
            return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return v.to(dtype).to(tl.float32)

    @triton.jit
    def _add_norm_kernel(
        x, delta, delta_bias, gate, weight, bias, h_out, y_out, scale_out, rows, delta_rows, slot_rows, width, eps,
        s_w, s_b, s_wn, s_gn, s_db,
        HAS_DELTA: tl.constexpr, DELTA_BIAS: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
        LAYER: tl.constexpr, SHIFT: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
        FP8: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        # Row r belongs to slot r // slot_rows: the gate's and the (modulated) weight's row of it
        # (strides s_gn, s_wn; 0 where every slot shares one). SPLITS > 0: delta is that many
        # float32 partial products (SPLITS, rows, width), summed in order. DELTA_BIAS: the
        # projection's bias, added to delta in float32 before x. FP8: y leaves as e4m3 values and
        # a float32 scale a row (scale_out), those of kernels.fp8.quantize_rows of the rounded y.
        inputs_ready(GDC)
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        slot = (row // slot_rows)[:, None]
        cols = tl.arange(0, BLOCK)
        inside = cols[None, :] < width
        m = (row < rows)[:, None] & inside
        off = row[:, None] * width + cols[None, :]
        h = tl.load(x + off, mask=m, other=0.0)
        if HAS_DELTA:  # delta's rows repeat every delta_rows rows of x (a broadcast over leading dims)
            if SPLITS:
                d = tl.load(delta + off, mask=m, other=0.0)
                for s in tl.static_range(1, SPLITS):
                    d += tl.load(delta + s * rows * width + off, mask=m, other=0.0)
            else:
                d = tl.load(delta + (row % delta_rows)[:, None] * width + cols[None, :], mask=m, other=0.0)
            if GATED:  # the gate rounded to x's dtype, then the product, as the reference rounds
                if SPLITS:  # the projection rounded first, as kernels.linear rounds it
                    d = _rounded(d, h.dtype)
                g = _rounded(tl.load(gate + slot * s_gn + cols[None, :], mask=m, other=0.0), h.dtype)
                d = _rounded(d.to(tl.float32) * g, h.dtype)
            d = d.to(tl.float32)
            if DELTA_BIAS:
                d += tl.load(delta_bias + cols * s_db, mask=cols < width, other=0.0).to(tl.float32)[None, :]
            h = (h.to(tl.float32) + d).to(h.dtype)
            tl.store(h_out + off, h, mask=m)
        if NORM:
            hf = h.to(tl.float32)
            w = tl.load(weight + slot * s_wn + cols[None, :] * s_w, mask=m, other=0.0).to(tl.float32)
            if LAYER:
                c = tl.where(inside, hf - (tl.sum(hf, axis=1) / width)[:, None], 0.0)
                r = 1.0 / tl.sqrt(tl.sum(c * c, axis=1) / width + eps)
                b = tl.load(bias + cols * s_b, mask=cols < width, other=0.0).to(tl.float32)[None, :]
                y = c * r[:, None] * w + b
            else:
                r = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=1) / width + eps)
                if SHIFT:  # adaptive: scale and shift in float32, one rounding
                    b = tl.load(bias + slot * s_wn + cols[None, :] * s_b, mask=m, other=0.0).to(tl.float32)
                    y = hf * r[:, None] * w + b
                else:  # Gemma-style: the normalised row rounded before the weight
                    y = (hf * r[:, None]).to(h.dtype).to(tl.float32) * w
            if FP8:  # quantize_rows of y as it would be stored: rounded to x's dtype first
                yr = _rounded(y, h.dtype)
                amax = tl.maximum(tl.max(tl.abs(yr), axis=1), 1e-12)  # fp8.MIN_AMAX
                q = yr * tl.div_rn(tl.full([ROWS], 448.0, tl.float32), amax)[:, None]  # rounded as torch divides
                tl.store(y_out + off, tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv), mask=m)
                tl.store(scale_out + row, tl.div_rn(amax, tl.full([ROWS], 448.0, tl.float32)), mask=row < rows)
            else:
                tl.store(y_out + off, y.to(h.dtype), mask=m)


def _add_norm_triton(
    x: torch.Tensor,
    delta: Delta,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    gate: torch.Tensor | None = None,
    layer: bool = False,
    delta_bias: torch.Tensor | None = None,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Launch the kernel: ``weight`` None skips the norm (``y`` None); ``bias`` is LayerNorm's
    (``layer``) or the adaptive shift; a 2-D ``weight``/``bias``/``gate`` has a row per slot of x;
    ``delta_bias`` (W,) is added to delta (LayerNorm's residual). ``fp8``: ``y`` comes as
    ``(q, scale)``, e4m3 ``(..., W)`` and float32 ``(..., 1)``: :func:`flashrt.kernels.fp8.quantize_rows`
    of the ``y`` it would otherwise return."""
    width = x.shape[-1]
    x = x.contiguous()
    splits = 0
    if isinstance(delta, PartialProduct):
        splits, delta = delta.parts.shape[0], delta.parts
    if gate is not None and gate.stride(-1) != 1:  # the kernel steps through a gate row one float at a time
        gate = gate.contiguous()
    h = x if delta is None else torch.empty_like(x)
    y = None if weight is None else torch.empty_like(x, dtype=torch.float8_e4m3fn if fp8 else x.dtype)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device) if fp8 else None
    rows = x.numel() // width if width else 0
    slots = (weight if weight is not None and weight.dim() == 2 else gate if gate is not None else x).shape[0]
    if rows:
        block = triton.next_power_of_2(width)
        per_program = max(1, min(16, 2048 // block))  # short rows: several a program
        programs = triton.cdiv(rows, per_program)
        stand_in = x  # any tensor stands in for an absent one
        _add_norm_kernel[(programs,)](
            x,
            stand_in if delta is None else delta.contiguous(),
            stand_in if delta_bias is None else delta_bias,
            stand_in if gate is None else gate,
            stand_in if weight is None else weight,
            stand_in if bias is None else bias,
            h,
            stand_in if y is None else y,
            stand_in if scale is None else scale,
            rows,
            1 if delta is None else delta.numel() // width // max(splits, 1),
            max(1, rows // slots),
            width,
            eps,
            1 if weight is None else weight.stride(-1),
            1 if bias is None else bias.stride(-1),
            weight.stride(0) if weight is not None and weight.dim() == 2 else 0,
            gate.stride(0) if gate is not None and gate.dim() == 2 else 0,
            1 if delta_bias is None else delta_bias.stride(-1),
            HAS_DELTA=delta is not None,
            DELTA_BIAS=delta is not None and delta_bias is not None,
            GATED=gate is not None,
            NORM=weight is not None,
            LAYER=layer,
            SHIFT=bias is not None and not layer,
            ROWS=per_program,
            BLOCK=block,
            SPLITS=splits,
            FP8=fp8,
            num_warps=4 if block <= 2048 else 8,
            enable_fp_fusion=gate is None,  # no fused multiply-add: torch rounds the gated product, then the sum
            **dependent_launch(x.device, programs),
        )
    return (h, (y, scale)) if fp8 else (h, y)


def add_rms_norm_triton(
    x: torch.Tensor, delta: Delta, weight: torch.Tensor, eps: float, fp8: bool = False
) -> tuple[torch.Tensor, torch.Tensor | Rows]:
    """The Triton kernel (called by :func:`add_rms_norm` on CUDA)."""
    return _add_norm_triton(x, delta, weight, None, eps, fp8=fp8)


def add_layer_norm_triton(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    delta_bias: torch.Tensor | None = None,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | Rows]:
    """The Triton kernel (called by :func:`add_layer_norm` on CUDA)."""
    return _add_norm_triton(x, delta, weight, bias, eps, layer=True, delta_bias=delta_bias, fp8=fp8)


def _check(name: str, x: torch.Tensor, delta: Delta, *params: torch.Tensor) -> None:
    if isinstance(delta, PartialProduct):
        parts = delta.parts
        if parts.dtype != torch.float32 or parts.dim() != x.dim() + 1 or parts.shape[1:] != x.shape:
            raise ValueError(
                f"{name}: a PartialProduct's parts must be float32 (S, *x.shape) for x {tuple(x.shape)}, got "
                f"{parts.dtype} {tuple(parts.shape)}; make it with kernels.matmul.linear_partials over x's rows"
            )
    elif delta is not None and (delta.dim() > x.dim() or delta.shape != x.shape[x.dim() - delta.dim() :]):
        raise ValueError(f"{name}: delta {tuple(delta.shape)} must match x {tuple(x.shape)} or its trailing dims")
    for p in params:
        if p.shape != x.shape[-1:]:
            raise ValueError(f"{name}: weight and bias must be ({x.shape[-1]},), got {tuple(p.shape)}")


def add_rms_norm(
    x: torch.Tensor, delta: Delta, weight: torch.Tensor, eps: float = 1e-6, *, fp8: bool = False
) -> tuple[torch.Tensor, torch.Tensor | Rows]:
    """``(h, y)``: the residual sum ``h = x + delta`` (``x`` if ``delta`` is None) and its RMSNorm
    times ``weight``, over the last dimension. x ``(..., W)``, delta x's shape or its trailing
    dims, of x's dtype, or a :class:`~flashrt.kernels.matmul.PartialProduct` over x's rows
    (added in float32, rounded once); weight ``(W,)``. ``fp8``: ``y`` as :data:`Rows`."""
    _check("add_rms_norm", x, delta, weight)
    tensors = (x, weight) if delta is None else (x, _tensor(delta), weight)
    if use_triton(*tensors) and x.dtype == weight.dtype:
        return add_rms_norm_triton(x, delta, weight, eps, fp8)
    return _rows(add_rms_norm_reference(x, delta, weight, eps), fp8)


def _rows(
    hy: tuple[torch.Tensor, torch.Tensor], fp8: bool
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, Rows]:
    """A reference's ``(h, y)``, with ``fp8`` its ``y`` quantised per row (what the fused kernel
    computes in one pass)."""
    h, y = hy
    return (h, quantize_rows(y)) if fp8 else (h, y)


def _tensor(delta: torch.Tensor | PartialProduct) -> torch.Tensor:
    """The tensor a delta's kernel reads."""
    return delta.parts if isinstance(delta, PartialProduct) else delta


def add_layer_norm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float = 1e-6,
    delta_bias: torch.Tensor | None = None,
    *,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | Rows]:
    """``(h, y)``: the residual sum ``h = x + delta`` (``x`` if ``delta`` is None) and its
    LayerNorm with ``weight`` and ``bias``, over the last dimension. Shapes as :func:`add_rms_norm`
    (a tensor delta).

    ``delta_bias`` ``(W,)``: the bias of the projection that made ``delta``, left out of it and
    added here (``x + (delta + delta_bias)`` in float32, rounded once). cuBLAS's matmul with a bias
    epilogue picks slower kernels at SigLIP's shapes than the plain one (docs/PERFORMANCE.md).
    ``fp8``: ``y`` as :data:`Rows`."""
    if isinstance(delta, PartialProduct):
        raise TypeError("add_layer_norm: delta must be a tensor; add_rms_norm takes a PartialProduct")
    _check("add_layer_norm", x, delta, weight, bias)
    if delta_bias is not None and delta is None:
        raise ValueError("add_layer_norm: a delta_bias needs the delta it belongs to; pass both or neither")
    if delta_bias is not None and delta_bias.shape != x.shape[-1:]:
        raise ValueError(
            f"add_layer_norm: delta_bias must be ({x.shape[-1]},), the bias of the projection that made delta, "
            f"got {tuple(delta_bias.shape)}"
        )
    tensors = [t for t in (x, delta, weight, bias, delta_bias) if t is not None]
    if use_triton(*tensors) and x.dtype == weight.dtype == bias.dtype:
        return add_layer_norm_triton(x, delta, weight, bias, eps, delta_bias, fp8)
    return _rows(add_layer_norm_reference(x, delta, weight, bias, eps, delta_bias), fp8)


def _check_modulation(name: str, x: torch.Tensor, t: torch.Tensor, what: str, rows: int) -> None:
    """``t`` must be ``(rows, W)`` float32 for x ``(..., W)``, or ``(N, rows, W)`` for x ``(N, T, W)``."""
    w = x.shape[-1]
    shared, per_slot = (rows, w), (x.shape[0], rows, w)
    if rows == 1:
        shared, per_slot = (w,), (x.shape[0], w)
    if t.dtype != torch.float32 or (t.shape != shared and not (x.dim() == 3 and t.shape == per_slot)):
        raise ValueError(
            f"{name}: the {what} must be float32 {shared}, or {per_slot} one per slot of x (N, T, W), "
            f"got {t.dtype} {tuple(t.shape)} for x {tuple(x.shape)}; pass AdaRMSNorm.modulation's output"
        )


def add_ada_rms_norm(
    x: torch.Tensor,
    delta: Delta,
    gate: torch.Tensor | None,
    mod: torch.Tensor,
    eps: float = 1e-6,
    *,
    fp8: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | Rows]:
    """pi0.5's adaptive RMSNorm after its gated residual add: ``(h, y)`` with
    ``h = x + delta * gate`` (``x`` if ``delta`` is None) and
    ``y = rms_norm(h) * mod[0] + mod[1]``.

    Args:
        x: ``(N, T, W)`` (or ``(..., W)`` with shared modulations) residual stream.
        delta: x's shape, a :class:`~flashrt.kernels.matmul.PartialProduct` over x's rows (its
            sum rounded to x's dtype before the gate), or None.
        gate: ``(W,)`` or ``(N, W)`` float32, the previous modulation's residual gate (with ``delta``).
        mod: ``(3, W)`` or ``(N, 3, W)`` float32: ``1 + scale``, ``shift`` and gate
            (``policies.layers.AdaRMSNorm.modulation``); rows 0 and 1 are read.
        eps: the norm's epsilon.
        fp8: ``y`` as :data:`Rows`.
    """
    _check("add_ada_rms_norm", x, delta)
    shape = None if delta is None else _tensor(delta).shape[-x.dim() :]
    if delta is not None and (shape != x.shape or gate is None):
        raise ValueError(f"add_ada_rms_norm: a delta must have x's shape {tuple(x.shape)} and come with its gate")
    _check_modulation("add_ada_rms_norm", x, mod, "modulation", 3)
    if gate is not None:
        _check_modulation("add_ada_rms_norm", x, gate, "gate", 1)
    tensors = [t for t in (x, None if delta is None else _tensor(delta), gate, mod) if t is not None]
    if use_triton(*tensors):
        return _add_norm_triton(x, delta, mod.select(-2, 0), mod.select(-2, 1), eps, gate=gate, fp8=fp8)
    return _rows(add_ada_rms_norm_reference(x, delta, gate, mod, eps), fp8)


def add_partials(x: torch.Tensor, delta: PartialProduct) -> torch.Tensor:
    """``x + delta``: a projection's partial products added to the residual where no norm follows
    (the last layer of a stack whose adds were deferred), summed in order, added in float32 and
    rounded once, as :func:`add_rms_norm` adds them. x ``(..., W)``; delta over x's rows."""
    if not isinstance(delta, PartialProduct):
        raise TypeError(f"add_partials: delta must be a PartialProduct, got {type(delta).__name__}")
    _check("add_partials", x, delta)
    if use_triton(x, delta.parts):
        return _add_norm_triton(x, delta, None, None, 0.0)[0]
    return _residual(x, delta)


def gated_add(x: torch.Tensor, delta: torch.Tensor | PartialProduct, gate: torch.Tensor) -> torch.Tensor:
    """``x + delta * gate``: pi0.5's gated residual add, rounded as :func:`add_ada_rms_norm` adds.
    x and delta ``(N, T, W)`` (or ``(..., W)`` with a shared gate; delta may be a
    :class:`~flashrt.kernels.matmul.PartialProduct` over x's rows, its sum rounded to x's dtype
    first); gate ``(W,)`` or ``(N, W)`` float32."""
    _check("gated_add", x, delta)
    if _tensor(delta).shape[-x.dim() :] != x.shape:
        raise ValueError(f"gated_add: delta {tuple(_tensor(delta).shape)} must have x's shape {tuple(x.shape)}")
    _check_modulation("gated_add", x, gate, "gate", 1)
    if use_triton(x, _tensor(delta), gate):
        return _add_norm_triton(x, delta, None, None, 0.0, gate=gate)[0]
    if isinstance(delta, PartialProduct):
        delta = delta.total().to(x.dtype)
    return gated_add_reference(x, delta, gate)
