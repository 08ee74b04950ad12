"""FlashRT-VLA env throughput, reset latency and fork time, each beside a baseline of the same run.

- steps (action chunks) per second against num_envs, the captured step graph beside the same
  env stepped eagerly, and beside ``gymnasium.vector.SyncVectorEnv`` of single envs;
- reset latency: a capsule reset (restore pre-encoded starts) beside the cold path (simulator
  init + render + instruction prefill + encode) as the instruction context grows (random
  weights of the tiny shape with ``max_text_len`` tokens);
- fork of one slot into N slots beside a device copy of the same bytes.

    python scripts/bench_env.py --out bench_env.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from benchlib import provenance, wall_ms

import runtime
from flashrt_gym import FlashRTEnv, FlashRTVectorEnv
from flashrt_gym.engine import Engine
from flashrt_gym.tasks import TabletopConfig
from policies import FlowPolicy, save, tiny


def bench_steps(sizes: list[int], eager_sizes: list[int], sync_envs: int, reps: int) -> list[dict]:
    rows = []
    for n in sizes:
        row: dict = {"num_envs": n}
        for graphs in (True, False):
            if not graphs and n not in eager_sizes:
                continue
            env = FlashRTVectorEnv(n, device="cuda", graphs=graphs, pool_size=max(4 * n, 16))
            env.reset(seed=0)
            a = torch.zeros(n, env.single_action_space.shape[0], device="cuda")
            ms = wall_ms(lambda env=env, a=a: env.step_torch(a), reps)
            row["graph_ms" if graphs else "eager_ms"] = ms
            row["graph_steps_per_s" if graphs else "eager_steps_per_s"] = n / ms * 1e3
        rows.append(row)
        print("steps", json.dumps(row), flush=True)
    sync = gym.vector.SyncVectorEnv([lambda: FlashRTEnv(device="cuda", pool_size=16) for _ in range(sync_envs)])
    sync.reset(seed=0)
    zeros = np.zeros((sync_envs, 16), np.float32)
    ms = wall_ms(lambda: sync.step(zeros), max(3, reps // 4))
    rows.append({"num_envs": sync_envs, "sync_vector_env_ms": ms, "sync_steps_per_s": sync_envs / ms * 1e3})
    return rows


def bench_reset(lengths: list[int], reps: int) -> list[dict]:
    rows = []
    task = TabletopConfig()
    for length in lengths:
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(0)
            save(FlowPolicy(dataclasses.replace(tiny(task.vocabulary), max_text_len=length)), tmp)
            env = FlashRTVectorEnv(1, device="cuda", weights=tmp, pool_size=16)
            env.reset(seed=0)  # builds and caches the start pool
            capsule = wall_ms(lambda env=env: env.reset(seed=0), reps)
            cold_engine = Engine(env.task, env.engine.model, "bench", 1)
            cold = wall_ms(lambda e=cold_engine: e.start([0]), reps)
        rows.append(
            {"context_tokens": length, "capsule_reset_ms": capsule, "cold_reset_ms": cold, "speedup": cold / capsule}
        )
        print("reset", json.dumps(rows[-1]), flush=True)
    return rows


def bench_fork(counts: list[int], reps: int) -> list[dict]:
    n = max(counts) + 1
    env = FlashRTVectorEnv(n, device="cuda", pool_size=n)
    env.reset(seed=0)
    row_bytes = env.bufs.row_bytes
    rows = []
    for k in counts:
        src = torch.empty(k * row_bytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        dst_slots = list(range(1, k + 1))
        fork = wall_ms(lambda d=dst_slots: runtime.fork(env.bufs, 0, d), reps)
        floor = wall_ms(lambda s=src, d=dst: d.copy_(s), reps)
        rows.append({"n": k, "bytes": k * row_bytes, "fork_ms": fork, "copy_floor_ms": floor, "ratio": fork / floor})
        print("fork", json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_env.json"))
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 256, 1024, 4096])
    ap.add_argument("--eager-sizes", type=int, nargs="*", default=[1, 256])
    ap.add_argument("--sync-envs", type=int, default=8)
    ap.add_argument("--contexts", type=int, nargs="+", default=[16, 128, 512, 2048])
    ap.add_argument("--forks", type=int, nargs="+", default=[1, 16, 256, 1024])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_env.py measures the GPU env: run it on a machine with a CUDA GPU")
    result = {
        **provenance(),
        "steps": bench_steps(args.sizes, args.eager_sizes, args.sync_envs, args.reps),
        "reset": bench_reset(args.contexts, args.reps),
        "fork": bench_fork(args.forks, args.reps),
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{result['gpu']} | torch {result['torch']} | commit {result['commit']}  (median ms, wall, synchronous)")
    for r in result["steps"]:
        print("  steps", {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
    for r in result["reset"]:
        print("  reset", {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
    for r in result["fork"]:
        print("  fork ", {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})


if __name__ == "__main__":
    main()
