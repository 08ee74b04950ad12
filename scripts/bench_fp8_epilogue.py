"""FP8 GEMMs with fused epilogues (CUTLASS, :mod:`flashrt.kernels.fp8_cutlass`) against
``torch._scaled_mm`` and the separate kernels pi0's FP8 layers run today, on one GPU.

At ``--batches`` slots of ``lerobot_pi0`` (shapes from the model: ``bench_fp8_gemm.shapes``):

- every SigLIP and Gemma projection (and half the Gemma gate/up weight), the plain product:
  ``torch._scaled_mm`` (fast accumulation, what :func:`flashrt.kernels.fp8.linear_rows` runs)
  against the CUTLASS GEMM's ``"scale"`` epilogue at each launch (``--tiles`` x ``--swizzles`` x
  ``--rasters``), µs a call, TFLOP/s and the relative (Frobenius) difference of the outputs;
- at each batch's fastest launches for their shapes: the Gemma gate/up projection and its
  GeGLU, from the norm's e4m3 rows to the e4m3 rows the down projection takes: ``unfused``
  (``_scaled_mm`` writing the ``(rows, 32 768)`` product, then
  :func:`flashrt.kernels.activation.gelu_mul` with ``fp8=True``) against ``split`` (the gate
  half's GEMM writing ``gelu(gate)``, the up half's multiplying it in place, then
  :func:`flashrt.kernels.fp8.quantize_rows`), and the dequantised outputs' difference; and the
  Gemma output projection and the norm after it: ``unfused`` (``_scaled_mm``, then
  :func:`flashrt.kernels.norm.add_rms_norm` adding it to the residual and quantising its
  output) against ``fused`` (the ``"add"`` epilogue writing the new residual, then the norm
  alone).

µs a call: the fastest of 5 replays of a captured graph of 20 calls (``bench_fp8_gemm.graph_us``).

    python scripts/bench_fp8_epilogue.py --batches 8 64 --out bench_fp8_epilogue.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from bench_fp8_gemm import CALLS, graph_us, shapes
from benchlib import provenance

from flashrt.kernels import fp8, fp8_cutlass
from flashrt.kernels.activation import gelu_mul
from flashrt.kernels.norm import add_rms_norm
from flashrt.runtime import atomic_write


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|`` (Frobenius, float32)."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def operands(m: int, n: int, k: int, seed: int = 0) -> tuple[fp8.Rows, fp8.Fp8Weight]:
    """Random e4m3 rows (m, k) and a weight (n, k) quantised as the model's are."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = fp8.quantize_rows(torch.randn(m, k, device="cuda", generator=gen).bfloat16())
    return rows, fp8.quantize_weight(torch.randn(n, k, device="cuda", generator=gen) / k**0.5)


def us(fn) -> float:
    """µs a call of ``fn()`` (CALLS calls a replay)."""
    return graph_us(lambda: [fn() for _ in range(CALLS)])


Launch = tuple[str, int, str]
"""A CUTLASS launch: tile, swizzle, raster (:func:`flashrt.kernels.fp8_cutlass.gemm`)."""


def projection(batch: int, name: str, m: int, n: int, k: int, launches: list[Launch]) -> dict:
    """One plain product's row (see the module docstring): cuBLAS, then each launch."""
    rows, w = operands(m, n, k)
    row: dict = {"batch": batch, "projection": name, "rows": m, "n": n, "k": k}
    row["cublas_us"] = round(us(lambda: fp8.linear_rows(rows, w)), 1)
    want = fp8.linear_rows(rows, w)
    row["launches"] = []
    for tile, swizzle, raster in launches:
        kw = {"tile": tile, "swizzle": swizzle, "raster": raster}
        t = round(us(lambda kw=kw: fp8_cutlass.gemm(rows, w, **kw)), 1)
        diff = relative(fp8_cutlass.gemm(rows, w, **kw), want)
        row["launches"].append({**kw, "us": t, "TFLOPs": round(2 * m * n * k / t / 1e6, 1), "difference": diff})
    row["cublas_TFLOPs"] = round(2 * m * n * k / row["cublas_us"] / 1e6, 1)
    row["best"] = min(row["launches"], key=lambda r: r["us"])
    print(json.dumps({k: v for k, v in row.items() if k != "launches"}), flush=True)
    return row


