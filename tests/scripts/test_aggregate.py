"""scripts/aggregate.py: groups are compared on validation, reported on test; runs stopped before
their end still count at their test evaluation at 200 000 env steps, with the base policy's
success on the same starts."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def write_runs(folder: Path, successes: list[float | None]) -> None:
    """One unfinished run per entry (no ``summary.json``): a validation point, and a test point
    at 200 000 steps with that success (None: the run stopped before it)."""
    for seed, success in enumerate(successes):
        run = folder / f"fast_sac_seed{seed}"
        run.mkdir(parents=True)
        curve = [{"env_steps": 100_000, "split": "validation", "success": 0.3, "base_success": 0.3}]
        if success is not None:
            point = {"env_steps": 200_704, "split": "test", "success": success, "base_success": 0.4}
            curve.append(point | {"milestone": 200_000})
        (run / "curve.json").write_text(json.dumps(curve))


@pytest.mark.parametrize("stopped_early", [False, True])
def test_unfinished_runs_count_at_their_200000_step_test_point(tmp_path, monkeypatch, stopped_early):
    """Three runs killed after their 200 000-step test point give that column (IQM of 0.5, 0.6,
    0.7) and the base beside it; when one stopped before it (the mutation), no figure is made
    from the other two."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import aggregate

    write_runs(tmp_path, [0.5, 0.6, None if stopped_early else 0.7])
    agg = aggregate.aggregate(aggregate.load_runs(tmp_path))["fast_sac"]
    assert agg["finished"] == 0 and agg["runs"] == 3
    row = aggregate.table({"fast_sac": agg}).splitlines()[-1]
    if stopped_early:
        assert "test_success_at_200000" not in agg and row == "| fast_sac | 0 | — | — | — | — | — | — | — | 3 |"
    else:
        assert agg["test_success_at_200000"]["value"] == pytest.approx(0.6) and agg["base_success"] == pytest.approx(
            0.4
        )
        assert row.startswith("| fast_sac | 0 | — | 40.0 % | — | 60.0 % (mean; range 50.0–70.0) |")


def write_finished(folder: Path, group: str, validation: list[float], test: list[float]) -> None:
    """Finished runs of one group: each a curve and a summary with these final successes."""
    for seed, (val, tst) in enumerate(zip(validation, test, strict=True)):
        run = folder / f"{group}_seed{seed}"
        run.mkdir(parents=True)
        (run / "curve.json").write_text(json.dumps([{"env_steps": 100, "split": "validation", "success": val}]))
        summary = {"seed": seed, "success": tst, "validation_success": val, "base_success": 0.4}
        summary |= {"env_steps": 100, "env_steps_per_s": 10.0, "wall_s": 10.0}
        (run / "summary.json").write_text(json.dumps(summary))


def test_groups_are_chosen_on_validation_not_test(tmp_path, monkeypatch):
    """Group ``a`` is better on validation and worse on test than ``b``: the validation column
    and the named choice follow validation. Mutation: choosing by the test column would name
    ``b``, and the columns must differ."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import aggregate

    write_finished(tmp_path, "a", [0.8, 0.8, 0.8], [0.5, 0.5, 0.5])
    write_finished(tmp_path, "b", [0.6, 0.6, 0.6], [0.7, 0.7, 0.7])
    agg = aggregate.aggregate(aggregate.load_runs(tmp_path))
    assert agg["a"]["validation_success"]["value"] == pytest.approx(0.8)
    assert agg["b"]["validation_success"]["value"] == pytest.approx(0.6)
    assert aggregate.best_on_validation(agg) == "a"
    assert max(agg, key=lambda g: agg[g]["test_success"]["value"]) == "b"  # the mutation's choice
    rows = aggregate.table(agg).splitlines()
    assert rows[2].startswith("| a | 3 | 80.0 % (mean; range") and "| 50.0 % (mean; range 50.0–50.0) |" in rows[2]
    assert aggregate.best_on_validation({"a": agg["a"]}) is None  # one group: nothing to choose


def test_five_runs_get_the_interquartile_mean_and_fewer_the_mean_with_its_range(monkeypatch):
    """Over five runs the figure trims the best and the worst (IQM of 0.1, 0.5, 0.6, 0.7, 0.99 is
    0.6, their mean 0.578) and its bootstrap interval lies strictly inside the range; over three
    it is labelled the mean with the range. Mutation: a plain mean misses the IQM."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import aggregate

    five = [0.1, 0.5, 0.6, 0.7, 0.99]
    got = aggregate.estimate(five)
    assert got["stat"] == "iqm" and got["interval"] == "95 % bootstrap" and got["value"] == pytest.approx(0.6)
    assert got["value"] != pytest.approx(sum(five) / 5)  # the mutation: the mean is not the IQM
    assert 0.1 <= got["lo"] < got["value"] < got["hi"] <= 0.99 and (got["lo"], got["hi"]) != (0.1, 0.99)
    three = aggregate.estimate([0.5, 0.6, 0.8])
    assert three == {"stat": "mean", "value": pytest.approx(0.6333, abs=1e-4), "lo": 0.5, "hi": 0.8} | {
        "interval": "range",
        "runs": 3,
    }
    row = aggregate.table(
        {
            "g": {
                "finished": 5,
                "runs": 5,
                "validation_success": got,
                "base_success": 0.4,
                "test_success": got,
                "env_steps": 1,
                "wall_s": 60,
                "env_steps_per_s": 1,
            }
        }
    )
    assert "| 60.0 % [" in row.splitlines()[-1]


def test_each_instruction_gets_its_figure_over_the_seeds_beside_the_base_policys(tmp_path, monkeypatch):
    """Five finished runs that recorded per-instruction test success (a task each on MT10): each
    instruction's IQM over the five, per seed beside it, the base policy's mean and the episodes
    summed, in summary.md's second table. Mutation: the runs' overall successes in place of the
    instruction's give another figure."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import aggregate

    drawer = [0.1, 0.5, 0.6, 0.7, 0.99]
    for seed, d in enumerate(drawer):
        run = tmp_path / f"fast_sac_seed{seed}"
        run.mkdir()
        (run / "curve.json").write_text(json.dumps([{"env_steps": 100, "split": "validation", "success": 0.5}]))
        per = {
            "open the drawer": {"success": d, "base_success": 0.2, "episodes": 100},
            "press the button": {"success": 1.0, "base_success": 0.6, "episodes": 100},
        }
        summary = {"seed": seed, "success": 0.3, "validation_success": 0.5, "base_success": 0.4}
        summary |= {"env_steps": 100, "env_steps_per_s": 10.0, "wall_s": 10.0, "test_by_instruction": per}
        (run / "summary.json").write_text(json.dumps(summary))
    agg = aggregate.aggregate(aggregate.load_runs(tmp_path))
    got = agg["fast_sac"]["test_by_instruction"]
    assert list(got) == ["open the drawer", "press the button"]
    assert got["open the drawer"]["success"]["value"] == pytest.approx(0.6)  # the IQM of the five
    assert got["open the drawer"]["success"]["per_seed"] == drawer
    assert got["open the drawer"]["base_success"] == pytest.approx(0.2) and got["open the drawer"]["episodes"] == 500
    assert got["press the button"]["success"]["value"] == pytest.approx(1.0)
    assert got["open the drawer"]["success"]["value"] != pytest.approx(agg["fast_sac"]["test_success"]["value"])
    rows = aggregate.instruction_table(agg).splitlines()
    assert rows[2].startswith("| fast_sac | open the drawer | 20.0 % | 60.0 % [") and rows[2].endswith("| 500 |")
    assert aggregate.instruction_table({"g": {}}) == ""
