"""Meta-World demonstrations, a multi-task VLA cloned on them, chosen on validation, measured on test.

1. Collect (skipped when ``<out>/demos`` already holds shards): Meta-World's scripted policies plus
   Gaussian action noise on MuJoCo's C library, ``--episodes`` successful episodes of every task
   (``--tasks``: MT10 by default), in batches of ``--slots`` episodes
   (``flashrt_gym.demos.metaworld.collect_batch``: slot i runs task i % len(tasks) from the
   demonstrations' seed block), ``--workers`` batches at a time in parallel processes, one shard
   per batch (the same shards whatever ``--workers``).
2. Pretrain (unless ``--collect-only``): ``scripts/pretrain_policy.py``'s ``run`` on those shards
   with ``configs/metaworld_pretrain.yaml`` (``configs/pretrain.yaml`` with the ``tiny_metaworld``
   preset; composed by Hydra) and the ``key=value`` overrides given. Every checkpoint is scored in
   closed loop per task on the validation starts (``eval_episodes`` per task, the unsteered policy,
   the physics split over ``--eval-processes`` worker processes). Writes ``<out>/pretrain/step-N/`` weights and
   ``<out>/pretrain/evals.json``.
3. Choose the checkpoint of the highest mean validation success over the tasks (the earliest of
   equals), with ``--ceiling c`` the highest at or below ``c`` (a base policy meant to be clearly
   imperfect, for steering to have room; if every checkpoint is above, the lowest), then measure
   it once on the test starts; ``<out>/base.json`` holds both, per task.

    python scripts/metaworld_pretrain.py --episodes 300 --workers 16 --eval-processes 16 \\
        --out runs/metaworld_mt10 steps=6000
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from itertools import count
from pathlib import Path
from typing import Any

import pretrain_policy
import torch
from benchlib import provenance
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from flashrt.runtime import atomic_write
from flashrt_gym.demos.metaworld import (
    MetaWorldTask,
    collect_batch,
    episodes_per_task,
    evaluate,
    first_episodes_per_task,
    load_shards,
    save_shard,
)
from flashrt_gym.splits import TEST_SEED, VALIDATION_SEED

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger(__name__)


def collect_into(folder: Path, task: MetaWorldTask, args: argparse.Namespace) -> torch.Tensor:
    """Shards of ``args.episodes`` successful episodes of every task in ``folder``: batches 0, 1,
    ... in order, ``--workers`` at a time; returns the episodes kept per task.

    Raises:
        RuntimeError: a wave of batches that adds no episode of a task still short of its count.
    """
    one = functools.partial(
        collect_batch, task, num_slots=args.slots, noise_std=args.noise_std, max_ticks=args.max_ticks, seed=args.seed
    )
    collection = {"noise_std": args.noise_std, "max_ticks": args.max_ticks, "seed": args.seed, "slots": args.slots}
    need = torch.full((len(task.tasks),), args.episodes)
    batches = count()
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(tqdm(total=int(need.sum()), desc="collect", unit="episode"))
        run: Any = map
        if args.workers > 1:
            context = multiprocessing.get_context("spawn")
            # one torch thread a worker, so N workers do not oversubscribe the cores
            pool = ProcessPoolExecutor(
                args.workers, mp_context=context, initializer=torch.set_num_threads, initargs=(1,)
            )
            run = stack.enter_context(pool).map
        while need.any():
            wave, before = [next(batches) for _ in range(args.workers)], need.clone()
            for b, shard in zip(wave, run(one, wave), strict=True):
                shard = first_episodes_per_task(shard, need.tolist())
                got = episodes_per_task(shard, len(task.tasks))
                if got.any():
                    need -= got
                    bar.update(int(got.sum()))
                    save_shard(shard, folder / f"shard-{b:04d}.safetensors", task, collection)
            stalled = [n for n, was, now in zip(task.tasks, before, need, strict=True) if now > 0 and now == was]
            if stalled:
                raise RuntimeError(
                    f"{args.workers * args.slots} episodes gave no success of {stalled}: lower --noise-std or raise "
                    "--max-ticks"
                )
    return args.episodes - need


def choose(evals: list[dict[str, Any]], ceiling: float | None) -> dict[str, Any]:
    """The checkpoint of the highest mean validation success (the earliest of equals); with a
    ``ceiling``, the highest at or below it, or if none is, the lowest.

    Args:
        evals: the pipeline's checkpoint evaluations (``success_mean`` each), in step order.
        ceiling: the highest validation mean a chosen checkpoint may have, or None.

    Returns:
        The chosen evaluation.
    """
    under = [e for e in evals if ceiling is None or e["success_mean"] <= ceiling]
    if not under:
        return min(evals, key=lambda e: e["success_mean"])
    return max(under, key=lambda e: e["success_mean"])  # max keeps the first of equals: the earliest


def main(argv: list[str] | None = None) -> dict:
    """Collect, pretrain, choose and test as the module says; ``argv`` as on the command line.

    Returns:
        What ``<out>/base.json`` holds (empty with ``--collect-only``).
    """
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=["MT10"], help="'MT10' or Meta-World task names (reach-v3 ...)")
    ap.add_argument("--episodes", type=int, default=300, help="successful demonstration episodes to keep per task")
    ap.add_argument("--slots", type=int, default=160, help="episodes simulated together in one batch")
    ap.add_argument("--workers", type=int, default=1, help="batches collected at once, in parallel processes")
    ap.add_argument("--noise-std", type=float, default=0.2, help="Gaussian noise added to the experts' actions")
    ap.add_argument("--max-ticks", type=int, default=200, help="a demonstration episode's tick limit")
    ap.add_argument("--seed", type=int, default=0, help="the collection's seed (flashrt_gym.splits.demo_seed)")
    ap.add_argument("--image-size", type=int, default=64, help="the camera's resolution (the policy's)")
    ap.add_argument("--camera", default="overview")
    ap.add_argument(
        "--eval-processes", type=int, default=os.cpu_count() or 1, help="worker processes of the evaluations' physics"
    )
    ap.add_argument("--collect-only", action="store_true")
    ap.add_argument(
        "--ceiling", type=float, default=None, help="choose the best checkpoint whose validation mean is at most this"
    )
    ap.add_argument("--out", type=Path, default=Path("runs/metaworld_pretrain"))
    ap.add_argument("overrides", nargs="*", help="configs/metaworld_pretrain.yaml keys as key=value")
    args = ap.parse_args(argv)
    if args.episodes < 1 or args.slots < 1 or args.workers < 1 or args.eval_processes < 1:
        ap.error("--episodes, --slots, --workers and --eval-processes must be >= 1")
    tasks = args.tasks[0] if args.tasks == ["MT10"] else args.tasks
    demos = args.out / "demos"
    if not any(demos.glob("*.safetensors")):
        task = MetaWorldTask(tasks, args.image_size, args.camera)
        kept = collect_into(demos, task, args)
        logger.info("collected %s episodes per task into %s", kept.tolist(), demos)
    if args.collect_only:
        return {}
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(
            config_name="metaworld_pretrain",
            overrides=[*args.overrides, f"demos={demos}", f"out={args.out / 'pretrain'}"],
        )
    seen: dict[str, Any] = {}  # the shards' setting and the device, as run() passes them

    def validation(folder: Path, task: MetaWorldTask, cfg: DictConfig, device: str) -> dict[str, float]:
        """The pipeline's checkpoint evaluation: per task, from the validation starts."""
        seen.update(task=task, device=device)
        return score(folder, task, cfg, device, VALIDATION_SEED)

    def score(folder: Path | str, task: MetaWorldTask, cfg: DictConfig, device: str, seed: int) -> dict[str, float]:
        return evaluate(
            folder,
            task,
            episodes=cfg.eval_episodes,
            seed=seed,
            n_action_steps=cfg.n_action_steps,
            max_episode_steps=cfg.max_episode_steps,
            device=device,
            processes=args.eval_processes,
        )

    # run() reads the shards, their instructions and its evaluation through these module-level names
    pretrain_policy.load_shards, pretrain_policy.evaluate = load_shards, validation
    pretrain_policy.instructions = lambda task: task.instructions
    summary = pretrain_policy.run(cfg)
    best = choose(summary["evals"], args.ceiling)
    task = seen["task"]
    test = score(best["weights"], task, cfg, seen["device"], TEST_SEED)
    result = {
        "machine": provenance(),
        "argv": argv if argv is not None else sys.argv[1:],
        "tasks": list(task.tasks),
        "episodes_per_task": cfg.eval_episodes,
        "ceiling": args.ceiling,
        "chosen": {
            "step": best["step"],
            "weights": best["weights"],
            "validation": {k.removeprefix("success_"): v for k, v in best.items() if k.startswith("success_")},
        },
        "test": test,
        "validation_seed": VALIDATION_SEED,
        "test_seed": TEST_SEED,
        "checkpoints": summary["evals"],
    }
    text = json.dumps(result, indent=2)
    atomic_write(args.out / "base.json", lambda f: f.write(text.encode()))
    logger.info("chose step %d (validation %.3f): test success %.3f", best["step"], best["success_mean"], test["mean"])
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    with logging_redirect_tqdm():  # pretrain_policy's log lines above its progress bar
        main()