def projections(batch: int, launches: list[Launch]) -> list[dict]:
    """The plain products of the SigLIP and Gemma blocks (the expert's are few rows), and the
    Gemma gate/up weight's half (what :func:`flashrt.kernels.fp8_cutlass.geglu` multiplies)."""
    out = []
    todo = {name: s for name, s in shapes(batch).items() if not name.startswith("expert")}
    m, n, k = todo["prefix.gate_up"]
    todo["prefix.gate_up_half"] = (m, n // 2, k)
    for name, (m, n, k) in todo.items():
        out.append(projection(batch, name, m, n, k, launches))
        torch.cuda.empty_cache()
    return out


def launch_of(rows: list[dict], batch: int, name: str) -> dict:
    """The fastest launch measured for ``name`` at ``batch``."""
    best = next(r["best"] for r in rows if r["batch"] == batch and r["projection"] == name)
    return {k: best[k] for k in ("tile", "swizzle", "raster")}


def geglu(batch: int, launch: dict) -> dict:
    """The gate/up projection and its GeGLU (see the module docstring)."""
    m, n, k = shapes(batch)["prefix.gate_up"]
    f = n // 2
    rows, w = operands(m, n, k, seed=1)
    gate, up = fp8.Fp8Weight(w.data[:f], w.scale[:f]), fp8.Fp8Weight(w.data[f:], w.scale[f:])

    def unfused() -> fp8.Rows:
        return gelu_mul(fp8.linear_rows(rows, w), fp8=True)

    def gemms() -> torch.Tensor:
        g = fp8_cutlass.gemm(rows, gate, "gelu", **launch)
        return fp8_cutlass.gemm(rows, up, "mul", c=g, out=g, **launch)

    def split() -> fp8.Rows:
        return fp8.quantize_rows(gemms())

    row: dict = {"batch": batch, "chain": "gate_up_geglu", "rows": m, "n": n, "k": k, **launch}
    row["unfused_us"] = round(us(unfused), 1)
    row["split_us"] = round(us(split), 1)

    row["split_gemms_us"] = round(us(gemms), 1)
    (qa, sa), (qb, sb) = unfused(), split()
    row["difference"] = relative(qb.float() * sb, qa.float() * sa)
    print(json.dumps(row), flush=True)
    return row


def residual(batch: int, launch: dict) -> dict:
    """The output projection and the norm after it (see the module docstring)."""
    m, n, k = shapes(batch)["prefix.o"]
    rows, w = operands(m, n, k, seed=2)
    x = torch.randn(m, n, device="cuda").bfloat16()
    scale = torch.rand(n, device="cuda").bfloat16() + 0.5

    def unfused() -> tuple[torch.Tensor, fp8.Rows]:
        return add_rms_norm(x, fp8.linear_rows(rows, w), scale, 1e-6, fp8=True)

    def fused() -> tuple[torch.Tensor, fp8.Rows]:
        h = fp8_cutlass.gemm(rows, w, "add", c=x, **launch)
        return add_rms_norm(h, None, scale, 1e-6, fp8=True)

    row: dict = {"batch": batch, "chain": "o_add_norm", "rows": m, "n": n, "k": k, **launch}
    row["unfused_us"] = round(us(unfused), 1)
    row["fused_us"] = round(us(fused), 1)
    (ha, (qa, sa)), (hb, (qb, sb)) = unfused(), fused()
    row["residual_difference"] = relative(hb, ha)
    row["difference"] = relative(qb.float() * sb, qa.float() * sa)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--tiles", nargs="+", default=sorted(fp8_cutlass.TILES), choices=sorted(fp8_cutlass.TILES))
    ap.add_argument("--swizzles", type=int, nargs="+", default=[1, 4, 8], choices=[1, 2, 4, 8])
    ap.add_argument("--rasters", nargs="+", default=["along_m", "along_n"], choices=sorted(fp8_cutlass.RASTERS))
    ap.add_argument("--out", type=Path, default=Path("bench_fp8_epilogue.json"))
    args = ap.parse_args()
    if not fp8_cutlass.available("cuda"):
        raise SystemExit("bench_fp8_epilogue.py needs a Hopper GPU, nvcc and nvidia-cutlass (the fp8 extra)")
    launches = [(t, s, r) for t in args.tiles for s in args.swizzles for r in args.rasters]
    result = {**provenance(), "calls": CALLS, "projections": [], "chains": []}
    for batch in args.batches:
        result["projections"] += projections(batch, launches)
        rows = result["projections"]
        result["chains"] += [
            geglu(batch, launch_of(rows, batch, "prefix.gate_up_half")),
            residual(batch, launch_of(rows, batch, "prefix.o")),
        ]
        torch.cuda.empty_cache()
        atomic_write(args.out, lambda f: f.write(json.dumps(result, indent=2).encode()))
    print(f"\n{result['gpu']} | commit {result['commit']} | µs a call (TFLOP/s)")
    print("batch | projection | rows x n x k | cuBLAS | fastest CUTLASS launch (tile, swizzle, raster)")
    for r in result["projections"]:
        b = r["best"]
        shape = f"{r['rows']}x{r['n']}x{r['k']}"
        best = f"{b['us']:.0f} ({b['TFLOPs']:.0f}) {b['tile']} {b['swizzle']} {b['raster']}"
        print(f"{r['batch']} | {r['projection']} | {shape} | {r['cublas_us']:.0f} ({r['cublas_TFLOPs']:.0f}) | {best}")
    for r in result["chains"]:
        new = "split" if "split_us" in r else "fused"
        times = f"unfused {r['unfused_us']:.0f} | {new} {r[new + '_us']:.0f}"
        print(f"{r['batch']} | {r['chain']} | {times} | difference {r['difference']:.1e}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
