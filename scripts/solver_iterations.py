"""The constraint solver's iterations on the MuJoCo Warp push task, and what its loop runs per step.

The fast step (``capture="warp"``) runs MuJoCo Warp's solver as a conditional while loop that
repeats until every world has converged or stopped at the bound (``iterations``): each physics
step costs as many loop iterations as its slowest world needs, however few the others need. This
script runs :class:`~flashrt_gym.sims.WarpPush` on Warp's CPU device (MuJoCo Warp's float32
kernels; without a conditional node the loop runs to the bound there, and a converged world
skips the rest, so each world's count is the one the GPU loop would see) over episodes of the
scripted pusher with Gaussian action noise, resetting a world after it succeeds or after
``--chunks-per-episode`` chunks, and records every world's count at every physics step
(``solver_niter``). For each solver setting it reports the counts' percentiles, the share that
stopped at the bound, and the loop's expected length at ``B`` worlds: the expected maximum of
``B`` independent draws from the counts (worlds are desynchronised by their resets, so draws at
one step are taken as independent).

What a setting costs in physics is measured teacher-forced: the reference setting's run stores
its rows and actions at every ``--every``-th tick, and each setting takes one tick from those
rows; the worlds' largest position difference against the reference setting's own tick is
reported (the reference: MuJoCo Warp's bound of 100 iterations at its float32 tolerance 1e-6),
beside the noisy pusher's success rate over the setting's own episodes. The reference forced from
its own records gives 0: the rows (and the worlds frozen by success) are all a tick reads, and
Warp's CPU device repeats a run bit for bit.

    python scripts/solver_iterations.py --out docs/bench/solver_iterations_<commit>.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from benchlib import provenance

from flashrt import runtime
from flashrt_gym.sims import WarpPush
from flashrt_gym.sims.push.mujoco_warp import state_offsets
from flashrt_gym.sims.push.warp_api import warp_api

SETTINGS = {  # name: (iterations, tolerance)
    "reference: 100 iterations, tolerance 1e-6": (100, 1e-6),
    "the env's: 10 iterations, tolerance 1e-6": (10, 1e-6),
    "10 iterations, tolerance 1e-5": (10, 1e-5),
    "10 iterations, tolerance 1e-4": (10, 1e-4),
    "5 iterations, tolerance 1e-6": (5, 1e-6),
    "3 iterations, tolerance 1e-6": (3, 1e-6),
}
"""The solver settings compared. MuJoCo Warp raises any tolerance below 1e-6 to 1e-6 (float32)."""


def expected_max(counts: np.ndarray, worlds: int) -> float:
    """The expected maximum of ``worlds`` independent draws from the empirical distribution of
    ``counts`` (non-negative integers): ``sum over k >= 1 of P(max >= k) = 1 - F(k - 1) ** worlds``.

    Args:
        counts: observed iteration counts.
        worlds: draws (worlds stepping together).

    Returns:
        The expected maximum.
    """
    top = int(counts.max())
    cdf = np.array([(counts <= k).mean() for k in range(top)])  # F(0) .. F(top - 1)
    return float(np.sum(1.0 - cdf**worlds))


def make_sim(worlds: int, iterations: int, tolerance: float) -> tuple[WarpPush, runtime.BufferSet]:
    """A :class:`WarpPush` of ``worlds`` worlds on Warp's CPU device at one solver setting."""
    sim = WarpPush(worlds, iterations=iterations, deterministic=False)
    sim.mjm.opt.tolerance = tolerance
    bufs = runtime.BufferSet(sim.specs(), worlds, torch.device("cpu"))
    sim.bind(bufs)
    return sim, bufs


def forced_error(sim: WarpPush, bufs: runtime.BufferSet, records: list) -> list[float]:
    """One tick of ``sim`` from each record's rows under its actions: the worlds' largest
    position difference against the record's own next rows, a record each."""
    start = state_offsets(sim.mjm)["qpos"]
    q = slice(start, start + sim.mjm.nq)
    dense, sparse = torch.zeros(sim.num_slots), torch.zeros(sim.num_slots)
    worst = []
    for before, frozen, act, after in records:
        bufs["sim.physics"].copy_(before)
        bufs["sim.success"].copy_(frozen)  # worlds that had succeeded stay as they were
        sim.run_ticks(act, dense, sparse)
        worst.append(float((bufs["sim.physics"][:, q] - after[:, q]).abs().max()))
    return worst


