"""The gated MLP's input half at the policies' shapes: GeGLU in the GEMM's tiles vs cuBLAS then gelu_mul.

``gelu_tanh(x W_gate^T) * (x W_up^T)`` over many rows runs two ways:

- ``chain``: cuBLAS's GEMM writes the ``(rows, 2m)`` gate/up product, ``kernels.gelu_mul`` reads
  it back and writes ``(rows, m)`` (what ``kernels.linear_geglu`` ran over many rows before
  its tiles);
- ``tiles``: ``kernels.matmul``'s blocked kernel in tiles of ``TILE_ROWS`` rows, the GeGLU in its
  epilogue, so only ``(rows, m)`` is written (forced here at every shape, also where
  ``linear_geglu`` keeps the chain, to show where its ``TILE_MAX_K`` rule stands).

For the frame encode (``frame_tokens`` rows a slot, the width and MLP) and the action expert
(``horizon`` rows a slot) of ``tiny`` at ``--tiny-batches`` slots and of pi0 at ``--pi0-batches``,
each call is timed inside a captured CUDA graph of ``--calls`` calls (median of ``--reps``
replays, µs a call), in bf16, with the bytes and FLOPs each form moves and does, and how far the
two outputs part (the largest difference relative to the chain's largest value, and the share
of elements that differ: only the order of the GEMM's sums differs). Without a GPU the
script times the chain's torch reference in float32 by wall clock: a smoke run, not a measurement.

With ``--sweep`` the tiles are also timed at the other shapes of :data:`SWEEP` (rows, columns,
warps, pipeline stages of a program: ``kernels.matmul.TILE_*``), to choose the kernel's.

    python scripts/bench_geglu.py --sweep --out bench_geglu.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_attention import per_call_us
from benchlib import commit, provenance

import flashrt.kernels.matmul as kl
from flashrt.kernels import gelu_mul, linear_geglu
from flashrt.kernels.backend import triton
from flashrt.policies import PRESETS
from flashrt_gym.sims.tabletop import TabletopConfig

SWEEP = [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (256, 64, 8, 3), (128, 32, 4, 4)]
"""Tiles ``--sweep`` times: ``(TILE_ROWS, TILE_COLS, TILE_WARPS, TILE_STAGES)``."""


def shapes(tiny_batches: list[int], pi0_batches: list[int]) -> list[dict]:
    """Per call site: preset, caller, batch, rows, input width ``k`` and gated width ``m``."""
    vocab = TabletopConfig().vocabulary
    out = []
    for preset, batches in (("tiny", tiny_batches), ("pi0", pi0_batches)):
        cfg = PRESETS[preset](vocab)
        for n in batches:
            for caller, tokens, k, m in (
                ("frame", cfg.frame_tokens, cfg.width, cfg.mlp),
                ("expert", cfg.horizon, cfg.expert_width, cfg.expert_mlp),
            ):
                if n * tokens > kl.LOOP_ROWS:  # fewer rows take the blocked kernel whole
                    out.append({"preset": preset, "caller": caller, "batch": n, "rows": n * tokens, "k": k, "m": m})
    return out


def parting(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """The largest ``|got - want|`` relative to the largest ``|want|``, and the share of elements
    that differ."""
    diff = (got.float() - want.float()).abs()
    return float(diff.max() / want.float().abs().max()), float((diff > 0).float().mean())


def with_tiles(tile: tuple[int, int, int, int], fn: Callable[[], object], calls: int, reps: int) -> float:
    """:func:`per_call_us` of ``fn`` with ``kernels.matmul``'s tiles set to ``tile`` (restored after)."""
    names = ("TILE_ROWS", "TILE_COLS", "TILE_WARPS", "TILE_STAGES")
    saved = [getattr(kl, name) for name in names]
    for name, value in zip(names, tile, strict=True):
        setattr(kl, name, value)
    try:
        return per_call_us(fn, calls, reps)
    finally:
        for name, value in zip(names, saved, strict=True):
            setattr(kl, name, value)


