"""Captured graphs: a bounded table of replayable variants keyed by an exact shape key.

Mechanism only. A :class:`Graph` records a callable that reads and writes the buffers of the
:class:`~flashrt.runtime.buffers.BufferSet` objects bound to it, once per shape key, and replays it.

Backends, one interface:

``cuda``   the callable is warmed up on a side stream, then captured into a
           ``torch.cuda.CUDAGraph`` that draws from the graph's memory pool (shared between
           its variants). Replay launches the recorded kernels; Python in the callable does
           not run again. torch's cache is emptied between warm-up and capture, so the
           warm-up's temporaries are not held beside the pool's copy of them.
``eager``  replay calls the recorded callable. Same semantics without a GPU: what CI tests,
           and the eager baseline of the benchmarks.

Capture has no side effect on the bound state: warm-up runs would otherwise advance it, so
the state arenas of the bound set are saved before warm-up and put back after capture.

A variant may be *guarded*: a guard callable (captured first) writes a one-byte flag, and a
replay runs the body only where the flag is set (CUDA: one launch, the body a conditional node,
see :mod:`flashrt.runtime.guarded`; eager: an ``if``). :meth:`Graph.held` then says whether it ran. This is
how a step rejects a bad input read on the device without a host round trip before the launch,
leaving the state untouched.
"""

from __future__ import annotations

import contextlib
import gc
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from flashrt.runtime.buffers import BufferSet
from flashrt.runtime.guarded import GuardedGraph, new_graph
from flashrt.runtime.streams import Stream

