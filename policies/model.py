"""A pi0-shaped flow-matching VLA in a few hundred lines.

Shapes in comments: N slots (batch), L instruction words, C cameras, P patches per camera,
T_B = C*P + 1 frame tokens (block B), R = (n_obs_steps - 1) * T_B ring tokens, H horizon,
A action dim, D prefix width, E expert width, h heads, g kv heads, d head dim, S layers.

- Vision: a SigLIP-shaped ViT over each camera's patches of the newest frame, projected to D.
- Prefix transformer (Gemma-shaped: RMSNorm, GQA, rotary, gated MLP). Block A (instruction)
  attends only to itself, so its keys/values are computed once per instruction. Block B (image
  tokens + a proprio token) attends to A, the ring of previous frames and itself.
- Action expert: a narrower transformer with the same depth, heads and head dim; layer l of
  the expert attends to the prefix keys/values of layer l and to its own action tokens.
- Flow matching: t = 1 noise, t = 0 data; x_t = t*noise + (1-t)*actions; target noise - actions;
  Euler x <- x - v/steps at t = 1, 1 - 1/steps, ...; time embeddings are precomputed per step.

Keys/values are laid out ``(N, S, 2, g, T, d)``: the caches of the static-buffer pipeline
(`policies.pipeline`) have exactly this shape, and training builds the same tensors on the fly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from flashrt.kernels import (
    add_layer_norm,
    add_matmul,
    add_rms_norm,
    attention,
    euler_step,
    expert_layer,
    linear,
    linear_gelu,
    rms_norm_geglu,
    rms_norm_qkv_rope,
    time_embed,
)
from flashrt.kernels.grouped_attention import Segment
from flashrt.policies.config import PolicyConfig

Prefix = Sequence[tuple[torch.Tensor, torch.Tensor]]
"""What a block attends to before its own tokens: segments ``(kv, mask)`` in token order, each
kv ``(N, S, 2, g, T_i, d)`` (every layer) with a bool mask ``(N, T_i)``. Attention reads the
segments where they live (the pipeline's instruction, ring and newest-frame buffers): the
prefix is never laid out as one tensor."""


def layer_segments(prefix: Prefix, layer: int) -> list[Segment]:
    """Layer ``layer``'s keys, values and mask of each prefix segment."""
    return [(kv[:, layer, 0], kv[:, layer, 1], mask) for kv, mask in prefix]


class RMSNorm(nn.Module):
    """Gemma-style RMSNorm: float32 statistics, the normed row rounded before the weight."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``norm(x)`` (one kernel on CUDA; a decoder layer's norms run inside its projections)."""
        return add_rms_norm(x, None, self.weight, self.eps)[1]


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
                a.shape == b.shape and a.device == b.device for a, b in zip(self.value, new, strict=True)
            ):
                for a, b in zip(self.value, new, strict=True):
                    a.copy_(b)
            else:
                self.value = new
            self.key = key
        return self.value


