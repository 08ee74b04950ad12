"""The MuJoCo push task on MuJoCo Warp (GPU): eager == graph, and what a tick costs.

For each world count (default 1, 256, 4096) it builds :class:`flashrt_gym.sims.mujoco_warp.WarpPush`
twice (eager launches, and Warp's captured graph), starts both from the same seeds and checks
that three chunks of noisy-expert actions leave every byte of the slot buffers and the rewards
equal. Then it times, on the graph instance (median wall time of a synchronised call):

- ``tick_ms``: ``run_ticks`` of one tick (``frame_skip`` physics steps, control, load/store of
  the state rows, rewards), with its torch parts eager;
- ``physics_ms``: the Warp graph of that tick alone;
- ``mjw_step_ms``: MuJoCo Warp's own step, ``frame_skip`` times, captured in a Warp graph on
  the same model and worlds (the floor a tick adds to);
- ``chunk_ms``: ``run_ticks`` of 4 ticks (one env step's worth);
- ``sustained_chunk_ms``: the mean, p50, p99 and max over 200 consecutive chunks of the expert
  with finished slots reset between chunks (autoresets at their natural times);
- ``render_ms`` / ``render_graph_ms``: the 64x64 top-down render of every world, eager and as a
  torch CUDA graph (checked byte-equal to eager).

With ``--testspeed`` it also runs ``mjwarp-testspeed`` (MuJoCo Warp's own benchmark) on the
scene at each world count and stores its JSON. Writes JSON to ``--out`` (default
``$OUT/bench_mujoco_warp.json``)::

    python scripts/bench_mujoco_warp.py --testspeed --out $OUT/bench_mujoco_warp.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch
from benchlib import commit, wall_ms

from flashrt.runtime import BufferSet, atomic_write
from flashrt_gym.sims import SCENE
from flashrt_gym.sims.mujoco_warp import WarpPush, warp_api


def start(sim: WarpPush, seed: int = 0) -> BufferSet:
    b = BufferSet(sim.specs(), sim.num_slots, sim.device)
    sim.seed(b, torch.arange(sim.num_slots, device=sim.device) + seed)
    sim.reset(b)
    return b


def noisy(sim: WarpPush, b: BufferSet, g: torch.Generator, ticks: int) -> torch.Tensor:
    """The expert's action held over ``ticks`` plus seeded noise, clipped."""
    noise = torch.randn(sim.num_slots, ticks, 2, generator=g, device=sim.device) * 0.3
    return (sim.expert(b)[:, None] + noise).clamp(-1, 1)


def identity(n: int) -> dict:
    eager, graph = WarpPush(n, graph=False), WarpPush(n, graph=True)
    b1, b2 = start(eager), start(graph)
    ok = torch.equal(b1.slot_arena, b2.slot_arena)
    g = torch.Generator(device=eager.device).manual_seed(1)
    for _ in range(3):
        a = noisy(eager, b1, g, 4)
        r1, r2 = eager.run_ticks(b1, a), graph.run_ticks(b2, a)
        ok &= torch.equal(b1.slot_arena, b2.slot_arena) and all(torch.equal(x, y) for x, y in zip(r1, r2, strict=True))
    return {"eager_equals_graph": bool(ok), "overflow_worlds": graph.overflow()}


