"""Aggregate a multirun folder of scripts/train.py into a table and a plot (mean ± std over seeds).

    python scripts/aggregate.py multirun/2026-11-30/12-00-00

Groups runs by their folder name without its seed (``...,seed=0`` from a sweep, ``..._seed0``
from scripts/headline.sh); writes ``summary.md`` and ``curves.png``
into the folder and prints the table.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np


def load_runs(folder: Path) -> dict[str, list[dict]]:
    """Runs by group name. A run stopped before its end (no summary.json) counts with its last
    evaluation, marked unfinished."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for curve_file in sorted(folder.rglob("curve.json")):
        run = curve_file.parent
        curve = json.loads(curve_file.read_text())
        if not curve:
            continue
        name = re.sub(r"(^|[,_-])seed=?\d+", "", run.name).strip(",_-") or "default"
        if (run / "summary.json").is_file():
            summary = json.loads((run / "summary.json").read_text())
        else:
            last = curve[-1]
            summary = {**last, "env_steps_per_s": last["env_steps"] / max(last["wall_s"], 1e-9), "unfinished": True}
        groups[name].append({"summary": summary, "curve": curve})
    if not groups:
        raise SystemExit(f"no runs (curve.json) under {folder}; is it a `train.py -m` folder?")
    return groups


def table(groups: dict[str, list[dict]]) -> str:
    rows = [
        "| runs | seeds | base success | steered success | env steps | env steps/s | unfinished |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in sorted(groups.items()):
        s = [r["summary"] for r in runs]

        def ms(key: str, pct: bool = False, s=s) -> str:
            v = np.array([x[key] for x in s], dtype=float) * (100 if pct else 1)
            return f"{v.mean():.1f} ± {v.std():.1f}" + (" %" if pct else "")

        rows.append(
            f"| {name} | {len(s)} | {ms('base_success', True)} | {ms('success', True)} | "
            f"{int(np.mean([x['env_steps'] for x in s]))} | {ms('env_steps_per_s')} | "
            f"{sum(bool(x.get('unfinished')) for x in s)} |"
        )
    return "\n".join(rows)


def plot(groups: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, runs in sorted(groups.items()):
        n = min(len(r["curve"]) for r in runs)
        x = np.array([p["env_steps"] for p in runs[0]["curve"][:n]])
        y = np.array([[p["success"] for p in r["curve"][:n]] for r in runs])
        ax.plot(x, y.mean(0), label=f"{name} (n={len(runs)})")
        ax.fill_between(x, y.mean(0) - y.std(0), y.mean(0) + y.std(0), alpha=0.2)
    ax.set(xlabel="env steps (chunks)", ylabel="success rate", ylim=(0, 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    args = ap.parse_args()
    groups = load_runs(args.folder)
    text = table(groups)
    (args.folder / "summary.md").write_text(text + "\n")
    plot(groups, args.folder / "curves.png")
    print(text)


if __name__ == "__main__":
    main()
