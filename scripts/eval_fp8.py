"""The shipped tiny policies quantised to FP8 against themselves in bf16, in closed loop.

For each task (``tabletop``: the shipped ``tiny``; ``mujoco_push``: ``tiny_mujoco``) and split,
the unsteered base policy (its own per-slot noise, no correction: what ``flashrt-eval`` reports
as the base) runs one episode per start on the split's first ``--episodes`` starts, once with the
policy loaded in its native precision and once with ``policy.precision=fp8`` (the env's
``precision`` argument, :meth:`flashrt.policies.FlowPolicy.set_precision`), through flashrt_gym's
own evaluation (:func:`flashrt_gym.training.make_env`, :func:`flashrt_gym.evaluation.evaluate`).
Writes the success rates with their Wilson 95 % intervals and the difference in points as JSON.

    python scripts/eval_fp8.py --out eval_fp8.json                      # tabletop, test and validation
    python scripts/eval_fp8.py --tasks tabletop mujoco_push --splits test --out eval_fp8.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from benchlib import provenance
from hydra import compose, initialize_config_dir

from flashrt.kernels import fp8
from flashrt.runtime import atomic_write
from flashrt_gym.evaluation import evaluate
from flashrt_gym.training import make_env
from flashrt_gym.training.runlog import success_interval

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("native", "fp8")


def base_success(task: str, split: str, episodes: int, precision: str) -> dict:
    """The base policy of ``task`` at ``precision`` on ``split``'s first ``episodes`` starts."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"task={task}", f"policy.precision={precision}"])
    env = make_env(cfg, episodes, autoreset=False, action_mode="residual")
    if env.engine.policy.model.precision != precision:
        raise RuntimeError(f"the env's policy runs at {env.engine.policy.model.precision}, not {precision}")
    zeros = np.zeros((env.num_envs, *env.single_action_space.shape), np.float32)
    t = time.perf_counter()
    result = evaluate(env, lambda _: zeros, split, episodes)
    seconds = time.perf_counter() - t
    env.close()
    low, high = success_interval(result.success, episodes)
    return {
        "task": task,
        "split": split,
        "precision": precision,
        "episodes": episodes,
        "success": result.success,
        "success_95": [low, high],
        "mean_return": result.mean_return,
        "seconds": seconds,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=["tabletop"], help="task config groups (configs/task)")
    ap.add_argument("--splits", nargs="+", default=["test", "validation"], choices=["test", "validation"])
    ap.add_argument("--episodes", type=int, default=1024, help="starts a split (one slot each)")
    ap.add_argument("--out", type=Path, default=Path("eval_fp8.json"))
    args = ap.parse_args()
    if not fp8.supported("cuda"):
        raise SystemExit("eval_fp8.py runs FP8 GEMMs: run it on a GPU of compute capability 8.9 or later")
    rows: list[dict] = []
    for task in args.tasks:
        for split in args.splits:
            pair = {p: base_success(task, split, args.episodes, p) for p in PRECISIONS}
            rows += pair.values()
            diff = 100 * (pair["fp8"]["success"] - pair["native"]["success"])
            rows.append({"task": task, "split": split, "fp8_minus_native_points": diff})
            print(
                f"{task} {split}: native {pair['native']['success']:.3f}, fp8 {pair['fp8']['success']:.3f} "
                f"({diff:+.1f} points, {args.episodes} starts)",
                flush=True,
            )
            torch.cuda.empty_cache()
    out = {**provenance(), "rows": rows}
    atomic_write(args.out, lambda f: f.write(json.dumps(out, indent=2).encode()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
