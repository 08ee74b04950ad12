"""scripts/bench_geglu.py end to end on the CPU (a smoke run through the torch reference)."""

import json
import subprocess
import sys
from pathlib import Path

import flashrt.kernels.matmul as kl

ROOT = Path(__file__).resolve().parents[2]


def test_bench_geglu_times_the_chain_at_the_policies_shapes_and_names_the_dispatch(tmp_path):
    out = tmp_path / "geglu.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_geglu.py"), "--tiny-batches", "1", "16", "--pi0-batches"]
    cmd += ["--sweep"]  # a GPU-only timing: the smoke run takes the option and skips it
    done = subprocess.run([*cmd, "--calls", "1", "--reps", "1", "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tile"] == [kl.TILE_ROWS, kl.TILE_COLS, kl.TILE_WARPS, kl.TILE_STAGES]
    assert result["tile_max_k"] == kl.TILE_MAX_K
    # tiny: 65 frame rows a slot (width 256, MLP 1024), 8 expert rows (192, 768); 8 rows take the blocked kernel
    sites = {(r["caller"], r["batch"]): (r["rows"], r["k"], r["m"], r["dispatch"]) for r in result["rows"]}
    assert sites == {
        ("frame", 1): (65, 256, 1024, "tiles"),
        ("frame", 16): (1040, 256, 1024, "tiles"),
        ("expert", 16): (128, 192, 768, "tiles"),
    }
    for r in result["rows"]:
        assert r["chain_us"] > 0 and "tiles_us" not in r and "sweep" not in r  # timed on a GPU only
        assert r["chain_bytes"] - r["tiles_bytes"] == 4 * r["rows"] * r["m"] * 4  # float32: the pair, twice
    assert "chain / tiles" in done.stdout
