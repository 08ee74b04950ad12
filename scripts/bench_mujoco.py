"""The MuJoCo push task on the GPU: the env step with MuJoCo Warp inside the step graph, beside
the same task on MuJoCo's C library (an external simulator) and the built-in tabletop, in one
run; and the physics tick alone, beside MuJoCo Warp's own step.

Env step, at each ``--sizes`` (default 1, 256, 4096 slots), for each simulator (MuJoCo Warp in
the step's one graph; split around Warp's own graph with the solver's conditional loop,
deterministic and not, the fast one also at a solver bound of 5 iterations instead of 10 (the
loop runs as long as its slowest world: ``scripts/solver_iterations.py``), and with the ticks as
while loops around one recorded step; MuJoCo's C library; the tabletop): an env on the GPU (the
shipped tiny policy, ``max_episode_steps`` 40, noise actions uniform in the box, so episodes end
by time limit or success and slots autoreset inside the steps at their natural times);
``--warmup`` steps (the first one captures the step) then ``--steps`` consecutive ``step_torch``
calls. Reported: the GPU memory the env holds after its capture (torch's allocator and Warp's
memory pool, over what was held before it), sustained chunks/s (the run's wall time over its
steps), mean, p50, p99 and max ms per step (CUDA events between consecutive steps), the slots
reset. The MuJoCo-CPU envs (physics on one CPU thread, on a thread per core, and split over a
worker process per core) run until ``--cpu-budget-s`` seconds have passed. For MuJoCo Warp also:
graph against eager (the largest relative difference of every output and physics value, one step
at a time from a shared capsule, through autoresets, at sizes up to ``--eager-max``; beside it
two eager envs, in lockstep and running freely: MuJoCo Warp does not repeat a run bit for bit
across env instances), the kernels of one replay of the step graph (count, span, the top kernels
by marginal time) and any warning of the runtime's guarded graph (none: the step is one launch
with its body a conditional node).

Physics tick alone, at each size: ``WarpPush.run_ticks`` of one tick (control, load,
``frame_skip`` MuJoCo Warp steps, store, rewards) recorded in a torch CUDA graph, and replayed
from Warp's own graph (``capture="warp"``); MuJoCo Warp's ``step`` x ``frame_skip`` in a Warp
graph with MuJoCo Warp's default options (the solver's conditional loop, no determinism), with
this simulator's (a fixed iteration bound, determinism) and with each of those two alone
(``MJW_OPTIONS``), and at the defaults from the env's own states (:func:`env_states`: the end-effector
among the objects, where ``mjwarp-testspeed`` steps the scene at rest); with ``--testspeed``,
``mjwarp-testspeed`` (MuJoCo Warp's own benchmark) on the scene. With ``--drift``, each MuJoCo
Warp mode's exactness (:func:`drift`): how far a restored run and a fork under equal actions
depart after 1, 10 and 40 chunks. For the split rows also the physics share: Warp's graph of the
step's ticks replayed alone (``physics_ms``, beside ``physics_steps``, to set against
``mjwarp-testspeed``'s time for as many steps).

Each measurement (an env row, its drift, the tick rows of a size, graph against eager, a
``mjwarp-testspeed`` run) runs in a process of its own, sharing Warp's kernel cache: its memory
figures are its own, and one row that runs out of memory or breaks a capture cannot take the
rows after it down (in one process, rows at 4 096 worlds ran out of what earlier rows held).

    python scripts/bench_mujoco.py --testspeed --out $OUT/bench_mujoco.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from benchlib import graph_kernels, provenance, wall_ms
from tqdm import tqdm

from flashrt.runtime import BufferSet, atomic_write
from flashrt_gym import FlashRTVectorEnv
from flashrt_gym.sims import SCENE, MujocoPush, PushConfig, WarpPush, load_scene, mujoco_push
from flashrt_gym.sims.push.mujoco_warp import ITERATIONS, STATE_SIG, state_offsets
from flashrt_gym.sims.push.warp_api import warp_api

MJW_OPTIONS = [  # (row name, a fixed iteration bound, determinism): the simulator's two options apart
    ("defaults", False, False),
    ("fixed_iterations", True, False),
    ("deterministic", False, True),
    ("ours", True, True),
]
SIMULATORS = {
    "mujoco_warp": WarpPush,  # the ticks recorded into the step's one torch graph (fixed iteration bound)
    "mujoco_warp_split": functools.partial(WarpPush, capture="warp"),  # Warp's graph between the two
    "mujoco_warp_split_fast": functools.partial(WarpPush, capture="warp", deterministic=False),
    "mujoco_warp_split_fast_5": functools.partial(WarpPush, capture="warp", deterministic=False, iterations=5),
    "mujoco_warp_split_loop": functools.partial(WarpPush, capture="warp", loop=True),  # one recorded step
    "mujoco_cpu": MujocoPush,  # one CPU thread
    "mujoco_cpu_all_cores": functools.partial(MujocoPush, threads=os.cpu_count() or 1),
    "mujoco_cpu_processes": functools.partial(mujoco_push, processes=os.cpu_count() or 1),  # one process a core
    "tabletop": None,
}


def make_env(kind: str, n: int, graphs: bool = True) -> FlashRTVectorEnv:
    return FlashRTVectorEnv(n, device="cuda", graphs=graphs, simulator=SIMULATORS[kind])


def actions(n: int, k: int, seed: int, dim: int = 16) -> list[torch.Tensor]:
    """``k`` batches of ``n`` agent actions of ``dim`` numbers (the tiny policy's 16 unless
    given), uniform in the noise box [-1, 1]."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.rand(n, dim, device="cuda", generator=g) * 2 - 1 for _ in range(k)]


