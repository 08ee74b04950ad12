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

pi0 and pi0.5 (LeRobot's / openpi's computation) are configurations of this one model (see
:class:`~flashrt.policies.config.PolicyConfig`): with ``prefix_order="images_first"`` block B is
the image tokens then the language tokens in one bidirectional block (no block A); with
``state_token="suffix"`` the state is the expert's first token, whose keys/values (independent
of the flow time) are computed once per observation and kept as block B's last token; with
``time_cond="adarms"`` the flow time modulates the expert's norms (per Euler step the
modulations are constants, folded once per weights); ``norm_plus_one`` takes Gemma's ``1 + w``
norm scale; ``state_norm`` / ``action_norm`` apply the dataset statistics stored beside the
weights.

Precision (:meth:`FlowPolicy.set_precision`): ``"native"`` runs every projection in the weights'
dtype; ``"fp8"`` runs the projections of every vision block and decoder layer (SigLIP, Gemma,
the expert) as FP8 GEMMs over per-channel e4m3 copies of their weights
(:mod:`flashrt.kernels.fp8`; tolerance: docs/FP8.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from flashrt.kernels import (
    add_ada_rms_norm,
    euler_step,
    expert_layer,
    linear,
    time_embed,
)
from flashrt.kernels.grouped_attention import Rope, rotates_on_load
from flashrt.kernels.rotary import rope_tables
from flashrt.policies.config import PolicyConfig
from flashrt.policies.layers import (
    AdaRMSNorm,
    Biased,
    DecoderLayer,
    Folded,
    Prefix,
    RMSNorm,
    VisionBlock,
    euler_times,
    layer_norm,
    layer_segments,
    normalize,
    settle,
    sincos,
    sincos_2d,
)
from flashrt.runtime.streams import Event, Stream, beside

PRECISIONS = ("native", "fp8")
"""What :meth:`FlowPolicy.set_precision` takes."""


class FlowPolicy(nn.Module):
    """The policy's weights and its three computations: instruction, frame, and denoising."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.cfg = c = cfg
        one = c.norm_plus_one
        self.text_embed = nn.Embedding(c.embed_rows, c.width)
        self.patch_embed = nn.Linear(3 * c.patch_size**2, c.vision_width)
        grid = c.image_size // c.patch_size  # learned, from a 2-D sin-cos start (ViTs from scratch need it)
        self.vision_pos = nn.Parameter(sincos_2d(grid, c.vision_width).expand(c.num_cameras, -1, -1).clone())
        self.vision = nn.ModuleList(
            VisionBlock(c.vision_width, c.vision_heads, c.vision_mlp, c.vision_norm_eps) for _ in range(c.vision_depth)
        )
        self.vision_norm = nn.LayerNorm(c.vision_width, eps=c.vision_norm_eps)
        self.projector = nn.Linear(c.vision_width, c.width)
        if c.state_token == "prefix":
            self.proprio_proj = nn.Linear(c.proprio_dim, c.width)
        self.prefix = nn.ModuleList(
            DecoderLayer(c.width, c.heads, c.kv_heads, c.head_dim, c.mlp, plus_one=one) for _ in range(c.depth)
        )
        self.prefix_norm = RMSNorm(c.width, plus_one=one)
        if c.state_token == "suffix":
            self.state_proj = nn.Linear(c.proprio_dim, c.expert_width)
        self.action_in = nn.Linear(c.action_dim, c.expert_width)
        adarms = c.time_cond == "adarms"
        self.time_in = nn.Linear(c.expert_width * (1 if adarms else 2), c.expert_width)
        self.time_out = nn.Linear(c.expert_width, c.expert_width)
        cond = c.expert_width if adarms else None
        self.expert = nn.ModuleList(
            DecoderLayer(c.expert_width, c.heads, c.kv_heads, c.head_dim, c.expert_mlp, plus_one=one, cond_dim=cond)
            for _ in range(c.depth)
        )
        self.expert_norm = AdaRMSNorm(c.expert_width, cond) if adarms else RMSNorm(c.expert_width, plus_one=one)
        self.action_out = nn.Linear(c.expert_width, c.action_dim)
        self.register_buffer("inv_freq", self._rope_frequencies(), persistent=False)  # (d/2,) float32
        for name, mode, dim in (
            ("state_stats", c.state_norm, c.proprio_dim),
            ("action_stats", c.action_norm, c.action_dim),
        ):
            if mode != "identity":  # (2, D) float32 dataset statistics, saved with the weights
                self.register_buffer(name, torch.stack([torch.zeros(dim), torch.ones(dim)]))
        if adarms:
            params = [*self.action_out.parameters(), *self.time_in.parameters(), *self.time_out.parameters()]
            params += [p for m in self.modules() if isinstance(m, AdaRMSNorm) for p in m.parameters()]
            self._flow = Folded(self._fold_adarms, *params)
        else:
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
        tokens (an episode's late frames), and ``kernels.expert_layer`` reads them as float32.
        Dataset statistics stay float32 too (LeRobot normalises in float32)."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = self._rope_frequencies().to(self.inv_freq.device)
        for name in ("state_stats", "action_stats"):
            stats = getattr(self, name, None)
            if stats is not None and stats.dtype != torch.float32:
                setattr(self, name, stats.float())
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

    @property
    def precision(self) -> str:
        """``"native"`` or ``"fp8"`` (:meth:`set_precision`)."""
        return "fp8" if self.prefix[0].fp8 is not None else "native"

    def set_precision(self, precision: str) -> FlowPolicy:
        """Choose how the large projections run; returns the model.

        ``"native"`` (the default): in the weights' dtype. ``"fp8"``: the q/k/v, output and MLP
        projections of every vision block and decoder layer (SigLIP, the prefix Gemma, the
        expert) as FP8 GEMMs: weights quantised to e4m3 per output channel, activations per
        token with dynamic scales (:mod:`flashrt.kernels.fp8`). Embeddings, the patch embedding,
        the projector, the time, state and action MLPs, norms, softmax and the Euler
        integration keep their dtype. The parameters are unchanged (the state dict, training and
        saving see them): the e4m3 copies are derived from them on first use and requantised in
        place when they change.

        Args:
            precision: one of :data:`PRECISIONS`.

        Returns:
            ``self``.

        Raises:
            ValueError: an unknown precision, or (on first use) a projection FP8 cannot take
                (a dimension not a multiple of 16).
        """
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        for block in (*self.vision, *self.prefix, *self.expert):
            block.quantize_fp8(precision == "fp8")
        return self

    # -- dataset normalisation -----------------------------------------------------------------
    def normalize_state(self, proprio: torch.Tensor) -> torch.Tensor:
        """Raw proprio (N, P), or (N, dataset_proprio_dim) -> the policy's float32 input (N, P):
        normalised with the dataset statistics, dims past ``dataset_proprio_dim`` zeroed (pi0
        pads the normalised state with zeros)."""
        c = self.cfg
        x = proprio.float()
        if x.shape[-1] < c.proprio_dim:
            x = F.pad(x, (0, c.proprio_dim - x.shape[-1]))
        x = normalize(x, c.state_norm, getattr(self, "state_stats", None))
        if c.dataset_proprio_dim:
            x = F.pad(x[..., : c.dataset_proprio_dim], (0, c.proprio_dim - c.dataset_proprio_dim))
        return x

    def normalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """Actions in dataset units (..., A) -> the flow's (normalised) space, float32."""
        return normalize(actions.float(), self.cfg.action_norm, getattr(self, "action_stats", None))

    def unnormalize_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """Sampled actions (..., A) in the flow's space -> dataset units."""
        return normalize(actions, self.cfg.action_norm, getattr(self, "action_stats", None), inverse=True)

    # -- layout --------------------------------------------------------------------------------
    def frame_start(self, frame: torch.Tensor) -> torch.Tensor:
        """(N,) position of the first token of frame ``frame`` (N,): after the instruction, T_B
        per frame (the action tokens of a chunk sit where the next frame will). With
        ``images_first`` every observation starts at 0."""
        if not self.cfg.text_block:
            return torch.zeros_like(frame)
        return self.cfg.max_text_len + frame * self.cfg.frame_tokens

    def frame_segments(self, kv: torch.Tensor, valid: torch.Tensor, text_mask: torch.Tensor | None = None) -> Prefix:
        """Block B's keys/values ``kv`` (N, S, 2, g, T_B, d) as prefix segments for the tokens
        after it, with frame validity flags ``valid`` (N,).

        ``text_first``: one segment, one flag per slot. ``images_first`` (``text_mask`` (N, L),
        the language padding): views of ``kv`` in the order attention reads fastest (keys carry
        their positions, so the order is free): the language and the state token after it (a
        token of the same buffer) with a per-token mask first, then the image tokens with one
        flag per slot, which the attention kernel sweeps without loading a mask per key. The
        state token rides in the language's last key block: as a segment of its own it cost a
        block of its own in every expert layer's attention."""
        c = self.cfg
        flag = valid[:, None]
        if c.text_block:
            return [(kv, flag.expand(-1, c.frame_tokens))]
        if text_mask is None:
            raise ValueError("with prefix_order='images_first' block B holds the language tokens: pass text_mask")
        cp = c.image_tokens
        mask = text_mask & flag
        if c.state_token != "text":
            mask = torch.cat([mask, flag], 1)
        return [(kv[..., cp:, :], mask), (kv[..., :cp, :], flag.expand(-1, cp))]

    def _action_start(self, prefix: Prefix, frame: torch.Tensor) -> torch.Tensor:
        """(N,) position of the first action token: after the frame's slot (``text_first``), or
        after the valid prefix tokens as pi0 counts them (``images_first``: padding does not
        advance positions)."""
        if self.cfg.text_block:
            return self.frame_start(frame + 1)
        return sum(mask.sum(1) for _, mask in prefix)

    def _kv_cache(self, x: torch.Tensor, tokens: int | None = None) -> torch.Tensor | None:
        """(N, S, 2, g, T, d) for the layers of T tokens (x (N, T, W), or ``tokens``) to write their
        keys/values into; None while recording autograd (in-place writes would clobber saved tensors)."""
        if torch.is_grad_enabled():
            return None
        c = self.cfg
        t = x.shape[1] if tokens is None else tokens
        return x.new_empty((x.shape[0], c.depth, 2, c.kv_heads, t, c.head_dim))

    @staticmethod
    def _stack(kv: torch.Tensor | None, kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return kv if kv is not None else torch.stack([torch.stack(p, 1) for p in kvs], 1)

    # -- block A -------------------------------------------------------------------------------
    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (N, L) -> token embeddings (N, L, D), scaled by sqrt(D) as Gemma does."""
        return self.text_embed(ids).to(self.dtype) * math.sqrt(self.cfg.width)

    def encode_text(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """ids, mask (N, L) -> instruction keys/values (N, S, 2, g, L, d) (``text_first`` only:
        with ``images_first`` the language is part of block B, see :meth:`encode_frame`)."""
        if not self.cfg.text_block:
            raise ValueError("with prefix_order='images_first' the language is encoded with each frame (encode_frame)")
        x = self.embed_text(ids)
        pos0 = torch.zeros(ids.shape[0], dtype=torch.int64, device=ids.device)
        kv, kvs = self._kv_cache(x), []
        for i, layer in enumerate(self.prefix):
            x, k, v = layer(x, pos0, self.inv_freq, own_mask=mask, kv_out=None if kv is None else kv[:, i])
            kvs.append((k, v))
        return self._stack(kv, kvs)

    # -- block B -------------------------------------------------------------------------------
    def embed_frame(self, image: torch.Tensor, proprio: torch.Tensor, text_ids: torch.Tensor | None = None):
        """image (N, C, H, W, 3) uint8, proprio (N, P) (and with ``images_first`` the language ids
        (N, L)) -> the tokens block B runs through the prefix layers (N, T, D): image tokens,
        language tokens, and the proprio token with ``state_token="prefix"``."""
        c = self.cfg
        n, ps, g = image.shape[0], c.patch_size, c.image_size // c.patch_size
        x = image.to(self.dtype) * (2.0 / 255.0) - 1.0
        x = x.view(n * c.num_cameras, g, ps, g, ps, 3).permute(0, 1, 3, 2, 4, 5).reshape(n * c.num_cameras, g * g, -1)
        x = linear(x, self.patch_embed.weight, self.patch_embed.bias).view(n, c.num_cameras * c.patches, -1)
        # the position embedding, added to every slot by the first block's norm
        delta = Biased(self.vision_pos.view(c.num_cameras * c.patches, -1), None)
        for block in self.vision:
            x, delta = block(x, delta, c.patches)
        x = linear(layer_norm(self.vision_norm, x, delta)[1], self.projector.weight, self.projector.bias)  # (N, C*P, D)
        parts = [x]
        if not c.text_block:
            if text_ids is None:
                raise ValueError("with prefix_order='images_first' block B holds the language tokens: pass text ids")
            parts.append(self.embed_text(text_ids))
        if c.state_token == "prefix":
            parts.append(self.proprio_proj(self.normalize_state(proprio).to(self.dtype))[:, None])
        return torch.cat(parts, dim=1) if len(parts) > 1 else x

    def encode_frame(
        self,
        image: torch.Tensor,
        proprio: torch.Tensor,
        frame: torch.Tensor,
        context: Prefix,
        kv_out: torch.Tensor | None = None,
        text: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The newest frame over its context (instruction + ring) -> its keys/values
        (N, S, 2, g, T_B, d), written into ``kv_out`` when given (evaluation only), and pooled
        features (N, D).

        With ``images_first``, ``text`` is the instruction's ids and mask (N, L): its tokens join
        the images in one bidirectional block (the context is then empty). With
        ``state_token="suffix"``, block B's last token is the state token: it runs through the
        expert's layers over block B and its context once here, and its keys/values are read by
        every Euler step as pi0's first suffix token."""
        c = self.cfg
        if not c.text_block and text is None:
            raise ValueError("with prefix_order='images_first' block B holds the language tokens: pass text")
        x = self.embed_frame(image, proprio, None if text is None else text[0])
        pos0 = self.frame_start(frame)
        own = None
        if not c.text_block:
            ones = torch.ones(x.shape[0], c.image_tokens, dtype=torch.bool, device=x.device)
            own = torch.cat([ones, text[1], ones[:, : x.shape[1] - c.image_tokens - c.max_text_len]], dim=1)
        kv = self._kv_cache(x, c.frame_tokens) if kv_out is None else kv_out
        kvs = []
        state = c.state_token == "suffix"
        if state:
            s = self.state_proj(self.normalize_state(proprio).to(self.dtype))[:, None]  # (N, 1, E)
            pos = pos0 + x.shape[1] if c.text_block else pos0 + c.image_tokens + text[1].sum(1)
        # Writing into a cache (no autograd), the state token's layer i runs on a stream of its own
        # as soon as the prefix's layer i is done, beside the prefix's later layers: the same
        # kernels in the same order, so the same bytes.
        # A layer's down projection that is not accumulated in its GEMM (an FP8 layer's) is added
        # by the next layer's first norm (``DecoderLayer.forward_deferred``), not by an add of its own.
        side = Stream(x.device) if state and kv is not None and not torch.compiler.is_compiling() else None
        pending = None
        for i, layer in enumerate(self.prefix):
            out = None if kv is None else kv[:, i, :, :, : x.shape[1]]
            x, pending, k, v = layer.forward_deferred(
                x, pending, pos0, self.inv_freq, layer_segments(context, i), own_mask=own, kv_out=out
            )
            kvs.append((k, v))
            if state:
                with beside(side, s, pos, own):
                    out = None if kv is None else kv[:, i, :, :, -1:]
                    segments = [*layer_segments(context, i), (k, v, own)]
                    s, k1, v1 = self.expert[i](s, pos, self.inv_freq, segments, kv_out=out)
                kvs[i] = (torch.cat([k, k1], 2), torch.cat([v, v1], 2)) if kv is None else kvs[i]
        if side is not None:
            Stream.current(x.device).wait(Event.record_on(side))
        feats = self.prefix_norm(settle(x, pending)).mean(1, dtype=torch.float32)
        return self._stack(kv, kvs), feats

    # -- action expert -------------------------------------------------------------------------
    def _time_cond(self, te: torch.Tensor) -> torch.Tensor:
        """pi0.5's condition from time embeddings (..., E): ``silu(time_out(silu(time_in(te))))``."""
        return F.silu(self.time_out(F.silu(self.time_in(te))))

    def _modulations(self, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every adaptive norm's modulation for conditions (..., E): layers (..., S, 2, 3, E) and
        the final norm (..., 3, E), float32."""
        layers = torch.stack(
            [torch.stack([m.norm1.modulation(cond), m.norm2.modulation(cond)], -3) for m in self.expert], -4
        )
        return layers, self.expert_norm.modulation(cond)

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
        te = sincos(t, c.expert_width).to(a.device, self.dtype)
        pos0 = self._action_start(prefix, frame)
        if c.time_cond == "adarms":
            mods, final = self._modulations(self._time_cond(te))
            h = a
            for i, layer in enumerate(self.expert):
                h, _, _ = layer(h, pos0, self.inv_freq, layer_segments(prefix, i), mod=mods[:, i])
            return self.action_out(add_ada_rms_norm(h, None, None, final, self.expert_norm.eps)[1]).float()
        te = te[:, None].expand(-1, a.shape[1], -1)
        h = self.time_out(F.silu(self.time_in(torch.cat([a, te], dim=-1))))
        h = self._expert_layers(h, prefix, pos0)
        return self.action_out(self.expert_norm(h)).float()

    def _expert_layers(
        self, h: torch.Tensor, prefix: Prefix, pos0: torch.Tensor, rope: Rope | None = None
    ) -> torch.Tensor:
        """The expert's layers over the prefix (before its final norm): (N, H, E). Each layer's
        down projection may be added by the next layer's first norm (``DecoderLayer.forward_deferred``);
        with ``rope`` (the tokens' rotation tables) each layer's attention rotates its heads."""
        pending = None
        for i, layer in enumerate(self.expert):
            context, weights = layer_segments(prefix, i), layer.fused_weights()
            if expert_layer.fits(h, context, *weights):  # at few slots: one CUDA kernel a layer
                h, pending, eps = settle(h, pending), None, (layer.norm1.eps, layer.norm2.eps)
                h = expert_layer.expert_layer(h, pos0, self.inv_freq, context, weights, eps)
            else:
                h, pending, _, _ = layer.forward_deferred(h, pending, pos0, self.inv_freq, context, rope=rope)
        return settle(h, pending)

    def _fold_flow(self) -> tuple[torch.Tensor, ...]:
        """The Euler loop's folded float32 weights (see :mod:`flashrt.kernels.flow`): wx (E, A), per-step
        bias (steps, E), w_out (A, E) and b_out (A,) scaled by -1/steps."""
        c, e = self.cfg, self.cfg.expert_width
        w_in, b_in = self.action_in.weight.float(), self.action_in.bias.float()
        w_t, b_t = self.time_in.weight.float(), self.time_in.bias.float()
        te = sincos(euler_times(c.steps, c.time_dtype, w_in.device), e)  # (steps, E): the Euler times t_s
        bias = w_t[:, :e] @ b_in + te @ w_t[:, e:].T + b_t
        scale = -1.0 / c.steps
        return w_t[:, :e] @ w_in, bias, self.action_out.weight.float() * scale, self.action_out.bias.float() * scale

    def _fold_adarms(self) -> tuple[torch.Tensor, ...]:
        """pi0.5's per-step constants: the flow time is the same for every slot at step s, so each
        adaptive norm's modulation is a constant of (weights, s). Returns the layers' modulations
        (steps, S, 2, 3, E), the final norm's scale (steps, E) in the model's dtype and, with its
        shift folded into the output projection (times -1/steps), w_out (A, E) and per-step b_out
        (steps, A)."""
        c = self.cfg
        te = sincos(euler_times(c.steps, c.time_dtype, self.time_in.weight.device), c.expert_width)
        mods, final = self._modulations(self._time_cond(te.to(self.dtype)))
        scale = -1.0 / c.steps
        w_out, b_out = self.action_out.weight.float() * scale, self.action_out.bias.float() * scale
        return mods, final[:, 0].to(self.dtype), w_out, b_out + final[:, 1] @ w_out.T

    @torch.no_grad()
    def sample(self, noise: torch.Tensor, prefix: Prefix, frame: torch.Tensor) -> torch.Tensor:
        """Euler integration from noise (t = 1) to actions (t = 0): (N, H, A) float32, in the
        dataset's units (un-normalised with ``action_norm``).

        Per step: folded time embedding, time_out, the expert's layers, then one kernel for the
        final norm, output projection and update ``x <- x - v / steps`` (pi0.5: the action
        embedding, the expert's layers under that step's folded modulations, the same update).
        The action tokens' positions are the same in every step: where the expert's attention
        rotates its heads as it loads them (head dims above 128), their rotation tables are made
        once here."""
        x = noise.float().contiguous()
        pos0 = self._action_start(prefix, frame)
        eps = self.expert_norm.eps
        rope = None
        if rotates_on_load(self.expert[0].head_dim):
            rope = rope_tables(pos0, x.shape[1], self.inv_freq, self.dtype)
        if self.cfg.time_cond == "adarms":
            mods, norm_w, w_out, b_out = self._flow.get()
            for s in range(self.cfg.steps):
                h, pending = linear(x.to(self.dtype), self.action_in.weight, self.action_in.bias), None
                for i, layer in enumerate(self.expert):
                    segments = layer_segments(prefix, i)
                    h, pending, _, _ = layer.forward_deferred(
                        h, pending, pos0, self.inv_freq, segments, mod=mods[s, i], rope=rope
                    )
                x = euler_step(x, settle(h, pending), norm_w[s], w_out, b_out[s], eps)
        else:
            wx, bias, w_out, b_out = self._flow.get()
            for s in range(self.cfg.steps):
                h = time_embed(x, wx, bias[s], self.dtype)
                h = self._expert_layers(linear(h, self.time_out.weight, self.time_out.bias), prefix, pos0, rope)
                x = euler_step(x, h, self.expert_norm.scale(), w_out, b_out, eps)
        return self.unnormalize_actions(x)

    # -- training ------------------------------------------------------------------------------
    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> torch.Tensor:
        """Flow-matching loss on a batch of windows.

        batch: ``text_ids``/``text_mask`` (B, L); ``images`` (B, n_obs, C, H, W, 3) uint8 and
        ``proprio`` (B, n_obs, P), oldest frame first; ``frame_valid`` (B, n_obs) bool (frames
        before the episode start are False; the last is always True); ``frame`` (B,) int64 index
        of the newest frame in its episode; ``actions`` (B, H, A) in dataset units;
        ``action_mask`` (B, H). The window is encoded frame by frame exactly as the pipeline does
        at run time.
        """
        prefix = self.encode_window(batch)
        actions = self.normalize_actions(batch["actions"])
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
        the window sees the instruction only: history beyond the window is truncated). With
        ``images_first``: the newest frame's block B (images and language) alone."""
        c = self.cfg
        text = (batch["text_ids"], batch["text_mask"])
        if not c.text_block:
            valid = batch["frame_valid"][:, -1]
            kv, _ = self.encode_frame(batch["images"][:, -1], batch["proprio"][:, -1], batch["frame"], [], text=text)
            return self.frame_segments(kv, valid, batch["text_mask"])
        prefix = [(self.encode_text(*text), batch["text_mask"])]
        for j in range(c.n_obs_steps):
            frame = batch["frame"] - (c.n_obs_steps - 1 - j)
            obs_kv, _ = self.encode_frame(batch["images"][:, j], batch["proprio"][:, j], frame, prefix)
            prefix += self.frame_segments(obs_kv, batch["frame_valid"][:, j])
        return prefix
