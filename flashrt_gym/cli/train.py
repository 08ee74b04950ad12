"""The main job, ``flashrt-train``: train an agent that steers the shipped VLA (Hydra app).

    flashrt-train                                  # FastSAC: 2048 slots on a GPU
    flashrt-train experiment=quick                 # minutes on a CPU-only machine
    flashrt-train -m agent=fast_sac,sac seed=0,1,2 # a sweep; then scripts/aggregate.py
    flashrt-train --cfg job                        # print the composed config and stop

Writes under the Hydra run folder: config.yaml, checkpoints/, tb/, curve.json, curve.png,
summary.json, and ``train.log`` (the job is named ``train`` after this module).
"""

from __future__ import annotations

import time

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from flashrt_gym.cli import CONFIGS
from flashrt_gym.training import train

IMPORTED = time.time()  # the launch when the caller gives none (after torch's import, which it cannot see)


def main(launch: float | None = None) -> None:
    """Run the main job on the command line in ``sys.argv`` (Hydra overrides).

    Args:
        launch: the ``time.time()`` of the process's launch, from which the first job's
            ``time_limit_s`` and reported wall times count (default: when this module was
            imported); a sequential multirun's later jobs count from their own start.
    """
    launches = [IMPORTED if launch is None else launch]

    @hydra.main(version_base="1.3", config_path=CONFIGS, config_name="train")
    def job(cfg: DictConfig) -> float:
        start = launches.pop() if launches else time.time()  # a sequential multirun's later jobs: their own start
        summary = train(cfg, HydraConfig.get().runtime.output_dir, launch=start)
        return summary.get("validation_success") or 0.0  # sweepers (Optuna) choose on validation, never on test

    job()
