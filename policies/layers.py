"""The policy's building blocks: norms, a decoder layer, a vision block, folded weights, the
time and position embeddings and the dataset normalisation, shared by :class:`FlowPolicy`
(:mod:`flashrt.policies.model`) and its training form. Each runs its fused kernel on CUDA and
its torch reference elsewhere (:mod:`flashrt.kernels`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from flashrt.kernels import (
    PartialProduct,
    add_ada_rms_norm,
    add_layer_norm,
    add_matmul,
    add_partials,
    add_rms_norm,
    attention,
    fp8,
    gated_add,
    gelu,
    gelu_mul,
    linear,
    linear_geglu,
    linear_gelu,
    qkv_rope,
    rms_norm_geglu,
    rms_norm_qkv_rope,
)
from flashrt.kernels.fp8 import Rows as Fp8Rows
from flashrt.kernels.grouped_attention import Rope, Segment
from flashrt.kernels.matmul import linear_partials, splits
from flashrt.kernels.rotary import split_heads
from flashrt.policies import attention_long

Prefix = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""What a block attends to before its own tokens: segments ``(kv, mask)`` in token order, each
kv ``(N, S, 2, g, T_i, d)`` (every layer) with a bool mask ``(N, T_i)``. Attention reads the
segments where they live (the pipeline's instruction, ring and newest-frame buffers): the
prefix is never laid out as one tensor."""


def layer_segments(prefix: Prefix, layer: int) -> list[Segment]:
    """Layer ``layer``'s keys, values and mask of each prefix segment."""
    return [(kv[:, layer, 0], kv[:, layer, 1], mask) for kv, mask in prefix]


