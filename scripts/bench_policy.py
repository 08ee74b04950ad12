"""Policy step latency and throughput: captured graph vs eager vs torch.compile, one run.

A *policy step* is what an env step asks of the policy: encode the newest observation (vision +
block B over the instruction and the history ring) and denoise one action chunk (``steps``
Euler steps of the action expert). For each preset and batch size it measures, on one GPU in
bf16:

- eager: the pipeline's stage functions called directly;
- graph: the same functions recorded once as a :class:`runtime.Graph` variant and replayed
  (plus the capture time);
- compile: a pure-function version of the same step under
  ``torch.compile(mode="reduce-overhead")`` (plus the compile time), for the batch sizes in
  ``--compile``.

    python scripts/bench_policy.py --out bench_policy.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from benchlib import provenance, wall_ms

from flashrt_gym.tasks import TabletopConfig
from policies import PRESETS, FlowPolicy, PolicyPipeline, policy_specs, tokenizer_for
from runtime import BufferSet, Graph


def make_pipeline(model: FlowPolicy, n: int) -> PolicyPipeline:
    bufs = BufferSet(policy_specs(model), n, "cuda", deployment="bench")
    p = PolicyPipeline(model, bufs)
    cfg = model.cfg
    ids, mask = tokenizer_for(cfg).encode(["push the red square to the left goal"] * n)
    bufs["policy.text_ids"].copy_(ids)
    bufs["policy.text_mask"].copy_(mask)
    bufs["policy.image"].random_(0, 256)
    bufs["policy.proprio"].uniform_(-1, 1)
    bufs["policy.noise"].normal_()
    p.begin_episode()
    p.encode_instruction()
    for _ in range(cfg.n_obs_steps):  # fill the history ring
        p.encode_observation()
    return p


def pure_step(model: FlowPolicy, p: PolicyPipeline) -> Callable[[], torch.Tensor]:
    """The same step as a function of tensors that mutates nothing (what torch.compile gets)."""
    cfg = model.cfg

    def step(image, proprio, frame, kv_text, text_mask, kv_ring, ring_valid, noise):
        ctx, ctx_mask = kv_text, text_mask
        if kv_ring is not None:
            ctx = torch.cat([kv_text, kv_ring], 4)
            ctx_mask = torch.cat([text_mask, ring_valid.repeat_interleave(cfg.frame_tokens, dim=1)], 1)
        kv, _ = model.encode_frame(image, proprio, frame, ctx, ctx_mask)
        prefix = torch.cat([ctx, kv], 4)
        mask = torch.cat([ctx_mask, torch.ones_like(ctx_mask[:, : cfg.frame_tokens])], 1)
        return model.sample(noise, prefix, mask, frame)

    compiled = torch.compile(step, mode="reduce-overhead")
    ring = cfg.n_obs_steps > 1
    args = (
        p["image"],
        p["proprio"],
        p["frame"],
        p["kv_text"],
        p["text_mask"],
        p["kv_ring"] if ring else None,
        p["ring_valid"] if ring else None,
        p["noise"],
    )
    return lambda: compiled(*args)


def bench(preset: str, n: int, reps: int, do_compile: bool) -> dict:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = FlowPolicy(PRESETS[preset](TabletopConfig().vocabulary)).to(torch.bfloat16)
    p = make_pipeline(model, n)

    def step() -> None:
        p.encode_observation()
        p.denoise()

    rec: dict = {"preset": preset, "batch": n, "params_M": sum(x.numel() for x in model.parameters()) / 1e6}
    rec["eager_ms"] = wall_ms(step, reps)
    g = Graph(f"{preset}-step").bind("state", p.bufs)
    t = time.perf_counter()
    g.capture(n, step)
    torch.cuda.synchronize()
    rec["capture_s"] = time.perf_counter() - t
    rec["graph_ms"] = wall_ms(lambda: g.replay(n), reps)
    rec["graph_chunks_per_s"] = n / rec["graph_ms"] * 1e3
    if do_compile:
        fn = pure_step(model, p)
        t = time.perf_counter()
        for _ in range(3):  # compile, record, then a first replay
            fn()
        torch.cuda.synchronize()
        rec["compile_s"] = time.perf_counter() - t
        rec["compile_ms"] = wall_ms(fn, reps)
        torch._dynamo.reset()  # drop the compiled graphs (and their references to this model)
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_policy.json"))
    ap.add_argument("--tiny-batches", type=int, nargs="+", default=[1, 16, 256, 1024])
    ap.add_argument("--pi0-batches", type=int, nargs="*", default=[1])
    ap.add_argument("--compile", nargs="*", default=["tiny:1", "tiny:256"], help="preset:batch pairs to compile")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_policy.py measures GPU latency: run it on a machine with a CUDA GPU")
    runs = [("tiny", n) for n in args.tiny_batches] + [("pi0", n) for n in args.pi0_batches]
    rows = []
    for preset, n in runs:
        rows.append(
            bench(preset, n, args.reps if preset == "tiny" else max(5, args.reps // 5), f"{preset}:{n}" in args.compile)
        )
        torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
    result = {
        **provenance(),
        "dtype": "bfloat16",
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{result['gpu']} | torch {result['torch']} | commit {result['commit']} | bf16 | median ms per step")
    print("preset | batch |   eager |   graph | compile | capture s | compile s | graph chunks/s")
    for r in rows:
        comp = f"{r['compile_ms']:7.2f}" if "compile_ms" in r else "      -"
        comp_s = f"{r['compile_s']:9.1f}" if "compile_s" in r else "        -"
        print(
            f"{r['preset']:>6} | {r['batch']:5d} | {r['eager_ms']:7.2f} | {r['graph_ms']:7.3f} | {comp} | "
            f"{r['capture_s']:9.2f} | {comp_s} | {r['graph_chunks_per_s']:14.0f}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