def sustained(env: FlashRTVectorEnv, steps: int, warmup: int, budget_s: float | None) -> dict:
    """Consecutive steps (after ``warmup``) with autoresets: per-step GPU-side times between
    consecutive steps, and the run's wall time."""
    n, dim = env.num_envs, env.single_action_space.shape[0]
    for a in actions(n, warmup, 0, dim):
        env.step_torch(a)
    acts = actions(n, steps, 1, dim)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
    resets = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    events[0].record()
    done = 0
    for i, a in enumerate(acts):
        *_, info = env.step_torch(a)
        resets.append(info["_final_obs"].sum())
        events[i + 1].record()
        done += 1
        if budget_s is not None and time.perf_counter() - start > budget_s:
            break
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    times = sorted(events[i].elapsed_time(events[i + 1]) for i in range(done))
    return {
        "steps": done,
        "sustained_chunks_per_s": n * done / wall,
        "mean_ms": wall * 1e3 / done,
        "p50_ms": statistics.median(times),
        "p99_ms": times[min(done - 1, round(0.99 * (done - 1)))],
        "max_ms": times[-1],
        "slots_reset": int(torch.stack(resets).sum()),
    }


def step_outputs(env: FlashRTVectorEnv, a: torch.Tensor) -> list[torch.Tensor]:
    obs, r, te, tr, info = env.step_torch(a)
    return [obs, r, te, tr, info["final_obs"], env.engine.bufs["sim.physics"].clone()]


def deviation(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, bool]:
    """The largest difference of the float outputs relative to ``1 + |b|``, and whether every
    flag output is equal."""
    pairs = list(zip(a, b, strict=True))
    floats = [float(((x - y).abs() / (1 + y.abs())).max()) for x, y in pairs if x.dtype.is_floating_point]
    return max(floats), all(torch.equal(x, y) for x, y in pairs if not x.dtype.is_floating_point)


def graph_vs_eager(n: int, steps: int = 5) -> dict:
    """The captured step against the eager one, each step taken from the same boundary (both
    envs restored from the eager env's capsule first), through autoresets; beside it a second
    eager env against the first, in lockstep (MuJoCo Warp's spread from one step) and running
    freely from the same reset (that spread grown by the steps)."""
    kw = {"device": "cuda", "simulator": WarpPush, "max_episode_steps": 2}
    eager, graph = FlashRTVectorEnv(n, graphs=False, **kw), FlashRTVectorEnv(n, **kw)
    again, free = FlashRTVectorEnv(n, graphs=False, **kw), FlashRTVectorEnv(n, graphs=False, **kw)
    for env in (eager, graph, again, free):
        env.reset(seed=5)
    rows = {"graph_lockstep": [], "eager_lockstep": [], "eager_free_running": []}
    for a in actions(n, steps, 7):
        capsule = eager.snapshot()
        graph.restore(capsule)
        again.restore(capsule)
        got = [step_outputs(env, a) for env in (graph, again, free)]
        want = step_outputs(eager, a)
        for key, out in zip(rows, got, strict=True):
            rows[key].append(deviation(out, want))
    torch.cuda.synchronize()
    return {
        key: {"max_rel_dev": max(d for d, _ in devs), "flags_equal": all(f for _, f in devs)}
        for key, devs in rows.items()
    }


DRIFT_AT = (1, 10, 40)
"""Chunks after a restore (or a fork) at which the drift is read."""