def bench(site: dict, device: str, dtype: torch.dtype, calls: int, reps: int, sweep: bool) -> dict:
    g = torch.Generator(device=device).manual_seed(site["rows"] + site["k"])
    rows, k, m = site["rows"], site["k"], site["m"]
    x = torch.randn(rows, k, device=device, generator=g).to(dtype)
    w = (torch.randn(2 * m, k, device=device, generator=g) / k**0.5).to(dtype)
    out = x.new_empty(rows, m)

    def tiles() -> torch.Tensor:
        kl._launch(x, w, None, out, geglu=True)
        return out

    def chain() -> torch.Tensor:
        return gelu_mul(F.linear(x, w))

    size = x.element_size()
    row = {
        **site,
        "dispatch": "tiles" if kl._tiled_rows(rows, k) else "chain",
        "flop": 4 * rows * k * m,
        "tiles_bytes": (rows * k + 2 * m * k + rows * m) * size,
        "chain_bytes": (rows * k + 2 * m * k + 2 * rows * 2 * m + rows * m) * size,
        "chain_us": per_call_us(chain, calls, reps),
    }
    if device == "cuda":
        row["tiles_us"] = per_call_us(tiles, calls, reps)
        row["max_diff_rel"], row["differ_share"] = parting(tiles(), chain())
        row["linear_geglu_equals_dispatch"] = bool(
            torch.equal(linear_geglu(x, w), tiles() if row["dispatch"] == "tiles" else chain())
        )
        if sweep:
            row["sweep"] = [{"tile": list(t), "us": with_tiles(t, tiles, calls, reps)} for t in SWEEP]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_geglu.json"))
    ap.add_argument("--tiny-batches", type=int, nargs="+", default=[1, 16, 256, 1024, 4096])
    ap.add_argument("--pi0-batches", type=int, nargs="*", default=[1, 8, 64])
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true", help="also time the tiles of SWEEP (on a GPU)")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and triton is not None
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rows = []
    for site in shapes(args.tiny_batches, args.pi0_batches):
        rows.append(bench(site, device, dtype, args.calls, args.reps, args.sweep))
        print(json.dumps(rows[-1]), flush=True)
    meta = provenance() if cuda else {"gpu": "none (smoke run)", "torch": torch.__version__, "commit": commit()}
    result = {
        **meta,
        "triton": None if triton is None else triton.__version__,
        "dtype": str(dtype),
        "tile": [kl.TILE_ROWS, kl.TILE_COLS, kl.TILE_WARPS, kl.TILE_STAGES],
        "tile_max_k": kl.TILE_MAX_K,
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\n{result['gpu']} | torch {result['torch']} | triton {result['triton']} | commit {result['commit']}")
    print("preset | caller | batch | rows x k -> m | dispatch | chain us | tiles us | chain / tiles | tiles GB/s")
    for r in rows:
        tiles_us = r.get("tiles_us", float("nan"))
        print(
            f"{r['preset']:>6} | {r['caller']:>6} | {r['batch']:5d} | {r['rows']:7d} x {r['k']:4d} -> {r['m']:5d} | "
            f"{r['dispatch']:>8} | {r['chain_us']:8.1f} | {tiles_us:8.1f} | {r['chain_us'] / tiles_us:13.2f} | "
            f"{r['tiles_bytes'] / tiles_us / 1e3:10.0f}"
        )
    swept = [r for r in rows if "sweep" in r]
    if swept:
        print("\ntiles (rows, columns, warps, stages): us a call")
        print("preset | caller | batch | " + " | ".join(str(tuple(t)) for t in SWEEP))
        for r in swept:
            cells = " | ".join(f"{c['us']:.1f}" for c in r["sweep"])
            print(f"{r['preset']:>6} | {r['caller']:>6} | {r['batch']:5d} | {cells}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
