"""scripts/bench_metaworld.py end to end on the CPU (two slots, a few chunks): the simulator and
env rows are written with their rates, in one process and split over two, the renderer's with its
memory, and asking for a GPU where there is none is refused by name."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "scripts" / "bench_metaworld.py")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("metaworld") is None, reason="needs Meta-World")


def test_the_sim_and_env_rows_are_written(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--sizes", "2", "--threads", "1", "--processes", "1", "2", "--rows", "sim", "render", "env", "--steps", "2"]
    done = subprocess.run([sys.executable, SCRIPT, *args, "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    got = [(r["row"], r["slots"], r["threads"], r["processes"]) for r in rows]
    assert got == [("render", 2, 1, 1), ("sim", 2, 1, 1), ("env", 2, 1, 1), ("sim", 2, 1, 2), ("env", 2, 1, 2)]
    render, rows = rows[0], rows[1:]
    assert render["frames_per_s"] > 0 and render["renderers_host_MB"] > 0
    assert all(r["steps"] == 2 and r["sustained_chunks_per_s"] > 0 for r in rows)
    one, two = (r for r in rows if r["row"] == "sim")
    assert one["host_MB"] is None and two["host_MB"] > 0  # two fresh workers' resident sets
    for env in (r for r in rows if r["row"] == "env"):  # where a step's time goes, by host method
        host = env["host_ms_per_step"]
        assert env["host_calls_per_step"]["run_ticks"] == 1 and host["run_ticks"] > 0  # one chunk a step
        assert env["host_calls_per_step"]["render"] >= 1 and "set_state" not in host
        assert env["outside_host_ms_per_step"] == pytest.approx(env["mean_ms"] - sum(host.values()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_asking_for_a_gpu_without_one_is_refused(tmp_path):
    done = subprocess.run([sys.executable, SCRIPT, "--device", "cuda", "--out", str(tmp_path / "x.json")],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode != 0 and "no CUDA GPU here" in done.stderr
