"""Aggregate a folder of scripts/train.py runs across seeds: IQM and 95 % bootstrap intervals
(rliable) over at least five runs, the mean and the range below that, a table, curves and a JSON.

    python scripts/aggregate.py multirun/2026-11-30/12-00-00

Groups runs by their folder name without its seed (``...,seed=0`` from a sweep, ``..._seed0``
from scripts/headline.sh). Groups are compared on their last *validation* evaluation (the column
to choose by; with several groups the script names the best), and the chosen group's figure is
its final success on the *test* starts (``summary.json``); the curves are the validation points.
Writes ``summary.md``, ``aggregate.json`` and ``curves.png`` into the folder and prints the
table. A run stopped before its end (no ``summary.json``) is counted as unfinished and left out
of the final figures. The column at 200 000 env steps comes from the curves' test point there,
so an unfinished run that got that far counts in it (a group of unfinished runs shows the base
policy's success on the same starts beside it); it is shown when every run of the group got
there.

Why five: the interquartile mean of fewer than five runs trims nothing (it is their mean), and a
bootstrap over three runs puts its 2.5 and 97.5 percentiles on the extremes, so "IQM [95 % CI]"
over three seeds would be the mean and the range under another name. Below :data:`MIN_IQM_RUNS`
runs the figure is therefore the mean with the range, and says so.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from rliable import library as rly
from rliable import metrics

REPS = 10_000  # bootstrap resamples for the table; the curves' points take CURVE_REPS
CURVE_REPS = 1_000
MIN_IQM_RUNS = 5
"""The fewest runs whose IQM trims anything and whose bootstrap interval is not just the range."""


def load_runs(folder: Path) -> dict[str, list[dict]]:
    """Runs by group name: each ``{"curve": [...], "summary": {...} or None}``."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for curve_file in sorted(folder.rglob("curve.json")):
        run = curve_file.parent
        curve = json.loads(curve_file.read_text())
        name = re.sub(r"(^|[,_-])seed=?\d+", "", run.name).strip(",_-") or "default"
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").is_file() else None
        groups[name].append({"curve": curve, "summary": summary})
    if not groups:
        raise SystemExit(f"no runs (curve.json) under {folder}; is it a `train.py -m` or headline folder?")
    return groups


def estimate(scores: list[float], reps: int = REPS) -> dict[str, Any]:
    """The figure over runs: with :data:`MIN_IQM_RUNS` or more, the interquartile mean and its
    95 % stratified-bootstrap interval (rliable); with fewer, the mean and the [min, max] range.

    Args:
        scores: one score per run.
        reps: bootstrap resamples.

    Returns:
        ``{"stat": "iqm" | "mean", "value", "lo", "hi", "interval": "95 % bootstrap" | "range", "runs"}``.
    """
    x = np.asarray(scores, dtype=float)
    if len(x) < MIN_IQM_RUNS:
        return {"stat": "mean", "value": float(x.mean()), "lo": float(x.min()), "hi": float(x.max())} | {
            "interval": "range",
            "runs": len(x),
        }
    point, interval = rly.get_interval_estimates(
        {"s": x[:, None]}, lambda s: np.array([metrics.aggregate_iqm(s)]), reps=reps, confidence_interval_size=0.95
    )
    return {"stat": "iqm", "value": float(point["s"][0]), "lo": float(interval["s"][0, 0])} | {
        "hi": float(interval["s"][1, 0]),
        "interval": "95 % bootstrap",
        "runs": len(x),
    }


def at_200000(curve: list[dict]) -> dict | None:
    """A run's test evaluation at 200 000 env steps (its curve's milestone point), if it got there."""
    return next((p for p in curve if p.get("split") == "test" and p.get("milestone") == 200_000), None)


def aggregate(groups: dict[str, list[dict]]) -> dict[str, dict]:
    out = {}
    for name, runs in sorted(groups.items()):
        done = [r["summary"] for r in runs if r["summary"] is not None]
        g: dict = {"runs": len(runs), "finished": len(done), "seeds": [s["seed"] for s in done]}
        if done:
            g["test_success"] = estimate([s["success"] for s in done]) | {"per_seed": [s["success"] for s in done]}
            if all(s.get("validation_success") is not None for s in done):
                g["validation_success"] = estimate([s["validation_success"] for s in done])
            g["base_success"] = float(np.mean([s["base_success"] for s in done]))
            for key in ("env_steps", "env_steps_per_s", "wall_s"):
                g[key] = float(np.mean([s[key] for s in done]))
            g["env_steps_per_s_summed"] = float(np.sum([s["env_steps_per_s"] for s in done]))  # runs sharing a GPU
            g["wall_s_to_validation_90"] = [s.get("first_wall_s_validation_90") for s in done]
            if all(s.get("test_by_instruction") for s in done):  # MT10: the per-task table
                g["test_by_instruction"] = by_instruction([s["test_by_instruction"] for s in done])
        milestones = [at_200000(r["curve"]) for r in runs]
        if all(m is not None for m in milestones):  # every run reached 200 000 steps, finished or not
            g["test_success_at_200000"] = estimate([m["success"] for m in milestones])
            if not done:
                g["base_success"] = float(np.mean([m["base_success"] for m in milestones]))
        out[name] = g
    return out


