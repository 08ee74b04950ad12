"""scripts/headline.sh's protocol with a stand-in interpreter (no training): the seeds' runs start
side by side, or with ALONE=1 one after another, and the aggregation runs once after them."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE = """#!/usr/bin/env bash
case "$1" in
  scripts/train.py) echo "start $2" >> "$LOG"; sleep 0.3; echo "end $2" >> "$LOG" ;;
  scripts/aggregate.py) echo "aggregate $2" >> "$LOG" ;;
esac
"""


def events(tmp_path: Path, alone: bool) -> list[str]:
    fake, log = tmp_path / "python", tmp_path / f"log_{alone}"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "LOG": str(log), "SEEDS": "0 1 2", "ALONE": "1" if alone else "0"}
    out = tmp_path / f"out_{alone}"
    cmd = ["bash", "scripts/headline.sh", str(out), "5"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return log.read_text().split("\n")[:-1]


def test_runs_start_side_by_side_or_one_after_another(tmp_path):
    side_by_side = events(tmp_path, alone=False)
    assert all(e.startswith("start") for e in side_by_side[:3])  # every run started before any ended
    assert side_by_side[-1].startswith("aggregate")
    alone = events(tmp_path, alone=True)
    seeds = [f"seed={s}" for s in range(3)]
    assert alone == [e for s in seeds for e in (f"start {s}", f"end {s}")] + [alone[-1]]
    assert alone[-1] == f"aggregate {tmp_path / 'out_True'}"
