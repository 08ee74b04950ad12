"""The policy over static buffers: every live tensor of every slot is a named buffer.

``PolicyPipeline`` owns no memory of its own: it declares ``policy.*`` buffer specs (to be
placed in a :class:`flashrt.runtime.BufferSet`, alone or together with a simulator's), then runs its
stages over those buffers, each recordable as a :class:`flashrt.runtime.Graph` variant. Per slot:

======================  ==========================================================  =========
buffer                  shape                                                       written by
======================  ==========================================================  =========
policy.text_ids/mask    (L,) int64 / bool                                           the owner
policy.kv_text          (S, 2, g, L, d)      instruction keys/values (block A)      encode_instruction
policy.kv_ring          (S, 2, g, R, d)      previous frames' keys/values           encode_observation
policy.ring_valid       (n_obs - 1,) bool                                           encode_observation
policy.kv_obs           (S, 2, g, T_B, d)    newest frame's keys/values (block B)   encode_observation
policy.obs_valid        () bool, policy.frame () int64 (frames encoded this episode)
policy.image/proprio    (C, H, W, 3) uint8 / (P,) float32                           the owner
policy.features         (D,) float32         pooled prefix embedding                encode_observation
policy.noise/actions    (H, A) float32                                              draw_noise / denoise
policy.rng_key/counter  () int64             per-slot counter-based RNG
======================  ==========================================================  =========

Transient intermediates of a stage come from its captured graph's private memory pool, which
is allocated once at capture and reused by every replay.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from flashrt import kernels, runtime
from flashrt.kernels import expert_layer
from flashrt.kernels.rng import draw_normal_
from flashrt.policies.model import FlowPolicy, Prefix
from flashrt.runtime import BufferSet, BufferSpec, Graph, slot

STAGES = ("encode_instruction", "encode_observation", "draw_noise", "denoise")


def policy_specs(model: FlowPolicy) -> list[BufferSpec]:
    """The ``policy.*`` buffers for ``model`` (its dtype sets the key/value cache dtype)."""
    c, dt = model.cfg, model.dtype
    kv = (c.depth, 2, c.kv_heads)
    specs = [
        slot("policy.text_ids", (c.max_text_len,), torch.int64),
        slot("policy.text_mask", (c.max_text_len,), torch.bool),
        slot("policy.kv_text", (*kv, c.max_text_len, c.head_dim), dt),
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
    if c.n_obs_steps > 1:
        specs += [
            slot("policy.kv_ring", (*kv, c.ring_tokens, c.head_dim), dt),
            slot("policy.ring_valid", (c.n_obs_steps - 1,), torch.bool),
        ]
    return specs


def deployment_digest(model: FlowPolicy, weights_id: str) -> str:
    """Hash of what makes outputs comparable: config, weights, dtype, runtime and kernel versions,
    and which kernel implementation (Triton or the torch references) runs on the model's device."""
    impl = kernels.implementation(next(model.parameters()).device)
    if impl == "triton" and expert_layer.runs_for(*model.expert[0].fused_weights()):  # sums in another order
        impl += "+expert_layer"
    text = "|".join([model.cfg.to_json(), weights_id, str(model.dtype), runtime.__version__, kernels.__version__, impl])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class PolicyPipeline:
    """Runs a :class:`FlowPolicy` over the ``policy.*`` buffers of ``bufs``.

    Args:
        model: the weights (on the buffers' device; evaluation only).
        bufs: a set holding :func:`policy_specs` (possibly among other buffers).
        backend: graph backend for :meth:`capture` (``"auto"``: CUDA graphs on a GPU).
    """

    def __init__(self, model: FlowPolicy, bufs: BufferSet, *, backend: runtime.graphs.Backend = "auto") -> None:
        missing = [s.name for s in policy_specs(model) if s.name not in bufs]
        if missing:
            raise ValueError(f"the buffer set lacks policy buffers {missing}; build it with policy_specs(model)")
        self.model = model.eval().requires_grad_(False)
        self.cfg = model.cfg
        self.bufs = bufs
        self.graphs = {name: Graph(f"policy.{name}", backend=backend).bind(bufs) for name in STAGES}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.bufs[f"policy.{name}"]

    # -- stages (plain callables over the buffers; capturable) ---------------------------------
    @torch.no_grad()
    def encode_instruction(self) -> None:
        """Instruction keys/values of every slot from ``text_ids``/``text_mask``."""
        self["kv_text"].copy_(self.model.encode_text(self["text_ids"], self["text_mask"]))

    def begin_episode(self, mask: torch.Tensor | None = None) -> None:
        """Forget the frame history of the slots in ``mask`` (all if None)."""
        m = torch.ones_like(self["obs_valid"]) if mask is None else mask
        self["obs_valid"].masked_fill_(m, False)
        self["frame"].masked_fill_(m, 0)
        if self.cfg.n_obs_steps > 1:
            self["ring_valid"].masked_fill_(m[:, None], False)

    def _context(self, newest: bool) -> Prefix:
        """The prefix segments, in place: instruction, ring (if any), and with ``newest`` the
        newest frame."""
        c = self.cfg
        segments = [(self["kv_text"], self["text_mask"])]
        if c.n_obs_steps > 1:
            ring_mask = self["ring_valid"][:, :, None].expand(-1, -1, c.frame_tokens)  # one flag per ring frame
            segments.append((self["kv_ring"], ring_mask.reshape(self.bufs.num_slots, c.ring_tokens)))
        if newest:
            segments.append((self["kv_obs"], self["obs_valid"][:, None].expand(-1, c.frame_tokens)))
        return segments

    @torch.no_grad()
    def encode_observation(self) -> None:
        """Move the newest frame into the ring, then encode ``image``/``proprio`` as block B
        (its keys/values written straight into ``kv_obs``)."""
        c = self.cfg
        if c.n_obs_steps > 1:
            t, ring, valid = c.frame_tokens, self["kv_ring"], self["ring_valid"]
            if c.n_obs_steps > 2:  # shift the ring one frame older (through a temporary: the ranges overlap)
                ring[..., :-t, :].copy_(ring[..., t:, :].clone())
                valid[:, :-1].copy_(valid[:, 1:].clone())
            ring[..., -t:, :].copy_(self["kv_obs"])
            valid[:, -1].copy_(self["obs_valid"])
        _, feats = self.model.encode_frame(
            self["image"], self["proprio"], self["frame"], self._context(newest=False), kv_out=self["kv_obs"]
        )
        self["features"].copy_(feats)
        self["obs_valid"].fill_(True)
        self["frame"].add_(1)

    def draw_noise(self) -> None:
        """Base-policy noise from each slot's RNG (reproducible, part of every capsule)."""
        draw_normal_(self["noise"].flatten(1), self["rng_key"], self["rng_counter"])

    @torch.no_grad()
    def denoise(self) -> None:
        """``actions`` from ``noise`` over the current prefix (10 Euler steps, unrolled), read in
        place from the instruction, ring and newest-frame buffers by every step."""
        self["actions"].copy_(self.model.sample(self["noise"], self._context(newest=True), self["frame"] - 1))

    # -- graphs --------------------------------------------------------------------------------
    def stage(self, name: str) -> Callable[[], None]:
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; stages are {STAGES}")
        return getattr(self, name)

    def capture(self, *names: str) -> None:
        """Record the named stages (all if none) as graph variants keyed by ``num_slots``."""
        for name in names or STAGES:
            self.graphs[name].capture(self.bufs.num_slots, self.stage(name))

    def run(self, name: str) -> None:
        """Replay a captured stage (raises if it was never captured)."""
        self.graphs[name].replay(self.bufs.num_slots)
