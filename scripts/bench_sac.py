"""SAC gradient steps per second: stable-baselines3's ``SAC.train`` beside ``GraphSAC`` (the same
update captured as one CUDA graph, replay buffer on the device), in the same run.

Both learners get the env's observation and action spaces (noise mode: 16 actions) and the
same replay contents; networks from the default (3 x 256) to DSRL's (3 x 2048).

    python scripts/bench_sac.py --out bench_sac.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from benchlib import provenance
from stable_baselines3 import SAC
from stable_baselines3.common.logger import configure
from tqdm import tqdm

from flashrt_gym.learners.graph_sac import GraphSAC
from flashrt_gym.sb3 import SB3VecEnv


def steps_per_s(model: SAC, env: SB3VecEnv, steps: int, batch: int) -> float:
    obs = env.reset()
    for _ in range(64):  # replay contents: 64 vector steps of random noise actions
        act = np.random.uniform(-1, 1, (env.num_envs, env.action_space.shape[0])).astype(np.float32)
        nxt, rew, done, infos = env.step(act)
        model.replay_buffer.add(obs, nxt, act, rew, done, infos)
        obs = nxt
    model.set_logger(configure(None, []))
    model.train(gradient_steps=16, batch_size=batch)  # warm-up (and capture, for GraphSAC)
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.train(gradient_steps=steps, batch_size=batch)
    torch.cuda.synchronize()
    return steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--out", type=Path, default=Path("bench_sac.json"))
    args = ap.parse_args()
    env = SB3VecEnv(num_envs=16)
    rows = []
    for width in tqdm(args.widths, desc="widths", unit="width"):
        row: dict[str, float] = {"width": width}
        for name, cls in (("sb3", SAC), ("graph", GraphSAC)):
            kw = {"policy_kwargs": {"net_arch": [width] * 3}, "learning_starts": 0, "seed": 0, "buffer_size": 100_000}
            row[f"{name}_steps_per_s"] = steps_per_s(cls("MlpPolicy", env, **kw), env, args.steps, args.batch)
        row["speedup"] = row["graph_steps_per_s"] / row["sb3_steps_per_s"]
        rows.append(row)
        print(row, flush=True)
    result = {"provenance": provenance(), "batch": args.batch, "rows": rows}
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nSAC gradient steps/s, batch {args.batch} ({result['provenance']['gpu']})")
    print(f"{'width':>6} {'SB3 SAC':>9} {'GraphSAC':>9} {'speed-up':>9}")
    for r in rows:
        print(f"{r['width']:>6} {r['sb3_steps_per_s']:>9.0f} {r['graph_steps_per_s']:>9.0f} {r['speedup']:>8.1f}x")


if __name__ == "__main__":
    main()
