"""FlashRT-VLA env throughput, reset latency and fork time, each beside a baseline of the same run.

- steps (action chunks) per second against num_envs: the captured step graph with the fused
  kernels, the same graph with every kernel's torch reference (the "before"), the env stepped
  eagerly, and ``gymnasium.vector.SyncVectorEnv`` of single envs; the step program alone
  (graph replay) beside the same program under ``torch.compile(mode="reduce-overhead")``; and
  the kernel count of one step (kernels vs references), and where one replay's time goes
  (each kernel's marginal time);
- reset latency: a capsule reset (restore pre-encoded starts) beside the cold path (simulator
  init + render + instruction prefill + encode) as the instruction context grows (random
  weights with ``max_text_len`` tokens, of the tiny shape and with pi0's wide language prefix
  and action expert, where the prefill's cost shows);
- fork of one slot into N slots beside a device copy of the same bytes.

    python scripts/bench_env.py --out bench_env.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
from benchlib import count_kernels, graph_kernels, provenance, top_kernels, wall_ms

from flashrt import kernels, runtime
from flashrt.policies import FlowPolicy, PolicyConfig, pi0, save, tiny
from flashrt_gym import FlashRTEnv, FlashRTVectorEnv
from flashrt_gym.engine import Engine
from flashrt_gym.tasks import TabletopConfig


def bench_steps(
    sizes: list[int], eager_sizes: list[int], ref_sizes: list[int], sync_envs: int, reps: int
) -> list[dict]:
    rows = []
    for n in sizes:
        row: dict = {"num_envs": n}
        variants = [("graph", True, False), ("reference_graph", True, True), ("eager", False, False)]
        for name, graphs, reference in variants:
            if (name == "eager" and n not in eager_sizes) or (reference and n not in ref_sizes):
                continue
            with kernels.reference_only() if reference else contextlib.nullcontext():
                env = FlashRTVectorEnv(n, device="cuda", graphs=graphs, pool_size=max(4 * n, 16))
                env.reset(seed=0)
                a = torch.zeros(n, env.single_action_space.shape[0], device="cuda")
                env.step_torch(a)  # captures the step graph (with this kernel selection)
            row[f"{name}_ms"] = wall_ms(lambda env=env, a=a: env.step_torch(a), reps)
            row[f"{name}_steps_per_s"] = n / row[f"{name}_ms"] * 1e3
            if graphs and not reference:
                row["program_graph_ms"] = wall_ms(lambda env=env: env._graph.replay(env._key), reps)
                row["graph_top_kernels"] = graph_kernels(lambda env=env: env._graph.replay(env._key))
            del env
            torch.cuda.empty_cache()
        rows.append(row)
        print("steps", json.dumps(row), flush=True)
    sync = gym.vector.SyncVectorEnv([lambda: FlashRTEnv(device="cuda", pool_size=16) for _ in range(sync_envs)])
    sync.reset(seed=0)
    zeros = np.zeros((sync_envs, 16), np.float32)
    ms = wall_ms(lambda: sync.step(zeros), max(3, reps // 4))
    rows.append({"num_envs": sync_envs, "sync_vector_env_ms": ms, "sync_steps_per_s": sync_envs / ms * 1e3})
    return rows


def bench_nodes_and_compile(n: int, reps: int, do_compile: bool) -> dict:
    """Kernel count of one env step program (kernels vs references), and the program under
    ``torch.compile(mode="reduce-overhead")`` (references: Inductor does its own fusion)."""
    env = FlashRTVectorEnv(n, device="cuda", graphs=False, pool_size=16)
    env.reset(seed=0)
    env.bufs["env.action"].zero_()
    row: dict = {"num_envs": n, "kernels_nodes": count_kernels(env._program), "top_kernels": top_kernels(env._program)}
    with kernels.reference_only():
        row["reference_nodes"] = count_kernels(env._program)
        if do_compile:
            fn = torch.compile(env._program, mode="reduce-overhead")
            t = time.perf_counter()
            try:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                row["compile_s"] = time.perf_counter() - t
                row["compile_program_ms"] = wall_ms(fn, reps)
            except Exception as e:  # a failed compile is a result too: record it, keep the other rows
                row["compile_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            torch._dynamo.reset()
    print("nodes", json.dumps(row), flush=True)
    return row


WIDE_FIELDS = ("width", "depth", "heads", "kv_heads", "head_dim", "mlp", "expert_width", "expert_mlp")


def reset_config(shape: str, length: int) -> PolicyConfig:
    """``tiny`` (the shipped policy's shape), or ``wide``: tiny's vision tower and task with pi0's
    Gemma-2B-shaped language prefix and Gemma-300M-shaped action expert; ``length`` instruction tokens."""
    vocab = TabletopConfig().vocabulary
    cfg = tiny(vocab)
    if shape == "wide":
        cfg = dataclasses.replace(cfg, **{f: getattr(pi0(vocab), f) for f in WIDE_FIELDS})
    return dataclasses.replace(cfg, max_text_len=length)


def bench_reset(shapes: list[str], lengths: list[int], reps: int) -> list[dict]:
    rows = []
    for shape in shapes:
        for length in lengths:
            with tempfile.TemporaryDirectory() as tmp:
                torch.manual_seed(0)
                with torch.device("cuda"):
                    model = FlowPolicy(reset_config(shape, length))
                save(model, tmp, dtype=torch.bfloat16)
                del model
                os.sync()  # the wide weights are GBs: their writeback must not compete with the timed calls
                env = FlashRTVectorEnv(1, device="cuda", weights=tmp, pool_size=16)
                env.reset(seed=0)  # builds and caches the start pool
                capsule = wall_ms(lambda env=env: env.reset(seed=0), reps)
                cold_engine = Engine(env.task, env.engine.model, "bench", 1)
                cold = wall_ms(lambda e=cold_engine: e.start([0]), reps)
            rows.append(
                {
                    "shape": shape,
                    "context_tokens": length,
                    "capsule_reset_ms": capsule,
                    "cold_reset_ms": cold,
                    "speedup": cold / capsule,
                }
            )
            print("reset", json.dumps(rows[-1]), flush=True)
            del env, cold_engine
            torch.cuda.empty_cache()
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
    ap.add_argument("--reference-sizes", type=int, nargs="*", default=[1, 256, 4096])
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline (minutes)")
    ap.add_argument("--sync-envs", type=int, default=8)
    ap.add_argument("--contexts", type=int, nargs="+", default=[16, 128, 512, 2048])
    ap.add_argument("--reset-shapes", nargs="+", choices=["tiny", "wide"], default=["tiny", "wide"])
    ap.add_argument("--forks", type=int, nargs="+", default=[1, 16, 256, 1024])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_env.py measures the GPU env: run it on a machine with a CUDA GPU")
    result = {
        **provenance(),
        "steps": bench_steps(args.sizes, args.eager_sizes, args.reference_sizes, args.sync_envs, args.reps),
        "reset": bench_reset(args.reset_shapes, args.contexts, args.reps),
        "fork": bench_fork(args.forks, args.reps),
    }
    args.out.write_text(json.dumps(result, indent=2))  # written before the (slow) compile baseline too
    result["nodes"] = bench_nodes_and_compile(1, args.reps, not args.no_compile)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{result['gpu']} | torch {result['torch']} | commit {result['commit']}  (median ms, wall, synchronous)")
    for r in result["steps"]:
        print(
            "  steps", {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items() if k != "graph_top_kernels"}
        )
        if "graph_top_kernels" in r:
            top = r["graph_top_kernels"]["top"][:4]
            print(
                "    in the graph (us marginal, calls):",
                [(k["kernel"][:40], k["marginal_us"], k["calls"]) for k in top],
            )
    print("  nodes", {k: round(v, 3) if isinstance(v, float) else v for k, v in result["nodes"].items()})
    for r in result["reset"]:
        print("  reset", {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
    for r in result["fork"]:
        print("  fork ", {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})


if __name__ == "__main__":
    main()