class RMSNorm(nn.Module):
    """Gemma-style RMSNorm: float32 statistics, the normed row rounded before the scale.

    The scale is ``weight``, or with ``plus_one`` Gemma's ``1 + weight`` (folded once per
    weights, so the kernels take it as a plain scale)."""

    def __init__(self, dim: int, eps: float = 1e-6, plus_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps, self.plus_one = eps, plus_one
        self._scale = Folded(lambda: (1.0 + self.weight,), self.weight) if plus_one else None

    def scale(self) -> torch.Tensor:
        """What the normed row is multiplied by: ``weight`` or ``1 + weight``."""
        if self._scale is None:
            return self.weight
        if torch.is_grad_enabled() and self.weight.requires_grad:
            return 1.0 + self.weight
        return self._scale.get()[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)`` (one kernel on CUDA; a decoder layer's norms run inside its projections)."""
        return add_rms_norm(x, None, self.scale(), self.eps)[1]


class AdaRMSNorm(nn.Module):
    """pi0.5's adaptive RMSNorm: a condition ``c`` sets the scale, shift and residual gate,
    ``(scale, shift, gate) = dense(c)``; ``y = norm(x) * (1 + scale) + shift`` in float32
    (LeRobot's ``PiGemmaRMSNorm`` with a condition), and the residual it feeds is added back
    times ``gate``. The kernels take the modulation: :func:`flashrt.kernels.add_ada_rms_norm`,
    :func:`flashrt.kernels.gated_add`."""

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dense = nn.Linear(cond_dim, 3 * dim)
        self.eps = eps

    def modulation(self, cond: torch.Tensor) -> torch.Tensor:
        """(..., 3, dim) float32: ``1 + scale``, ``shift`` and ``gate`` for conditions (..., cond_dim)."""
        scale, shift, gate = self.dense(cond).float().chunk(3, dim=-1)
        return torch.stack([1.0 + scale, shift, gate], dim=-2)


class Folded:
    """Tensors derived from weights once, refreshed in place when the weights change.

    A captured graph reads these tensors by address, so they are rewritten in place (never
    reallocated) when their source parameters change (an optimizer step or a load bumps
    ``Tensor._version``); move or convert the model and they are rebuilt.
    """

    def __init__(self, fn, *params: nn.Parameter) -> None:
        self.fn, self.params = fn, params
        self.key: tuple | None = None
        self.value: tuple[torch.Tensor, ...] = ()

    @torch.no_grad()
    def get(self) -> tuple[torch.Tensor, ...]:
        if torch.compiler.is_compiling():  # traced: fold inside the compiled graph, no cache lookups
            return self.fn()
        key = tuple((p.data_ptr(), p._version, p.dtype) for p in self.params)
        if key != self.key:
            # A graph's kernels load weights before they wait for the kernel ahead of them
            # (kernels.backend): a refresh recorded into the graph would race with its readers.
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "weights changed since the last run and a graph is being captured: run the "
                    "computation once outside the capture (a warm-up) so the derived weights are "
                    "refreshed before it"
                )
            new = self.fn()
            if self.value and all(
                a.shape == b.shape and a.device == b.device and a.dtype == b.dtype
                for a, b in zip(self.value, new, strict=True)
            ):
                for a, b in zip(self.value, new, strict=True):
                    a.copy_(b)
            else:
                self.value = new
            self.key = key
        return self.value


class Fp8Weights:
    """A block's projection weights as per-channel e4m3 copies (:func:`flashrt.kernels.fp8.quantize_weight`),
    derived from its parameters as :class:`Folded` derives (quantised on first use, requantised in
    place when the parameters change, so a captured graph keeps reading the right bytes).

    Args:
        weights: the projections by name, each a function returning its (n, k) weight (kept as
            ``sources``).
        params: the parameters they are made from.
    """

    def __init__(self, weights: dict[str, Callable[[], torch.Tensor]], *params: nn.Parameter) -> None:
        self.names, self.sources = tuple(weights), weights
        self._folded = Folded(
            lambda: tuple(t for n, w in weights.items() for t in fp8.quantize_weight(w(), n)), *params
        )

    def get(self) -> dict[str, fp8.Fp8Weight]:
        """The quantised weights by name."""
        flat = self._folded.get()
        return {n: fp8.Fp8Weight(flat[2 * i], flat[2 * i + 1]) for i, n in enumerate(self.names)}


class Deferred(NamedTuple):
    """A layer's down projection not yet added to the residual stream: ``x + delta`` (pi0), or
    ``x + delta * gate`` (pi0.5's gated add, ``gate`` (W,) or (N, W) float32). The next layer's
    first norm adds it (:meth:`DecoderLayer.forward_deferred`), or :func:`settle` after the last.
    ``delta``: split-k partial products, or (an FP8 layer's down projection) x's shape and dtype."""

    delta: PartialProduct | torch.Tensor
    gate: torch.Tensor | None


def settle(x: torch.Tensor, pending: Deferred | None) -> torch.Tensor:
    """``x`` with a deferred down projection added (``x`` itself where there is none)."""
    if pending is None:
        return x
    if pending.gate is None:
        return add_partials(x, pending.delta) if isinstance(pending.delta, PartialProduct) else x + pending.delta
    return gated_add(x, pending.delta, pending.gate)


class DecoderLayer(nn.Module):
    """Pre-norm layer: GQA self/cross attention with rotary embeddings, gated (GeGLU) MLP.

    Attention over a long block (pi0's block B: thousands of query rows per key/value head) runs
    :mod:`flashrt.policies.attention_long`'s flash kernel, every other call the few-row kernel.
    Per layer on CUDA, at best five kernels: norm + fused q/k/v projection + rotary split
    (keys/values written into the caller's cache view), attention over [context; own], the output
    projection accumulated onto the residual, norm + gate/up projection + GeGLU, and the down
    projection accumulated onto the residual. Where a fused norm + projection does not pay (rows
    wider than ``kernels.norm_linear.FUSED_MAX_WIDTH``, or many rows: cuBLAS is faster there) its
    norm, projection and pointwise step run apart, three kernels for one (nine a layer at most).
    Where a projection's input is split over programs (``kernels.matmul.splits``: pi0's 2 048-wide
    heads and 4 096-wide MLP at few rows), its float32 partial sums go to the kernel after it,
    which adds them to the residual: the norm, pi0.5's gated add, or for the down projection in a
    stack of layers (:meth:`forward_deferred`) the next layer's first norm. Given the rotation
    tables of its tokens (:meth:`forward_deferred`'s ``rope``: the expert inside an Euler loop),
    the layer runs no rotary split: the attention rotates queries and keys as it loads them.
    """

    def __init__(
        self,
        width: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        mlp: int,
        *,
        plus_one: bool = False,
        cond_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        if cond_dim is None:
            self.norm1, self.norm2 = RMSNorm(width, plus_one=plus_one), RMSNorm(width, plus_one=plus_one)
        else:  # pi0.5's time-conditioned expert: see forward's ``mod``
            self.norm1, self.norm2 = AdaRMSNorm(width, cond_dim), AdaRMSNorm(width, cond_dim)
        self.q = nn.Linear(width, heads * head_dim, bias=False)
        self.kv = nn.Linear(width, 2 * kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, width, bias=False)
        self.gate_up = nn.Linear(width, 2 * mlp, bias=False)
        self.down = nn.Linear(mlp, width, bias=False)
        self._qkv = Folded(lambda: (torch.cat([self.q.weight, self.kv.weight]),), self.q.weight, self.kv.weight)
        self.fp8: Fp8Weights | None = None

    @property
    def adaptive(self) -> bool:
        return isinstance(self.norm1, AdaRMSNorm)

    def quantize_fp8(self, on: bool = True) -> None:
        """Run the four projections (q/k/v, o, gate/up, down) as FP8 GEMMs (``on``), or in the
        weights' dtype again. The parameters stay as they are; the e4m3 copies are derived."""
        ws = (self.q.weight, self.kv.weight, self.o.weight, self.gate_up.weight, self.down.weight)
        named = {"qkv": lambda: torch.cat([self.q.weight, self.kv.weight]), "o": lambda: self.o.weight,
                 "gate_up": lambda: self.gate_up.weight, "down": lambda: self.down.weight}  # fmt: skip
        self.fp8 = Fp8Weights(named, *ws) if on else None

    def fused_weights(self) -> tuple[torch.Tensor, ...]:
        """norm1, q/k/v, o, norm2, gate/up and down weights: what :mod:`flashrt.kernels.expert_layer`
        takes (norm scales as applied); empty for an adaptive or FP8 layer, which no fused kernel takes."""
        if self.adaptive or self.fp8 is not None:
            return ()
        return (self.norm1.scale(), self.qkv_weight(), self.o.weight, self.norm2.scale(), self.gate_up.weight,
                self.down.weight)  # fmt: skip

    def qkv_weight(self) -> torch.Tensor:
        """[W_q; W_kv]: one projection for queries, keys and values."""
        if torch.is_grad_enabled() and self.q.weight.requires_grad:
            return torch.cat([self.q.weight, self.kv.weight])
        return self._qkv.get()[0]

    def forward(
        self,
        x: torch.Tensor,
        pos0: torch.Tensor,
        inv_freq: torch.Tensor,
        context: Sequence[Segment] = (),
        own_mask: torch.Tensor | None = None,
        kv_out: torch.Tensor | None = None,
        mod: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, T, W) at positions ``pos0 + t`` attends to the context segments (keys/values
        (N, g, T_i, d), masks (N, T_i)) and to itself (``own_mask`` (N, T)). Returns the new x and
        its own keys/values (N, g, T, d), written into ``kv_out`` (N, 2, g, T, d) when given.

        An adaptive layer takes ``mod`` (2, 3, W) or (N, 2, 3, W): each norm's ``1 + scale``,
        ``shift`` and residual gate (:meth:`AdaRMSNorm.modulation`), as pi0.5 computes it.

        Unless autograd records through it, the residual stream is updated in place: x is
        overwritten and returned (pass a tensor no one else reads, as every caller here does)."""
        x, _, k, v = self.forward_deferred(x, None, pos0, inv_freq, context, own_mask, kv_out, mod, defer=False)
        return x, k, v

    def forward_deferred(
        self,
        x: torch.Tensor,
        pending: Deferred | None,
        pos0: torch.Tensor,
        inv_freq: torch.Tensor,
        context: Sequence[Segment] = (),
        own_mask: torch.Tensor | None = None,
        kv_out: torch.Tensor | None = None,
        mod: torch.Tensor | None = None,
        *,
        defer: bool = True,
        rope: Rope | None = None,
    ) -> tuple[torch.Tensor, Deferred | None, torch.Tensor | None, torch.Tensor | None]:
        """:meth:`forward` in a stack of layers: the layer's input is ``x`` plus ``pending`` (the
        down projection of the layer before, not yet added), and with ``defer`` its own down
        projection is returned as a :class:`Deferred` where it splits its input over programs
        (``kernels.matmul.splits``: the 4 096-wide expert MLP of pi0 and pi0.5 at few rows), else
        added (pending None). Returns ``(x, pending, k, v)``.

        The first norm of the next layer adds a deferred projection in the kernel that reads x
        anyway, so neither a reduce kernel nor an add runs for it; :func:`settle` adds the last.

        ``rope``: the rotation tables of the tokens at ``pos0 + t``
        (:func:`flashrt.kernels.rotary.rope_tables`, made once for a stack's calls). The
        attention then rotates queries and keys as it loads them from the q/k/v projection, so
        no rotary kernel runs between (where :func:`flashrt.kernels.grouped_attention.rotates_on_load`
        holds); the keys are then never stored, and k and v are returned as None."""
        n, t, _ = x.shape
        n1, n2 = self.norm1, self.norm2
        if rope is not None and kv_out is not None:
            raise ValueError(
                "forward_deferred: rope rotates keys inside attention and stores none, but kv_out asks for them; "
                "pass one or the other"
            )
        if pending is not None and (pending.gate is None) == self.adaptive:
            raise ValueError(
                "forward_deferred: a pending projection needs its gate exactly where the layer is adaptive "
                "(pi0.5); pass the pending that the layer before returned"
            )
        if self.fp8 is not None:
            return self._forward_fp8(x, pending, pos0, inv_freq, context, own_mask, kv_out, mod, defer, rope)
        if self.adaptive:
            if mod is None:
                raise ValueError("an adaptive (time-conditioned) layer needs its modulation `mod`")
            m1, m2 = mod.unbind(-3)
            if pending is None:
                _, y = add_ada_rms_norm(x, None, None, m1, n1.eps)
            else:
                x, y = add_ada_rms_norm(x, pending.delta, pending.gate, m1, n1.eps)
            a, k, v = self._attend(linear(y, self.qkv_weight()), pos0, inv_freq, context, own_mask, kv_out, rope)
            o = linear_partials(a, self.o.weight) if splits(a, self.o.weight) else linear(a, self.o.weight)
            x, y = add_ada_rms_norm(x, o, m1.select(-2, 2), m2, n2.eps)
            h = linear_geglu(y, self.gate_up.weight)
            if splits(h, self.down.weight):
                down = Deferred(linear_partials(h, self.down.weight), m2.select(-2, 2))
                return (x, down, k, v) if defer else (settle(x, down), None, k, v)
            return gated_add(x, linear(h, self.down.weight), m2.select(-2, 2)), None, k, v
        if pending is None and rope is None:  # norm, projection and rotation: one kernel at narrow rows
            q, k, v = rms_norm_qkv_rope(
                x, n1.scale(), n1.eps, self.qkv_weight(), pos0, inv_freq, self.heads, self.kv_heads, kv_out
            )
            a = attention_long.attention(q, k, v, own_mask, context).reshape(n, t, -1)
        else:
            x, y = add_rms_norm(x, None if pending is None else pending.delta, n1.scale(), n1.eps)
            a, k, v = self._attend(linear(y, self.qkv_weight()), pos0, inv_freq, context, own_mask, kv_out, rope)
        if splits(a, self.o.weight):
            x, y = add_rms_norm(x, linear_partials(a, self.o.weight), n2.scale(), n2.eps)
            h = linear_geglu(y, self.gate_up.weight)
        else:
            x = add_matmul(x, a, self.o.weight)
            h = rms_norm_geglu(x, n2.scale(), n2.eps, self.gate_up.weight)
        if defer and splits(h, self.down.weight):
            return x, Deferred(linear_partials(h, self.down.weight), None), k, v
        return add_matmul(x, h, self.down.weight), None, k, v

    def _forward_fp8(
        self,
        x: torch.Tensor,
        pending: Deferred | None,
        pos0: torch.Tensor,
        inv_freq: torch.Tensor,
        context: Sequence[Segment],
        own_mask: torch.Tensor | None,
        kv_out: torch.Tensor | None,
        mod: torch.Tensor | None,
        defer: bool,
        rope: Rope | None,
    ) -> tuple[torch.Tensor, Deferred | None, torch.Tensor | None, torch.Tensor | None]:
        """:meth:`forward_deferred` with the four projections as FP8 GEMMs
        (:func:`flashrt.kernels.fp8.linear`): each norm and the GeGLU quantise their output per
        row in their own kernel (``fp8=True``) for the projection after them; rotary, attention
        and the residual adds are the bf16 path's kernels; the down projection is deferred as a
        tensor."""
        w = self.fp8.get()
        delta = None if pending is None else pending.delta
        if self.adaptive:
            if mod is None:
                raise ValueError("an adaptive (time-conditioned) layer needs its modulation `mod`")
            m1, m2 = mod.unbind(-3)
            gate = None if pending is None else pending.gate
            x, y = add_ada_rms_norm(x, delta, gate, m1, self.norm1.eps, fp8=True)
        else:
            x, y = add_rms_norm(x, delta, self.norm1.scale(), self.norm1.eps, fp8=True)
        qkv = fp8.linear_rows(y, w["qkv"], dtype=x.dtype)
        a, k, v = self._attend(qkv, pos0, inv_freq, context, own_mask, kv_out, rope)
        o = fp8.linear(a, w["o"])
        if self.adaptive:
            x, y = add_ada_rms_norm(x, o, m1.select(-2, 2), m2, self.norm2.eps, fp8=True)
        else:
            x, y = add_rms_norm(x, o, self.norm2.scale(), self.norm2.eps, fp8=True)
        h = gelu_mul(fp8.linear_rows(y, w["gate_up"], dtype=x.dtype), fp8=True)
        down = Deferred(fp8.linear_rows(h, w["down"], dtype=x.dtype), m2.select(-2, 2) if self.adaptive else None)
        return (x, down, k, v) if defer else (settle(x, down), None, k, v)

    def _attend(
        self,
        qkv: torch.Tensor,
        pos0: torch.Tensor,
        inv_freq: torch.Tensor,
        context: Sequence[Segment],
        own_mask: torch.Tensor | None,
        kv_out: torch.Tensor | None,
        rope: Rope | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Attention of the projected tokens ``qkv`` (N, T, (h + 2g) d): its output (N, T, h d)
        and the own keys and values; with ``rope`` the heads are rotated inside the attention
        and the keys and values are None."""
        n, t, _ = qkv.shape
        if rope is None:
            q, k, v = qkv_rope(qkv, pos0, inv_freq, self.heads, self.kv_heads, kv_out)
            return attention_long.attention(q, k, v, own_mask, context).reshape(n, t, -1), k, v
        q, k, v = split_heads(qkv, self.heads, self.kv_heads)
        return attention_long.attention(q, k, v, own_mask, context, rope).reshape(n, t, -1), None, None


class Biased(NamedTuple):
    """A projection's output with its bias not yet added: the LayerNorm that adds it to the
    residual stream adds the bias too (:func:`flashrt.kernels.add_layer_norm`'s ``delta_bias``)."""

    product: torch.Tensor
    bias: torch.Tensor | None


def layer_norm(
    norm: nn.LayerNorm, x: torch.Tensor, delta: Biased, fp8: bool = False
) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
    """``(x + delta, norm(x + delta))`` (one fused kernel on CUDA); with ``fp8`` the norm's output
    quantised per row in that kernel (:data:`flashrt.kernels.fp8.Rows`)."""
    return add_layer_norm(x, delta.product, norm.weight, norm.bias, norm.eps, delta.bias, fp8=fp8)


class VisionBlock(nn.Module):
    """SigLIP-shaped encoder block: LayerNorm, full multi-head attention, GELU MLP.

    The residual stream arrives as ``x + delta``, the previous block's MLP output not yet added:
    each add runs inside the norm kernel that reads its sum (so does the position embedding's,
    in the first block), and so does each add of the output and second MLP projections' biases
    (:class:`Biased`). At a few frames every kernel is Triton (projections from
    :mod:`flashrt.kernels.matmul`, attention from :mod:`flashrt.kernels.grouped_attention`), so inside a graph
    each launches dependent; at many, cuBLAS and SDPA's fused kernels run.
    """

    def __init__(self, width: int, heads: int, mlp: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width, eps=eps), nn.LayerNorm(width, eps=eps)
        self.qkv = nn.Linear(width, 3 * width)
        self.o = nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, mlp), nn.Linear(mlp, width)
        self.fp8: Fp8Weights | None = None

    def quantize_fp8(self, on: bool = True) -> None:
        """Run the four projections (q/k/v, o, fc1, fc2) as FP8 GEMMs (``on``), or in the weights'
        dtype again. The parameters stay as they are; the e4m3 copies are derived, fc2's with
        ``k`` zero-padded to a multiple of :data:`flashrt.kernels.fp8.K_STEP` (the GELU before it
        writes the input's zeros)."""
        mods = {"qkv": self.qkv, "o": self.o, "fc1": self.fc1, "fc2": self.fc2}
        named = {name: (lambda m=m: m.weight) for name, m in mods.items()}
        named["fc2"] = lambda: fp8.pad_k(self.fc2.weight)  # k padded: the GELU writes the zeros
        self.fp8 = Fp8Weights(named, *(m.weight for m in mods.values())) if on else None

    def forward(self, x: torch.Tensor, delta: Biased, patches: int) -> tuple[torch.Tensor, Biased]:
        """x (N, C*P, W) and the pending ``delta`` (x's shape or its trailing dims) -> the block's
        output as the same pair (the stream is their sum); attention runs within each image of
        ``patches`` tokens. With :meth:`quantize_fp8` the projections are FP8 GEMMs (the GELU
        in bf16, apart, quantising its output)."""
        n, t, w = x.shape
        if self.fp8 is not None:
            return self._forward_fp8(x, delta, patches)
        x, h = layer_norm(self.norm1, x, delta)
        qkv = linear(h, self.qkv.weight, self.qkv.bias)
        attn = self._attention(qkv, n, t, w, patches)
        x, h = layer_norm(self.norm2, x, Biased(linear(attn, self.o.weight), self.o.bias))
        return x, Biased(linear(linear_gelu(h, self.fc1.weight, self.fc1.bias), self.fc2.weight), self.fc2.bias)

    def _forward_fp8(self, x: torch.Tensor, delta: Biased, patches: int) -> tuple[torch.Tensor, Biased]:
        """:meth:`forward` with the four projections as FP8 GEMMs: each norm, and the GELU,
        quantise their output per row in their own kernel (``fp8=True``); the q/k/v and fc1
        biases are added in their GEMM's epilogue, the others by the norm after."""
        n, t, w = x.shape
        q8 = self.fp8.get()
        x, h = layer_norm(self.norm1, x, delta, fp8=True)
        attn = self._attention(fp8.linear_rows(h, q8["qkv"], self.qkv.bias, dtype=x.dtype), n, t, w, patches)
        x, h = layer_norm(self.norm2, x, Biased(fp8.linear(attn, q8["o"]), self.o.bias), fp8=True)
        f = gelu(fp8.linear_rows(h, q8["fc1"], self.fc1.bias, dtype=x.dtype), fp8=True, width=q8["fc2"].data.shape[1])
        return x, Biased(fp8.linear_rows(f, q8["fc2"], dtype=x.dtype), self.fc2.bias)

    def _attention(self, qkv: torch.Tensor, n: int, t: int, w: int, patches: int) -> torch.Tensor:
        """Full attention within each image of ``patches`` tokens: (N, C*P, 3W) -> (N, C*P, W)."""
        q, k, v = qkv.view(n * t // patches, patches, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        return attention(q, k, v, None).reshape(n, t, w)  # (N*C, P, heads, w/heads) -> (N, C*P, W)


def sincos(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """pi0's sinusoidal time embedding: (n,) -> (n, dim)."""
    frac = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** frac
    ang = t.double()[:, None] * (2 * math.pi / period)
    return torch.cat([ang.sin(), ang.cos()], dim=-1).float()


def euler_times(steps: int, dtype: str, device: torch.device | None = None) -> torch.Tensor:
    """(steps,) float64: the Euler times ``1 - s/steps``, exact (``"float64"``) or as LeRobot
    holds them (``"float32"``: ``1.0 + s * (-1/steps)`` rounded to float32)."""
    if dtype == "float64":
        return 1.0 - torch.arange(steps, dtype=torch.float64, device=device) / steps
    dt = -1.0 / steps
    return torch.tensor([1.0 + s * dt for s in range(steps)], dtype=torch.float32, device=device).double()


NORM_EPS = 1e-8
"""LeRobot's normaliser epsilon (its ``NormalizerProcessorStep`` default)."""


def normalize(x: torch.Tensor, mode: str, stats: torch.Tensor | None, inverse: bool = False) -> torch.Tensor:
    """LeRobot's dataset normalisation (its formulas, their rounding, epsilon 1e-8) of float32 x
    (..., D) with ``stats`` (2, D): (mean, std), (min, max) or the two quantiles per ``mode``."""
    if mode == "identity":
        return x
    a, b = stats[0], stats[1]
    if mode == "mean_std":
        return x * b + a if inverse else (x - a) / (b + NORM_EPS)
    denom = b - a
    denom = torch.where(denom == 0, NORM_EPS, denom)  # a Python scalar: nothing is copied inside a capture
    if mode == "min_max":
        return (x + 1) / 2 * denom + a if inverse else 2 * (x - a) / denom - 1
    return (x + 1.0) * denom / 2.0 + a if inverse else 2.0 * (x - a) / denom - 1.0  # quantiles, quantile10


def sincos_2d(grid: int, dim: int) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding of a grid x grid patch layout: (grid*grid, dim)."""
    ys, xs = torch.meshgrid(
        torch.arange(grid, dtype=torch.float32), torch.arange(grid, dtype=torch.float32), indexing="ij"
    )
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float32) / max(1, dim // 4))
    ang_y, ang_x = ys.flatten()[:, None] * omega, xs.flatten()[:, None] * omega
    emb = torch.cat([ang_y.sin(), ang_y.cos(), ang_x.sin(), ang_x.cos()], dim=1)
    return torch.nn.functional.pad(emb, (0, dim - emb.shape[1]))
