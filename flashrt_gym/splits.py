"""Which episode starts each use of the env draws: training runs, demonstrations, validation, test.

``reset(seed=s)`` gives slot ``i`` the RNG stream of seed ``s + i`` (Gymnasium's convention), and
slot ``i``'s later episodes continue that stream. The per-slot RNG (:mod:`flashrt.kernels.rng`)
mixes all 64 bits of a seed before anything is folded, so distinct seeds draw unrelated streams and
two uses of the env share no episode start iff their seed ranges do not overlap. The ranges are
blocks of the int64 seeds, named here and nowhere else:

* training run ``r`` (Hydra's ``seed``) owns ``[r * TRAIN_STRIDE, (r + 1) * TRAIN_STRIDE)``; its
  slots (all data-parallel ranks together) take the first ``num_envs`` of them;
* :data:`VALIDATION_SEED` and :data:`TEST_SEED` start the two evaluation splits: evaluation runs
  one episode per slot from a split's first seed on, at most :data:`EVAL_SPAN` episodes.
  Hyperparameters and checkpoints are chosen on ``validation``; results are reported on ``test``,
  which no choice has seen;
* :data:`DEMO_SEED` starts the demonstrations: collection ``c`` (its config's ``seed``) owns
  ``DEMO_STRIDE`` seeds, so a policy is never cloned on a start it is evaluated or steered from.

``tests/flashrt_gym/test_splits.py`` draws the start states of every block and checks that no two
coincide (states, not only seed ranges).
"""

from __future__ import annotations

TRAIN_STRIDE = 1 << 22
"""Seeds owned by one training run: the most slots a run may use."""
VALIDATION_SEED = 1 << 40
"""First seed of the validation starts: hyperparameters and checkpoints are chosen on these."""
TEST_SEED = 2 << 40
"""First seed of the test starts: results are reported on these, once, after every choice."""
DEMO_SEED = 3 << 40
"""First seed of the demonstrations' starts (scripted-expert episodes that policies are cloned on)."""
EVAL_SPAN = 1 << 40
"""Most evaluation episodes of one split."""
DEMO_STRIDE = 1 << 32
"""Seeds owned by one demonstration collection (its episodes, kept or not)."""
MAX_RUN_SEED = VALIDATION_SEED // TRAIN_STRIDE - 1
"""The largest run seed (every training seed stays below the validation starts)."""
MAX_DEMO_SEED = EVAL_SPAN // DEMO_STRIDE - 1
"""The largest demonstration collection seed."""
SPLITS = {"validation": VALIDATION_SEED, "test": TEST_SEED}


def train_seed(run_seed: int, num_envs: int, rank: int = 0, world_size: int = 1) -> int:
    """The reset seed of rank ``rank``'s slots in training run ``run_seed``.

    Args:
        run_seed: the run's seed (Hydra's ``seed``), in ``[0, MAX_RUN_SEED]``.
        num_envs: the run's slots over all ranks, split evenly in rank order.
        rank: this process's rank.
        world_size: the number of ranks.

    Returns:
        The seed whose ``reset(seed=...)`` gives this rank's slots their own block of starts.

    Raises:
        ValueError: a run seed or slot count outside the run's block, or slots that do not split evenly.
    """
    if not 0 <= run_seed <= MAX_RUN_SEED:
        raise ValueError(f"seed must lie in [0, {MAX_RUN_SEED}] (each run owns its own episode starts), got {run_seed}")
    if not 0 < num_envs <= TRAIN_STRIDE:
        raise ValueError(f"num_envs must lie in [1, {TRAIN_STRIDE}] (the starts one run owns), got {num_envs}")
    if num_envs % world_size or not 0 <= rank < world_size:
        raise ValueError(f"num_envs ({num_envs}) must split evenly over {world_size} ranks (rank {rank})")
    return run_seed * TRAIN_STRIDE + rank * (num_envs // world_size)


def eval_seed(split: str, episodes: int) -> int:
    """The first reset seed of ``episodes`` evaluation episodes on ``split``.

    Args:
        split: ``"validation"`` or ``"test"``.
        episodes: how many episodes (one per seed) the evaluation runs.

    Returns:
        The split's first seed; the episodes take the seeds after it.

    Raises:
        ValueError: an unknown split, or more episodes than one split holds.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if not 0 < episodes <= EVAL_SPAN:
        raise ValueError(f"evaluation episodes must lie in [1, {EVAL_SPAN}] (one split's starts), got {episodes}")
    return SPLITS[split]


def demo_seed(collection_seed: int, episode: int = 0) -> int:
    """The seed of demonstration episode ``episode`` of collection ``collection_seed``.

    Args:
        collection_seed: the collection's seed (``collect_demos.yaml``'s ``seed``), in ``[0, MAX_DEMO_SEED]``.
        episode: the episode's index in the collection, kept or not, in ``[0, DEMO_STRIDE)``.

    Returns:
        ``DEMO_SEED + collection_seed * DEMO_STRIDE + episode``.

    Raises:
        ValueError: a collection seed or episode index outside the demonstrations' block.
    """
    if not 0 <= collection_seed <= MAX_DEMO_SEED:
        raise ValueError(f"demonstration seed must lie in [0, {MAX_DEMO_SEED}], got {collection_seed}")
    if not 0 <= episode < DEMO_STRIDE:
        raise ValueError(f"demonstration episode must lie in [0, {DEMO_STRIDE}), got {episode}")
    return DEMO_SEED + collection_seed * DEMO_STRIDE + episode
