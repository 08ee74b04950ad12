"""Which episode starts each use of the env draws: training runs, validation, test.

``reset(seed=s)`` gives slot ``i`` the RNG stream of seed ``s + i`` (Gymnasium's convention), and
slot ``i``'s later episodes continue that stream. Two uses of the env therefore share no episode
start iff their seed ranges ``[s, s + slots)`` do not overlap. This module names those ranges in
one place:

* training run ``r`` (Hydra's ``seed``) owns ``[TRAIN + r * TRAIN_STRIDE, + TRAIN_STRIDE)``; its
  slots (all data-parallel ranks together) take the first ``num_envs`` of them;
* evaluation on a split runs one episode per slot from ``SPLITS[split]`` on, at most
  ``EVAL_SPAN`` episodes. Hyper-parameters and checkpoints are chosen on ``validation``; the
  headline is reported on ``test``, which no choice has seen.
"""

from __future__ import annotations

VALIDATION = 1_000_000
"""First seed of the validation starts (the starts every earlier tuning of this task used)."""
TEST = 2_000_000
"""First seed of the test starts: reported once, never used for a choice."""
EVAL_SPAN = 1_000_000
"""Most evaluation episodes of one split."""
SPLITS = {"validation": VALIDATION, "test": TEST}

TRAIN = 1 << 30
"""First seed of training run 0."""
TRAIN_STRIDE = 1 << 22
"""Seeds owned by one training run: the most slots a run may use."""
MAX_RUN_SEED = ((1 << 31) - TRAIN) // TRAIN_STRIDE - 1
"""The largest run seed (reset seeds stay below 2**31)."""


def train_seed(run_seed: int, num_envs: int, rank: int = 0, world_size: int = 1) -> int:
    """The reset seed of rank ``rank``'s slots in training run ``run_seed``: the run's
    ``num_envs`` slots are split evenly over ``world_size`` ranks, in rank order."""
    if not 0 <= run_seed <= MAX_RUN_SEED:
        raise ValueError(f"seed must lie in [0, {MAX_RUN_SEED}] (each run owns its own episode starts), got {run_seed}")
    if not 0 < num_envs <= TRAIN_STRIDE:
        raise ValueError(f"num_envs must lie in [1, {TRAIN_STRIDE}] (the starts one run owns), got {num_envs}")
    if num_envs % world_size or not 0 <= rank < world_size:
        raise ValueError(f"num_envs ({num_envs}) must split evenly over {world_size} ranks (rank {rank})")
    return TRAIN + run_seed * TRAIN_STRIDE + rank * (num_envs // world_size)


def eval_seed(split: str, episodes: int) -> int:
    """The first reset seed of ``episodes`` evaluation episodes on ``split``."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if not 0 < episodes <= EVAL_SPAN:
        raise ValueError(f"evaluation episodes must lie in [1, {EVAL_SPAN}] (one split's starts), got {episodes}")
    return SPLITS[split]
