"""Capsule verbs against bytes moved, each beside the copy floor measured in the same run.

For state sizes from 1 KB to 1 GB (a 64-slot BufferSet of mixed dtypes, fewer slots when
small) it times, on one GPU: snapshot / restore / fork on the gpu tier, snapshot to and
promotion from the host tier (pinned), and the plain copies of the same bytes that bound them
(device-to-device, device-to-host, host-to-device). It then measures what a masked restore of
one slot adds to a captured graph replay of a 64-slot set, and the disk tier: saving a capsule
file (one pass: data and checksum, fsync, rename) and loading it onto the GPU (read, verify,
copy), each beside writing or reading the same bytes as a plain file.

    python scripts/bench_runtime.py --out runtime.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from benchlib import cuda_time, provenance
from tqdm import tqdm

from flashrt.runtime import BufferSet, Capsule, Graph, fork, masked_restore, restore, slot, snapshot

SIZES = [1 << 10, 10 << 10, 100 << 10, 1 << 20, 10 << 20, 100 << 20, 1 << 30]
DISK_SIZES = [1 << 20, 10 << 20, 100 << 20, 1 << 30]


def make_set(total: int) -> BufferSet:
    """A set of about ``total`` state bytes: up to 64 slots, four buffers of mixed dtypes."""
    slots = max(1, min(64, total // 4096))
    per = max(64, total // slots // 4)
    specs = [
        slot("f32", (per // 4,), torch.float32),
        slot("bf16", (per // 2,), torch.bfloat16),
        slot("i64", (per // 8,), torch.int64),
        slot("u8", (per,), torch.uint8),
    ]
    b = BufferSet(specs, slots, "cuda", deployment="bench")
    b.slot_arena.random_(0, 256)
    return b


def bench_size(size: int, reps: int) -> dict:
    b = make_set(size)
    n = b.state_nbytes
    r = max(5, min(reps, (4 << 30) // n))
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    cap = snapshot(b)
    hcap = snapshot(b, tier="host")
    hcap.ready.synchronize()
    rec = {
        "bytes": n,
        "slots": b.num_slots,
        "floor_d2d_us": cuda_time(lambda: dst.copy_(src), r),
        "floor_d2h_us": cuda_time(lambda: host.copy_(src, non_blocking=True), r),
        "floor_h2d_us": cuda_time(lambda: src.copy_(host, non_blocking=True), r),
        "snapshot_gpu_us": cuda_time(lambda: snapshot(b), r),
        "restore_gpu_us": cuda_time(lambda: restore(b, cap), r),
        "snapshot_host_us": cuda_time(lambda: snapshot(b, tier="host"), r),
        "restore_from_host_us": cuda_time(lambda: restore(b, hcap), r),
    }
    if b.num_slots > 1:
        fork_bytes = b.row_bytes * (b.num_slots - 1)
        rec["fork_bytes"] = fork_bytes
        rec["floor_fork_d2d_us"] = cuda_time(lambda: dst[:fork_bytes].copy_(src[:fork_bytes]), r)
        rec["fork_gpu_us"] = cuda_time(lambda: fork(b, 0, range(1, b.num_slots)), r)
    samples = []
    for _ in range(min(r, 20)):  # each sample promotes a capsule that is back on the host tier
        hcap.to("host").ready.synchronize()
        samples.append(cuda_time(lambda: hcap.to("gpu"), 1, warmup=0))
    rec["promote_host_to_gpu_us"] = statistics.median(samples)
    return rec


def bench_masked_restore(row_bytes: int, reps: int) -> dict:
    """Replay time of a captured step over 64 slots, with and without a masked restore of one."""
    b = BufferSet([slot("state", (row_bytes // 4,), torch.float32)], 64, "cuda", deployment="bench")
    start = b.slot_arena.clone()
    mask = torch.zeros(64, dtype=torch.bool, device="cuda")
    mask[5] = True
    x = b["state"]

    def work() -> None:
        x.mul_(0.999).add_(0.001)

    def work_and_reset() -> None:
        work()
        masked_restore(b.slot_arena, start, mask)

    g = Graph("bench").bind(b)
    g.capture("work", work)
    g.capture("work+reset", work_and_reset)
    g.capture("reset", lambda: masked_restore(b.slot_arena, start, mask))
    base = cuda_time(lambda: g.replay("work"), reps)
    with_reset = cuda_time(lambda: g.replay("work+reset"), reps)
    return {
        "slots": 64,
        "row_bytes": row_bytes,
        "replay_us": base,
        "replay_with_masked_restore_us": with_reset,
        "added_us": with_reset - base,
        "masked_restore_alone_us": cuda_time(lambda: g.replay("reset"), reps),
    }


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def bench_disk(size: int, reps: int, folder: Path) -> dict:
    """Capsule save and load onto the GPU against a plain write (with fsync) and read of as many
    bytes, all in ``folder`` (the page cache serves the reads, as it serves a registry's)."""
    b = make_set(size)
    cap = snapshot(b)
    n = cap.nbytes
    raw = os.urandom(n)
    path, plain = folder / "c.safetensors", folder / "plain.bin"

    def write_plain() -> None:
        with open(plain, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())

    def read_plain() -> None:
        torch.frombuffer(bytearray(plain.read_bytes()), dtype=torch.uint8).to("cuda").sum().item()

    def load() -> None:
        Capsule.load(path, device="cuda").ready.synchronize()

    r = max(3, min(reps, (2 << 30) // n))
    rec = {
        "bytes": n,
        "save_ms": median_ms(lambda: cap.save(path), r),
        "floor_write_fsync_ms": median_ms(write_plain, r),
        "load_gpu_ms": median_ms(load, r),
        "floor_read_to_gpu_ms": median_ms(read_plain, r),
    }
    path.unlink()
    plain.unlink()
    return rec


def fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_runtime.json"))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--disk-dir", type=Path, default=None, help="folder for the disk-tier files (default: $TMPDIR)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_runtime.py measures GPU copies: run it on a machine with a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    sizes = []
    for size in tqdm(SIZES, desc="state sizes", unit="size"):
        sizes.append(bench_size(size, args.reps))
        torch.cuda.empty_cache()
    graph = [bench_masked_restore(row, max(args.reps, 200)) for row in (16 << 10, 256 << 10, 1536 << 10)]
    with tempfile.TemporaryDirectory(dir=args.disk_dir) as folder:
        disk = [bench_disk(size, min(args.reps, 10), Path(folder)) for size in DISK_SIZES]
    result = {
        **provenance(),
        "sizes": sizes,
        "masked_restore_in_graph": graph,
        "disk": disk,
    }
    args.out.write_text(json.dumps(result, indent=2))

    print(f"\n{result['gpu']} | torch {result['torch']} | commit {result['commit']}  (median µs)")
    head = "state     | snap gpu | restore gpu | d2d floor | ratio | fork (floor)     | snap host (d2h) | promote (h2d)"
    print(head)
    print("-" * len(head))
    for r in sizes:
        fork_s = f"{r['fork_gpu_us']:8.1f} ({r['floor_fork_d2d_us']:.1f})" if "fork_gpu_us" in r else "       -        "
        print(
            f"{fmt_bytes(r['bytes']):>9} | {r['snapshot_gpu_us']:8.1f} | {r['restore_gpu_us']:11.1f} | "
            f"{r['floor_d2d_us']:9.1f} | {r['restore_gpu_us'] / r['floor_d2d_us']:5.2f} | {fork_s:16} | "
            f"{r['snapshot_host_us']:7.1f} ({r['floor_d2h_us']:.1f}) | "
            f"{r['promote_host_to_gpu_us']:7.1f} ({r['floor_h2d_us']:.1f})"
        )
    print("\nmasked restore of 1 of 64 slots inside a captured graph")
    for r in graph:
        print(
            f"  row {fmt_bytes(r['row_bytes']):>9}: replay {r['replay_us']:.1f} µs -> "
            f"{r['replay_with_masked_restore_us']:.1f} µs (+{r['added_us']:.1f} µs; "
            f"restore alone {r['masked_restore_alone_us']:.1f} µs)"
        )
    print("\ndisk tier (median ms): save vs plain write+fsync | load onto the GPU vs plain read+copy")
    for r in disk:
        print(
            f"  {fmt_bytes(r['bytes']):>9}: save {r['save_ms']:8.1f} ({r['floor_write_fsync_ms']:.1f}) | "
            f"load {r['load_gpu_ms']:8.1f} ({r['floor_read_to_gpu_ms']:.1f})"
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
