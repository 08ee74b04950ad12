"""Data shipped with the package: the pretrained ``tiny`` policy for the built-in tabletop.

``tiny/`` holds ``config.json``, ``tokenizer.json`` and ``model.safetensors`` (bf16, 25 MB),
trained by ``scripts/pretrain_policy.py`` on 4000 noisy-expert demonstrations (see README).
"""

from __future__ import annotations

from pathlib import Path

import torch

from flashrt.policies import FlowPolicy, load
from flashrt_gym.devices import policy_dtype

TINY = Path(__file__).parent / "tiny"


def load_pretrained(device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> tuple[FlowPolicy, str]:
    """The shipped ``tiny`` policy on ``device`` (bf16 on CUDA, fp32 on the CPU by default),
    and its weights id (the SHA-256 of the weights file)."""
    device = torch.device(device)
    return load(TINY, device=device, dtype=dtype or policy_dtype(device))