def drift(kind: str, n: int) -> dict:
    """What a mode keeps of exactness: a run restored from a capsule against the run that made
    the capsule's continuation, and a fork of slot 0 into every slot under equal actions (slots
    against slot 0), after each of :data:`DRIFT_AT` chunks under the same noise actions (episodes
    end and restart inside them): the largest difference of the physics rows relative to
    ``1 + |row|`` (the solver's warm start included, where it is largest), the largest
    difference of the worlds' positions (``qpos``, table units: what the agent sees parting),
    the share of worlds whose rows differ at all, and whether the episode flags agree."""
    env = make_env(kind, n)
    start = state_offsets(env.engine.sim.mjm)["qpos"]
    qpos = slice(start, start + env.engine.sim.mjm.nq)
    env.reset(seed=9)
    for a in actions(n, 2, 3):
        env.step_torch(a)
    capsule, acts = env.snapshot(), actions(n, max(DRIFT_AT), 4)

    def rows_at() -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for i, a in enumerate(acts, 1):
            _, _, te, tr, _ = env.step_torch(a)
            if i in DRIFT_AT:
                out.append((env.engine.bufs["sim.physics"].clone(), te | tr))
        return out

    first = rows_at()
    env.restore(capsule)
    again = rows_at()
    env.restore(capsule)
    env.fork(0, range(n))
    acts = [a[:1].expand(n, -1).contiguous() for a in acts]
    forked = rows_at()
    torch.cuda.synchronize()

    def parted(x: torch.Tensor, y: torch.Tensor, same_flags: bool) -> dict:
        return {
            "max_rel_dev": float(((x - y).abs() / (1 + y.abs())).max()),
            "max_qpos_dev": float((x[:, qpos] - y[:, qpos]).abs().max()),
            "worlds_differing": float((x != y).any(1).float().mean()),
            "flags_equal": same_flags,
        }

    return {
        "restore": {
            str(c): parted(a[0], b[0], bool(torch.equal(a[1], b[1])))
            for c, a, b in zip(DRIFT_AT, again, first, strict=True)
        },
        "fork_equal_actions": {
            str(c): parted(f[0], f[0][:1].expand_as(f[0]), bool((f[1] == f[1][0]).all()))
            for c, f in zip(DRIFT_AT, forked, strict=True)
        },
    }


def gpu_memory_mb() -> dict[str, float]:
    """GPU memory held now on the current device, MB (2**20 bytes, as bench_env.py): torch's
    caching allocator (graph pools included, so MuJoCo Warp's temporaries inside a torch capture)
    and Warp's memory pool (MuJoCo Warp's own arrays and the buffers Warp keeps for the
    deterministic launches a capture recorded; 0 where Warp is not in use)."""
    wp, device = sys.modules.get("warp"), f"cuda:{torch.cuda.current_device()}"
    pool = wp.get_mempool_used_mem_current(device) if wp is not None and wp.is_mempool_enabled(device) else 0
    return {"torch_reserved": torch.cuda.memory_reserved() / 2**20, "warp_pool": pool / 2**20}


def bench_env(kind: str, n: int, args: argparse.Namespace) -> dict:
    torch.cuda.empty_cache()
    before = gpu_memory_mb()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = time.perf_counter()
        env = make_env(kind, n)
        env.reset(seed=0)
        env.step_torch(actions(n, 1, 9)[0])  # captures the step
        torch.cuda.synchronize()
        first = time.perf_counter() - t
    held = {key: mb - before[key] for key, mb in gpu_memory_mb().items()}
    row = {"first_step_s_with_capture": first, "memory_after_capture_MB": held}
    cpu = kind.startswith("mujoco_cpu")  # physics on the host's CPU: few warm-up steps, a time budget
    row |= sustained(env, args.steps, min(args.warmup, 2) if cpu else args.warmup, args.cpu_budget_s if cpu else None)
    if kind.startswith("mujoco_warp"):
        row["guarded_graph_warnings"] = [str(w.message) for w in caught if "runtime.guarded" in str(w.message)]
        row["program_ms"] = wall_ms(env.engine.replay, args.reps)
        sim, ticks = env.engine.sim, env.engine.cfg.n_action_steps
        if sim.capture == "warp":  # the physics share: Warp's graph of the step's ticks alone
            row["physics_ms"] = wall_ms(functools.partial(sim.physics, ticks), args.reps)
            row["physics_steps"] = ticks * sim.cfg.frame_skip
        row["step_graph_kernels"] = graph_kernels(env.engine.replay, top=30)
        row["flagged_worlds"] = env.engine.sim.overflow()
    del env
    return row


