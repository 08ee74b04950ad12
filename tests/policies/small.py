"""A small policy configuration and helpers shared by the policy tests."""

from collections.abc import Callable

import torch

from flashrt.policies import FlowPolicy, PolicyConfig, PolicyPipeline, policy_specs, tokenizer_for
from flashrt.runtime import BufferSet, Graph
from flashrt_gym.sims.tabletop import TabletopConfig

TEXTS = ["push the red square to the left goal", "push the blue triangle to the top goal"]


def config(**kw) -> PolicyConfig:
    base = dict(
        vocab=tuple(TabletopConfig().vocabulary),
        image_size=32,
        patch_size=8,
        vision_width=32,
        vision_depth=1,
        vision_heads=2,
        vision_mlp=64,
        width=64,
        depth=2,
        heads=2,
        kv_heads=1,
        head_dim=32,
        mlp=128,
        expert_width=48,
        expert_mlp=96,
        horizon=4,
    )
    return PolicyConfig(**{**base, **kw})


def pipeline(
    n: int = 4, device: str = "cpu", cfg: PolicyConfig | None = None, seed: int = 0, dtype=torch.float32
) -> PolicyPipeline:
    torch.manual_seed(seed)
    model = FlowPolicy(cfg or config()).to(device=device, dtype=dtype)
    bufs = BufferSet(policy_specs(model), n, device, deployment="test")
    p = PolicyPipeline(model, bufs)
    ids, mask = tokenizer_for(model.cfg).encode([TEXTS[i % 2] for i in range(n)])
    bufs["policy.text_ids"].copy_(ids)
    bufs["policy.text_mask"].copy_(mask)
    bufs["policy.rng_key"].copy_(torch.arange(n) + 17)
    p.begin_episode()
    p.encode_instruction()
    return p


def observe(p: PolicyPipeline, seed: int) -> None:
    """Write a random observation into every slot and encode it."""
    g = torch.Generator().manual_seed(seed)
    img = p["image"]
    p["image"].copy_(torch.randint(0, 256, img.shape, generator=g, dtype=torch.uint8))
    p["proprio"].copy_(torch.rand(p["proprio"].shape, generator=g) * 2 - 1)
    p.encode_observation()


STAGES = ("encode_instruction", "encode_observation", "draw_noise", "denoise")


def capture(p: PolicyPipeline) -> Callable[[str], None]:
    """Capture each stage of ``p`` as a variant of one graph; returns ``replay(stage)``."""
    g = Graph("policy-stages", max_variants=len(STAGES)).bind(p.bufs)
    for stage in STAGES:
        g.capture(stage, getattr(p, stage))
    return g.replay
