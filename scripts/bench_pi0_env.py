"""pi0 inside the env loop: ``FlashRTVectorEnv`` with a pi0-sized policy on the MuJoCo Warp push
scene, the figure a user who steers pi0 by RL gets (chunks a second of whole env steps: policy,
physics, autoresets, render, encode), beside nothing published to compare with.

- Weights: LeRobot's pi0 at full size (:func:`flashrt.policies.config.lerobot_pi0`, the config
  :mod:`flashrt.policies.convert` writes from a ``gemma_2b`` / ``gemma_300m`` checkpoint: 3
  cameras at 224x224, 48 tokens, horizon 50, 32-D state and actions, 10 denoising steps), random,
  written once as a bf16 weights folder and loaded by the env like any other. The tests'
  SentencePiece model stands in for PaliGemma's tokenizer (as in ``bench_policy.py``); the
  embedding keeps PaliGemma's 257 152 rows.
- Scene: :class:`flashrt_gym.sims.WarpPush` split around Warp's own graph, determinism off (the
  default ``--simulator mujoco_warp_split_fast``, the ``mujoco_warp_push`` task's default and
  ``bench_mujoco.py``'s row of that name; ``mujoco_warp``: in the step's one graph, deterministic;
  ``mujoco_cpu``: the same scene on MuJoCo's C library, a thread per core, as an external
  simulator) with three fixed cameras (``top``, ``opposite``, ``centre``) rendered at 224x224,
  the end-effector as the first 2 of the policy's 32 state numbers (the rest zero), the first 2
  of its 32 action numbers driving the end-effector.
- At each ``--sizes`` and ``--precisions``: the first reset and step (the capture included), the
  GPU memory the env holds after it (torch's allocator and Warp's pool), then ``--steps``
  consecutive ``step_torch`` calls with noise actions uniform in the box, so slots autoreset at
  their natural times: sustained chunks/s (wall time over steps), mean, p50, p99 and max ms a
  step (``bench_mujoco.sustained``).
- ``--train-seconds T``: FastSAC steering it (``scripts/train.py`` with its defaults and
  ``env.repeat_over_horizon=true``, DSRL's pi0 setting) for T s at each ``--train-sizes``, its env
  steps/s while training and from launch (``summary.json``): a throughput figure (random weights
  learn nothing worth reporting).

    python scripts/bench_pi0_env.py --out $OUT/bench_pi0_env.json --train-seconds 120
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_mujoco import gpu_memory_mb, sustained
from benchlib import provenance

from flashrt.policies import FlowPolicy, PaliGemmaTokenizer, save
from flashrt.policies.config import lerobot_pi0
from flashrt.policies.model import PRECISIONS
from flashrt.runtime import atomic_write
from flashrt_gym import FlashRTVectorEnv
from flashrt_gym.sims import MujocoPush, WarpPush
from flashrt_gym.sims.push.warp_api import warp_api

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "policies" / "fixtures" / "tokenizer.model"
CAMERAS = ["top", "opposite", "centre"]
SCENE = {"cameras": CAMERAS, "table": {"image_size": 224}}
SIMULATORS = {  # the physics under the same scene: in the step graph, split around Warp's own graph, or C
    "mujoco_warp": functools.partial(WarpPush, cfg=SCENE),
    "mujoco_warp_split_fast": functools.partial(WarpPush, cfg=SCENE, capture="warp", deterministic=False),
    "mujoco_cpu": functools.partial(MujocoPush, cfg=SCENE, threads=os.cpu_count() or 1),
}
TRAIN_TASK = {  # train.py on the same simulator (Hydra overrides); the C library's row trains on the one graph
    "mujoco_warp": ["task=mujoco_warp_push", "task.capture=torch", "task.deterministic=true"],
    "mujoco_warp_split_fast": ["task=mujoco_warp_push"],  # the task's default
    "mujoco_cpu": ["task=mujoco_warp_push", "task.capture=torch", "task.deterministic=true"],
}


def write_weights(folder: Path) -> Path:
    """Random full-size pi0 weights (bf16) in ``folder``, made on the GPU (its init on a CPU takes
    minutes)."""
    cfg = lerobot_pi0()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = FlowPolicy(cfg)
    model.tokenizer = PaliGemmaTokenizer(TOKENIZER.read_bytes(), cfg.max_text_len, cfg.state_token == "text")
    return save(model, folder, dtype=torch.bfloat16)


def bench_env(weights: Path, n: int, precision: str, args: argparse.Namespace) -> dict:
    gc.collect()  # what earlier rows (or the weights' writer) left in cycles, before the baseline
    torch.cuda.empty_cache()
    before = gpu_memory_mb()
    t = time.perf_counter()
    env = FlashRTVectorEnv(
        n,
        device="cuda",
        weights=weights,
        precision=precision,
        simulator=SIMULATORS[args.simulator],
        repeat_over_horizon=args.repeat_over_horizon,
    )
    env.reset(seed=0)
    env.step_torch(torch.zeros(env.action_space.shape, device="cuda"))  # captures the step
    torch.cuda.synchronize()
    first = time.perf_counter() - t
    held = {key: mb - before[key] for key, mb in gpu_memory_mb().items()}
    row = {"num_envs": n, "precision": precision, "first_step_s_with_capture": first, "memory_after_capture_MB": held}
    row |= sustained(env, args.steps, args.warmup, None)
    if args.simulator.startswith("mujoco_warp"):
        row["flagged_worlds"] = env.engine.sim.overflow()
    del env
    return row


def train_rate(weights: Path, simulator: str, n: int, precision: str, seconds: int, out: Path) -> dict:
    """FastSAC (the main job) steering the policy for ``seconds``: its summary's rates."""
    run = out / f"fast_sac_{precision}_{n}"
    cmd = [
        sys.executable, str(ROOT / "scripts" / "train.py"), *TRAIN_TASK[simulator], f"policy.weights={weights}",
        f"policy.precision={precision}", f"task.cfg.cameras=[{','.join(CAMERAS)}]", "task.cfg.table.image_size=224",
        "env.repeat_over_horizon=true", f"env.num_envs={n}", f"time_limit_s={seconds}", "total_steps=1000000000",
        "eval.episodes=16", "eval.test_episodes=16", "eval.every=1000000000", "eval.test_at=[]", f"hydra.run.dir={run}",
    ]  # fmt: skip
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    row = {"num_envs": n, "precision": precision, "command": " ".join(cmd[1:]), "wall_s": time.perf_counter() - t}
    if proc.returncode != 0:
        return row | {"error": proc.stderr[-3000:]}
    summary = json.loads((run / "summary.json").read_text())
    keep = ("env_steps", "env_steps_per_s", "env_steps_per_s_from_launch", "wall_s")
    return row | {k: summary[k] for k in keep if k in summary}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="*", default=[1, 16, 64, 256], help="env rows (none: train only)")
    ap.add_argument("--precisions", nargs="+", default=["native", "fp8"], choices=PRECISIONS)
    ap.add_argument("--simulator", default="mujoco_warp_split_fast", choices=list(SIMULATORS))
    ap.add_argument("--steps", type=int, default=60, help="timed consecutive steps (1.5 episode lengths)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--repeat-over-horizon",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one 32-D noise repeated over the horizon (DSRL's pi0 setting) instead of 50 x 32",
    )
    ap.add_argument("--train-seconds", type=int, default=0, help="FastSAC runs of this length (0: none)")
    ap.add_argument("--train-sizes", type=int, nargs="+", default=[64])
    ap.add_argument("--weights", type=Path, default=None, help="a pi0-sized weights folder (default: made here)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "bench_pi0_env.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_pi0_env.py measures pi0 on the GPU: run it on a machine with a CUDA GPU")
    if args.simulator.startswith("mujoco_warp"):
        warp_api().wp.config.quiet = True
    result: dict = {
        **provenance(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "scene": SCENE,
        "policy": "lerobot_pi0 (full size, random, bf16 folder; the tests' SentencePiece tokenizer)",
        "env": [],
        "train": [],
    }

    def save_json() -> None:
        atomic_write(args.out, lambda f: f.write((json.dumps(result, indent=1) + "\n").encode()))

    with tempfile.TemporaryDirectory(prefix="pi0_weights_") as tmp:
        weights = args.weights
        if weights is None:
            t = time.perf_counter()
            weights = write_weights(Path(tmp) / "pi0")
            result["weights_written_s"] = time.perf_counter() - t
        for precision in args.precisions:
            for n in args.sizes:
                try:
                    row = bench_env(weights, n, precision, args)
                except torch.cuda.OutOfMemoryError as e:
                    row = {"num_envs": n, "precision": precision, "error": f"out of memory: {e}"}
                    torch.cuda.empty_cache()
                print(json.dumps(row), flush=True)
                result["env"].append(row)
                save_json()
        if args.train_seconds:
            for precision in args.precisions:
                for n in args.train_sizes:
                    row = train_rate(weights, args.simulator, n, precision, args.train_seconds, args.out.parent)
                    print(json.dumps({k: v for k, v in row.items() if k != "command"}), flush=True)
                    result["train"].append(row)
                    save_json()
    print(f"\n{'precision':>9} {'slots':>6} {'chunks/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'GB':>6}")
    for r in result["env"]:
        if "error" in r:
            print(f"{r['precision']:>9} {r['num_envs']:>6} {r['error'][:40]}")
            continue
        gb = sum(r["memory_after_capture_MB"].values()) / 1024
        print(
            f"{r['precision']:>9} {r['num_envs']:>6} {r['sustained_chunks_per_s']:>9.1f} {r['p50_ms']:>7.2f} "
            f"{r['p99_ms']:>7.2f} {r['max_ms']:>7.2f} {gb:>6.2f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