def run_setting(args: argparse.Namespace, iterations: int, tolerance: float, records: list) -> dict:
    """One setting's episodes, then its ticks from the reference's records; its row. With no
    ``records`` yet (the reference), its own run fills them first."""
    sim, bufs = make_sim(args.worlds, iterations, tolerance)
    mjw = warp_api().mjw
    real_step, counts = mjw.step, []

    def counting_step(m, d) -> None:
        real_step(m, d)
        if d is sim.d:
            counts.append(d.solver_niter.numpy().copy())

    recording = not records
    rng = np.random.default_rng(args.seed)
    sim.seed(torch.arange(args.worlds, dtype=torch.int64) + args.seed)
    sim.reset()
    dense, sparse = torch.zeros(args.worlds), torch.zeros(args.worlds)
    chunks = torch.zeros(args.worlds, dtype=torch.int64)
    episodes = successes = 0
    start = time.perf_counter()
    mjw.step = counting_step
    try:
        for chunk in range(args.chunks):
            for tick in range(args.ticks_per_chunk):
                noisy = sim.expert().numpy() + rng.normal(0.0, args.noise, (args.worlds, 2))
                act = torch.from_numpy(noisy).float().clamp(-1, 1)[:, None]
                before, frozen = bufs["sim.physics"].clone(), bufs["sim.success"].clone()
                sim.run_ticks(act, dense, sparse)
                if recording and (chunk * args.ticks_per_chunk + tick) % args.every == 0:
                    records.append((before, frozen, act, bufs["sim.physics"].clone()))
            chunks += 1
            done = bufs["sim.success"] | (chunks >= args.chunks_per_episode)
            episodes += int(done.sum())
            successes += int(bufs["sim.success"].sum())
            if done.any():
                sim.reset(done)
                chunks[done] = 0
    finally:
        mjw.step = real_step
    seconds = time.perf_counter() - start
    niter = np.concatenate(counts)
    worst = forced_error(sim, bufs, records)
    return {
        "iterations": iterations,
        "tolerance": tolerance,
        "physics_steps": len(counts),
        "world_steps": int(niter.size),
        "seconds": seconds,
        "episodes": episodes,
        "pusher_success": successes / max(episodes, 1),
        "mean": float(niter.mean()),
        "p50": float(np.percentile(niter, 50)),
        "p90": float(np.percentile(niter, 90)),
        "p99": float(np.percentile(niter, 99)),
        "max": int(niter.max()),
        "at_bound": float((niter >= iterations).mean()),
        "loop_expected": {str(b): expected_max(niter, b) for b in args.batch_worlds},
        "loop_observed": float(np.stack(counts).max(axis=1).mean()),
        "forced_ticks": len(worst),
        "forced_qpos_max": max(worst),
        "forced_qpos_p50": float(np.median(worst)),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=120, help="chunks each setting runs (3 episode lengths)")
    ap.add_argument("--ticks-per-chunk", type=int, default=4)
    ap.add_argument("--chunks-per-episode", type=int, default=40)
    ap.add_argument("--noise", type=float, default=0.3, help="std of the Gaussian noise on the pusher's actions")
    ap.add_argument("--every", type=int, default=7, help="teacher-forcing records: every this many ticks")
    ap.add_argument("--batch-worlds", type=int, nargs="+", default=[1, 64, 256, 2048, 4096])
    ap.add_argument("--seed", type=int, default=9_000_000, help="the worlds' seeds start here (no split's starts)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "solver_iterations.json")
    args = ap.parse_args(argv)
    rows: dict[str, dict] = {}
    records: list = []  # filled by the first setting, the reference
    for name, (iterations, tolerance) in SETTINGS.items():
        rows[name] = row = run_setting(args, iterations, tolerance, records)
        print(
            f"{name}: mean {row['mean']:.2f}, p99 {row['p99']:.0f}, at bound {row['at_bound']:.3f}, "
            f"loop at 4096 {row['loop_expected'].get('4096', float('nan')):.2f}, "
            f"forced qpos max {row['forced_qpos_max']:.2e}, pusher success {row['pusher_success']:.3f}",
            flush=True,
        )
    versions = {"warp": warp_api().wp.__version__, "mujoco_warp": warp_api().mjw.__version__}
    result = {**provenance(), **versions, "args": {k: str(v) for k, v in vars(args).items()}, "settings": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runtime.atomic_write(args.out, lambda f: f.write(json.dumps(result, indent=1).encode()))
    return result


if __name__ == "__main__":
    main()
