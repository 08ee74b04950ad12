"""Which episode starts each use of the env draws: training runs, validation, test.

``reset(seed=s)`` gives slot ``i`` the RNG stream of seed ``s + i`` (Gymnasium's convention), and
slot ``i``'s later episodes continue that stream. Two uses of the env therefore share no episode
start iff their seed ranges ``[s, s + slots)`` do not overlap. The evaluation splits are named in
:mod:`flashrt_gym.evaluation` (``VALIDATION_SEED``, ``TEST_SEED``); this module adds the blocks of
the training runs, all below the validation starts:

* training run ``r`` (Hydra's ``seed``) owns ``[r * TRAIN_STRIDE, (r + 1) * TRAIN_STRIDE)``; its
  slots (all data-parallel ranks together) take the first ``num_envs`` of them;
* evaluation on a split runs one episode per slot from ``SPLITS[split]`` on, at most
  ``EVAL_SPAN`` episodes. Hyper-parameters and checkpoints are chosen on ``validation``; results
  are reported on ``test``, which no choice has seen.
"""

from __future__ import annotations

from flashrt_gym.evaluation import TEST_SEED, VALIDATION_SEED

SPLITS = {"validation": VALIDATION_SEED, "test": TEST_SEED}
EVAL_SPAN = TEST_SEED - VALIDATION_SEED
"""Most evaluation episodes of one split."""
TRAIN_STRIDE = 1 << 22
"""Seeds owned by one training run: the most slots a run may use."""
MAX_RUN_SEED = VALIDATION_SEED // TRAIN_STRIDE - 1
"""The largest run seed (every training seed stays below the validation starts)."""


def train_seed(run_seed: int, num_envs: int, rank: int = 0, world_size: int = 1) -> int:
    """The reset seed of rank ``rank``'s slots in training run ``run_seed``: the run's
    ``num_envs`` slots are split evenly over ``world_size`` ranks, in rank order."""
    if not 0 <= run_seed <= MAX_RUN_SEED:
        raise ValueError(f"seed must lie in [0, {MAX_RUN_SEED}] (each run owns its own episode starts), got {run_seed}")
    if not 0 < num_envs <= TRAIN_STRIDE:
        raise ValueError(f"num_envs must lie in [1, {TRAIN_STRIDE}] (the starts one run owns), got {num_envs}")
    if num_envs % world_size or not 0 <= rank < world_size:
        raise ValueError(f"num_envs ({num_envs}) must split evenly over {world_size} ranks (rank {rank})")
    return run_seed * TRAIN_STRIDE + rank * (num_envs // world_size)


def eval_seed(split: str, episodes: int) -> int:
    """The first reset seed of ``episodes`` evaluation episodes on ``split``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if not 0 < episodes <= EVAL_SPAN:
        raise ValueError(f"evaluation episodes must lie in [1, {EVAL_SPAN}] (one split's starts), got {episodes}")
    return SPLITS[split]
