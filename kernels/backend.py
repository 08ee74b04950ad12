"""Which implementation a kernel call takes: Triton on CUDA, the torch reference elsewhere.

A call takes its Triton kernel when Triton is installed, its tensors are on a CUDA device and
no autograd graph is being recorded through them (the kernels have no backward; training runs
the references, which are plain differentiable torch). :func:`reference_only` forces the
references for a block of code, e.g. to measure a before/after in one process; it is read when
the Python code runs, so it selects what a graph captures, not what a replay does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: every call takes its reference
    triton = None
    tl = None

_forced_reference = False


def use_triton(*tensors: torch.Tensor) -> bool:
    """True where a kernel call on ``tensors`` takes its Triton implementation."""
    if triton is None or _forced_reference:
        return False
    if not all(t.is_cuda for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def implementation(device: torch.device | str) -> str:
    """``"triton"`` where kernel calls on ``device`` take their Triton kernels (outside autograd),
    else ``"reference"``: the two agree to rounding, not to the bit, so outputs are comparable
    only within one implementation (it is part of a deployment's identity)."""
    return (
        "triton"
        if triton is not None and not _forced_reference and torch.device(device).type == "cuda"
        else "reference"
    )


@contextlib.contextmanager
def reference_only() -> Iterator[None]:
    """Run the torch references inside the block, whatever the device."""
    global _forced_reference
    before, _forced_reference = _forced_reference, True
    try:
        yield
    finally:
        _forced_reference = before
