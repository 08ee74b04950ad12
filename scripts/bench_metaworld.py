"""Meta-World MT10 on the CPU: the simulator alone and the env around it, sustained.

Rows, at each ``--sizes`` (default 1 and 64 slots; slot i runs MT10 task i % 10), each
``--threads`` (CPU threads that step the slots' physics; default 1 and 2) and each ``--processes``
(worker processes that split the slots, each with that many threads; default 1; counts above the
slots are skipped):

- ``sim``: :class:`~flashrt_gym.sims.MetaWorld` alone, chunks of 4 Meta-World steps under
  uniform random actions, a slot reset (Meta-World's ``reset``) when it succeeds or after 50
  chunks (the ids' episode length); each chunk also takes every slot's state row
  (``get_state``), as the env's hand-off does. Sustained chunks/s over the run's wall time,
  p50 / p99 / max ms a chunk, and with ``--processes`` > 1 the simulator's host memory
  (``host_MB``: its fresh worker processes' whole resident memory; the difference between two
  sizes is what the slots take).
- ``render``: the camera's frames/s (``render()`` of every slot, one thread), at 64 px, and the
  host memory its renderers took (one a task: ten for MT10).
- ``env``: ``FlashRTVectorEnv`` through the public ``step()`` with noise actions uniform in the
  box (``max_episode_steps`` 50, so slots autoreset at their natural times), on ``--device``:
  eager on the CPU, or the policy's captured graphs on a GPU with the physics on the CPU threads
  (the GPU machine's setting). The policy is ``--weights`` (a Meta-World policy: 4-D actions and
  proprioception), by default the shipped MT10 policy. Where the step's time goes: each host
  method's ms and calls a step (``host_ms_per_step``, ``host_calls_per_step``: the physics, the
  frames, the state rows, the resets) and the rest (``outside_host_ms_per_step``: the policy's
  graphs, the copies to and from the device, Python).

With ``--frames PATH``, a PNG of the camera's first frame of each MT10 task (the policy's
resolution, each pixel drawn 3x3) is written there too.

Each row runs ``--steps`` steps after ``--warmup``, or until ``--budget-s`` seconds have passed.
The machine's load average before and after each row is written beside it: on a shared machine
the figures are lower bounds.

    python scripts/bench_metaworld.py --out docs/bench/bench_metaworld_<commit>.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from benchlib import commit, cpu_model, rss_mb

from flashrt.runtime import atomic_write
from flashrt_gym import FlashRTVectorEnv
from flashrt_gym.sims import MetaWorld, metaworld
from flashrt_gym.sims.metaworld_tasks import EPISODE_STEPS
from flashrt_gym.simulator import ExternalSimulator, protocol_members


def timed(step, steps: int, warmup: int, budget_s: float, slots: int) -> dict:
    """``step()`` ``warmup`` times, then until ``steps`` or ``budget_s``: sustained rates."""
    for _ in range(warmup):
        step()
    times = []
    start = time.perf_counter()
    while len(times) < steps and time.perf_counter() - start < budget_s:
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    times.sort()
    return {
        "steps": len(times),
        "sustained_chunks_per_s": slots * len(times) / wall,
        "mean_ms": wall * 1e3 / len(times),
        "p50_ms": statistics.median(times) * 1e3,
        "p99_ms": times[min(len(times) - 1, round(0.99 * (len(times) - 1)))] * 1e3,
        "max_ms": times[-1] * 1e3,
    }


def bench_sim(n: int, threads: int, processes: int, args: argparse.Namespace) -> dict:
    t = time.perf_counter()
    sim = metaworld(n, "MT10", threads=threads, processes=processes)
    built = time.perf_counter() - t
    sim.seed(np.arange(n))
    sim.reset()
    rng = np.random.default_rng(0)
    chunks = np.zeros(n, dtype=np.int64)
    resets = [0]

    def step() -> None:
        sim.run_ticks(rng.uniform(-1, 1, (n, 4, 4)))
        sim.get_state()
        chunks[:] += 1
        done = sim.success() | (chunks >= EPISODE_STEPS)
        if done.any():
            sim.reset(done)
            chunks[done] = 0
            resets[0] += int(done.sum())

    row = {"build_s": built} | timed(step, args.steps, args.warmup, args.budget_s, n)
    # the simulator's host memory: its fresh worker processes' whole resident sets (in this process
    # what a row adds depends on the rows before it, whose freed memory it reuses)
    row["host_MB"] = sum(rss_mb(pid) for pid in sim.pids) if processes > 1 else None
    if processes > 1:
        sim.close()
    return row | {"slots_reset": resets[0]}


def bench_render(n: int, args: argparse.Namespace) -> dict:
    sim = MetaWorld(n, "MT10")
    sim.seed(np.arange(n))
    sim.reset()
    before = rss_mb()
    t = time.perf_counter()
    sim.render()  # makes the renderers (an OpenGL context and the textures per task)
    first = time.perf_counter() - t
    made = rss_mb() - before  # the renderers' (all of it under a CPU OpenGL); 0 where a row before made them
    row = timed(sim.render, args.steps, 1, args.budget_s, n)
    return {"first_render_s": first, "renderers_host_MB": made} | {
        "frames_per_s": row["sustained_chunks_per_s"],
        "ms_per_call": row["mean_ms"],
    }


def bench_env(n: int, threads: int, processes: int, weights: str | None, args: argparse.Namespace) -> dict:
    t = time.perf_counter()
    simulator = functools.partial(metaworld, tasks="MT10", threads=threads, processes=processes)
    env = FlashRTVectorEnv(n, simulator=simulator, weights=weights, device=args.device, max_episode_steps=EPISODE_STEPS)
    env.reset(seed=0)
    built = time.perf_counter() - t
    rng = np.random.default_rng(0)
    finished, calls = [0], [0]
    shape = env.action_space.shape
    host_s, host_calls = time_host_calls(env.engine.mirror.host)

    def step() -> None:
        if calls[0] == args.warmup:  # the timed steps' host calls only
            host_s.clear()
            host_calls.clear()
        calls[0] += 1
        *_, terminated, truncated, _ = env.step(rng.uniform(-1, 1, shape).astype(np.float32))
        finished[0] += int((terminated | truncated).sum())

    row = {"build_and_reset_s": built} | timed(step, args.steps, args.warmup, args.budget_s, n)
    env.close()
    steps = row["steps"]
    host_ms = {k: v * 1e3 / steps for k, v in sorted(host_s.items(), key=lambda kv: -kv[1])}
    return row | {
        "episodes_finished": finished[0],
        "host_ms_per_step": host_ms,
        "host_calls_per_step": {k: host_calls[k] / steps for k in host_ms},
        "outside_host_ms_per_step": row["mean_ms"] - sum(host_ms.values()),
    }


def time_host_calls(host: object) -> tuple[dict[str, float], dict[str, int]]:
    """Wrap the external simulator's methods on ``host`` (the env's, in place) with timers: where
    an env step's time goes on the host, by method; the rest of the step (``outside_host``) is
    the policy's graphs, the copies to and from the device and Python.

    Returns:
        (seconds, calls) by method name, filled as the env steps.
    """
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    _, methods = protocol_members(ExternalSimulator)
    for name in methods:
        method = getattr(host, name)

        def timed_call(*a: object, _method: Callable = method, _name: str = name, **k: object) -> object:
            t = time.perf_counter()
            try:
                return _method(*a, **k)
            finally:
                seconds[_name] += time.perf_counter() - t
                calls[_name] += 1

        setattr(host, name, timed_call)
    return seconds, calls


def save_frames(path: Path, size: int) -> None:
    """The first frame of one episode of each MT10 task side by side, each pixel 3x3, as a PNG."""
    from matplotlib.image import imsave

    sim = MetaWorld(10, "MT10", image_size=size)
    sim.seed(np.arange(10))
    sim.reset()
    strip = np.concatenate(list(sim.render()[:, 0]), axis=1).repeat(3, axis=0).repeat(3, axis=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    imsave(path, strip)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--processes", type=int, nargs="+", default=[1])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=60.0)
    ap.add_argument("--rows", nargs="+", default=["sim", "render", "env"], choices=["sim", "render", "env"])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "bench_metaworld.json")
    ap.add_argument("--frames", type=Path, default=None, help="write the MT10 tasks' first frames here (PNG)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the env's policy runs")
    ap.add_argument("--weights", default=None, help="a Meta-World policy's folder (default: the shipped MT10 one)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here; run the env rows on the CPU (--device cpu)")
    if args.frames is not None:
        save_frames(args.frames, 64)
    result: dict = {
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "commit": commit(),
            "mujoco_gl": os.environ.get("MUJOCO_GL"),
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": [],
    }

    def record(kind: str, n: int, threads: int | None, processes: int, fn, *a) -> None:
        load = os.getloadavg()
        row = {"row": kind, "slots": n, "threads": threads, "processes": processes, "load_before": load} | fn(*a)
        row["load_after"] = os.getloadavg()
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        atomic_write(args.out, lambda f: f.write((json.dumps(result, indent=1) + "\n").encode()))

    for n in args.sizes:
        if "render" in args.rows:
            record("render", n, 1, 1, bench_render, n, args)
        for processes in (p for p in args.processes if p <= n):
            for threads in args.threads:
                if "sim" in args.rows:
                    record("sim", n, threads, processes, bench_sim, n, threads, processes, args)
                if "env" in args.rows:
                    record("env", n, threads, processes, bench_env, n, threads, processes, args.weights, args)


if __name__ == "__main__":
    main()
