"""Policy step latency and throughput: fused kernels vs torch references, graph vs eager vs torch.compile.

A *policy step* is what an env step asks of the policy: encode the newest observation (vision +
block B over the instruction and the history ring) and denoise one action chunk (``steps``
Euler steps of the action expert). For each preset and batch size, on one GPU in bf16, in one
run:

- ``graph``: the pipeline's stages recorded once as a :class:`flashrt.runtime.Graph` variant and replayed,
  with the fused Triton kernels (``kernels``) and with every kernel's torch reference
  (``reference``: the "before" of the kernels), each with its node count and capture time
  (after a first eager call, timed apart: with an empty Triton cache it includes compiling
  the kernels);
- ``eager``: the same stage functions called directly (kernels on);
- ``compile``: a pure-function version of the same step (references: Inductor fuses them itself)
  under ``torch.compile(mode="reduce-overhead")``, plus its compile time;
- floors: bytes the step must move (weights read once for the encode and once per Euler step,
  the prefix keys/values read per Euler step) over the measured copy bandwidth; its FLOPs (torch's
  flop counter over the reference step, at up to 64 slots and scaled) over the measured bf16
  matrix rate; and its kernel count times the measured replay cost of one graph node;
- where the time goes: the step's kernels by total GPU time (one eager call, kernels on), and
  inside one replay of the kernels graph by marginal time (what each adds to the chain when
  dependent launches overlap); the same for the step's two halves captured apart (encoding the
  observation, the prefix; denoising the chunk, the expert's Euler steps).

``lerobot_pi0`` / ``lerobot_pi05`` (``--exact``) are LeRobot's pi0 / pi0.5 at full size with
their exact computation (what the converter produces; random weights, and the tests' small
SentencePiece model standing in for PaliGemma's tokenizer): images then language in one block B,
encoded with every observation (pi0.5: the prompt with the state assembled first).

``--precision native fp8`` measures every run in both precisions (``FlowPolicy.set_precision``:
FP8 runs the blocks' projections as e4m3 GEMMs); an FP8 row's FLOP floor charges its FP8 GEMMs
at the measured FP8 matrix rate and the rest at the bf16 rate (``fp8_GFLOP``), and
``floor_ratio`` is the graph's time over that floor. ``--runs preset:batch`` adds single runs
(pi0.5 at one batch size), ``--lean`` keeps only what a throughput table needs (the kernels graph
with its capture time, floors, compile where asked).

    python scripts/bench_policy.py --out bench_policy.json
    python scripts/bench_policy.py --tiny-batches --pi0-batches --exact lerobot_pi0 lerobot_pi05 \
        --exact-batches 1 8 64 --compile lerobot_pi0:1 --out bench_policy_exact.json
    python scripts/bench_policy.py --tiny-batches --pi0-batches --exact lerobot_pi0 --exact-batches 1 8 64 256 \
        --runs lerobot_pi05:1 --precision native fp8 --compile lerobot_pi0:1 lerobot_pi0:64 --lean \
        --out bench_policy_fp8.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from benchlib import count_kernels, cuda_time, gpu_rates, graph_kernels, provenance, top_kernels, wall_ms
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

from flashrt import kernels
from flashrt.kernels import fp8
from flashrt.policies import PRESETS, FlowPolicy, InstructionTable, PaliGemmaTokenizer, PolicyPipeline, policy_specs
from flashrt.policies.model import PRECISIONS
from flashrt.runtime import BufferSet, Graph, atomic_write
from flashrt_gym.sims.tabletop import TabletopConfig

EXACT = ("lerobot_pi0", "lerobot_pi05")
COUNT_SLOTS = 64  # the most slots whose FLOPs are counted on the reference path (scaled beyond)
TOKENIZER = Path(__file__).parents[1] / "tests" / "policies" / "fixtures" / "tokenizer.model"


def make_pipeline(model: FlowPolicy, n: int) -> PolicyPipeline:
    cfg = model.cfg
    if cfg.tokenizer == "paligemma":  # random weights: the tests' small SentencePiece model stands in for PaliGemma's
        model.tokenizer = PaliGemmaTokenizer(TOKENIZER.read_bytes(), cfg.max_text_len, cfg.state_token == "text")
    bufs = BufferSet(policy_specs(model), n, "cuda", deployment="bench")
    p = PolicyPipeline(model, bufs)
    table = InstructionTable(model, ["push the red square to the left goal"])
    p.set_text(table, torch.zeros(n, dtype=torch.int64, device="cuda"))
    bufs["policy.image"].random_(0, 256)
    bufs["policy.proprio"].uniform_(-1, 1)
    bufs["policy.noise"].normal_()
    p.begin_episode()
    for _ in range(cfg.n_obs_steps):  # fill the history ring
        p.encode_observation()
    return p


def pure_step(model: FlowPolicy, p: PolicyPipeline) -> Callable[[], torch.Tensor]:
    """The same step as a function of tensors that mutates nothing (what torch.compile gets)."""
    cfg = model.cfg
    valid = torch.ones_like(p["obs_valid"])

    def step(image, proprio, frame, kv_text, text_ids, text_mask, kv_ring, ring_valid, noise):
        if not cfg.text_block:  # pi0's layout: images and language in one block B
            kv, _ = model.encode_frame(image, proprio, frame, [], text=(text_ids, text_mask))
            return model.sample(noise, model.frame_segments(kv, valid, text_mask), frame)
        ctx = [(kv_text, text_mask)]
        if kv_ring is not None:
            ctx.append((kv_ring, ring_valid.repeat_interleave(cfg.frame_tokens, dim=1)))
        kv, _ = model.encode_frame(image, proprio, frame, ctx)
        return model.sample(noise, [*ctx, *model.frame_segments(kv, valid)], frame)

    compiled = torch.compile(step, mode="reduce-overhead")
    s = p.state
    ids, mask = (s.text_ids, s.text_mask) if s.prompt_ids is None else (s.prompt_ids, s.prompt_mask)  # pi0.5: encoded
    args = (s.image, s.proprio, s.frame, s.kv_text, ids, mask, s.kv_ring, s.ring_valid, s.noise)
    return lambda: compiled(*args)


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Attention FLOPs of q (N, h, Tq, d) over Tk keys, also when keys have fewer (GQA) heads."""
    n, h, tq, d = query_shape
    return 4 * n * h * tq * key_shape[-2] * d