def warp_tick(n: int, capture: str, reps: int) -> float:
    """Median ms of one tick of ``WarpPush.run_ticks``: recorded in a torch graph, or with its
    physics replayed from Warp's own graph."""
    sim = WarpPush(n, capture=capture)
    sim.bind(BufferSet(sim.specs(), n, "cuda"))
    sim.seed(torch.arange(n, device="cuda"))
    sim.reset()
    chunk = torch.zeros(n, 1, 2, device="cuda")
    dense, sparse = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    if capture == "warp":
        return wall_ms(lambda: sim.run_ticks(chunk, dense, sparse), reps)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            sim.run_ticks(chunk, dense, sparse)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        sim.run_ticks(chunk, dense, sparse)
    return wall_ms(graph.replay, reps)


def env_states(n: int, chunks: int = 3, device: str = "cuda") -> torch.Tensor:
    """(n, nstate) float32 physics rows of ``n`` worlds from seeded starts after ``chunks`` chunks
    of 4 ticks under noise actions: states as the env meets them (the end-effector among the
    objects, some pushed), where the scene's initial state (what ``mjwarp-testspeed`` steps) has
    every object at rest and the end-effector clear of them."""
    sim = WarpPush(n)
    sim.bind(BufferSet(sim.specs(), n, device))
    sim.seed(torch.arange(n, device=device))
    sim.reset()
    dense, sparse = torch.zeros(n, device=device), torch.zeros(n, device=device)
    g = torch.Generator(device=device).manual_seed(5)
    for _ in range(chunks):
        sim.run_ticks(torch.rand(n, 4, 2, device=device, generator=g) * 2 - 1, dense, sparse)
    return sim.state.physics.clone()


def mjw_steps(
    n: int, frame_skip: int, fixed_iterations: bool, deterministic: bool, reps: int, start: torch.Tensor | None = None
) -> float:
    """Median ms of MuJoCo Warp's own ``step`` x ``frame_skip`` in a Warp graph, from the scene's
    initial state (or the rows ``start``, :func:`env_states`), under MuJoCo Warp's default options
    but for the two this simulator sets: ``fixed_iterations`` (at most ``ITERATIONS`` solver
    iterations, run as a fixed loop instead of the solver's conditional node) and
    ``deterministic`` (every determinism feature)."""
    k = warp_api()
    mjm, _ = load_scene(PushConfig())
    if fixed_iterations:
        mjm.opt.iterations = min(mjm.opt.iterations, ITERATIONS)
    m = k.mjw.put_model(mjm)
    if fixed_iterations:
        m.opt.graph_conditional = False
    if deterministic:
        m.opt.deterministic = int(k.mjw.DeterminismType.ALL)
    d = k.mjw.make_data(mjm, nworld=n, nconmax=32, njmax=160)
    if start is not None:
        k.mjw.set_state(m, d, k.wp.from_torch(start), STATE_SIG)
    for _ in range(frame_skip):  # load the modules
        k.mjw.step(m, d)
    with k.wp.ScopedCapture() as cap:
        for _ in range(frame_skip):
            k.mjw.step(m, d)
    return wall_ms(lambda: k.wp.capture_launch(cap.graph), reps)


def testspeed(n: int, nstep: int) -> dict:
    cmd = [sys.executable, "-m", "mujoco_warp.testspeed", str(SCENE), f"--nworld={n}", f"--nstep={nstep}"]
    cmd.append("--format=json")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    out: dict = {"command": " ".join(cmd[1:]), "returncode": run.returncode}
    if lines:
        out["metrics"] = json.loads(lines[-1])
    else:
        out["stderr_tail"] = run.stderr[-2000:]
    return out


def measure(item: str, n: int, args: argparse.Namespace) -> dict:
    """One measurement of ``item`` at ``n`` worlds, in this process (``--one``)."""
    frame_skip = PushConfig().frame_skip
    if item == "graph_vs_eager":
        return graph_vs_eager(n)
    if item.startswith("env:"):
        return bench_env(item.removeprefix("env:"), n, args)
    if item.startswith("drift:"):
        return drift(item.removeprefix("drift:"), n)
    if item == "tick":
        return {
            "tick_torch_graph_ms": warp_tick(n, "torch", args.reps),
            "tick_warp_graph_ms": warp_tick(n, "warp", args.reps),
            **{
                f"mjw_step_x{frame_skip}_{name}_ms": mjw_steps(n, frame_skip, fixed, det, args.reps)
                for name, fixed, det in MJW_OPTIONS
            },
            # MuJoCo Warp's defaults from the env's own states: the physics share's denominator
            f"mjw_step_x{frame_skip}_defaults_env_states_ms": mjw_steps(
                n, frame_skip, False, False, args.reps, env_states(n)
            ),
        }
    if item == "testspeed":
        return testspeed(n, args.nstep)
    raise ValueError(f"unknown measurement {item!r}")


