"""Memory stays within the bounds a user chose over thousands of capsule verbs."""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

from flashrt.runtime import BufferSet, CapsuleRegistry, fork, restore, rollback, snapshot
from tests.runtime import toy

TOLERANCE = 4 << 20
"""RSS growth allowed over the measured run after warm-up (what allocator noise needs; a 1 000
cycle run moves ~25 MB of capsules through the registries)."""


def rss() -> int:
    """Resident set size of this process, in bytes (Linux ``/proc``; psutil is no dependency)."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cycle(b: BufferSet, mem: CapsuleRegistry, disk: CapsuleRegistry, i: int) -> None:
    """Eight verbs: a step, two snapshots, a restore, two forks, a put and a get, a rollback;
    every 25th cycle a put into the registry with a disk tier. Every name is new."""
    n = b.num_slots
    toy.step(b)
    cap = snapshot(b, meta={"i": i})
    part = snapshot(b, [i % n, (i + 3) % n])
    restore(b, cap)
    fork(b, part, [(i + 5) % n], src_slot=i % n)
    fork(b, i % n, [(i + 1) % n, (i + 2) % n])
    mem.put(f"c{i}", cap)
    if f"c{i - 3}" in mem:
        restore(b, mem.get(f"c{i - 3}"))
    rollback(b, cap)
    if i % 25 == 0:
        disk.put(f"d{i}", part)


def soak(folder: str) -> dict[str, int]:
    """The measured runs, in this process: RSS growth over 1 000 cycles after 300 of warm-up
    under bounded budgets, then over 400 more into an unbounded registry (the mutation check)."""
    b = toy.make(64)
    n = b.state_nbytes
    mem = CapsuleRegistry(gpu_bytes=4 * n, host_bytes=4 * n)
    disk = CapsuleRegistry(folder, gpu_bytes=0, host_bytes=0, disk_bytes=4 * part_bytes(b))
    for i in range(300):  # warm-up: allocator pools, registries filled to their budgets
        cycle(b, mem, disk, i)
    before = rss()
    for i in range(300, 1300):
        cycle(b, mem, disk, i)
    out = {"grown": rss() - before, "mem_gpu": mem.stats.bytes["gpu"], "mem_host": mem.stats.bytes["host"]}
    out |= {"entries": len(mem), "files": len(os.listdir(folder)), "disk_entries": len(disk), "budget": 4 * n}
    unbounded = CapsuleRegistry(gpu_bytes=None, host_bytes=None)
    before = rss()
    for i in range(1300, 1700):
        cycle(b, unbounded, disk, i)
    out["unbounded_grown"] = rss() - before
    return out


def test_rss_stays_flat_over_thousands_of_verbs_under_bounded_budgets(tmp_path):
    """In a fresh process: a long-lived one (the test suite's) serves allocations from memory it
    freed earlier, where RSS would not show a leak either."""
    code = "import json, sys; from tests.runtime.test_soak import soak; print(json.dumps(soak(sys.argv[1])))"
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout.splitlines()[-1])
    assert r["grown"] < TOLERANCE, f"RSS grew {r['grown'] / 2**20:.1f} MiB over 1000 cycles"
    assert r["mem_gpu"] <= r["budget"] and r["mem_host"] <= r["budget"] and r["entries"] <= 8
    assert r["files"] == r["disk_entries"] <= 4
    assert r["unbounded_grown"] > TOLERANCE  # the same load without bounds: the harness sees it grow


def part_bytes(b: BufferSet) -> int:
    return 2 * b.row_bytes
