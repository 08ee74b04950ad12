"""The FP8 Gemma gate/up projection and its GeGLU, unfused against fused, on one GPU.

At ``--batches`` slots of ``lerobot_pi0`` (rows: the batch times the prefix's 817 tokens; the
gate/up weight's shape from the model), µs a call of what one layer runs from its norm's e4m3
rows to the e4m3 rows its down projection takes:

- ``unfused``: ``torch._scaled_mm`` (fast accumulation) writing the ``(rows, 32 768)`` bf16
  product, then :func:`flashrt.kernels.activation.gelu_mul` (``fp8=True``) reading it back;
- ``fused``: :func:`flashrt.kernels.fp8_geglu.gate_up_geglu` writing the ``(rows, 16 384)`` GeGLU
  output, then :func:`flashrt.kernels.fp8.quantize_rows`; ``fused_gemm``: that kernel alone;

at each ``--tiles`` (``BMxBNxBKxWARPSxSTAGES``: the kernel's launch, :data:`fp8_geglu.TILE`),
the fastest of 5 replays of a captured graph of 20 calls (``bench_fp8_gemm.graph_us``), and the
fused output's relative (Frobenius) error against the unfused one's.

    python scripts/bench_fp8_geglu.py --batches 8 64 --tiles 128x128x128x8x3 128x128x128x8x4 128x64x128x4x4
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_fp8_gemm import graph_us
from benchlib import provenance

from flashrt.kernels import fp8, fp8_geglu
from flashrt.kernels.activation import gelu_mul
from flashrt.policies import PRESETS, FlowPolicy
from flashrt.runtime import atomic_write
from flashrt_gym.sims.tabletop import TabletopConfig

CALLS = 20


def gate_up_shape(batch: int) -> tuple[int, int, int]:
    """``(rows, n, k)`` of the prefix's gate/up projection at ``batch`` slots."""
    with torch.device("meta"):
        model = FlowPolicy(PRESETS["lerobot_pi0"](TabletopConfig().vocabulary))
    model.set_precision("fp8")
    return batch * model.cfg.frame_tokens, *model.prefix[0].fp8.sources["gate_up"]().shape


def tile(text: str) -> dict:
    """``BMxBNxBKxWARPSxSTAGES`` -> the kernel's launch."""
    bm, bn, bk, warps, stages = (int(v) for v in text.split("x"))
    return {"BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8, "num_warps": warps, "num_stages": stages}


def measure(batch: int, tiles: list[str]) -> dict:
    """One batch's row (see the module docstring)."""
    m, n, k = gate_up_shape(batch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = max(1, min(CALLS, int(2e9 // (n * k + m * k + m * n * 2))))  # distinct operands, within ~2 GB
    rows = [fp8.quantize_rows(torch.randn(m, k, device="cuda", generator=gen).bfloat16()) for _ in range(copies)]
    ws = [fp8.quantize_weight(torch.randn(n, k, device="cuda", generator=gen) / k**0.5) for _ in range(copies)]

    def us(fn) -> float:
        """µs a call of ``fn(i)``, CALLS calls a replay, each output dropped before the next."""

        def calls() -> None:
            for i in range(CALLS):
                fn(i % copies)

        return graph_us(calls)

    row: dict = {"batch": batch, "rows": m, "n": n, "k": k}
    row["unfused_us"] = round(us(lambda i: gelu_mul(fp8.linear_rows(rows[i], ws[i]), fp8=True)), 1)
    want = gelu_mul(fp8.linear_rows(rows[0], ws[0])).float()
    for text in tiles:
        fp8_geglu.TILE = tile(text)
        fused_us = us(lambda i: fp8.quantize_rows(fp8_geglu.gate_up_geglu(rows[i], ws[i])))
        gemm = us(lambda i: fp8_geglu.gate_up_geglu(rows[i], ws[i]))
        got = fp8_geglu.gate_up_geglu(rows[0], ws[0]).float()
        row[text] = {
            "fused_us": round(fused_us, 1),
            "fused_gemm_us": round(gemm, 1),
            "fused_gemm_TFLOPs": round(2 * m * n * k / gemm / 1e6, 1),
            "error_vs_unfused": ((got - want).norm() / want.norm()).item(),
        }
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--tiles", nargs="+", default=["128x128x128x8x3"])
    ap.add_argument("--out", type=Path, default=Path("bench_fp8_geglu.json"))
    args = ap.parse_args()
    if not fp8.supported("cuda"):
        raise SystemExit("bench_fp8_geglu.py times FP8 GEMMs: run it on a GPU of compute capability 8.9 or later")
    result = {**provenance(), "calls": CALLS, "rows": []}
    for batch in args.batches:
        result["rows"].append(measure(batch, args.tiles))
        torch.cuda.empty_cache()
        print(json.dumps(result["rows"][-1]), flush=True)
        atomic_write(args.out, lambda f: f.write(json.dumps(result, indent=2).encode()))
    print(f"\n{result['gpu']} | commit {result['commit']} | µs a call: unfused | fused (its GEMM alone, TFLOP/s)")
    for r in result["rows"]:
        cells = " | ".join(
            f"{t}: {c['fused_us']:.0f} ({c['fused_gemm_us']:.0f}, {c['fused_gemm_TFLOPs']:.0f})"
            for t, c in ((t, r[t]) for t in args.tiles)
        )
        print(f"batch {r['batch']:4d} ({r['rows']} rows) | {r['unfused_us']:.0f} | {cells}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