def by_instruction(runs: list[dict[str, dict]]) -> dict[str, dict]:
    """Each instruction's test success over the runs (:func:`estimate`, the per-seed values beside
    it) and the base policy's mean on the same starts: a task each on Meta-World's MT10.

    Args:
        runs: each run's ``summary.json`` ``test_by_instruction`` (text to ``success``,
            ``base_success``, ``episodes``).

    Returns:
        Instruction text (those every run has, in the first run's order) to ``success``,
        ``base_success`` and ``episodes`` (summed over the runs).
    """
    out = {}
    for text in runs[0]:
        if all(text in r for r in runs):
            seeds = [r[text]["success"] for r in runs]
            out[text] = {
                "success": estimate(seeds) | {"per_seed": seeds},
                "base_success": float(np.mean([r[text]["base_success"] for r in runs])),
                "episodes": int(sum(r[text]["episodes"] for r in runs)),
            }
    return out


def instruction_table(agg: dict[str, dict]) -> str:
    """Per instruction (task), each group's steered test success beside its base policy's, for
    the groups whose runs recorded it; empty when none did."""
    rows = []
    for name, g in agg.items():
        for text, d in g.get("test_by_instruction", {}).items():
            s = d["success"]
            what = f"[{100 * s['lo']:.1f}, {100 * s['hi']:.1f}]" if s["stat"] == "iqm" else "(mean)"
            steered = f"{100 * s['value']:.1f} % {what}"
            rows.append(f"| {name} | {text} | {100 * d['base_success']:.1f} % | {steered} | {d['episodes']} |")
    if not rows:
        return ""
    head = "| runs | instruction | base (test) | steered (test) | episodes (all seeds) |\n|---|---|---|---|---|"
    return head + "\n" + "\n".join(rows)


def table(agg: dict[str, dict]) -> str:
    def pct(d: dict | None) -> str:
        if d is None:
            return "—"
        if d["stat"] == "mean":
            return f"{100 * d['value']:.1f} % (mean; range {100 * d['lo']:.1f}–{100 * d['hi']:.1f})"
        return f"{100 * d['value']:.1f} % [{100 * d['lo']:.1f}, {100 * d['hi']:.1f}]"

    rows = [
        f"| runs | seeds | validation (choose by) | base (test) | steered (test): IQM [95 % CI] over >= {MIN_IQM_RUNS} "
        "seeds, else mean (range) | at 200 000 steps | env steps | wall | env steps/s | unfinished |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, g in agg.items():
        if not g["finished"]:
            base = f"{100 * g['base_success']:.1f} %" if "base_success" in g else "—"
            rows.append(
                f"| {name} | 0 | — | {base} | — | {pct(g.get('test_success_at_200000'))} | — | — | — | {g['runs']} |"
            )
            continue
        rows.append(
            f"| {name} | {g['finished']} | {pct(g.get('validation_success'))} | {100 * g['base_success']:.1f} % | "
            f"{pct(g['test_success'])} | "
            f"{pct(g.get('test_success_at_200000'))} | {g['env_steps']:.0f} | {g['wall_s'] / 60:.1f} min | "
            f"{g['env_steps_per_s']:.0f} | {g['runs'] - g['finished']} |"
        )
    return "\n".join(rows)


def best_on_validation(agg: dict[str, dict]) -> str | None:
    """The group with the highest last-validation IQM, when more than one has one: the one
    whose test figure to report (the others' test figures were not chosen on)."""
    scored = {name: g["validation_success"]["value"] for name, g in agg.items() if "validation_success" in g}
    return max(scored, key=scored.__getitem__) if len(scored) > 1 else None


def plot(groups: dict[str, list[dict]], path: Path) -> None:
    """Validation success against env steps: IQM over seeds with its 95 % interval, and the
    base policy's on the same starts (dashed): what the steering is measured against."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in sorted(groups.items()):
        curves = [[p for p in r["curve"] if p.get("split", "validation") == "validation"] for r in runs]
        n = min(len(c) for c in curves)
        if n == 0:
            continue
        x = np.array([p["env_steps"] for p in curves[0][:n]])
        y = [estimate([c[i]["success"] for c in curves], CURVE_REPS) for i in range(n)]
        what = "IQM, 95 % CI" if y[0]["stat"] == "iqm" else "mean, range"
        # markers: a group evaluated once (a short run) is a point, which a bare line would not show
        (line,) = ax.plot(x, [v["value"] for v in y], marker="o", ms=3, label=f"{name} (n={len(runs)}; {what})")
        ax.fill_between(x, [v["lo"] for v in y], [v["hi"] for v in y], alpha=0.2)
        base = estimate([c[0]["base_success"] for c in curves], CURVE_REPS)["value"]
        ax.axhline(base, ls="--", lw=1, color=line.get_color(), label=f"{name}: base policy")
    ax.set(xlabel="env steps (chunks)", ylabel="validation success", ylim=(0, 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    args = ap.parse_args()
    groups = load_runs(args.folder)
    agg = aggregate(groups)
    text = table(agg)
    per_instruction = instruction_table(agg)
    if per_instruction:
        text += "\n\n" + per_instruction
    (args.folder / "summary.md").write_text(text + "\n")
    (args.folder / "aggregate.json").write_text(json.dumps(agg, indent=2))
    plot(groups, args.folder / "curves.png")
    print(text)
    best = best_on_validation(agg)
    if best is not None:
        print(f"best on validation: {best} (report its test figure)")


if __name__ == "__main__":
    main()
