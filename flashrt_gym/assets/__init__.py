"""Data shipped with the package: the pretrained ``tiny`` policies and the MuJoCo scene.

Each policy folder holds ``config.json``, ``tokenizer.json`` and ``model.safetensors`` (bf16,
25 MB), behaviour-cloned on noisy-expert demonstrations (see README):

- ``tiny/``: the built-in tabletop's, by ``scripts/pretrain_policy.py``;
- ``tiny_mujoco/``: the MuJoCo push task's, ``tiny/`` fine-tuned on camera images of the MuJoCo
  scene by ``scripts/mujoco_pretrain.py`` (``init=``); the MuJoCo simulators name it as their
  ``pretrained_weights``, which the env loads when it is given no weights;
- ``tiny_metaworld/``: Meta-World MT10's (the ``tiny_metaworld`` preset: 4-D actions and
  proprioception), by ``scripts/metaworld_pretrain.py`` on 300 noisy scripted-expert episodes a
  task, the checkpoint chosen on the validation starts under a ceiling so that it stays clearly
  imperfect; :class:`flashrt_gym.sims.MetaWorld` names it as its ``pretrained_weights``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flashrt.policies import FlowPolicy, load
from flashrt_gym.devices import policy_dtype

TINY = Path(__file__).parent / "tiny"
TINY_MUJOCO = Path(__file__).parent / "tiny_mujoco"
TINY_METAWORLD = Path(__file__).parent / "tiny_metaworld"


def load_pretrained(device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> tuple[FlowPolicy, str]:
    """The shipped ``tiny`` policy on ``device`` (bf16 on CUDA, fp32 on the CPU by default),
    and its weights id (the SHA-256 of the weights file)."""
    device = torch.device(device)
    return load(TINY, device=device, dtype=dtype or policy_dtype(device))
