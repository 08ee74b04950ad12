"""MuJoCo Warp's side of :class:`flashrt_gym.sims.WarpPush`: the Warp module and the task's Warp
kernels (imported lazily, on first use), and the two allocators that serve MuJoCo Warp's
temporaries from torch's caching allocator: while it runs on the torch stream (inside a torch
capture: from the graph's memory pool), and while a looped graph is recorded (kept for the graph's
lifetime)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch


@functools.cache
def warp_api() -> SimpleNamespace:
    """Import Warp and MuJoCo Warp, and define the task's kernels (once)."""
    try:
        import mujoco_warp as mjw
        import warp as wp
    except ImportError as e:
        raise ImportError(
            "the MuJoCo Warp simulator needs the pinned versions it was tested with, "
            f'`pip install -e ".[mujoco-warp]"` (mujoco-warp, warp-lang), and a CUDA GPU: {e}'
        ) from e
    wp.init()

    @wp.func
    def distances(state: wp.array2d(dtype=wp.float32), w: int, ee: int, obj: int, goal: wp.vec2, ring_r: float):
        px = state[w, obj]
        py = state[w, obj + 1]
        dx = state[w, ee] - px
        dy = state[w, ee + 1] - py
        return wp.vec2(wp.length(wp.vec2(px, py) - goal), wp.max(wp.sqrt(dx * dx + dy * dy) - ring_r, 0.0))

    @wp.func
    def drive(
        state: wp.array2d(dtype=wp.float32),
        actions: wp.array3d(dtype=wp.float32),
        alive: wp.array(dtype=wp.bool),
        w: int,
        t: int,
        ctrl: int,
        speed: float,
    ):
        if alive[w]:  # a frozen world keeps its whole row
            state[w, ctrl] = wp.clamp(actions[w, t, 0], -1.0, 1.0) * speed
            state[w, ctrl + 1] = wp.clamp(actions[w, t, 1], -1.0, 1.0) * speed

    @wp.kernel
    def write_ctrl(
        state: wp.array2d(dtype=wp.float32),
        actions: wp.array3d(dtype=wp.float32),
        alive: wp.array(dtype=wp.bool),
        t: int,
        ctrl: int,
        speed: float,
    ):
        drive(state, actions, alive, wp.tid(), t, ctrl, speed)

    @wp.kernel
    def write_ctrl_left(
        state: wp.array2d(dtype=wp.float32),
        actions: wp.array3d(dtype=wp.float32),
        alive: wp.array(dtype=wp.bool),
        left: wp.array(dtype=wp.int32),
        ticks: int,
        ctrl: int,
        speed: float,
    ):
        """``write_ctrl`` of tick ``ticks - left[0]``: the tick read on the device, in a loop."""
        drive(state, actions, alive, wp.tid(), ticks - left[0], ctrl, speed)

    # the bodies name ``wp`` so that Warp, reading the annotations as strings, finds it in the closure
    @wp.kernel
    def set_count(counter: wp.array(dtype=wp.int32), value: int):
        counter[0] = wp.int32(value)

    @wp.kernel
    def count_down(counter: wp.array(dtype=wp.int32)):
        counter[0] = counter[0] - wp.int32(1)

    @wp.kernel
    def measure(
        state: wp.array2d(dtype=wp.float32),
        ee: int,
        obj: wp.array(dtype=wp.int32),
        goal: wp.array(dtype=wp.vec2),
        ring_r: float,
        dist: wp.array(dtype=wp.vec2),
    ):
        w = wp.tid()
        dist[w] = distances(state, w, ee, obj[w], goal[w], ring_r)

    @wp.kernel
    def score(
        state: wp.array2d(dtype=wp.float32),
        ee: int,
        obj: wp.array(dtype=wp.int32),
        goal: wp.array(dtype=wp.vec2),
        ring_r: float,
        goal_radius: float,
        dist: wp.array(dtype=wp.vec2),
        alive: wp.array(dtype=wp.bool),
        tick: wp.array(dtype=wp.int64),
        dense: wp.array(dtype=wp.float32),
        sparse: wp.array(dtype=wp.float32),
    ):
        w = wp.tid()
        after = distances(state, w, ee, obj[w], goal[w], ring_r)
        if alive[w]:
            before = dist[w]
            success = after[0] < goal_radius
            sparse[w] = sparse[w] - wp.where(success, 0.0, 1.0)
            dense[w] = dense[w] + 5.0 * (before[0] - after[0]) + (before[1] - after[1]) + wp.where(success, 2.0, 0.0)
            tick[w] = tick[w] + wp.int64(1)
            alive[w] = not success
        dist[w] = after

    return SimpleNamespace(
        wp=wp,
        mjw=mjw,
        write_ctrl=write_ctrl,
        write_ctrl_left=write_ctrl_left,
        set_count=set_count,
        count_down=count_down,
        measure=measure,
        score=score,
    )


