"""The scripted expert of the MuJoCo push task: success and episode length over seeded episodes.

Each split's episodes are slot ``i`` drawing from seed ``seed + i`` (the env's convention), the
expert acting every tick, an episode ending on success or after ``max_ticks`` ticks (the env's
default: 40 chunks of 4). The built-in 2-D tabletop's expert runs the same seeds beside it (the
same seed starts the same instruction and positions in both). Runs on the CPU.

    python scripts/mujoco_expert.py --episodes 1000 --out docs/bench/mujoco_expert_<commit>.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import Counter
from pathlib import Path

import mujoco
import numpy as np
import torch
from benchlib import commit

from flashrt.runtime import BufferSet, atomic_write
from flashrt_gym.sims import MujocoPush, PushConfig
from flashrt_gym.sims.tabletop import Tabletop, TabletopConfig


def mujoco_episodes(cfg: TabletopConfig, seeds: np.ndarray, max_ticks: int, batch: int) -> dict[str, np.ndarray]:
    """Instruction, success and ticks to success (or ``max_ticks``) of each seeded episode."""
    out: dict[str, list[np.ndarray]] = {"instruction": [], "success": [], "ticks": []}
    for lo in range(0, len(seeds), batch):
        part = seeds[lo : lo + batch]
        sim = MujocoPush(len(part), PushConfig(cfg))
        sim.seed(part)
        sim.reset()
        out["instruction"].append(sim.instruction())
        for _ in range(max_ticks):
            sim.run_ticks(sim.expert()[:, None])
            if sim.success().all():
                break
        out["success"].append(sim.success())
        out["ticks"].append(sim.ticks())
    return {k: np.concatenate(v) for k, v in out.items()}


def tabletop_episodes(cfg: TabletopConfig, seeds: np.ndarray, max_ticks: int) -> dict[str, np.ndarray]:
    """The same for the built-in tabletop and its expert."""
    task = Tabletop(cfg)
    b = BufferSet(task.specs(), len(seeds))
    task.bind(b)
    task.seed(torch.from_numpy(seeds))
    task.reset()
    instruction = b["sim.instruction"].numpy().copy()
    with torch.no_grad():
        for _ in range(max_ticks):
            task.step(task.expert())
    return {"instruction": instruction, "success": b["sim.success"].numpy().copy(), "ticks": b["sim.tick"].numpy()}


def summary(ep: dict[str, np.ndarray], chunk: int) -> dict:
    ok = ep["ticks"][ep["success"]]
    return {
        "episodes": len(ep["success"]),
        "successes": int(ep["success"].sum()),
        "success_rate": float(ep["success"].mean()),
        "median_ticks": float(statistics.median(ok.tolist())) if ok.size else None,
        "p90_ticks": float(np.percentile(ok, 90)) if ok.size else None,
        "median_env_steps": float(statistics.median((-(-ok // chunk)).tolist())) if ok.size else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--episodes", type=int, default=1000, help="seeded episodes per split")
    ap.add_argument("--seed", type=int, default=0, help="slot i of a split draws from seed + i")
    ap.add_argument("--max-ticks", type=int, default=160, help="ticks before an episode counts as failed")
    ap.add_argument("--chunk", type=int, default=4, help="ticks per env step, for the length in env steps")
    ap.add_argument("--batch", type=int, default=250, help="episodes simulated together")
    ap.add_argument("--out", type=Path, help="JSON file to write")
    args = ap.parse_args()
    seeds = np.arange(args.episodes, dtype=np.int64) + args.seed
    result: dict = {
        "what": "scripted expert of the MuJoCo push task (flashrt_gym.sims), beside the 2-D tabletop's",
        "command": "python scripts/mujoco_expert.py "
        + f"--episodes {args.episodes} --seed {args.seed} --max-ticks {args.max_ticks} --chunk {args.chunk}",
        "commit": commit(),
        "mujoco": mujoco.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "max_ticks": args.max_ticks,
        "splits": {},
    }
    for split in ("train", "heldout"):
        cfg = TabletopConfig(split=split)
        start = time.perf_counter()
        ep = mujoco_episodes(cfg, seeds, args.max_ticks, args.batch)
        wall = time.perf_counter() - start
        names = [f"{cfg.objects[o]} -> {cfg.goals[g]}" for o, g in cfg.combos("all")]
        per = {}
        for i, n in sorted(Counter(ep["instruction"].tolist()).items()):
            sel = ep["instruction"] == i
            per[names[i]] = summary({k: v[sel] for k, v in ep.items()}, args.chunk) | {"episodes": n}
        result["splits"][split] = {
            "mujoco": summary(ep, args.chunk),
            "tabletop_2d": summary(tabletop_episodes(cfg, seeds, args.max_ticks), args.chunk),
            "mujoco_per_instruction": per,
            "mujoco_failed_seeds": seeds[~ep["success"]].tolist(),
            "cpu_wall_s": round(wall, 1),
        }
        m = result["splits"][split]["mujoco"]
        print(
            f"{split:8s} mujoco: {m['successes']}/{m['episodes']} = {m['success_rate']:.4f}, median "
            f"{m['median_ticks']} ticks ({m['median_env_steps']} env steps); tabletop 2-D: "
            f"{result['splits'][split]['tabletop_2d']['success_rate']:.4f}, median "
            f"{result['splits'][split]['tabletop_2d']['median_ticks']} ticks"
        )
    if args.out:
        atomic_write(args.out, lambda f: f.write((json.dumps(result, indent=1) + "\n").encode()))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
