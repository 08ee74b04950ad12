"""Train an agent that steers the shipped VLA on FlashRT-VLA (the main job; ``flashrt-train``).

    python scripts/train.py                                  # FastSAC: 2048 slots on the GPU
    python scripts/train.py experiment=quick                 # minutes on a CPU-only machine
    torchrun --nproc_per_node 2 scripts/train.py             # data-parallel FastSAC (NCCL_NVLS_ENABLE=0)
    python scripts/train.py experiment=dsrl_sac              # the SB3 path (GraphSAC, 64 slots)
    python scripts/train.py -m agent=fast_sac,sac seed=0,1,2 # a sweep; then scripts/aggregate.py
    python scripts/train.py resume=outputs/<run>/checkpoints/last.safetensors

The job is :func:`flashrt_gym.cli.train.main`; see there for what a run folder holds.
"""

import time

LAUNCH = time.time()  # before the heavy imports: time limits and wall times count from here

from flashrt_gym.cli.train import main  # noqa: E402

if __name__ == "__main__":
    main(launch=LAUNCH)