class TorchAllocator:
    """A Warp allocator that serves Warp arrays made while Warp runs on the torch stream from
    torch's caching allocator (inside a torch capture: from the graph's memory pool, as a torch
    temporary would be), and everything else (Warp's own side streams) from Warp's allocator.

    Args:
        device: the torch CUDA device.
        fallback: Warp's built-in allocator of the device.
    """

    def __init__(self, device: torch.device, fallback: Any) -> None:
        self.device, self.fallback = device, fallback
        self.stream: Any = None  # the Warp handle of the torch stream in use (set by the caller)
        self._blocks: dict[int, torch.Tensor] = {}

    def allocate(self, size_in_bytes: int) -> int:
        wp = warp_api().wp
        if self.stream is None or wp.get_stream(self.stream.device).cuda_stream != self.stream.cuda_stream:
            return self.fallback.allocate(size_in_bytes)
        block = torch.empty(size_in_bytes, dtype=torch.uint8, device=self.device)
        self._blocks[block.data_ptr()] = block
        return block.data_ptr()

    def deallocate(self, ptr: int, size_in_bytes: int) -> None:
        if self._blocks.pop(ptr, None) is None:
            self.fallback.deallocate(ptr, size_in_bytes)


@functools.cache
def kept_pool(index: int) -> torch.cuda.MemPool:
    """The process's one memory pool for :class:`KeptAllocator`'s blocks on CUDA device ``index``,
    made on first use and never dropped. Dropping a pool empties its cache, which torch refuses
    while any CUDA graph is being captured (it aborts the process); an env is dropped by the
    garbage collector, which may run at any allocation, inside another env's capture. A dropped
    graph's blocks go back to this pool, where the next looped graph's capture finds them.

    Args:
        index: the CUDA device's index.

    Returns:
        The pool.
    """
    with torch.cuda.device(index):
        return torch.cuda.MemPool()


class KeptAllocator:
    """A Warp allocator whose blocks come from torch's caching allocator and stay allocated until
    the allocator is dropped. A MuJoCo Warp step allocates its solver's and broad phase's scratch
    at every call; recorded in the body of a conditional (while) node of Warp's graph, those
    allocations cannot be memory nodes (CUDA refuses them there), so they are plain device memory
    that the graph's owner holds: one recorded step's scratch, reused by every iteration.

    On CUDA the blocks come from the process's pool for kept blocks (:func:`kept_pool`), on the
    stream that Warp records (and later replays) on: see :meth:`serving`.

    Args:
        device: the torch device.
    """

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:  # use_mem_pool needs the index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.blocks: list[torch.Tensor] = []
        self.pool = kept_pool(device.index) if device.type == "cuda" else None

    @contextlib.contextmanager
    def serving(self, stream: torch.cuda.Stream | None) -> Iterator[None]:
        """While Warp records a capture on ``stream``: make it torch's current stream and route
        torch's allocations to the pool for kept blocks. Torch's allocator then sees the capture, so
        it takes new device memory in CUDA's relaxed capture mode (a plain ``cudaMalloc`` while
        this thread captures fails with "operation not permitted when stream is capturing": the
        looped graph at 256 worlds and more) and skips its event queries, also illegal there.
        The blocks belong to ``stream``, where the graph replays. Nothing to do on the CPU.

        Args:
            stream: the torch stream Warp's capture records on (None on the CPU).
        """
        if self.pool is None or stream is None:
            yield
            return
        with torch.cuda.stream(stream), torch.cuda.use_mem_pool(self.pool, self.device):
            yield

    def allocate(self, size_in_bytes: int) -> int:
        block = torch.empty(max(size_in_bytes, 1), dtype=torch.uint8, device=self.device)
        self.blocks.append(block)
        return block.data_ptr()

    def deallocate(self, ptr: int, size_in_bytes: int) -> None:
        """Nothing: the recorded graph reads and writes the block at every replay."""