class DecoderLayer(nn.Module):
    """Pre-norm layer: GQA self/cross attention with rotary embeddings, gated (GeGLU) MLP.

    Per layer on CUDA, at best five kernels: norm + fused q/k/v projection + rotary split
    (keys/values written into the caller's cache view), attention over [context; own], the output
    projection accumulated onto the residual, norm + gate/up projection + GeGLU, and the down
    projection accumulated onto the residual. Where a fused norm + projection does not pay (rows
    wider than ``kernels.norm_linear.FUSED_MAX_WIDTH``, or many rows: cuBLAS is faster there) its
    norm, projection and pointwise step run apart, three kernels for one (nine a layer at most).
    """

    def __init__(self, width: int, heads: int, kv_heads: int, head_dim: int, mlp: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        self.q = nn.Linear(width, heads * head_dim, bias=False)
        self.kv = nn.Linear(width, 2 * kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, width, bias=False)
        self.gate_up = nn.Linear(width, 2 * mlp, bias=False)
        self.down = nn.Linear(mlp, width, bias=False)
        self._qkv = Folded(lambda: (torch.cat([self.q.weight, self.kv.weight]),), self.q.weight, self.kv.weight)

    def fused_weights(self) -> tuple[torch.Tensor, ...]:
        """norm1, q/k/v, o, norm2, gate/up and down weights: what :mod:`flashrt.kernels.expert_layer` takes."""
        return (self.norm1.weight, self.qkv_weight(), self.o.weight, self.norm2.weight, self.gate_up.weight,
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
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, T, W) at positions ``pos0 + t`` attends to the context segments (keys/values
        (N, g, T_i, d), masks (N, T_i)) and to itself (``own_mask`` (N, T)). Returns the new x and
        its own keys/values (N, g, T, d), written into ``kv_out`` (N, 2, g, T, d) when given.

        Unless autograd records through it, the residual stream is updated in place: x is
        overwritten and returned (pass a tensor no one else reads, as every caller here does)."""
        n, t, _ = x.shape
        n1, n2 = self.norm1, self.norm2
        q, k, v = rms_norm_qkv_rope(
            x, n1.weight, n1.eps, self.qkv_weight(), pos0, inv_freq, self.heads, self.kv_heads, kv_out
        )
        x = add_matmul(x, attention(q, k, v, own_mask, context).reshape(n, t, -1), self.o.weight)
        x = add_matmul(x, rms_norm_geglu(x, n2.weight, n2.eps, self.gate_up.weight), self.down.weight)
        return x, k, v


def layer_norm(norm: nn.LayerNorm, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, norm(x + delta))`` (one fused kernel on CUDA)."""
    return add_layer_norm(x, delta, norm.weight, norm.bias, norm.eps)


class VisionBlock(nn.Module):
    """SigLIP-shaped encoder block: LayerNorm, full multi-head attention, GELU MLP.

    The residual stream arrives as ``x + delta``, the previous block's MLP output not yet added:
    each add runs inside the norm kernel that reads its sum (so does the position embedding's,
    in the first block). At a few frames every kernel is Triton (projections from
    :mod:`flashrt.kernels.matmul`, attention from :mod:`flashrt.kernels.grouped_attention`), so inside a graph
    each launches dependent; at many, cuBLAS and SDPA's fused kernels run.
    """

    def __init__(self, width: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.o = nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, mlp), nn.Linear(mlp, width)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, patches: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, C*P, W) and the pending ``delta`` (x's shape or its trailing dims) -> the block's
        output as the same pair (the stream is their sum); attention runs within each image of
        ``patches`` tokens."""
        n, t, w = x.shape
        x, h = layer_norm(self.norm1, x, delta)
        qkv = linear(h, self.qkv.weight, self.qkv.bias)
        q, k, v = qkv.view(n * t // patches, patches, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attn = attention(q, k, v, None).reshape(n, t, w)  # (N*C, P, heads, w/heads) -> (N, C*P, W)
        x, h = layer_norm(self.norm2, x, linear(attn, self.o.weight, self.o.bias))
        return x, linear(linear_gelu(h, self.fc1.weight, self.fc1.bias), self.fc2.weight, self.fc2.bias)


def sincos(t: torch.Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0) -> torch.Tensor:
    """pi0's sinusoidal time embedding: (n,) -> (n, dim)."""
    frac = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** frac
    ang = t.double()[:, None] * (2 * math.pi / period)
    return torch.cat([ang.sin(), ang.cos()], dim=-1).float()


def sincos_2d(grid: int, dim: int) -> torch.Tensor:
    """Fixed 2-D sin-cos position embedding of a grid x grid patch layout: (grid*grid, dim)."""
    ys, xs = torch.meshgrid(
        torch.arange(grid, dtype=torch.float32), torch.arange(grid, dtype=torch.float32), indexing="ij"
    )
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float32) / max(1, dim // 4))
    ang_y, ang_x = ys.flatten()[:, None] * omega, xs.flatten()[:, None] * omega
    emb = torch.cat([ang_y.sin(), ang_y.cos(), ang_x.sin(), ang_x.cos()], dim=1)
    return torch.nn.functional.pad(emb, (0, dim - emb.shape[1]))


class FlowPolicy(nn.Module):
    """The policy's weights and its three computations: instruction, frame, and denoising."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.cfg = c = cfg
        self.text_embed = nn.Embedding(len(c.vocab) + 2, c.width)
        self.patch_embed = nn.Linear(3 * c.patch_size**2, c.vision_width)
        grid = c.image_size // c.patch_size  # learned, from a 2-D sin-cos start (ViTs from scratch need it)
        self.vision_pos = nn.Parameter(sincos_2d(grid, c.vision_width).expand(c.num_cameras, -1, -1).clone())
        self.vision = nn.ModuleList(
            VisionBlock(c.vision_width, c.vision_heads, c.vision_mlp) for _ in range(c.vision_depth)
        )
        self.vision_norm = nn.LayerNorm(c.vision_width)
        self.projector = nn.Linear(c.vision_width, c.width)
        self.proprio_proj = nn.Linear(c.proprio_dim, c.width)
        self.prefix = nn.ModuleList(
            DecoderLayer(c.width, c.heads, c.kv_heads, c.head_dim, c.mlp) for _ in range(c.depth)
        )
        self.prefix_norm = RMSNorm(c.width)
        self.action_in = nn.Linear(c.action_dim, c.expert_width)
        self.time_in = nn.Linear(2 * c.expert_width, c.expert_width)
        self.time_out = nn.Linear(c.expert_width, c.expert_width)
        self.expert = nn.ModuleList(
            DecoderLayer(c.expert_width, c.heads, c.kv_heads, c.head_dim, c.expert_mlp) for _ in range(c.depth)
        )
        self.expert_norm = RMSNorm(c.expert_width)
        self.action_out = nn.Linear(c.expert_width, c.action_dim)
        self.register_buffer("inv_freq", self._rope_frequencies(), persistent=False)  # (d/2,) float32
        self._flow = Folded(self._fold_flow, *self.action_in.parameters(), *self.time_in.parameters(),
                            *self.action_out.parameters())  # fmt: skip
        self.apply(self._init)

    def _rope_frequencies(self) -> torch.Tensor:
        """(d/2,) float32 rotary frequencies ``theta ** (-2i / d)``, computed on the CPU (the same
        bits wherever the model then lives)."""
        c = self.cfg
        return c.rope_theta ** (-torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)

    def _apply(self, fn, recurse: bool = True) -> FlowPolicy:
        """Module conversions (``.to(dtype)``, ``.bfloat16()``, ...) move the rotary frequencies
        but keep them float32, as training computes the angles: rounded to bf16 a frequency is off
        by up to 2^-9 of itself, so a position's angle is off by radians after a few thousand
        tokens (an episode's late frames), and ``kernels.expert_layer`` reads them as float32."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = self._rope_frequencies().to(self.inv_freq.device)
        return self

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    @property
    def dtype(self) -> torch.dtype:
        return self.action_in.weight.dtype

    def frame_start(self, frame: torch.Tensor) -> torch.Tensor:
        """(N,) position of the first token of frame ``frame`` (N,): after the instruction, T_B
        per frame (the action tokens of a chunk sit where the next frame will)."""
        return self.cfg.max_text_len + frame * self.cfg.frame_tokens

    def _kv_cache(self, x: torch.Tensor) -> torch.Tensor | None:
        """(N, S, 2, g, T, d) for the layers of tokens x (N, T, W) to write their keys/values
        into; None while recording autograd (in-place writes would clobber saved tensors)."""
        if torch.is_grad_enabled():
            return None
        c = self.cfg
        return x.new_empty((x.shape[0], c.depth, 2, c.kv_heads, x.shape[1], c.head_dim))

    @staticmethod
    def _stack(kv: torch.Tensor | None, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return kv if kv is not None else torch.stack([torch.stack(p, 1) for p in kvs], 1)

    # -- block A -------------------------------------------------------------------------------
    def encode_text(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask (N, L) -> instruction keys/values (N, S, 2, g, L, d)."""
        x = self.text_embed(ids).to(self.dtype) * math.sqrt(self.cfg.width)
        pos0 = torch.zeros(ids.shape[0], dtype=torch.int64, device=ids.device)
        kv, kvs = self._kv_cache(x), []
        for i, layer in enumerate(self.prefix):
            x, k, v = layer(x, pos0, self.inv_freq, own_mask=mask, kv_out=None if kv is None else kv[:, i])
            kvs.append((k, v))
        return self._stack(kv, kvs)

    # -- block B -------------------------------------------------------------------------------
    def embed_frame(self, image: torch.Tensor, proprio: torch.Tensor) -> torch.Tensor:
        """image (N, C, H, W, 3) uint8, proprio (N, P) -> frame tokens (N, T_B, D)."""
        c = self.cfg
        n, ps, g = image.shape[0], c.patch_size, c.image_size // c.patch_size
        x = image.to(self.dtype) * (2.0 / 255.0) - 1.0
        x = x.view(n * c.num_cameras, g, ps, g, ps, 3).permute(0, 1, 3, 2, 4, 5).reshape(n * c.num_cameras, g * g, -1)
        x = linear(x, self.patch_embed.weight, self.patch_embed.bias).view(n, c.num_cameras * c.patches, -1)
        delta = self.vision_pos.view(c.num_cameras * c.patches, -1)  # added to every slot by the first norm
        for block in self.vision:
            x, delta = block(x, delta, c.patches)
        x = linear(layer_norm(self.vision_norm, x, delta)[1], self.projector.weight, self.projector.bias)  # (N, C*P, D)
        return torch.cat([x, self.proprio_proj(proprio.to(self.dtype))[:, None]], dim=1)

    def encode_frame(
        self,
        image: torch.Tensor,
        proprio: torch.Tensor,
        frame: torch.Tensor,
        context: Prefix,
        kv_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The newest frame over its context (instruction + ring) -> its keys/values
        (N, S, 2, g, T_B, d), written into ``kv_out`` when given (evaluation only), and pooled
        features (N, D)."""
        x = self.embed_frame(image, proprio)
        pos0 = self.frame_start(frame)
        kv, kvs = self._kv_cache(x) if kv_out is None else kv_out, []
        for i, layer in enumerate(self.prefix):
            out = None if kv is None else kv[:, i]
            x, k, v = layer(x, pos0, self.inv_freq, layer_segments(context, i), kv_out=out)
            kvs.append((k, v))
        return self._stack(kv, kvs), self.prefix_norm(x).mean(1, dtype=torch.float32)

    # -- action expert -------------------------------------------------------------------------
    def velocity(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        prefix: Prefix,
        frame: torch.Tensor,
    ) -> torch.Tensor:
        """v(x_t, t) for noisy actions x (N, H, A) at flow times t (N,) over the prefix: the
        training form (unfolded, differentiable)."""
        c = self.cfg
        a = self.action_in(x.to(self.dtype))
        te = sincos(t, c.expert_width).to(a.device, self.dtype)[:, None].expand(-1, a.shape[1], -1)
        h = self.time_out(F.silu(self.time_in(torch.cat([a, te], dim=-1))))
        h = self._expert_layers(h, prefix, self.frame_start(frame + 1))
        return self.action_out(self.expert_norm(h)).float()

    def _expert_layers(self, h: torch.Tensor, prefix: Prefix, pos0: torch.Tensor) -> torch.Tensor:
        """The expert's layers over the prefix (before its final norm): (N, H, E)."""
        for i, layer in enumerate(self.expert):
            context, weights = layer_segments(prefix, i), layer.fused_weights()
            if expert_layer.fits(h, context, *weights):  # at few slots: one CUDA kernel a layer
                eps = (layer.norm1.eps, layer.norm2.eps)
                h = expert_layer.expert_layer(h, pos0, self.inv_freq, context, weights, eps)
            else:
                h, _, _ = layer(h, pos0, self.inv_freq, context)
        return h

    def _fold_flow(self) -> tuple[torch.Tensor, ...]:
        """The Euler loop's folded float32 weights (see :mod:`flashrt.kernels.flow`): wx (E, A), per-step
        bias (steps, E), w_out (A, E) and b_out (A,) scaled by -1/steps."""
        c, e = self.cfg, self.cfg.expert_width
        w_in, b_in = self.action_in.weight.float(), self.action_in.bias.float()
        w_t, b_t = self.time_in.weight.float(), self.time_in.bias.float()
        times = 1.0 - torch.arange(c.steps, dtype=torch.float64, device=w_in.device) / c.steps
        te = sincos(times, e)  # (steps, E): the Euler times t_s = 1 - s/steps
        bias = w_t[:, :e] @ b_in + te @ w_t[:, e:].T + b_t
        scale = -1.0 / c.steps
        return w_t[:, :e] @ w_in, bias, self.action_out.weight.float() * scale, self.action_out.bias.float() * scale

    @torch.no_grad()
    def sample(self, noise: torch.Tensor, prefix: Prefix, frame: torch.Tensor) -> torch.Tensor:
        """Euler integration from noise (t = 1) to actions (t = 0): (N, H, A) float32.

        Per step: folded time embedding, time_out, the expert's layers, then one kernel for the
        final norm, output projection and update ``x <- x - v / steps``."""
        wx, bias, w_out, b_out = self._flow.get()
        x = noise.float().contiguous()
        pos0 = self.frame_start(frame + 1)
        for s in range(self.cfg.steps):
            h = time_embed(x, wx, bias[s], self.dtype)
            h = self._expert_layers(linear(h, self.time_out.weight, self.time_out.bias), prefix, pos0)
            x = euler_step(x, h, self.expert_norm.weight, w_out, b_out, self.expert_norm.eps)
        return x

    # -- training ------------------------------------------------------------------------------
    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> torch.Tensor:
        """Flow-matching loss on a batch of windows.

        batch: ``text_ids``/``text_mask`` (B, L); ``images`` (B, n_obs, C, H, W, 3) uint8 and
        ``proprio`` (B, n_obs, P), oldest frame first; ``frame_valid`` (B, n_obs) bool (frames
        before the episode start are False; the last is always True); ``frame`` (B,) int64 index
        of the newest frame in its episode; ``actions`` (B, H, A); ``action_mask`` (B, H).
        The window is encoded frame by frame exactly as the pipeline does at run time.
        """
        prefix = self.encode_window(batch)
        actions = batch["actions"].float()
        b = actions.shape[0]
        # pi0's time distribution Beta(1.5, 1) * 0.999 + 0.001, by its inverse CDF u ** (1 / 1.5)
        u = torch.rand(b, generator=generator, device=actions.device)
        t = u.pow(1 / 1.5) * 0.999 + 0.001
        noise = torch.randn(actions.shape, generator=generator, device=actions.device)
        x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
        v = self.velocity(x_t, t, prefix, batch["frame"])
        err = (v - (noise - actions)).pow(2).mean(-1)
        m = batch["action_mask"].float()
        return (err * m).sum() / m.sum().clamp_min(1.0)

    def encode_window(self, batch: dict[str, torch.Tensor]) -> Prefix:
        """The prefix of a window of frames (instruction, then each frame's keys/values with its
        validity), encoded frame by frame as the pipeline does at run time (the oldest frame of
        the window sees the instruction only: history beyond the window is truncated)."""
        c = self.cfg
        prefix = [(self.encode_text(batch["text_ids"], batch["text_mask"]), batch["text_mask"])]
        for j in range(c.n_obs_steps):
            frame = batch["frame"] - (c.n_obs_steps - 1 - j)
            obs_kv, _ = self.encode_frame(batch["images"][:, j], batch["proprio"][:, j], frame, prefix)
            prefix.append((obs_kv, batch["frame_valid"][:, j : j + 1].expand(-1, c.frame_tokens)))
        return prefix
