"""scripts/aggregate.py on runs stopped before their end: their test evaluation at 200 000 env
steps still counts, with the base policy's success on the same starts."""

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
        assert "test_success_at_200000" not in agg and row == "| fast_sac | 0 | — | — | — | — | — | — | 3 |"
    else:
        assert agg["test_success_at_200000"]["iqm"] == pytest.approx(0.6) and agg["base_success"] == pytest.approx(0.4)
        assert row.startswith("| fast_sac | 0 | 40.0 % | — | 60.0 % [")
