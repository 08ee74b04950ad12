"""FlashRT-VLA env throughput as a training loop gets it, reset latency, fork time and memory,
each beside a baseline measured the same way in the same run.

- sustained steps: at each ``num_envs``, ``--steps`` consecutive steps (after ``--warmup``) with
  random actions in the box, so episodes end by success and by time limit and slots autoreset
  at their natural times, through the public calls: ``step_torch`` (device tensors; the step is
  timed on the GPU between consecutive steps, and the whole run by the wall clock) and the
  Gymnasium ``step()`` (NumPy in and out, synchronous, wall clock per call). Reported: the
  sustained mean (the run's wall time over its steps), p50, p99 and max per step, and the
  steady-state rate by the median beside it. Baselines: the same graph with every kernel's
  torch reference, the env stepped eagerly, and ``gymnasium.vector.SyncVectorEnv`` of single
  envs, all with autoresets;
- the step program alone (``Engine.replay``), its kernel count, and where a replay's time goes;
- memory by part: live slot state, step scratch, kept seeded starts, the captured graph's pool,
  the weights, and the peak;
- reset latency: ``reset(seed=s)`` again (the kept starts restored) beside a new seed (the cold
  start: simulator draw, instruction from the table, first encode);
- fork of one slot into N slots beside a device copy of the same bytes.

    python scripts/bench_env.py --out docs/bench/bench_env_<commit>.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from benchlib import count_kernels, graph_kernels, provenance, wall_ms
from tqdm import tqdm

from flashrt import kernels, runtime
from flashrt_gym import FlashRTEnv, FlashRTVectorEnv


def stats(times_ms: list[float], wall_s: float, n: int) -> dict:
    """Sustained and steady-state figures of one run of consecutive steps."""
    times = sorted(times_ms)
    p50 = statistics.median(times)
    return {
        "steps": len(times),
        "mean_ms": wall_s * 1e3 / len(times),
        "p50_ms": p50,
        "p99_ms": times[min(len(times) - 1, round(0.99 * (len(times) - 1)))],
        "max_ms": times[-1],
        "sustained_chunks_per_s": n * len(times) / wall_s,
        "steady_chunks_per_s": n / p50 * 1e3,
    }


def run_torch(env: FlashRTVectorEnv, acts: list[torch.Tensor]) -> tuple[list[float], float, int]:
    """Per-step GPU time between consecutive steps, the run's wall time, and the slots reset."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(acts) + 1)]
    resets = []
    torch.cuda.synchronize()
    t = time.perf_counter()
    events[0].record()
    for i, a in enumerate(acts):
        _, _, _, _, info = env.step_torch(a)
        resets.append(info["_final_obs"].sum())
        events[i + 1].record()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    times = [events[i].elapsed_time(events[i + 1]) for i in range(len(acts))]
    return times, wall, int(torch.stack(resets).sum())


def run_numpy(env: FlashRTVectorEnv, acts: list[np.ndarray]) -> tuple[list[float], float, int]:
    times, resets = [], 0
    t0 = time.perf_counter()
    for a in acts:
        t = time.perf_counter()
        *_, info = env.step(a)
        times.append((time.perf_counter() - t) * 1e3)
        resets += int(info["_final_obs"].sum()) if info else 0
    return times, time.perf_counter() - t0, resets


def memory(env: FlashRTVectorEnv, before: int, graph_pool: int) -> dict:
    b = env.engine.bufs
    weights = sum(p.numel() * p.element_size() for p in env.engine.policy.model.parameters())
    return {
        "live_state_MB": b.state_nbytes / 2**20,
        "scratch_MB": b.scratch_arena.numel() / 2**20,
        "start_cache_MB": env.starts.nbytes / 2**20,
        "start_cache_budget_MB": env.starts.budget_bytes / 2**20,
        "graph_pool_MB": graph_pool / 2**20,
        "weights_MB": weights / 2**20,
        "allocated_MB": (torch.cuda.memory_allocated() - before) / 2**20,
        "peak_MB": (torch.cuda.max_memory_allocated() - before) / 2**20,
    }


