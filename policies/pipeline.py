"""The policy over static buffers: every live tensor of every slot is a named buffer.

``PolicyPipeline`` owns no memory of its own: it declares ``policy.*`` buffer specs (to be
placed in a :class:`flashrt.runtime.BufferSet`, alone or together with a simulator's), holds a
typed view of them (:class:`PolicyState`), and runs its stages over them. Each stage is a plain
callable over the buffers, so whoever replays a step captures it (the env's engine captures the
whole env step; tests and benchmarks capture stages with :class:`flashrt.runtime.Graph`). Per slot:

======================  ==========================================================  =========
buffer                  shape                                                       written by
======================  ==========================================================  =========
policy.text_ids/mask    (L,) int64 / bool                                           the owner / set_text
policy.prompt_ids/mask  (L,) int64 / bool    pi0.5: the newest frame's prompt       encode_observation
policy.kv_text          (S, 2, g, L, d)      instruction keys/values (block A)      encode_instruction / set_text
                        (``text_first`` policies only)
policy.kv_ring          (S, 2, g, R, d)      previous frames' keys/values           encode_observation
policy.ring_valid       (n_obs - 1,) bool                                           encode_observation
policy.kv_obs           (S, 2, g, T_B, d)    newest frame's keys/values (block B)   encode_observation
policy.obs_valid        () bool, policy.frame () int64 (frames encoded this episode)
policy.image/proprio    (C, H, W, 3) uint8 / (P,) float32                           the owner
policy.features         (D,) float32         pooled prefix embedding                encode_observation
policy.noise/actions    (H, A) float32                                              draw_noise / denoise
policy.rng_key/counter  () int64             per-slot counter-based RNG
======================  ==========================================================  =========

Block A attends only to itself, so an instruction's keys/values are a function of the
instruction alone: :class:`InstructionTable` encodes a fixed set of instructions once, and a
slot's instruction becomes a row copy from the table (``set_text``), inside a captured step too.

pi0's layout (``prefix_order="images_first"``) has no block A: the language tokens follow the
image tokens in block B, which ``encode_observation`` encodes from ``text_ids``/``text_mask``
with every frame (``kv_obs`` holds images, language and, with ``state_token="suffix"``, the
state token), so the table holds token ids only and ``encode_instruction`` has nothing to do.
pi0.5 (``state_token="text"``) writes the frame's discretised state into its prompt:
``text_ids`` holds the instruction's part, and ``encode_observation`` assembles the frame's
prompt into ``policy.prompt_ids``/``prompt_mask`` on the device
(:func:`~flashrt.policies.tokenizer.compose_prompt`) before it encodes block B.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from flashrt import kernels, runtime
from flashrt.kernels import expert_layer, fp8
from flashrt.kernels.rng import draw_normal_
from flashrt.policies import attention_long
from flashrt.policies.layers import Prefix
from flashrt.policies.model import FlowPolicy
from flashrt.policies.tokenizer import compose_prompt
from flashrt.policies.weights import tokenizer_for
from flashrt.runtime import BufferSet, BufferSpec, slot
from flashrt.runtime.views import bind_views


def policy_specs(model: FlowPolicy) -> list[BufferSpec]:
    """The ``policy.*`` buffers for ``model`` (its dtype sets the key/value cache dtype)."""
    c, dt = model.cfg, model.dtype
    kv = (c.depth, 2, c.kv_heads)
    specs = [
        slot("policy.text_ids", (c.max_text_len,), torch.int64),
        slot("policy.text_mask", (c.max_text_len,), torch.bool),
        *([slot("policy.kv_text", (*kv, c.max_text_len, c.head_dim), dt)] if c.text_block else []),
        slot("policy.kv_obs", (*kv, c.frame_tokens, c.head_dim), dt),
        slot("policy.obs_valid", (), torch.bool),
        slot("policy.frame", (), torch.int64),
        slot("policy.image", (c.num_cameras, c.image_size, c.image_size, 3), torch.uint8),
        slot("policy.proprio", (c.proprio_dim,), torch.float32),
        slot("policy.features", (c.width,), torch.float32),
        slot("policy.noise", (c.horizon, c.action_dim), torch.float32),
        slot("policy.actions", (c.horizon, c.action_dim), torch.float32),
        slot("policy.rng_key", (), torch.int64),
        slot("policy.rng_counter", (), torch.int64),
    ]
    if c.state_token == "text":
        specs += [
            slot("policy.prompt_ids", (c.max_text_len,), torch.int64),
            slot("policy.prompt_mask", (c.max_text_len,), torch.bool),
        ]
    if c.n_obs_steps > 1:
        specs += [
            slot("policy.kv_ring", (*kv, c.ring_tokens, c.head_dim), dt),
            slot("policy.ring_valid", (c.n_obs_steps - 1,), torch.bool),
        ]
    return specs


@dataclass(frozen=True)
class PolicyState:
    """Typed views of the ``policy.*`` buffers (see the module's table)."""

    text_ids: torch.Tensor
    text_mask: torch.Tensor
    kv_obs: torch.Tensor
    obs_valid: torch.Tensor
    frame: torch.Tensor
    image: torch.Tensor
    proprio: torch.Tensor
    features: torch.Tensor
    noise: torch.Tensor
    actions: torch.Tensor
    rng_key: torch.Tensor
    rng_counter: torch.Tensor
    kv_text: torch.Tensor | None = None
    prompt_ids: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    kv_ring: torch.Tensor | None = None
    ring_valid: torch.Tensor | None = None


def deployment_digest(model: FlowPolicy, weights_id: str) -> str:
    """Hash of what makes outputs comparable: config, weights, dtype, precision, runtime and kernel
    versions, and which kernel implementation (Triton or the torch references) runs on the model's
    device (with FP8, whether its GEMMs run or are emulated)."""
    device = next(model.parameters()).device
    impl = kernels.implementation(device)
    if model.precision == "fp8" and not (fp8.supported(device) and model.dtype == torch.bfloat16):
        impl += "+fp8-emulated"
    if impl == "triton" and expert_layer.runs_for(*model.expert[0].fused_weights()):  # sums in another order
        impl += "+expert_layer"
    if impl.startswith("triton"):  # long prefix blocks (pi0's) take the flash kernel
        impl += f"+attention_long-{attention_long.VERSION}"
    parts = [model.cfg.to_json(), weights_id, str(model.dtype), runtime.__version__, kernels.__version__, impl]
    if model.precision != "native":  # FP8 GEMMs: other outputs (a native digest is as it always was)
        parts.append(f"{model.precision}-{fp8.VERSION}")
    text = "|".join(parts)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class InstructionTable:
    """The keys/values of a fixed list of instructions, encoded once: ``ids``/``mask`` (n, L)
    and ``kv`` (n, S, 2, g, L, d) on the model's device (None for an ``images_first`` policy,
    whose language is encoded with each frame). Row i belongs to ``texts[i]``."""

    def __init__(self, model: FlowPolicy, texts: Sequence[str]) -> None:
        if not texts:
            raise ValueError("an instruction table needs at least one instruction")
        c, device, tok = model.cfg, next(model.parameters()).device, tokenizer_for(model)
        if c.state_token == "text":  # pi0.5: the prompts' instruction parts; the state joins per frame
            tok.check_state_prompt(texts, c.dataset_proprio_dim or c.proprio_dim)
            ids, mask = tok.prompt_heads(texts)
        else:
            ids, mask = tok.encode(list(texts))
        self.texts = tuple(texts)
        self.ids, self.mask = ids.to(device), mask.to(device)
        self.kv = None
        if model.cfg.text_block:
            with torch.no_grad():
                self.kv = model.encode_text(self.ids, self.mask)

    def __len__(self) -> int:
        return len(self.texts)


class PolicyPipeline:
    """Runs a :class:`FlowPolicy` over the ``policy.*`` buffers of ``bufs``.

    Args:
        model: the weights (on the buffers' device; evaluation only).
        bufs: a set holding :func:`policy_specs` (possibly among other buffers).
    """

    def __init__(self, model: FlowPolicy, bufs: BufferSet) -> None:
        missing = [s.name for s in policy_specs(model) if s.name not in bufs]
        if missing:
            raise ValueError(f"the buffer set lacks policy buffers {missing}; build it with policy_specs(model)")
        self.model = model.eval().requires_grad_(False)
        self.cfg = model.cfg
        self.bufs = bufs
        self.state = bind_views(PolicyState, bufs, "policy")
        self._state_parts = None  # pi0.5: the prompt's state part, constants of every captured step
        if self.cfg.state_token == "text":
            self._state_parts = tokenizer_for(model).state_parts().to(bufs.device)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.bufs[f"policy.{name}"]

    def validate(self, state: Mapping[str, torch.Tensor]) -> None:
        """Raise ``ValueError`` naming the buffer if ``policy.*`` tensors (a capsule's, before it is
        restored) hold values the policy cannot run from: token ids outside the vocabulary,
        flags other than 0/1, a negative frame count, NaN or infinity."""
        vocab = self.model.text_embed.num_embeddings
        for name, t in state.items():
            if not t.numel():
                continue
            if name == "policy.text_ids" and (int(t.min()) < 0 or int(t.max()) >= vocab):
                raise ValueError(f"{name} holds token ids outside [0, {vocab})")
            if name == "policy.frame" and int(t.min()) < 0:
                raise ValueError(f"{name} holds negative frame counts")
            if t.dtype == torch.bool and int(t.view(torch.uint8).max()) > 1:
                raise ValueError(f"{name} holds bytes other than 0 and 1")
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise ValueError(f"{name} holds NaN or infinity")

    # -- stages (plain callables over the buffers; capturable) ---------------------------------
    @torch.no_grad()
    def encode_instruction(self) -> None:
        """Instruction keys/values of every slot from ``text_ids``/``text_mask`` (nothing to do
        for an ``images_first`` policy: its language is encoded with each frame)."""
        s = self.state
        if s.kv_text is not None:
            s.kv_text.copy_(self.model.encode_text(s.text_ids, s.text_mask))

    def set_text(self, table: InstructionTable, index: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Give each slot (where ``mask``, all if None) the instruction ``table`` row ``index``
        (slots,) int64: its token ids, mask and keys/values, copied from the table (capturable)."""
        s = self.state
        pairs = [(s.text_ids, table.ids), (s.text_mask, table.mask)]
        if s.kv_text is not None:
            pairs.append((s.kv_text, table.kv))
        for dst, src in pairs:
            rows = src[index]
            if mask is not None:
                rows = torch.where(mask.view(-1, *[1] * (rows.dim() - 1)), rows, dst)
            dst.copy_(rows)

    def begin_episode(self, mask: torch.Tensor | None = None) -> None:
        """Forget the frame history of the slots in ``mask`` (all if None)."""
        s = self.state
        m = torch.ones_like(s.obs_valid) if mask is None else mask
        s.obs_valid.masked_fill_(m, False)
        s.frame.masked_fill_(m, 0)
        if s.ring_valid is not None:
            s.ring_valid.masked_fill_(m[:, None], False)

    def _text(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What ``encode_frame`` reads beside the frame: the language of an ``images_first`` policy
        (pi0.5: the frame's prompt)."""
        s = self.state
        if self.cfg.text_block:
            return None
        return (s.text_ids, s.text_mask) if s.prompt_ids is None else (s.prompt_ids, s.prompt_mask)

    def _prompt(self, proprio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pi0.5's prompt of a frame with state ``proprio``: the slot's instruction part and the
        normalised state's bins (ids and mask, (slots, L))."""
        c, s = self.cfg, self.state
        states = self.model.normalize_state(proprio)[:, : c.dataset_proprio_dim or c.proprio_dim]
        return compose_prompt(s.text_ids, s.text_mask, states, self._state_parts)

    def _context(self, newest: bool) -> Prefix:
        """The prefix segments, in place: instruction, ring (if any), and with ``newest`` the
        newest frame (``images_first``: block B alone, language padding masked)."""
        c, s = self.cfg, self.state
        if not c.text_block:
            mask = s.text_mask if s.prompt_mask is None else s.prompt_mask
            return self.model.frame_segments(s.kv_obs, s.obs_valid, mask) if newest else []
        segments = [(s.kv_text, s.text_mask)]
        if s.kv_ring is not None:
            ring_mask = s.ring_valid[:, :, None].expand(-1, -1, c.frame_tokens)  # one flag per ring frame
            segments.append((s.kv_ring, ring_mask.reshape(self.bufs.num_slots, c.ring_tokens)))
        if newest:
            segments.append((s.kv_obs, s.obs_valid[:, None].expand(-1, c.frame_tokens)))
        return segments

    def _context_of_next(self) -> Prefix:
        """What the next frame attends to, read in place without moving the ring: the instruction,
        the ring's frames but its oldest, and the newest frame (what the ring will hold then)."""
        c, s = self.cfg, self.state
        if not c.text_block:
            return []
        segments = [(s.kv_text, s.text_mask)]
        if c.n_obs_steps > 1:
            t, n = c.frame_tokens, self.bufs.num_slots
            if c.n_obs_steps > 2:
                kept = s.ring_valid[:, 1:, None].expand(-1, -1, t).reshape(n, (c.n_obs_steps - 2) * t)
                segments.append((s.kv_ring[..., t:, :], kept))
            segments.append((s.kv_obs, s.obs_valid[:, None].expand(-1, t)))
        return segments

    @torch.no_grad()
    def encode_observation(self) -> None:
        """Move the newest frame into the ring, then encode ``image``/``proprio`` as block B
        (its keys/values written straight into ``kv_obs``)."""
        c, s = self.cfg, self.state
        if s.kv_ring is not None:
            t, ring, valid = c.frame_tokens, s.kv_ring, s.ring_valid
            if c.n_obs_steps > 2:  # shift the ring one frame older (through a temporary: the ranges overlap)
                ring[..., :-t, :].copy_(ring[..., t:, :].clone())
                valid[:, :-1].copy_(valid[:, 1:].clone())
            ring[..., -t:, :].copy_(s.kv_obs)
            valid[:, -1].copy_(s.obs_valid)
        if s.prompt_ids is not None:
            ids, mask = self._prompt(s.proprio)
            s.prompt_ids.copy_(ids)
            s.prompt_mask.copy_(mask)
        _, feats = self.model.encode_frame(
            s.image, s.proprio, s.frame, self._context(newest=False), kv_out=s.kv_obs, text=self._text()
        )
        s.features.copy_(feats)
        s.obs_valid.fill_(True)
        s.frame.add_(1)

    @torch.no_grad()
    def features_of_next(self, image: torch.Tensor, proprio: torch.Tensor, out: torch.Tensor) -> None:
        """Pooled features (slots, D) of the frame ``image``/``proprio`` as :meth:`encode_observation`
        would compute them next, written into ``out``; no buffer of the policy changes (the
        terminal observation of an episode that is reset in the same step)."""
        text = self._text() if self.state.prompt_ids is None else self._prompt(proprio)
        _, feats = self.model.encode_frame(image, proprio, self.state.frame, self._context_of_next(), text=text)
        out.copy_(feats)

    def draw_noise(self) -> None:
        """Base-policy noise from each slot's RNG (reproducible, part of every capsule)."""
        s = self.state
        draw_normal_(s.noise.flatten(1), s.rng_key, s.rng_counter)

    @torch.no_grad()
    def denoise(self) -> None:
        """``actions`` from ``noise`` over the current prefix (10 Euler steps, unrolled), read in
        place from the instruction, ring and newest-frame buffers by every step."""
        s = self.state
        s.actions.copy_(self.model.sample(s.noise, self._context(newest=True), s.frame - 1))
