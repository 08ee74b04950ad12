"""Policy configurations: the ``tiny`` default for the built-in task and a ``pi0``-sized preset."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True)
class PolicyConfig:
    """Shape of a pi0-style flow policy. Every field is static: it fixes the buffers and graphs.

    Token layout per slot: instruction block A (``max_text_len`` words), a ring of the previous
    ``n_obs_steps - 1`` frames' block-B keys/values, block B (``num_cameras * patches`` image
    tokens + 1 proprio token), then ``horizon`` action tokens in the action expert.
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "vocab", tuple(self.vocab))
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
    def frame_tokens(self) -> int:
        """Block B: image patches of every camera plus one proprio token."""
        return self.num_cameras * self.patches + 1

    @property
    def ring_tokens(self) -> int:
        return (self.n_obs_steps - 1) * self.frame_tokens

    @property
    def prefix_tokens(self) -> int:
        return self.max_text_len + self.ring_tokens + self.frame_tokens

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


def tiny(vocab: Sequence[str]) -> PolicyConfig:
    """About 12 M parameters: 64x64 RGB, one camera, horizon 8, 2-D actions."""
    return PolicyConfig(vocab=tuple(vocab))


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


PRESETS = {"tiny": tiny, "pi0": pi0}
