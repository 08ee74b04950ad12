"""scripts/steer_search.py end to end: search with fork beside the baselines, on a tiny budget."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_search_runs_and_reports_every_method(tmp_path, micro):
    out = tmp_path / "search.json"  # the micro policy: the search's bookkeeping, not the shipped VLA's rates
    cmd = [sys.executable, str(ROOT / "scripts" / "steer_search.py"), "--episodes", "3", "--candidates", "2"]
    args = ["--lookahead", "2", "--scales", "0.5", "--weights", str(micro), "--out", str(out)]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (r["episodes"], r["candidates"], r["lookahead"]) == (3, 2, 2)
    assert r["commit"] and r["cpu"] and "gpu" in r  # where it was measured
    assert r["command"] == " ".join(["python scripts/steer_search.py", *cmd[2:], *args])
    for key in (
        "base_success",
        "zero_noise_success",
        "saturated_noise_success",
        "normal_x0.5_success",
        "search_success",
    ):
        assert r[key] * 3 == round(r[key] * 3) and 0 <= r[key] <= 1  # a fraction of 3 episodes
    assert r["search_env_steps"] > 0 and r["search_env_steps"] % 6 == 0  # whole steps of 3 groups x 2 slots
    assert "search with fork" in done.stdout and "saturated" in done.stdout


def test_search_runs_on_the_mujoco_task_with_given_weights(tmp_path, micro):
    pytest.importorskip("mujoco")
    out = tmp_path / "search.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "steer_search.py"), "--task", "mujoco_push", "--weights", str(micro)]
    args = ["--episodes", "3", "--candidates", "2", "--out", str(out)]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (r["task"], r["weights"], r["episodes"]) == ("mujoco_push", str(micro), 3)
    assert 0 <= r["search_success"] <= 1 and r["search_env_steps"] % 6 == 0


def test_search_on_metaworld_pairs_each_group_with_its_task_and_reports_every_task(tmp_path):
    """MT10 with its shipped policy, two worker processes: episode g runs task g % 10 under every
    law and in the search (whose groups fork within one task: a fork across tasks is refused), and
    each law's per-task rates are reported on those tasks."""
    pytest.importorskip("metaworld")
    out = tmp_path / "search.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "steer_search.py"), "--task", "metaworld_mt10", "--out", str(out)]
    args = ["--episodes", "3", "--candidates", "2", "processes=2", "block=1"]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["overrides"] == ["processes=2", "block=1"] and r["search_env_steps"] % 6 == 0
    tasks = ["reach the goal", "push the puck to the goal", "pick up the puck and place it at the goal"]
    laws = ("base_success", "zero_noise_success", "saturated_noise_success", "search_success")
    assert all(list(r["by_instruction"][law]) == tasks for law in laws)
    assert all(r[law] == sum(r["by_instruction"][law].values()) / 3 for law in laws)  # one episode a task


def test_bad_arguments_are_refused():
    cmd = [sys.executable, str(ROOT / "scripts" / "steer_search.py"), "--candidates", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "--candidates >= 2" in done.stderr
    done = subprocess.run([*cmd[:2], "--task", "cartpole"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "invalid choice: 'cartpole'" in done.stderr and "mujoco_push" in done.stderr
    done = subprocess.run([*cmd[:2], "processes"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "bad task override in ['processes']" in done.stderr
