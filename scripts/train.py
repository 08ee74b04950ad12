"""Train an agent that steers the shipped VLA on FlashRT-VLA (the main job).

    python scripts/train.py                                  # FastSAC: 1024 slots on the GPU
    python scripts/train.py experiment=quick                 # minutes on a CPU-only machine
    torchrun --nproc_per_node 2 scripts/train.py             # data-parallel FastSAC (NCCL_NVLS_ENABLE=0)
    python scripts/train.py experiment=dsrl_sac              # the SB3 path (GraphSAC, 64 slots)
    python scripts/train.py -m agent=fast_sac,sac seed=0,1,2 # a sweep; then scripts/aggregate.py
    python scripts/train.py resume=outputs/<run>/checkpoints/last.safetensors

Writes under the Hydra run folder: config.yaml, checkpoints/, tb/, curve.json, curve.png,
summary.json; prints the base policy's success beside the steered one on the test starts.
"""

from __future__ import annotations

import time

LAUNCH = time.time()  # before the heavy imports: time limits and wall times count from here

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from flashrt_gym.training import train  # noqa: E402


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> float:
    summary = train(cfg, HydraConfig.get().runtime.output_dir, launch=LAUNCH)
    return summary.get("validation_success") or 0.0  # sweepers (Optuna) choose on validation, never on test


if __name__ == "__main__":
    main()