def timings(n: int, reps: int) -> dict:
    k = warp_api()
    sim = WarpPush(n, graph=True)
    b = start(sim)
    g = torch.Generator(device=sim.device).manual_seed(2)
    one, four = noisy(sim, b, g, 1), noisy(sim, b, g, 4)
    out: dict = {"worlds": n, "frame_skip": sim.cfg.frame_skip}
    out["tick_ms"] = wall_ms(lambda: sim.run_ticks(b, one), reps)
    sim.ticks_begin(b, one)
    out["physics_ms"] = wall_ms(lambda: sim.ticks_physics(1), reps)
    stream = k.wp.stream_from_torch(torch.cuda.current_stream())
    with k.wp.ScopedDevice(sim.wp_device), k.wp.ScopedStream(stream):
        for _ in range(sim.cfg.frame_skip):  # load the modules before capture
            k.mjw.step(sim.m, sim.d)
        with k.wp.ScopedCapture(stream=stream) as cap:
            for _ in range(sim.cfg.frame_skip):
                k.mjw.step(sim.m, sim.d)
    out["mjw_step_ms"] = wall_ms(lambda: k.wp.capture_launch(cap.graph, stream=stream), reps)
    out["chunk_ms"] = wall_ms(lambda: sim.run_ticks(b, four), reps)

    b = start(sim, seed=10_000)
    times = []
    for _ in range(200):
        a = noisy(sim, b, g, 4)
        torch.cuda.synchronize()
        t = time.perf_counter()
        sim.run_ticks(b, a)
        sim.reset(b, b["sim.success"] | (b["sim.tick"] >= 160))
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    out["sustained_chunk_ms"] = {
        "mean": statistics.fmean(times),
        "p50": times[len(times) // 2],
        "p99": times[int(0.99 * (len(times) - 1))],
        "max": times[-1],
    }
    out["sustained_ticks_per_s"] = 4 * n / (out["sustained_chunk_ms"]["mean"] / 1e3)

    img = torch.empty(n, sim.image_size, sim.image_size, 3, dtype=torch.uint8, device=sim.device)
    out["render_ms"] = wall_ms(lambda: sim.render(b, out=img), reps)
    want = img.clone()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sim.render(b, out=img)  # warm-up on the side stream, as torch's capture recipe asks
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        sim.render(b, out=img)
    img.zero_()
    graph.replay()
    torch.cuda.synchronize()
    out["render_graph_equals_eager"] = bool(torch.equal(img, want))
    out["render_graph_ms"] = wall_ms(graph.replay, reps)
    out["overflow_worlds"] = sim.overflow()
    return out


def testspeed(n: int, nstep: int) -> dict:
    exe = shutil.which("mjwarp-testspeed")
    if exe is None:
        return {"error": "mjwarp-testspeed not on PATH"}
    cmd = [exe, str(SCENE), f"--nworld={n}", f"--nstep={nstep}", "--format=json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    result: dict = {"command": " ".join(cmd[1:]), "returncode": run.returncode}
    if lines:
        result["metrics"] = json.loads(lines[-1])
    else:
        result["stderr_tail"] = run.stderr[-2000:]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 256, 4096])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--testspeed", action="store_true", help="also run mjwarp-testspeed on the scene")
    ap.add_argument("--nstep", type=int, default=1000, help="steps of each mjwarp-testspeed run")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "bench_mujoco_warp.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mujoco_warp needs a CUDA GPU")
    k = warp_api()
    result: dict = {
        "what": "MuJoCo push task on MuJoCo Warp: eager == graph, tick / chunk / render times",
        "command": "python scripts/bench_mujoco_warp.py "
        + f"--worlds {' '.join(map(str, args.worlds))} --reps {args.reps}"
        + (f" --testspeed --nstep {args.nstep}" if args.testspeed else ""),
        "commit": commit(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "warp": k.wp.__version__,
        "mujoco_warp": getattr(k.mjw, "__version__", "unknown"),
        "python": platform.python_version(),
        "runs": [],
    }
    for n in args.worlds:
        run = {"worlds": n, **identity(n), **timings(n, args.reps)}
        if args.testspeed:
            run["mjwarp_testspeed"] = testspeed(n, args.nstep)
        result["runs"].append(run)
        print(
            f"{n:5d} worlds: eager==graph {run['eager_equals_graph']}, tick {run['tick_ms']:.3f} ms "
            f"(physics {run['physics_ms']:.3f}, mjw step x{run['frame_skip']} {run['mjw_step_ms']:.3f}), "
            f"chunk {run['chunk_ms']:.3f} ms, sustained {run['sustained_chunk_ms']['mean']:.3f} ms, "
            f"render {run['render_ms']:.3f} / graph {run['render_graph_ms']:.3f} ms",
            flush=True,
        )
        atomic_write(args.out, lambda tmp: Path(tmp).write_text(json.dumps(result, indent=1) + "\n"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
