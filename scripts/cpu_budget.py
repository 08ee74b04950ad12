"""What the main job can do on a CPU-only machine in 10 minutes: measured, then projected.

    python scripts/cpu_budget.py --out docs/training/cpu_budget.json

Measures, in process CPU time (all threads; robust to other load on a shared machine) and in
wall time, one env step of the CPU configuration's slots with the shipped VLA (render, encode,
denoise, simulate) and one FastSAC round (act, store, the configured gradient steps), then
projects onto a machine of ``--cores`` idle cores (CPU time / cores: an optimistic bound) the
seconds that the main job's base and steered evaluations on ``--test-episodes`` test starts take,
and the env steps that fit in ``--budget-s``. The JSON holds the load average seen, since the
wall times depend on it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch
from benchlib import commit
from hydra import compose, initialize_config_dir
from tqdm import tqdm

from flashrt.runtime import atomic_write
from flashrt_gym.learners.fast_sac import FastSAC, FastSACConfig
from flashrt_gym.training import check, make_env

logger = logging.getLogger("cpu_budget")
ROOT = Path(__file__).resolve().parents[1]


def timed(fn, reps: int, desc: str) -> tuple[float, float]:
    """Mean (process CPU seconds, wall seconds) of ``fn()`` over ``reps`` calls after one warm-up."""
    fn()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in tqdm(range(reps), desc=desc, unit="call"):
        fn()
    return (time.process_time() - cpu) / reps, (time.perf_counter() - wall) / reps


def main(argv: list[str] | None = None) -> dict:
    """Measure, project and write the JSON (see the module docstring); returns what it wrote."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="timed calls of each measurement")
    ap.add_argument("--cores", type=int, default=2, help="idle cores of the machine projected onto")
    ap.add_argument("--budget-s", type=float, default=600.0, help="the main job's wall-time budget")
    ap.add_argument("--test-episodes", type=int, default=256, help="test starts the base and steered runs each play")
    ap.add_argument("--out", type=Path, default=ROOT / "docs/training/cpu_budget.json")
    ap.add_argument("overrides", nargs="*", help="configs/train.yaml overrides (runtime.device=cpu is set)")
    args = ap.parse_args(argv)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*args.overrides, "runtime.device=cpu"])
    check(cfg)  # the CPU column of the auto budgets
    load_before = os.getloadavg()
    n, horizon = cfg.env.num_envs, cfg.env.max_episode_steps
    env = make_env(cfg, n, autoreset=True, action_mode="residual")
    env.reset(seed=0)
    zeros = torch.zeros(n, *env.single_action_space.shape)
    step_cpu, step_wall = timed(lambda: env.step_torch(zeros), args.reps, f"env step, {n} slots")
    obs = torch.tensor(env.reset(seed=0)[0])
    kw = dict(cfg.agent.kwargs)
    kw["hidden"] = tuple(kw["hidden"])
    sac = FastSAC(obs.shape[1], zeros.shape[1], n, FastSACConfig(**kw), "cpu", seed=0, graphs=False)
    reward, keep = torch.zeros(n), torch.ones(n, dtype=torch.bool)
    for _ in range(max(1, -(-sac.cfg.batch_size // n))):  # a batch's worth of transitions before updates
        sac.store(obs, sac.act(obs), reward, obs, keep)

    def learner_round() -> None:
        sac.store(obs, sac.act(obs), reward, obs, keep)
        sac.update()

    update_cpu, update_wall = timed(learner_round, args.reps, f"FastSAC round, {sac.cfg.updates_per_step} updates")
    env.close()
    per_slot_step = step_cpu / n
    eval_cpu = 2 * args.test_episodes * horizon * per_slot_step  # base and steered: every batch runs the horizon
    train_cpu_per_env_step = per_slot_step + update_cpu / n
    left = args.budget_s * args.cores - eval_cpu
    result = {
        "commit": commit(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "slots": n,
        "env_step_cpu_s": step_cpu,
        "env_step_wall_s": step_wall,
        "cpu_s_per_env_step": per_slot_step,
        "fast_sac_round_cpu_s": update_cpu,
        "fast_sac_round_wall_s": update_wall,
        "updates_per_step": sac.cfg.updates_per_step,
        "batch_size": sac.cfg.batch_size,
        "projected_cores": args.cores,
        "test_episodes": args.test_episodes,
        "projected_eval_wall_s": eval_cpu / args.cores,
        "projected_train_env_steps_in_budget": max(0, int(left / train_cpu_per_env_step)),
        "budget_s": args.budget_s,
        "overrides": args.overrides,
    }
    text = json.dumps(result, indent=2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(args.out, lambda f: f.write(text.encode()))
    logger.info("%s", text)
    logger.info("wrote %s", args.out)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    main()