Backend = Literal["auto", "cuda", "eager"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Hold Python's cyclic garbage collector off while a CUDA graph is captured.

    A collection can start at any allocation of a Python object, so inside a capture it would
    run the destructors of whatever dropped cycles it finds: another env's Warp arrays and
    graphs, a torch memory pool. Their frees and cache flushes cannot be captured: CUDA
    invalidates the capture (error 901 at a later launch) or torch's allocator aborts the
    process. The collector runs again after the capture, where they are harmless; explicit
    ``gc.collect()`` calls are not held off. Nests: an inner use leaves the collector as the
    outer one set it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class MissingVariantError(LookupError):
    """Replay of a shape key that has not been captured (never a silent eager run)."""


@dataclass
class _Variant:
    run: Callable[[], None]  # a bound replay/launch method keeps its captured graphs alive
    held: Callable[[], bool] | None = None


class Graph:
    """A table of captured variants of one computation, keyed by an exact hashable key.

    Args:
        name: for messages.
        backend: ``"cuda"``, ``"eager"``, or ``"auto"`` (CUDA when the bound sets live on a
            CUDA device, eager otherwise).
        max_variants: table bound; capturing past it evicts the least recently used variant
            (the one least recently captured or replayed).

    Example:
        >>> g = Graph("double")
        >>> g.bind(bufs)
        >>> g.capture(("n", 4), lambda: bufs["x"].mul_(2))
        >>> g.replay(("n", 4))
    """

    def __init__(
        self,
        name: str = "graph",
        *,
        backend: Backend = "auto",
        max_variants: int = 16,
    ) -> None:
        if backend not in ("auto", "cuda", "eager"):
            raise ValueError(f"backend must be 'auto', 'cuda' or 'eager', got {backend!r}")
        if type(max_variants) is not int or max_variants < 1:
            raise ValueError(f"max_variants must be an int >= 1 (the table's bound), got {max_variants!r}")
        self.name = name
        self.requested_backend: Backend = backend
        self.max_variants = max_variants
        self.bufs: BufferSet | None = None
        self._pool: tuple[int, int] | None = None  # one memory pool for all variants, made at first capture
        self._variants: OrderedDict[Hashable, _Variant] = OrderedDict()

    # -- binding -----------------------------------------------------------------------------
    def bind(self, bufs: BufferSet) -> Graph:
        """Name the buffer set the graph reads and writes. Two graphs bound to the same set hand
        data to each other with no copy (pointers are baked in at capture)."""
        if self.bufs is not None and self.bufs is not bufs and self._variants:
            raise ValueError(
                f"graph {self.name!r} already has variants captured against another buffer set; "
                "captured pointers cannot be re-bound: make a new Graph for the new set"
            )
        self.bufs = bufs
        return self

    @property
    def device(self) -> torch.device:
        if self.bufs is None:
            raise ValueError(f"graph {self.name!r}: bind a BufferSet before capturing")
        return self.bufs.device

    @property
    def backend(self) -> Literal["cuda", "eager"]:
        """The backend that capture uses (``auto`` resolved from the bound device)."""
        if self.requested_backend != "auto":
            return self.requested_backend
        return "cuda" if self.device.type == "cuda" else "eager"

    # -- variants ----------------------------------------------------------------------------
    def capture(
        self,
        key: Hashable,
        fn: Callable[[], object],
        *,
        warmup: int = 2,
        stream: Stream | None = None,
        guard: Callable[[], torch.Tensor] | None = None,
    ) -> None:
        """Record ``fn`` (which must only touch bound buffers and allocate nothing that outlives
        it) as the variant ``key``. Re-capturing a key replaces it.

        ``guard``, if given, is recorded before ``fn`` and returns the one-byte (bool or uint8)
        flag it writes, a tensor that outlives the variant (a bound buffer, say); a replay then
        runs ``fn`` only where the flag is set, and :meth:`held` reports whether it did. ``fn``
        must not draw from torch's random generators when guarded (their offsets advance only
        through ``CUDAGraph.replay``)."""
        hash(key)
        if self.backend == "eager":
            if guard is None:
                self._put(key, _Variant(run=fn))
                return
            ran: list[bool] = [False]

            def run() -> None:
                ran[0] = bool(guard())
                if ran[0]:
                    fn()

            self._put(key, _Variant(run=run, held=lambda: ran[0]))
            return
        device = self.device
        if device.type != "cuda":
            raise ValueError(
                f"graph {self.name!r}: the cuda backend needs CUDA buffers, got {device}; bind a set on a CUDA "
                "device, or use backend='eager'"
            )
        b = self.bufs
        saved = b.slot_arena.clone(), b.shared_arena.clone()
        side = stream.cuda if stream is not None and stream.cuda is not None else torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                if guard is not None:
                    guard()
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        # The warm-up's temporaries are free again but stay cached by torch's allocator, and the
        # capture cannot reuse them (it allocates from the graph's own pool): handed back first,
        # a step with large temporaries (pi0's encode at many slots) holds them once, not twice.
        torch.cuda.empty_cache()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if guard is None:
            g = torch.cuda.CUDAGraph()
            with (
                collector_paused(),
                torch.cuda.graph(g, pool=self._pool, stream=side, capture_error_mode="thread_local"),
            ):
                fn()
            variant = _Variant(run=g.replay)
        else:
            parts = []
            for part in (guard, fn):  # one pool, replayed in capture order
                g = new_graph()
                with (
                    collector_paused(),
                    torch.cuda.graph(g, pool=self._pool, stream=side, capture_error_mode="thread_local"),
                ):
                    out = part()
                parts.append((g, out))
            guarded = GuardedGraph(parts[0][0], parts[1][0], parts[0][1])
            variant = _Variant(run=guarded.launch, held=guarded.held)
        b.slot_arena.copy_(saved[0])
        b.shared_arena.copy_(saved[1])
        self._put(key, variant)

    def replay(self, key: Hashable, stream: Stream | None = None) -> None:
        """Run the variant ``key`` (on ``stream`` if given, else the current stream)."""
        v = self._variants.get(key)
        if v is None:
            raise MissingVariantError(
                f"graph {self.name!r} has no variant {key!r}; captured: {list(self._variants)}. "
                "Capture it first (replay never falls back to an eager run)."
            )
        self._variants.move_to_end(key)
        if stream is None:
            v.run()
        else:
            with stream:
                v.run()

    def held(self, key: Hashable) -> bool:
        """Whether the last replay of the guarded variant ``key`` runs its body (its guard held);
        waits until that replay's guard has run, not for the body."""
        v = self._variants.get(key)
        if v is None or v.held is None:
            raise ValueError(
                f"graph {self.name!r}: variant {key!r} is not a captured guarded variant; capture it with guard=... "
                "to learn whether a replay ran its body"
            )
        return v.held()

    def _put(self, key: Hashable, v: _Variant) -> None:
        self._variants.pop(key, None)
        self._variants[key] = v
        while len(self._variants) > self.max_variants:
            self._variants.popitem(last=False)

    def __contains__(self, key: Hashable) -> bool:
        """Whether the variant ``key`` is captured (and not evicted)."""
        return key in self._variants
