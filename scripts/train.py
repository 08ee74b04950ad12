"""Train an SB3 agent that steers the shipped VLA on FlashRT-VLA (the main job).

    python scripts/train.py                                  # SAC steering, noise space, GPU budget
    python scripts/train.py experiment=quick                 # minutes on a CPU-only machine
    python scripts/train.py -m agent=sac,ppo seed=0,1,2      # a sweep; then scripts/aggregate.py
    python scripts/train.py resume=outputs/<run>/checkpoints/last.zip

Writes under the Hydra run folder: config.yaml, checkpoints/, tb/, curve.json, curve.png,
summary.json; prints the base policy's success beside the steered one.
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from flashrt_gym.training import train


@hydra.main(version_base="1.3", config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> float:
    summary = train(cfg, HydraConfig.get().runtime.output_dir)
    return summary["success"]  # the objective of sweepers such as Optuna


if __name__ == "__main__":
    main()
