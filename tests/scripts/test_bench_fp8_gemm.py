"""scripts/bench_fp8_gemm.py times the projections FP8 actually runs: those of its layers
(``fp8.sources``: q/k/v fused), at the rows each stack sees at a batch."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_fp8_gemm import shapes  # noqa: E402


def test_shapes_are_the_fp8_projections_at_each_stacks_rows():
    one, many = shapes(1), shapes(64)
    assert set(one) == {f"{s}.{p}" for s in ("vision", "prefix", "expert") for p in ("qkv", "o", "fc1", "fc2")
                        if s == "vision"} | {f"{s}.{p}" for s in ("prefix", "expert")
                                             for p in ("qkv", "o", "gate_up", "down")}  # fmt: skip
    assert one["vision.qkv"] == (3 * 256, 3 * 1152, 1152)  # 3 views of 256 patches
    assert one["prefix.qkv"] == (817, 2560, 2048)  # q (8 heads) and k, v (one group) fused
    assert one["expert.down"] == (50, 1024, 4096)  # the 50-action horizon
    assert all(many[k] == (64 * one[k][0], *one[k][1:]) for k in one)
