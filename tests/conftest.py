"""Shared test options (`cuda` tests skip cleanly on machines without a CUDA GPU) and fixtures.

Without a GPU, Triton kernels run through Triton's CPU interpreter where Triton is installed
(the variable must be set before Triton is first imported, hence here); without a display,
MuJoCo renders through EGL (likewise fixed at its first import).
"""

import importlib.util
import os
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if not os.environ.get("DISPLAY"):  # MuJoCo picks its OpenGL backend at its first import, whichever test runs first
    os.environ.setdefault("MUJOCO_GL", "egl")

if importlib.util.find_spec("mujoco") is None:  # the MuJoCo task's tests need the mujoco extra
    collect_ignore_glob = ["flashrt_gym/sims/test_mujoco*.py", "flashrt_gym/demos/test_mujoco*.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def micro(tmp_path_factory):
    """A random policy with the shipped tiny policy's interface (64x64 image, 2-D actions and
    proprio, horizon 8, the task's vocabulary) and one layer of width 64: fast on a CPU."""
    from flashrt.policies import FlowPolicy, save
    from flashrt.policies.config import tiny
    from flashrt_gym.sims.tabletop import TabletopConfig

    cfg = replace(
        tiny(TabletopConfig().vocabulary),
        width=64, depth=1, heads=2, head_dim=32, mlp=128, vision_width=64, vision_depth=1, vision_heads=2,
        vision_mlp=128, expert_width=64, expert_mlp=128, steps=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return save(FlowPolicy(cfg), tmp_path_factory.mktemp("micro"))