def isolated(item: str, n: int, args: argparse.Namespace, errors: list[str]) -> dict:
    """``measure(item, n)`` in a process of its own: its memory is its own (a row cannot run out
    of what an earlier one holds), and a failed capture cannot poison the next row's CUDA state.
    Warp's kernel cache (``WARP_CACHE_PATH`` or its default folder) is shared, so each module
    compiles once. A failure is recorded (and counted in ``errors``) and the run goes on."""
    cmd = [sys.executable, __file__, "--one", item, "--sizes", str(n), "--steps", str(args.steps)]
    cmd += ["--warmup", str(args.warmup), "--cpu-budget-s", str(args.cpu_budget_s), "--reps", str(args.reps)]
    cmd += ["--nstep", str(args.nstep)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.row_timeout_s)
    except subprocess.TimeoutExpired:
        run = None
    lines = [line for line in (run.stdout if run else "").splitlines() if line.startswith(ROW_TAG)]
    if run is not None and run.returncode == 0 and lines:
        return json.loads(lines[-1].removeprefix(ROW_TAG))
    why = f"timed out after {args.row_timeout_s} s" if run is None else f"exit {run.returncode}: " + run.stderr[-1500:]
    errors.append(f"{n} {item}: {why}")
    print(f"{n} {item} failed: {why}", flush=True)
    return {"error": why}


ROW_TAG = "ROW "
"""What starts the result line of a ``--one`` process."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 256, 4096])
    ap.add_argument("--simulators", nargs="+", default=list(SIMULATORS), choices=list(SIMULATORS))
    ap.add_argument("--steps", type=int, default=120, help="timed consecutive steps (3 episode lengths)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--cpu-budget-s", type=float, default=60.0, help="wall seconds of MuJoCo-CPU steps per size")
    ap.add_argument("--eager-max", type=int, default=256, help="largest size where graph and eager are compared")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--testspeed", action="store_true", help="also run mjwarp-testspeed on the scene")
    ap.add_argument("--drift", action="store_true", help="also measure each MuJoCo Warp mode's restore and fork drift")
    ap.add_argument("--nstep", type=int, default=1000, help="steps of each mjwarp-testspeed run")
    ap.add_argument("--row-timeout-s", type=int, default=900, help="a measurement's process is stopped after this")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: one measurement, in this process
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "bench_mujoco.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mujoco.py measures the GPU env: run it on a machine with a CUDA GPU")
    k = warp_api()
    k.wp.config.quiet = True  # Warp's per-module load lines would bury the results
    if args.one is not None:
        print(ROW_TAG + json.dumps(measure(args.one, args.sizes[0], args)), flush=True)
        return
    result: dict = {
        **provenance(),
        "warp": k.wp.__version__,
        "mujoco_warp": getattr(k.mjw, "__version__", "unknown"),
        "args": vars(args) | {"out": str(args.out)},
        "frame_skip": PushConfig().frame_skip,
        "env": [],
        "tick": [],
    }

    def save() -> None:
        atomic_write(args.out, lambda f: f.write((json.dumps(result, indent=1) + "\n").encode()))

    errors: list[str] = []
    for n in tqdm(args.sizes, desc="world counts", unit="size"):
        row: dict = {"num_envs": n}
        result["env"].append(row)
        if "mujoco_warp" in args.simulators and n <= args.eager_max:
            row["mujoco_warp_graph_vs_eager"] = isolated("graph_vs_eager", n, args, errors)
        for kind in args.simulators:
            row[kind] = isolated(f"env:{kind}", n, args, errors)
            if kind.startswith("mujoco_warp") and args.drift:
                row[kind]["drift"] = isolated(f"drift:{kind}", n, args, errors)
            print(n, kind, json.dumps({k: v for k, v in row[kind].items() if k != "step_graph_kernels"}), flush=True)
            result["errors"] = errors
            save()
        tick = {"worlds": n, **isolated("tick", n, args, errors)}
        if args.testspeed:
            tick["mjwarp_testspeed"] = isolated("testspeed", n, args, errors)
        print(n, "tick", json.dumps({k: v for k, v in tick.items() if k != "mjwarp_testspeed"}), flush=True)
        result["tick"].append(tick)
        result["errors"] = errors
        save()
    print(f"wrote {args.out}" + (f"; {len(errors)} rows failed (their errors are in the JSON)" if errors else ""))
    if errors:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