def bench_size(n: int, steps: int, warmup: int, reference: bool, eager: bool) -> dict:
    row: dict = {"num_envs": n}
    g = torch.Generator(device="cuda").manual_seed(n)
    rng = np.random.default_rng(n)
    variants = [("graph", True, False)] + [("reference", True, True)] * reference + [("eager", False, False)] * eager
    for name, graphs, ref in variants:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with kernels.reference_only() if ref else contextlib.nullcontext():
            env = FlashRTVectorEnv(n, device="cuda", graphs=graphs)
            env.reset(seed=0)
            pre_capture = torch.cuda.memory_allocated()
            dev = [torch.rand(n, 16, device="cuda", generator=g) * 2 - 1 for _ in range(warmup + steps)]
            host = [rng.uniform(-1, 1, (n, 16)).astype(np.float32) for _ in range(warmup + steps)]
            k = steps if name == "graph" else max(60, steps // 4)  # baselines: fewer steps, the same way
            run_torch(env, dev[:warmup])  # captures the step (with this kernel selection)
            graph_pool = torch.cuda.memory_allocated() - pre_capture - sum(a.nbytes for a in dev) - 0
            times, wall, resets = run_torch(env, dev[warmup : warmup + k])
            row[f"{name}_step_torch"] = {**stats(times, wall, n), "slots_reset": resets}
            if name == "graph":
                run_numpy(env, host[:warmup])
                times, wall, resets = run_numpy(env, host[warmup : warmup + k])
                row["graph_step_numpy"] = {**stats(times, wall, n), "slots_reset": resets}
                row["memory"] = memory(env, before, max(0, graph_pool))
                row["program_ms"] = wall_ms(env.engine.replay, 20)
                row["program_kernels"] = graph_kernels(env.engine.replay)
        del env, dev, host
        print(name, n, json.dumps({k: v for k, v in row.items() if k.startswith(name)}), flush=True)
    return row


def bench_sync(num_envs: int, steps: int) -> dict:
    sync = gym.vector.SyncVectorEnv([lambda: FlashRTEnv(device="cuda") for _ in range(num_envs)])
    sync.reset(seed=0)
    rng = np.random.default_rng(0)
    acts = [rng.uniform(-1, 1, (num_envs, 16)).astype(np.float32) for _ in range(steps + 3)]
    for a in acts[:3]:
        sync.step(a)
    times, t0 = [], time.perf_counter()
    for a in acts[3:]:
        t = time.perf_counter()
        sync.step(a)
        times.append((time.perf_counter() - t) * 1e3)
    return {"num_envs": num_envs, **stats(times, time.perf_counter() - t0, num_envs)}


def bench_reset(reps: int) -> dict:
    env = FlashRTVectorEnv(1, device="cuda")
    env.reset(seed=0)
    kept = wall_ms(lambda: env.reset(seed=0), reps)
    seeds = iter(range(1, 10 * reps))
    cold = wall_ms(lambda: env.reset(seed=next(seeds)), reps)
    return {"num_envs": 1, "kept_start_reset_ms": kept, "cold_reset_ms": cold, "speedup": cold / kept}


def bench_fork(counts: list[int], reps: int) -> list[dict]:
    n = max(counts) + 1
    env = FlashRTVectorEnv(n, device="cuda")
    env.reset(seed=0)
    row_bytes = env.engine.bufs.row_bytes
    rows = []
    for k in counts:
        src = torch.empty(k * row_bytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        dst_slots = list(range(1, k + 1))
        fork = wall_ms(lambda d=dst_slots: runtime.fork(env.engine.bufs, 0, d), reps)
        floor = wall_ms(lambda s=src, d=dst: d.copy_(s), reps)
        rows.append({"n": k, "bytes": k * row_bytes, "fork_ms": fork, "copy_floor_ms": floor, "ratio": fork / floor})
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """The sustained-throughput targets, checked on this run's figures."""
    out = []
    for r in rows:
        t, np_ = r["graph_step_torch"], r["graph_step_numpy"]
        out.append(
            {
                "num_envs": r["num_envs"],
                "sustained_over_steady": t["sustained_chunks_per_s"] / t["steady_chunks_per_s"],
                "p99_over_p50": t["p99_ms"] / t["p50_ms"],
                "max_over_p50": t["max_ms"] / t["p50_ms"],
                "numpy_over_torch": np_["mean_ms"] / t["mean_ms"],
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_env.json"))
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 256, 1024, 4096])
    ap.add_argument("--steps", type=int, default=240, help="timed consecutive steps (6 episode lengths)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--reference-sizes", type=int, nargs="*", default=[1, 256, 4096])
    ap.add_argument("--eager-sizes", type=int, nargs="*", default=[1, 256])
    ap.add_argument("--sync-envs", type=int, default=8)
    ap.add_argument("--forks", type=int, nargs="+", default=[1, 16, 256, 1024])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_env.py measures the GPU env: run it on a machine with a CUDA GPU")
    result: dict = {**provenance(), "args": vars(args) | {"out": str(args.out)}}
    result["steps"] = [
        bench_size(n, args.steps, args.warmup, n in args.reference_sizes, n in args.eager_sizes)
        for n in tqdm(args.sizes, desc="env sizes", unit="size")
    ]
    result["targets"] = targets(result["steps"])
    args.out.write_text(json.dumps(result, indent=2))
    result["sync_vector_env"] = bench_sync(args.sync_envs, 60)
    result["reset"] = bench_reset(args.reps)
    result["fork"] = bench_fork(args.forks, args.reps)
    env = FlashRTVectorEnv(1, device="cuda", graphs=False)
    env.reset(seed=0)
    result["kernels_per_step"] = count_kernels(env.engine.program)
    with kernels.reference_only():
        ref = FlashRTVectorEnv(1, device="cuda", graphs=False)
        ref.reset(seed=0)
        result["reference_kernels_per_step"] = count_kernels(ref.engine.program)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{result['gpu']} | torch {result['torch']} | commit {result['commit']}")
    print("num_envs | call | sustained chunks/s | steady (p50) | mean / p50 / p99 / max ms | slots reset")
    for r in result["steps"]:
        for key, v in r.items():
            if key.endswith(("_step_torch", "_step_numpy")):
                print(
                    f"{r['num_envs']:>8} | {key:<20} | {v['sustained_chunks_per_s']:>12,.0f} | "
                    f"{v['steady_chunks_per_s']:>12,.0f} | {v['mean_ms']:.3f} / {v['p50_ms']:.3f} / "
                    f"{v['p99_ms']:.3f} / {v['max_ms']:.3f} | {v['slots_reset']}"
                )
        print(f"         memory MB: {json.dumps({k: round(v, 1) for k, v in r['memory'].items()})}")
    print("targets:", json.dumps(result["targets"]))
    print("sync:", json.dumps(result["sync_vector_env"]))
    print(
        "reset:",
        json.dumps(result["reset"]),
        "| kernels",
        result["kernels_per_step"],
        result["reference_kernels_per_step"],
    )


if __name__ == "__main__":
    main()
