"""A guarded graph: a guard graph, then the body graph only where the guard's flag is set.

The body is a CUDA conditional (IF) node of one executable graph: one launch, no host round trip
between the guard and the body, and nothing of the body runs when the flag is zero. A one-thread
kernel (``runtime/cuda/conditional.cu``, built with ``nvcc`` on first use) sets the condition from
the flag, counts the launches and writes ``count << 1 | flag`` into pinned host memory. The host
learns the outcome of its latest launch by watching that word: as soon as the guard has run,
without waiting for the body or reading the device.

Where no ``nvcc`` is found or the driver cannot build the conditional graph, the same semantics
run with the guard and the body as two launches and one flag read between them.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from pathlib import Path

import numpy as np
import torch

from flashrt.kernels import nvcc

SOURCE = Path(__file__).with_name("cuda") / "conditional.cu"
_MASK = 0xFFFFFFFF  # the device writes an unsigned 32-bit word: count << 1 | flag


@functools.cache
def _library(capability: tuple[int, int]) -> ctypes.CDLL | None:
    arch = f"{capability[0]}{capability[1]}"
    lib = nvcc.build(
        SOURCE, [f"-gencode=arch=compute_{arch},code=sm_{arch}"], "runtime.guarded (guard read on the host)"
    )
    if lib is not None:
        void = ctypes.c_void_p
        lib.flashrt_guarded_graph.argtypes = [void, void, void, void, void, ctypes.POINTER(void)]
        lib.flashrt_graph_launch.argtypes = [void, void]
        lib.flashrt_graph_exec_destroy.argtypes = [void]
        for f in (lib.flashrt_guarded_graph, lib.flashrt_graph_launch, lib.flashrt_graph_exec_destroy):
            f.restype = ctypes.c_int
    return lib


def new_graph() -> torch.cuda.CUDAGraph:
    """A ``torch.cuda.CUDAGraph`` that keeps its ``cudaGraph_t`` after capture (what
    :class:`GuardedGraph` builds on), where this torch can (``keep_graph``, torch >= 2.8)."""
    try:
        return torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        return torch.cuda.CUDAGraph()


class GuardedGraph:
    """``guard`` then, if the byte at ``flag`` is non-zero, ``body``: two graphs captured with
    :func:`new_graph` (not yet replayed, sharing one memory pool in capture order) run as one
    launch.

    Args:
        guard: the captured guard; it writes ``flag``.
        body: the captured body.
        flag: a one-byte (bool or uint8) device tensor that outlives the graph.
    """

    def __init__(self, guard: torch.cuda.CUDAGraph, body: torch.cuda.CUDAGraph, flag: torch.Tensor) -> None:
        if flag.numel() != 1 or flag.element_size() != 1 or flag.device.type != "cuda":
            raise ValueError(
                f"the guard's flag must be one byte (bool or uint8) on a CUDA device, got {flag.dtype} "
                f"{tuple(flag.shape)} on {flag.device}"
            )
        self._graphs = (guard, body)  # their memory pools back the captured addresses
        self.flag = flag
        self._count = torch.zeros(1, dtype=torch.int32, device=flag.device)  # launches, counted on the device
        self._mirror = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # count << 1 | flag, written by the device
        self._word = self._mirror.numpy().view(np.uint32)  # read without torch's dispatch while waiting
        self._launches = 0
        self._exec: ctypes.c_void_p | None = None
        self._lib = _library(torch.cuda.get_device_capability(flag.device))
        try:
            raw = (guard.raw_cuda_graph(), body.raw_cuda_graph())
        except (AttributeError, RuntimeError):  # torch < 2.8 drops the cudaGraph_t at capture end
            raw = None
            warnings.warn(
                "runtime.guarded: this torch cannot keep a captured graph (keep_graph, torch >= 2.8); the "
                "guard is read on the host instead",
                stacklevel=2,
            )
        if self._lib is not None and raw is not None:
            exec_ = ctypes.c_void_p()
            err = self._lib.flashrt_guarded_graph(
                *raw,
                flag.data_ptr(),
                self._count.data_ptr(),
                self._mirror.data_ptr(),
                ctypes.byref(exec_),
            )
            if err:
                warnings.warn(
                    f"runtime.guarded: the conditional graph failed to build (cudaError {err}); the guard is "
                    "read on the host instead",
                    stacklevel=2,
                )
            else:
                self._exec = exec_
        self._done = torch.cuda.Event()

    @property
    def conditional(self) -> bool:
        """Whether the body is a conditional node (one launch) rather than a host-read guard."""
        return self._exec is not None

    def launch(self) -> None:
        """Run on the current stream."""
        stream = torch.cuda.current_stream(self.flag.device)
        if self._exec is not None:
            err = self._lib.flashrt_graph_launch(self._exec, ctypes.c_void_p(stream.cuda_stream))
            if err:
                raise RuntimeError(
                    f"runtime.guarded: cudaGraphLaunch failed with cudaError {err}; rerun with CUDA_LAUNCH_BLOCKING=1 "
                    "to find the failing kernel"
                )
        else:
            self._graphs[0].replay()
            value = bool(self.flag.reshape(()))  # waits for the guard
            self._word[0] = ((self._launches + 1) << 1 | value) & _MASK
            if value:
                self._graphs[1].replay()
        self._launches = (self._launches + 1) & (_MASK >> 1)
        self._done.record(stream)

    def held(self) -> bool:
        """Whether the latest launch's guard held (its body runs). Waits until that launch's guard
        has run, not for its body."""
        want, spins = self._launches, 0
        while True:
            word = int(self._word[0])
            if word >> 1 == want:
                return bool(word & 1)
            spins += 1
            if spins % 1024 == 0 and self._done.query() and int(self._word[0]) >> 1 != want:
                raise RuntimeError(
                    "runtime.guarded: the launch finished without reporting its guard (the conditional graph did "
                    "not run its flag kernel); rerun with CUDA_LAUNCH_BLOCKING=1 and report the driver version"
                )

    def __del__(self) -> None:
        if getattr(self, "_exec", None) is not None:
            self._lib.flashrt_graph_exec_destroy(self._exec)
