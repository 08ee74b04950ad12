"""Demonstrations of the MuJoCo push task, and a tiny VLA pretrained on them, through the pipeline.

1. Collect (skipped when ``<out>/demos`` already holds shards): the push task's scripted expert
   plus action noise on MuJoCo's C library, ``--episodes`` successful episodes in batches of
   ``--slots`` (``flashrt_gym.demos.push.collect_batch``), ``--workers`` batches at a time in
   parallel processes, one shard per batch in the format of ``flashrt_gym.demos.tabletop``.
2. Pretrain (unless ``--collect-only``): ``scripts/pretrain_policy.py``'s ``run`` on those shards
   with ``configs/pretrain.yaml`` (composed by Hydra) and the ``key=value`` overrides given, its
   checkpoints evaluated in closed loop on the MuJoCo push task
   (``flashrt_gym.demos.push.evaluate``, seen and held-out instructions, validation starts, the
   physics on ``--eval-threads`` CPU threads) instead of the 2-D tabletop. Writes
   ``<out>/pretrain/step-N/`` weights and ``<out>/pretrain/evals.json``.

    python scripts/mujoco_pretrain.py --episodes 4000 --workers 16 --out runs/mujoco_pretrain steps=2500
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from itertools import count
from pathlib import Path

import pretrain_policy
import torch
from hydra import compose, initialize_config_dir
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from flashrt_gym.demos.push import collect_batch, first_episodes, push_config, save_shard
from flashrt_gym.demos.push import evaluate as evaluate_push
from flashrt_gym.sims.push.task import PushConfig

ROOT = Path(__file__).resolve().parents[1]


def collect_into(folder: Path, cfg: PushConfig, args: argparse.Namespace) -> int:
    """Shards of ``args.episodes`` successful episodes in ``folder``: batches 0, 1, ... in order
    (the same shards whatever ``--workers``), ``--workers`` at a time."""
    one = functools.partial(
        collect_batch, cfg, num_slots=args.slots, noise_std=args.noise_std, max_ticks=args.max_ticks, seed=args.seed
    )
    kept, batches = 0, count()
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(tqdm(total=args.episodes, desc="collect", unit="episode"))
        run = map
        if args.workers > 1:
            context = multiprocessing.get_context("spawn")
            # one torch thread a worker: N workers with a thread per core each oversubscribe the
            # cores, and the renderer's tensor ops then slow down by orders of magnitude
            pool = ProcessPoolExecutor(
                args.workers, mp_context=context, initializer=torch.set_num_threads, initargs=(1,)
            )
            run = stack.enter_context(pool).map
        while kept < args.episodes:
            wave = [next(batches) for _ in range(args.workers)]
            for b, shard in zip(wave, run(one, wave), strict=True):
                if kept >= args.episodes:
                    break
                shard = first_episodes(shard, args.episodes - kept)
                n = int(shard["episode"].unique().numel())
                kept += n
                bar.update(n)
                save_shard(shard, folder / f"shard-{b:04d}.safetensors", cfg)
    return kept


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=4000, help="successful demonstration episodes to keep")
    ap.add_argument("--slots", type=int, default=256, help="episodes simulated together in one batch")
    ap.add_argument("--workers", type=int, default=1, help="batches collected at once, in parallel processes")
    ap.add_argument("--noise-std", type=float, default=0.3, help="Gaussian noise added to the expert's actions")
    ap.add_argument("--max-ticks", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--frame-skip", type=int, default=PushConfig().frame_skip)
    ap.add_argument("--eval-threads", type=int, default=os.cpu_count() or 1, help="CPU threads of the evaluations")
    ap.add_argument("--collect-only", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("runs/mujoco_pretrain"))
    ap.add_argument("overrides", nargs="*", help="configs/pretrain.yaml keys as key=value (demos and out are set)")
    args = ap.parse_args(argv)
    demos = args.out / "demos"
    if not any(demos.glob("*.safetensors")):
        collect_into(demos, PushConfig(frame_skip=args.frame_skip), args)
    if args.collect_only:
        return None
    push = push_config(demos)

    def evaluate(folder: Path, task_cfg, cfg, device: str) -> dict[str, float]:
        """The pipeline's checkpoint evaluation, on the MuJoCo task the demos came from."""
        return evaluate_push(
            folder,
            dataclasses.replace(push, table=task_cfg),
            episodes=cfg.eval_episodes,
            n_action_steps=cfg.n_action_steps,
            max_episode_steps=cfg.max_episode_steps,
            device=device,
            threads=args.eval_threads,
        )

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(
            config_name="pretrain", overrides=[*args.overrides, f"demos={demos}", f"out={args.out / 'pretrain'}"]
        )
    pretrain_policy.evaluate = evaluate  # run() evaluates through this module-level name
    return pretrain_policy.run(cfg)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    with logging_redirect_tqdm():  # pretrain_policy's log lines above its progress bar
        main()
