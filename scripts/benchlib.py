"""What the benchmark scripts share: the two timers (CUDA events per call for copies measured
in microseconds, wall clock around a synchronised call for whole steps), the kernel count of a
step, where its time goes (eager, and inside a graph replay), the GPU's measured rates that
floors are computed from, and the provenance every result file records (GPU, CPU, torch,
Python, commit)."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch


def cuda_time(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median wall time of ``fn`` in microseconds, by CUDA events, one event pair per call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def wall_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median wall time of one synchronous call (launch to completion on the GPU), in ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _gpu_events(fn: Callable[[], object]) -> list:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def count_kernels(fn: Callable[[], object]) -> int:
    """GPU activities (kernels, memcpys, memsets) one eager call of ``fn`` launches: the node
    count of the graph that records it."""
    return len(_gpu_events(fn))


def top_kernels(fn: Callable[[], object], top: int = 10) -> list[dict]:
    """Where one eager call of ``fn`` spends GPU time: kernels by name, largest total first."""
    agg: dict[str, list[float]] = {}
    for e in _gpu_events(fn):
        row = agg.setdefault(e.name[:80], [0.0, 0])
        row[0] += e.time_range.elapsed_us()
        row[1] += 1
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"kernel": k, "total_us": round(v[0], 1), "calls": int(v[1])} for k, v in rows]


def graph_kernels(replay: Callable[[], object], top: int = 10) -> dict:
    """Where one replay of a captured graph spends its time. Kernels launched dependent start
    before the kernel ahead of them ends, so their durations add up to more than the replay;
    each is charged its marginal time instead, its end minus the latest end before it (the
    marginal times add up to the replay's span). Kernels by name, largest marginal total first;
    beside them the GPU's idle time (no kernel running) summed by the pair of kernels around it,
    largest first, to tell a slow kernel from a wait before it. The profiler records only the
    first iteration of a conditional while node's body (pytorch/kineto#1062), so a graph with
    one (MuJoCo Warp's solver loop) shows its later iterations as idle time, not as kernels."""
    return replay_time(_gpu_events(replay), top)


def replay_time(events: list, top: int = 10) -> dict:
    """:func:`graph_kernels` over profiler events (``name``, ``time_range.start`` / ``.end`` /
    ``.elapsed_us()``, in µs), given in any order."""
    events = sorted(events, key=lambda e: e.time_range.start)
    agg: dict[str, list[float]] = {}
    idle: dict[tuple[str, str], list[float]] = {}
    last_end, last_name = events[0].time_range.start, ""
    for e in events:
        name = e.name[:80]
        row = agg.setdefault(name, [0.0, 0.0, 0])
        row[0] += max(0.0, e.time_range.end - last_end)
        row[1] += e.time_range.elapsed_us()
        row[2] += 1
        if e.time_range.start > last_end:
            gap = idle.setdefault((last_name, name), [0.0, 0])
            gap[0] += e.time_range.start - last_end
            gap[1] += 1
        if e.time_range.end > last_end:
            last_end, last_name = e.time_range.end, name
    rows = sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]
    gaps = sorted(idle.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "span_us": round(last_end - events[0].time_range.start, 1),
        "kernels": len(events),
        "top": [
            {"kernel": k, "marginal_us": round(v[0], 1), "busy_us": round(v[1], 1), "calls": int(v[2])} for k, v in rows
        ],
        "idle": [{"after": a, "before": b, "idle_us": round(v[0], 1), "times": int(v[1])} for (a, b), v in gaps],
    }


def gpu_rates() -> dict[str, float]:
    """The rates floors are computed from, measured now: device copy bandwidth (GB/s), dense
    bf16 matrix rate (TFLOP/s), and the replay cost of one node of a captured graph (µs)."""
    big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    out = torch.empty_like(big)
    copy_us = cuda_time(lambda: out.copy_(big), 20)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_us = cuda_time(lambda: a @ a, 20)
    x = torch.zeros(1, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(1000):
            x.add_(1)
    node_us = cuda_time(g.replay, 20) / 1000
    return {
        "copy_GBps": 2 * (1 << 30) / copy_us / 1e3,  # read + write
        "bf16_TFLOPs": 2 * 8192**3 / mm_us / 1e6,
        "node_us": node_us,
    }


def commit() -> str:
    """The commit measured: $FLASHRT_COMMIT (set it where the tree has no .git), else git's HEAD."""
    if os.environ.get("FLASHRT_COMMIT"):
        return os.environ["FLASHRT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else what ``platform`` says)."""
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def rss_mb(pid: int | str = "self") -> float:
    """A process's resident host memory, MB (Linux's ``/proc/<pid>/statm``)."""
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def provenance() -> dict[str, str | None]:
    """Where a result was measured: the GPU (None without CUDA), the CPU, torch, Python, commit."""
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit(),
    }
