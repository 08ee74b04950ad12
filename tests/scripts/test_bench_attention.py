"""scripts/bench_attention.py end to end on the CPU (a smoke run through the torch reference)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_attention_times_both_callers_at_the_policy_shapes(tmp_path):
    out = tmp_path / "attention.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_attention.py"), "--tiny-batches", "2", "--pi0-batches"]
    done = subprocess.run([*cmd, "--calls", "1", "--reps", "1", "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    # tiny: 16 instruction words, a 65-token ring frame and newest frame (64 patches + proprio), horizon 8
    shapes = {r["caller"]: (r["queries"], r["keys"]) for r in rows}
    assert shapes == {"expert": (8, 16 + 65 + 65 + 8), "frame": (65, 16 + 65 + 65)}
    assert all(r[k] > 0 for r in rows for k in ("segments_us", "one_segment_us", "concat_us"))
    assert "one segment us" in done.stdout
