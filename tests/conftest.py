"""Shared test options: `cuda` tests skip cleanly on machines without a CUDA GPU.

Without a GPU, Triton kernels run through Triton's CPU interpreter where Triton is installed
(the variable must be set before Triton is first imported, hence here).
"""

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if importlib.util.find_spec("mujoco") is None:  # the MuJoCo task's tests need the mujoco extra
    collect_ignore_glob = ["flashrt_gym/test_mujoco*.py"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
