"""What the benchmark scripts share: the two timers (CUDA events per call for copies measured
in microseconds, wall clock around a synchronised call for whole steps) and the provenance every
result file records (GPU, torch, Python, commit)."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

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


def commit() -> str:
    """The commit measured: $FLASHRT_COMMIT (set it where the tree has no .git), else git's HEAD."""
    if os.environ.get("FLASHRT_COMMIT"):
        return os.environ["FLASHRT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def provenance() -> dict[str, str]:
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": commit(),
    }
