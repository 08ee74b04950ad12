"""Attention per call at the policy's shapes: prefix segments read in place vs concatenated.

The policy's queries attend to a prefix that lives in separate buffers (instruction, history
ring, newest frame) and to their own keys. For each preset and batch, and for both callers (the
action expert: ``horizon`` queries over instruction + ring + newest frame; the frame encode:
``frame_tokens`` queries over instruction + ring), this times one attention call three ways:

- ``segments``: what the pipeline runs, the segments read in place by the kernel;
- ``one_segment``: the same keys laid out beforehand as one segment (the kernel reads one
  source), to isolate what reading several costs;
- ``concat``: laying the prefix out as one tensor, every layer at once (what the pipeline did
  once a chunk before it read segments).

On a GPU each call is timed inside a captured CUDA graph of ``--calls`` calls (median over
``--reps`` replays, in µs a call), in bf16. Elsewhere the same calls take the torch reference
(``kernels.attention`` picks, as in the policy) in float32, timed by wall clock: a smoke run of
the script, not a measurement.

    python scripts/bench_attention.py --out bench_attention.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from benchlib import commit, cuda_time, provenance
from tqdm import tqdm

from flashrt.kernels import attention
from flashrt.kernels.backend import triton
from flashrt.policies import PRESETS, PolicyConfig
from flashrt_gym.sims.tabletop import TabletopConfig


def per_call_us(fn: Callable[[], object], calls: int, reps: int) -> float:
    """Median time of one ``fn()`` in µs: replays of a graph of ``calls`` calls on a GPU, the
    wall clock around ``calls`` calls elsewhere."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        return cuda_time(g.replay, reps) / calls
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) * 1e6 / calls)
    return statistics.median(times)


def callers(cfg: PolicyConfig) -> dict[str, tuple[int, list[tuple[int, str]]]]:
    """Per caller: query tokens, and the prefix segments as (tokens, mask form)."""
    ring = [(cfg.ring_tokens, "flag")] if cfg.n_obs_steps > 1 else []
    text = [(cfg.max_text_len, "tokens")]
    return {
        "expert": (cfg.horizon, [*text, *ring, (cfg.frame_tokens, "flag")]),
        "frame": (cfg.frame_tokens, text + ring),
    }


def bench(cfg: PolicyConfig, n: int, caller: str, device: str, dtype: torch.dtype, calls: int, reps: int) -> dict:
    tq, segments = callers(cfg)[caller]
    g, d = cfg.kv_heads, cfg.head_dim
    rnd = lambda *s: torch.randn(*s, device=device).to(dtype)  # noqa: E731
    q = rnd(n, tq, cfg.heads, d).transpose(1, 2)  # (N, h, Tq, d) as the q/k/v split lays it out
    own = rnd(n, 2, g, tq, d)  # one layer's own keys/values, as written by the split
    caches, context = [], []
    for tokens, form in segments:  # (N, S, 2, g, T, d) caches, read at layer 0
        cache = rnd(n, cfg.depth, 2, g, tokens, d)
        if form == "tokens":
            mask = torch.rand(n, tokens, device=device) < 0.9
        else:  # one validity flag per slot, expanded over the frame's tokens (stride 0)
            mask = (torch.rand(n, 1, device=device) < 0.9).expand(-1, tokens)
        caches.append((cache, mask))
        context.append((cache[:, 0, 0], cache[:, 0, 1], mask))
    joined = [
        (
            torch.cat([c[0] for c in context], 2),
            torch.cat([c[1] for c in context], 2),
            torch.cat([c[2] for c in context], 1),
        )
    ]
    run = lambda ctx: attention(q, own[:, 0], own[:, 1], None, ctx)  # noqa: E731
    return {
        "batch": n,
        "caller": caller,
        "queries": tq,
        "keys": sum(t for t, _ in segments) + tq,
        "segments_us": per_call_us(lambda: run(context), calls, reps),
        "one_segment_us": per_call_us(lambda: run(joined), calls, reps),
        "concat_us": per_call_us(
            lambda: (torch.cat([c for c, _ in caches], 4), torch.cat([m for _, m in caches], 1)), calls, reps
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_attention.json"))
    ap.add_argument("--tiny-batches", type=int, nargs="+", default=[1, 16, 256, 1024, 4096])
    ap.add_argument("--pi0-batches", type=int, nargs="*", default=[1])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    vocab = TabletopConfig().vocabulary
    rows = []
    for preset, batches in (("tiny", args.tiny_batches), ("pi0", args.pi0_batches)):
        cfg = PRESETS[preset](vocab)
        for n in tqdm(batches, desc=f"{preset} batches", unit="batch size"):
            for caller in ("expert", "frame"):
                if caller == "frame" and n > 1024:  # the frame's 65 queries a slot: 1024 is plenty
                    continue
                row = {"preset": preset, **bench(cfg, n, caller, device, dtype, args.calls, args.reps)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = provenance() if cuda else {"gpu": "none (smoke run)", "torch": torch.__version__, "commit": commit()}
    result = {**meta, "triton": None if triton is None else triton.__version__, "dtype": str(dtype), "rows": rows}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{result['gpu']} | torch {result['torch']} | triton {result['triton']} | commit {result['commit']}")
    print("preset | batch | caller | queries x keys | segments us | one segment us | concat us (all layers)")
    for r in rows:
        print(
            f"{r['preset']:>6} | {r['batch']:5d} | {r['caller']:>6} | {r['queries']:4d} x {r['keys']:4d} | "
            f"{r['segments_us']:11.2f} | {r['one_segment_us']:14.2f} | {r['concat_us']:9.2f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
