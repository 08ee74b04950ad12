"""Fixtures shared by the env tests."""

from dataclasses import replace

import pytest
import torch

from flashrt.policies import FlowPolicy, save
from flashrt.policies.config import tiny
from flashrt_gym.tasks import TabletopConfig


@pytest.fixture(scope="session")
def micro(tmp_path_factory):
    """A random policy with the shipped tiny policy's interface (64x64 image, 2-D actions and
    proprio, horizon 8, the task's vocabulary) and one layer of width 64: fast on a CPU."""
    cfg = replace(
        tiny(TabletopConfig().vocabulary),
        width=64, depth=1, heads=2, head_dim=32, mlp=128, vision_width=64, vision_depth=1, vision_heads=2,
        vision_mlp=128, expert_width=64, expert_mlp=128, steps=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return save(FlowPolicy(cfg), tmp_path_factory.mktemp("micro"))