def _addmm_flops(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``x + a @ b`` with a (m, k), b (k, n): the product's multiply-adds (as torch counts addmm)."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


FLOP_FORMULAS = {  # what torch's counter has no formula for: fused attention, and in-place addmm
    **{
        getattr(torch.ops.aten, name): _sdpa_flops
        for name in (
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
        )
        if hasattr(torch.ops.aten, name)
    },
    torch.ops.aten.addmm_: _addmm_flops,  # the down projection accumulates in place
}


def nbytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def fp8_rate() -> float:
    """Dense FP8 matrix rate (TFLOP/s) of ``torch._scaled_mm`` with row-wise scales, measured
    now (0 where the GPU has no FP8 GEMM)."""
    if not fp8.supported("cuda"):
        return 0.0
    a = torch.randn(8192, 8192, device="cuda").to(fp8.E4M3)
    sa, sb = torch.ones(8192, 1, device="cuda"), torch.ones(1, 8192, device="cuda")
    us = cuda_time(lambda: torch._scaled_mm(a, a.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), 20)
    return 2 * 8192**3 / us / 1e6


def floors(model: FlowPolicy, n: int, pipeline: PolicyPipeline, rates: dict) -> dict:
    """The step's floors (see the module docstring), in ms, for ``pipeline`` of ``n`` slots.
    FLOPs are counted over at most :data:`COUNT_SLOTS` slots and scaled to ``n`` (every product
    of the step is per slot): the reference path at pi0's 256 slots holds more than an H100."""
    c = model.cfg
    encode = nbytes(model) - nbytes(model.expert) - sum(nbytes(m) for m in (model.action_in, model.time_in))
    encode -= nbytes(model.text_embed)  # a table the step looks a few rows up in (pi0's: 1 GB)
    per_euler = nbytes(model.expert) + n * c.depth * 2 * c.kv_heads * c.prefix_tokens * c.head_dim * 2
    moved = encode + c.steps * per_euler
    if model.precision == "fp8":  # the blocks' weights are read as e4m3
        blocks = [*model.vision, *model.prefix, *model.expert]
        mats = [m.weight for b in blocks for m in b.modules() if isinstance(m, torch.nn.Linear)]
        fp8_bytes = {p.data_ptr(): p.numel() * (p.element_size() - 1) for p in mats}
        expert = {p.data_ptr() for b in model.expert for p in b.parameters()}
        moved -= sum(v * (c.steps if k in expert else 1) for k, v in fp8_bytes.items())
    counted = pipeline if n <= COUNT_SLOTS else make_pipeline(model, COUNT_SLOTS)
    with kernels.reference_only(), FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as fc:
        counted.encode_observation()
        counted.denoise()
    scale = n / counted.bufs.num_slots
    total = fc.get_total_flops() * scale
    low = fc.get_flop_counts().get("Global", {}).get(torch.ops.aten._scaled_mm, 0) * scale
    floor = (total - low) / (rates["bf16_TFLOPs"] * 1e9) + (low / (rates["fp8_TFLOPs"] * 1e9) if low else 0.0)
    return {
        "bytes_MB": moved / 1e6,
        "GFLOP": total / 1e9,
        "fp8_GFLOP": low / 1e9,
        "bytes_floor_ms": moved / (rates["copy_GBps"] * 1e6),
        "flops_floor_ms": floor,
    }


def bench(
    preset: str,
    n: int,
    reps: int,
    do_compile: bool,
    rates: dict,
    save: Callable[[dict], None],
    precision: str = "native",
    lean: bool = False,
) -> dict:
    """One row: eager, reference and kernels graphs, floors and, with ``do_compile``, torch.compile.
    ``save`` gets the row before the compile (minutes at pi0's size), so a run stopped by a time
    limit during it keeps the row's other figures. ``precision``: the model's
    (``FlowPolicy.set_precision``; torch.compile runs the native step only); ``lean``: the kernels
    graph, floors and the compile only."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = FlowPolicy(PRESETS[preset](TabletopConfig().vocabulary)).to(torch.bfloat16)
    model.set_precision(precision)
    p = make_pipeline(model, n)

    def step() -> None:
        p.encode_observation()
        p.denoise()

    rec: dict = {"preset": preset, "batch": n, "precision": precision}
    rec["params_M"] = sum(x.numel() for x in model.parameters()) / 1e6
    t = time.perf_counter()
    step()  # the first call compiles the Triton kernels it has not seen (and quantises FP8 weights)
    torch.cuda.synchronize()
    rec["first_call_s"] = time.perf_counter() - t
    if not lean:
        rec["eager_ms"] = wall_ms(step, reps)
    graphs = (("kernels", contextlib.nullcontext),)
    if not lean:
        graphs = (("reference", kernels.reference_only), *graphs)
    for name, mode in graphs:
        with mode():
            rec[f"{name}_nodes"] = count_kernels(step)
            g = Graph(f"{preset}-step-{name}").bind(p.bufs)
            t = time.perf_counter()
            g.capture(n, step)
            torch.cuda.synchronize()
            rec[f"{name}_capture_s"] = time.perf_counter() - t
        rec[f"{name}_graph_ms"] = wall_ms(lambda g=g: g.replay(n), reps)
        if name == "kernels" and not lean:
            rec["graph_top_kernels"] = graph_kernels(lambda g=g: g.replay(n), top=40)
        del g
    phases = () if lean else (("encode", p.encode_observation), ("denoise", p.denoise))
    for phase, fn in phases:  # the step's two halves
        g = Graph(f"{preset}-{phase}").bind(p.bufs)
        g.capture(n, fn)
        rec[f"{phase}_graph_ms"] = wall_ms(lambda g=g: g.replay(n), reps)
        rec[f"{phase}_top_kernels"] = graph_kernels(lambda g=g: g.replay(n), top=20)
        del g
    rec["graph_chunks_per_s"] = n / rec["kernels_graph_ms"] * 1e3
    rec.update(floors(model, n, p, rates))
    rec["floor_ratio"] = rec["kernels_graph_ms"] / rec["flops_floor_ms"]
    rec["launch_floor_ms"] = rec["kernels_nodes"] * rates["node_us"] / 1e3
    if not lean:
        rec["top_kernels"] = top_kernels(step)
    if do_compile and precision == "native":
        save(rec)
        with kernels.reference_only():
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
    ap.add_argument("--tiny-batches", type=int, nargs="*", default=[1, 16, 256, 1024])
    ap.add_argument("--pi0-batches", type=int, nargs="*", default=[1])
    ap.add_argument("--exact", nargs="*", default=[], choices=EXACT, help="pi0-exact presets to run")
    ap.add_argument("--exact-batches", type=int, nargs="*", default=[1, 8, 64])
    ap.add_argument("--runs", nargs="*", default=[], help="further preset:batch runs (e.g. lerobot_pi05:1)")
    ap.add_argument("--compile", nargs="*", default=["tiny:1", "tiny:256"], help="preset:batch pairs to compile")
    ap.add_argument("--precision", nargs="+", default=["native"], choices=PRECISIONS, help="each run in each")
    ap.add_argument("--lean", action="store_true", help="the kernels graph, floors and compile only")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_policy.py measures GPU latency: run it on a machine with a CUDA GPU")
    if "fp8" in args.precision and not fp8.supported("cuda"):
        raise SystemExit("--precision fp8 needs an FP8 GPU (compute capability 8.9 or later)")
    runs = [("tiny", n) for n in args.tiny_batches] + [("pi0", n) for n in args.pi0_batches]
    runs += [(preset, n) for preset in args.exact for n in args.exact_batches]
    for run in args.runs:
        preset, _, n = run.partition(":")
        if preset not in PRESETS or not n.isdigit():
            raise SystemExit(f"--runs takes preset:batch with a preset of {sorted(PRESETS)}, got {run!r}")
        runs.append((preset, int(n)))
    rates = {**gpu_rates(), "fp8_TFLOPs": fp8_rate()}
    print("rates", json.dumps(rates), flush=True)
    rows: list[dict] = []
    result = {**provenance(), "dtype": "bfloat16", "rates": rates, "rows": rows}

    def save(partial: dict | None = None) -> None:
        """Write the rows measured so far (and a row still being measured): a run stopped by a time
        limit keeps them."""
        out = {**result, "rows": rows + ([partial] if partial is not None else [])}
        atomic_write(args.out, lambda f: f.write(json.dumps(out, indent=2).encode()))

    for (preset, n), precision in tqdm(
        [(run, prec) for run in runs for prec in args.precision], desc="policy batches", unit="run"
    ):
        reps = args.reps if preset == "tiny" else max(5, args.reps // 5)  # pi0-sized steps take ms
        compile_it = f"{preset}:{n}" in args.compile
        rows.append(bench(preset, n, reps, compile_it, rates, save, precision, args.lean))
        torch.cuda.empty_cache()
        print(json.dumps(rows[-1]), flush=True)
        save()
    print(f"\n{result['gpu']} | torch {result['torch']} | commit {result['commit']} | bf16 | median ms per step")
    print(
        f"rates: copy {rates['copy_GBps']:.0f} GB/s, bf16 {rates['bf16_TFLOPs']:.0f} TFLOP/s, "
        f"fp8 {rates['fp8_TFLOPs']:.0f} TFLOP/s, {rates['node_us']:.2f} us per graph node"
    )
    print(
        "preset | batch | precision | eager | ref graph (nodes) | kernels graph (nodes) | compile | capture s | "
        "floor bytes/flops/launch ms | graph/flop floor | chunks/s"
    )
    for r in rows:
        comp = f"{r['compile_ms']:7.2f}" if "compile_ms" in r else "      -"
        eager = f"{r['eager_ms']:6.1f}" if "eager_ms" in r else "     -"
        ref = f"{r['reference_graph_ms']:7.3f} ({r['reference_nodes']:5d})" if "reference_graph_ms" in r else "  -"
        print(
            f"{r['preset']:>12} | {r['batch']:5d} | {r['precision']:>6} | {eager} | {ref} | "
            f"{r['kernels_graph_ms']:7.3f} ({r['kernels_nodes']:5d}) | {comp} | {r['kernels_capture_s']:5.2f} | "
            f"{r['bytes_floor_ms']:.3f}/{r['flops_floor_ms']:.3f}/{r['launch_floor_ms']:.3f} | "
            f"{r['floor_ratio']:5.2f} | {r['graph_chunks_per_s']:9.0f}"
        )
    for r in (r for r in rows if "graph_top_kernels" in r):
        print(
            f"top kernels in the graph, {r['preset']} batch {r['batch']} (encode {r['encode_graph_ms']:.3f} ms, "
            f"denoise {r['denoise_graph_ms']:.3f} ms apart; us marginal, us busy, calls):"
        )
        for k in r["graph_top_kernels"]["top"][:6]:
            print(f"  {k['marginal_us']:9.1f} {k['busy_us']:9.1f} {k['calls']:5d}  {k['kernel']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
