"""pi0's projections one at a time: the bf16 GEMM against the FP8 GEMM with and without fast
accumulation, at the row counts of a policy step, on one GPU.

For each projection of a SigLIP block, a Gemma (prefix) layer and an expert layer of
``lerobot_pi0`` (weights' shapes from the model itself), at ``--batches`` slots (rows: the
batch times 3 views x 256 patches, the 817 tokens of block B, or the 50-action horizon):

- ``bf16``: ``F.linear`` of bf16 operands (cuBLAS);
- ``fp8``: ``torch._scaled_mm`` of e4m3 operands with row-wise scales (what
  :func:`flashrt.kernels.fp8.linear` runs), precise accumulation (``use_fast_accum=False``);
- ``fp8_fast``: the same with the tensor cores' fast accumulation (what it runs since FP8
  version 3);

µs a call (the fastest of 5 replays of a captured graph of 20 calls, distinct operands), TFLOP/s,
and each FP8 GEMM's relative (Frobenius) error against the float32 product of the same
dequantised operands: the GEMM's own error, bf16 output rounding included, apart from the
quantisation's (~3.5 % at these shapes, docs/FP8.md).

    python scripts/bench_fp8_gemm.py --batches 1 64 --out bench_fp8_gemm.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from benchlib import provenance

from flashrt.kernels import fp8
from flashrt.policies import PRESETS, FlowPolicy
from flashrt.runtime import atomic_write
from flashrt_gym.sims.tabletop import TabletopConfig

CALLS, REPLAYS = 20, 5


def shapes(batch: int) -> dict[str, tuple[int, int, int]]:
    """``name: (rows, n, k)`` of every FP8 projection of one block of each stack at ``batch``
    slots (the weights FP8 quantises: q/k/v fused)."""
    with torch.device("meta"):
        model = FlowPolicy(PRESETS["lerobot_pi0"](TabletopConfig().vocabulary))
    model.set_precision("fp8")
    c = model.cfg
    rows = {"vision": batch * c.num_cameras * c.patches, "prefix": batch * c.frame_tokens, "expert": batch * c.horizon}
    out = {}
    for stack, m in rows.items():
        for name, weight in getattr(model, stack)[0].fp8.sources.items():
            out[f"{stack}.{name}"] = (m, *weight().shape)
    return out


def graph_us(fn) -> float:
    """µs a call of ``fn`` (which makes ``CALLS`` calls) replayed in a captured graph."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / CALLS)
    return best


def measure(m: int, n: int, k: int) -> dict:
    """One projection's row (see the module docstring)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = max(1, min(CALLS, int(2e9 // (n * k * 3 + m * k * 3))))  # distinct operands, within ~2 GB
    xs = [torch.randn(m, k, device="cuda", generator=gen).bfloat16() for _ in range(copies)]
    ws = [(torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16() for _ in range(copies)]
    qx = [fp8.quantize_rows(x) for x in xs]
    qw = [fp8.quantize_weight(w) for w in ws]

    def scaled(i: int, fast: bool) -> torch.Tensor:
        (q, s), w = qx[i], qw[i]
        return torch._scaled_mm(
            q, w.data.t(), scale_a=s, scale_b=w.scale.view(1, n), out_dtype=torch.bfloat16, use_fast_accum=fast
        )

    runs = {
        "bf16": lambda i: torch.nn.functional.linear(xs[i], ws[i]),
        "fp8": lambda i: scaled(i, False),
        "fp8_fast": lambda i: scaled(i, True),
    }
    row: dict = {"rows": m, "n": n, "k": k}
    for name, run in runs.items():
        us = graph_us(lambda run=run: [run(i % copies) for i in range(CALLS)])
        row[f"{name}_us"] = round(us, 2)
        row[f"{name}_TFLOPs"] = round(2 * m * n * k / us / 1e6, 1)
    (q, s), w = qx[0], qw[0]
    exact = (q.float() * s) @ w.dequantize().t()
    for name in ("fp8", "fp8_fast"):
        row[f"{name}_error"] = ((runs[name](0).float() - exact).norm() / exact.norm()).item()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--out", type=Path, default=Path("bench_fp8_gemm.json"))
    args = ap.parse_args()
    if not fp8.supported("cuda"):
        raise SystemExit("bench_fp8_gemm.py times FP8 GEMMs: run it on a GPU of compute capability 8.9 or later")
    rows = []
    for batch in args.batches:
        for name, (m, n, k) in shapes(batch).items():
            rows.append({"batch": batch, "projection": name, **measure(m, n, k)})
            torch.cuda.empty_cache()
            print(json.dumps(rows[-1]), flush=True)
    result = {**provenance(), "calls": CALLS, "replays": REPLAYS, "rows": rows}
    atomic_write(args.out, lambda f: f.write(json.dumps(result, indent=2).encode()))
    print(f"\n{result['gpu']} | commit {result['commit']} | µs a call (TFLOP/s); FP8 GEMM error vs its exact product")
    print("batch | projection | rows x n x k | bf16 | fp8 | fp8 fast | error fp8 / fast")
    for r in rows:
        print(
            f"{r['batch']:5d} | {r['projection']:>15} | {r['rows']}x{r['n']}x{r['k']} | "
            f"{r['bf16_us']:8.1f} ({r['bf16_TFLOPs']:5.0f}) | {r['fp8_us']:8.1f} ({r['fp8_TFLOPs']:5.0f}) | "
            f"{r['fp8_fast_us']:8.1f} ({r['fp8_fast_TFLOPs']:5.0f}) | {r['fp8_error']:.2e} / {r['fp8_fast_error']:.2e}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
