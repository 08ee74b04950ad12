"""Policy configurations: the ``tiny`` default for the built-in task and a ``pi0``-sized preset."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True)
class PolicyConfig:
    """Shape of a pi0-style flow policy. Every field is static: it fixes the buffers and graphs.

    Token layout per slot with the defaults (``prefix_order="text_first"``): instruction block A
    (``max_text_len`` tokens), a ring of the previous ``n_obs_steps - 1`` frames' block-B
    keys/values, block B (``num_cameras * patches`` image tokens + 1 proprio token), then
    ``horizon`` action tokens in the action expert.

    The fields after ``rope_theta`` select pi0's and pi0.5's exact computation (as LeRobot and
    openpi run it) in the same model; their defaults are this project's own policy:

    - ``prefix_order``: ``"text_first"`` (block A attends only to itself, so its keys/values are
      computed once per instruction) or ``"images_first"`` (pi0: one bidirectional block of image
      tokens, then language tokens, encoded per observation; needs ``n_obs_steps == 1``).
    - ``state_token``: where the proprio state enters. ``"prefix"``: a token of block B projected
      to the prefix width; ``"suffix"`` (pi0): the first token of the action expert's sequence,
      attending to the prefix and itself (its keys/values do not depend on the flow time, so they
      are computed once per observation and kept as the last token of block B); ``"text"``
      (pi0.5): discretised into the prompt by the tokenizer, no state token at all.
    - ``norm_plus_one``: RMSNorm scales by ``1 + w`` (Gemma's convention) instead of ``w``.
    - ``time_cond``: ``"mlp"`` (pi0: the sinusoidal time embedding concatenated with the action
      embedding through an MLP) or ``"adarms"`` (pi0.5: an MLP of the time embedding drives every
      expert RMSNorm's scale, shift and residual gate; no time in the action tokens).
    - ``time_dtype``: the dtype the Euler times are held in before their sinusoid (LeRobot holds
      them as float32 tensors; ``"float64"`` keeps ``1 - s/steps`` exact).
    - ``state_norm`` / ``action_norm``: per-dataset normalisation (LeRobot's modes, its formulas
      and epsilon) of the proprio input and the sampled actions, with statistics stored in the
      weights. ``dataset_proprio_dim`` / ``dataset_action_dim``: how many leading dims carry data
      (0: all); the rest is pi0's zero padding to ``proprio_dim`` / ``action_dim``.
    - ``tokenizer``: ``"words"`` (:class:`~flashrt.policies.tokenizer.WordTokenizer` over
      ``vocab``) or ``"paligemma"`` (a SentencePiece model file beside the weights, ids below
      ``vocab_size``; BOS first, right padding, pi0's newline or pi0.5's state prompt).
    - ``vision_norm_eps``: the vision tower's LayerNorm epsilon (SigLIP: 1e-6).
    """

    vocab: tuple[str, ...]
    max_text_len: int = 16
    num_cameras: int = 1
    image_size: int = 64
    patch_size: int = 8
    vision_width: int = 256
    vision_depth: int = 4
    vision_heads: int = 4
    vision_mlp: int = 1024
    width: int = 256
    depth: int = 6
    heads: int = 4
    kv_heads: int = 1
    head_dim: int = 64
    mlp: int = 1024
    expert_width: int = 192
    expert_mlp: int = 768
    proprio_dim: int = 2
    action_dim: int = 2
    horizon: int = 8
    n_obs_steps: int = 2
    steps: int = 10
    rope_theta: float = 10000.0
    prefix_order: str = "text_first"
    state_token: str = "prefix"
    norm_plus_one: bool = False
    time_cond: str = "mlp"
    time_dtype: str = "float64"
    state_norm: str = "identity"
    action_norm: str = "identity"
    dataset_proprio_dim: int = 0
    dataset_action_dim: int = 0
    tokenizer: str = "words"
    vocab_size: int = 0
    vision_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        object.__setattr__(self, "vocab", tuple(self.vocab))
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.prefix_order == "images_first" and self.n_obs_steps != 1:
            raise ValueError("prefix_order='images_first' encodes one observation at a time: set n_obs_steps=1")
        if self.state_token == "suffix" and self.time_cond != "mlp":
            raise ValueError(
                "state_token='suffix' keeps the state token's keys/values for all Euler steps, which needs "
                "time-independent expert norms: use time_cond='mlp' (pi0), or state_token='text' (pi0.5)"
            )
        if self.state_token == "text" and self.tokenizer != "paligemma":
            raise ValueError("state_token='text' puts the state into the prompt: it needs tokenizer='paligemma'")
        if self.tokenizer == "paligemma" and self.vocab_size < 4:
            raise ValueError(f"tokenizer='paligemma' needs vocab_size (the embedding rows), got {self.vocab_size}")
        if self.tokenizer == "words" and self.vocab_size:
            raise ValueError("vocab_size is the SentencePiece vocabulary; a word tokenizer's comes from vocab")
        for name, full in (("dataset_proprio_dim", self.proprio_dim), ("dataset_action_dim", self.action_dim)):
            if not 0 <= getattr(self, name) <= full:
                raise ValueError(f"{name} must be in [0, {full}], got {getattr(self, name)}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} must be a multiple of patch_size {self.patch_size}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.vision_width % self.vision_heads:
            raise ValueError(f"vision_width {self.vision_width} must divide into {self.vision_heads} heads")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name in ("max_text_len", "num_cameras", "horizon", "n_obs_steps", "steps", "depth", "vision_depth"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def text_block(self) -> bool:
        """Whether the instruction is block A (encoded once per instruction, ``kv_text``)."""
        return self.prefix_order == "text_first"

    @property
    def image_tokens(self) -> int:
        return self.num_cameras * self.patches

    @property
    def frame_tokens(self) -> int:
        """Block B: image patches of every camera (with ``images_first``, then the language
        tokens), then the state token unless the state is in the prompt."""
        text = 0 if self.text_block else self.max_text_len
        return self.image_tokens + text + (self.state_token != "text")

    @property
    def ring_tokens(self) -> int:
        return (self.n_obs_steps - 1) * self.frame_tokens

    @property
    def prefix_tokens(self) -> int:
        return self.max_text_len * self.text_block + self.ring_tokens + self.frame_tokens

    @property
    def embed_rows(self) -> int:
        """Rows of the token embedding: the SentencePiece vocabulary, or the words plus pad/unk."""
        return self.vocab_size if self.tokenizer == "paligemma" else len(self.vocab) + 2

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PolicyConfig:
        d = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"policy config has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**d)


NORMS = ("identity", "mean_std", "min_max", "quantiles", "quantile10")
CHOICES = {
    "prefix_order": ("text_first", "images_first"),
    "state_token": ("prefix", "suffix", "text"),
    "time_cond": ("mlp", "adarms"),
    "time_dtype": ("float64", "float32"),
    "state_norm": NORMS,
    "action_norm": NORMS,
    "tokenizer": ("words", "paligemma"),
}


def tiny(vocab: Sequence[str]) -> PolicyConfig:
    """About 12 M parameters: 64x64 RGB, one camera, horizon 8, 2-D actions."""
    return PolicyConfig(vocab=tuple(vocab))


def tiny_metaworld(vocab: Sequence[str]) -> PolicyConfig:
    """``tiny`` for Meta-World (:class:`flashrt_gym.sims.MetaWorld`): its 4-D actions (hand motion
    xyz, gripper) and proprioception (hand position, gripper opening) at the simulator's 64 px
    camera; about 12.5 M parameters (25 MB in bf16)."""
    return replace(tiny(vocab), proprio_dim=4, action_dim=4)


def pi0(vocab: Sequence[str]) -> PolicyConfig:
    """SigLIP-So400m / Gemma-2B / Gemma-300M-shaped (about 2.7 B parameters with this small
    vocabulary): 3 cameras at 224x224, 48 language tokens, horizon 50, action dim 32, 18+18
    layers, 8 heads / 1 KV head / head dim 256. Random weights: for latency work only."""
    return replace(
        tiny(vocab),
        max_text_len=48,
        num_cameras=3,
        image_size=224,
        patch_size=14,
        vision_width=1152,
        vision_depth=27,
        vision_heads=16,
        vision_mlp=4304,
        width=2048,
        depth=18,
        heads=8,
        kv_heads=1,
        head_dim=256,
        mlp=16384,
        expert_width=1024,
        expert_mlp=4096,
        proprio_dim=32,
        action_dim=32,
        horizon=50,
        n_obs_steps=1,
    )


def lerobot_pi0(vocab: Sequence[str] = ()) -> PolicyConfig:
    """LeRobot's pi0 at full size, as :mod:`flashrt.policies.convert` writes it from a
    ``gemma_2b`` / ``gemma_300m`` checkpoint (3 cameras at 224x224, 48 tokens of PaliGemma's
    257 152-piece vocabulary): ``pi0``'s shapes with pi0's exact computation (images then
    language in one block, the state as the expert's first token, Gemma's ``1 + w`` norms,
    mean/std normalisation). Random weights: for latency work (``vocab`` is unused)."""
    return replace(
        pi0(()),
        prefix_order="images_first",
        state_token="suffix",
        norm_plus_one=True,
        time_dtype="float32",
        state_norm="mean_std",
        action_norm="mean_std",
        tokenizer="paligemma",
        vocab_size=257152,
        vision_norm_eps=1e-6,
    )


def lerobot_pi05(vocab: Sequence[str] = ()) -> PolicyConfig:
    """LeRobot's pi0.5 at full size: :func:`lerobot_pi0` with 200 prompt tokens holding the
    discretised state, adaptive-RMSNorm time conditioning and quantile normalisation."""
    return replace(
        lerobot_pi0(()),
        max_text_len=200,
        state_token="text",
        time_cond="adarms",
        state_norm="quantiles",
        action_norm="quantiles",
    )


PRESETS = {
    "tiny": tiny,
    "tiny_metaworld": tiny_metaworld,
    "pi0": pi0,
    "lerobot_pi0": lerobot_pi0,
    "lerobot_pi05": lerobot_pi05,
}
