"""scripts/metaworld_main.sh's protocol with a stand-in interpreter (no training): the base policy
evaluated once on all the cores into the file every run reads, both action modes run seed 0 side by
side, the mode aggregate.py names best on validation then runs every seed, and with no mode named
the script stops and says why."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE = """#!/usr/bin/env bash
case "$1" in
  scripts/train.py)
    echo "train ${*:2}" >> "$LOG"
    # a run side by side with another returns only once that one has started too (10 s at most),
    # so "both modes started before either was aggregated" does not hang on the scheduler
    for _ in $(seq 100); do [ "$(grep -c '^train' "$LOG")" -ge 2 ] && break; sleep 0.1; done ;;
  scripts/eval.py) echo "eval ${*:2}" >> "$LOG" ;;
  scripts/aggregate.py)
    echo "aggregate $2" >> "$LOG"
    case "$2" in */choice) [ -n "$BEST" ] && echo "best on validation: $BEST (report its test figure)" ;; esac ;;
esac
exit 0
"""


def run(tmp_path: Path, best: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    fake, log = tmp_path / "python", tmp_path / f"log_{best}"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "LOG": str(log), "BEST": best, "CHOICE_S": "3", "RUN_S": "4"}
    cmd = ["bash", "scripts/metaworld_main.sh", str(tmp_path / f"out_{best}"), "agent.kwargs.lr=1e-4"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    return done, log.read_text().split("\n")[:-1] if log.exists() else []


def test_the_mode_best_on_validation_runs_every_seed(tmp_path):
    done, events = run(tmp_path, "residual")
    assert done.returncode == 0, done.stderr
    base = tmp_path / "out_residual" / "base_eval.json"
    assert events[0].startswith("eval experiment=metaworld_mt10") and f"base_eval={base}" in events[0]
    cores = subprocess.run(["nproc"], capture_output=True, text=True, env=os.environ).stdout.strip()
    assert f"task.processes={cores}" in events[0] and "agent.kwargs.lr=1e-4" in events[0]  # all the cores
    assert sum(e.startswith("eval") for e in events) == 1  # once for both stages
    cut = events.index(f"aggregate {tmp_path / 'out_residual' / 'choice'}") + 1
    choice, main = events[1:cut], events[cut:]  # each mode's headline aggregates its own folder too
    assert all(f"base_eval={base}" in e for e in events if e.startswith("train"))
    trains = sorted(e for e in choice if e.startswith("train"))
    assert [("env=noise" in t, "env=residual" in t, "seed=0" in t, "time_limit_s=3" in t) for t in trains] == [
        (True, False, True, True),
        (False, True, True, True),
    ]
    assert all("experiment=metaworld_mt10" in t and "agent.kwargs.lr=1e-4" in t for t in trains)
    assert all(e.startswith("train") for e in choice[:2])  # both modes started before either was aggregated
    runs = [e for e in main if e.startswith("train")]
    assert sorted(e.split()[1] for e in runs) == [f"seed={s}" for s in range(5)]
    assert all("env=residual" in e and "time_limit_s=4" in e and "task.processes=" in e for e in runs)
    assert main[-1] == f"aggregate {tmp_path / 'out_residual' / 'main'}"
    assert "chosen on validation: env=residual" in done.stdout


def test_no_mode_named_stops_before_the_seeds(tmp_path):
    done, events = run(tmp_path, "")
    assert done.returncode != 0 and "no choice" in done.stderr
    assert not any("seed=1" in e for e in events)


def test_the_stages_run_apart_on_the_choice_written_to_the_folder(tmp_path):
    fake, log, out = tmp_path / "python", tmp_path / "log", tmp_path / "out"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "LOG": str(log), "BEST": "noise", "CHOICE_S": "3", "RUN_S": "4"}
    cmd = ["bash", "scripts/metaworld_main.sh", str(out)]
    first = subprocess.run(cmd, cwd=ROOT, env={**env, "STAGE": "choice"}, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    choice = log.read_text().split("\n")[:-1]
    assert choice[0].startswith("eval") and sum(e.startswith("eval") for e in choice) == 1
    assert sorted(e.split()[1] for e in choice if e.startswith("train")) == ["seed=0", "seed=0"]
    assert (out / "choice.txt").read_text().startswith("best on validation: noise")
    log.unlink()
    second = subprocess.run(cmd, cwd=ROOT, env={**env, "STAGE": "main", "BEST": ""}, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    main = log.read_text().split("\n")[:-1]
    assert main[0].startswith("eval") and sum(e.startswith("eval") for e in main) == 1  # this sitting's own
    runs = [e for e in main if e.startswith("train")]
    assert sorted(e.split()[1] for e in runs) == [f"seed={s}" for s in range(5)]
    assert all("env=noise" in e for e in runs) and f"aggregate {out / 'choice'}" not in main
    assert "chosen on validation: env=noise" in second.stdout


def test_the_main_stage_alone_needs_a_choice_and_a_known_stage(tmp_path):
    fake, log = tmp_path / "python", tmp_path / "log"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "LOG": str(log), "BEST": "noise", "RUN_S": "4"}
    cmd = ["bash", "scripts/metaworld_main.sh", str(tmp_path / "out")]
    done = subprocess.run(cmd, cwd=ROOT, env={**env, "STAGE": "main"}, capture_output=True, text=True)
    assert done.returncode != 0 and "STAGE=choice" in done.stderr and not log.exists()
    done = subprocess.run(cmd, cwd=ROOT, env={**env, "STAGE": "seeds"}, capture_output=True, text=True)
    assert done.returncode == 2 and "STAGE must be all, choice or main" in done.stderr and not log.exists()


def test_the_seeds_hard_stop_leaves_room_for_their_final_evaluations(tmp_path):
    """headline.sh stops a run at its time limit plus GRACE (``timeout``): the seeds' stage gives
    them 360 s unless GRACE says otherwise, the choice stage keeps headline.sh's 180 s."""
    fake, log, bin_ = tmp_path / "python", tmp_path / "log", tmp_path / "bin"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    bin_.mkdir()
    (bin_ / "timeout").write_text('#!/usr/bin/env bash\necho "timeout $2" >> "$LOG"\nshift 2\nexec "$@"\n')
    (bin_ / "timeout").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "PYTHON": str(fake), "LOG": str(log)}
    env |= {"BEST": "noise", "CHOICE_S": "3", "RUN_S": "4"}
    cmd = ["bash", "scripts/metaworld_main.sh", str(tmp_path / "out")]
    assert subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True).returncode == 0
    limits = [e.split()[1] for e in log.read_text().split("\n") if e.startswith("timeout")]
    assert limits == ["183", "183"] + ["364"] * 5
    log.unlink()
    assert (
        subprocess.run(cmd, cwd=ROOT, env={**env, "STAGE": "main", "GRACE": "20"}, capture_output=True).returncode == 0
    )
    assert [e for e in log.read_text().split("\n") if e.startswith("timeout")] == ["timeout 24"] * 5
