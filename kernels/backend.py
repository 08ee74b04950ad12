"""Which implementation a kernel call takes: Triton on CUDA, the torch reference elsewhere.

A call takes its Triton kernel when Triton is installed, its tensors are on a CUDA device and
no autograd graph is being recorded through them (the kernels have no backward; training runs
the references, which are plain differentiable torch). :func:`reference_only` forces the
references for a block of code, e.g. to measure a before/after in one process; it is read when
the Python code runs, so it selects what a graph captures, not what a replay does.

Programmatic dependent launch (Hopper and later): inside a captured graph a small kernel may
start while the kernel before it is still running. A kernel written for it calls
:func:`inputs_ready` before it touches anything an earlier kernel wrote, or anything it writes
(loads of the weights, constants of the graph, may come first); that call also lets the next
kernel start. :func:`dependent_launch` gives the launch options. Where it is off (eager calls,
older GPUs or Triton, the CPU interpreter) the call is a no-op and launches are stream-ordered
as usual.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: every call takes its reference
    triton = None
    tl = None

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # no Triton, or one older than 3.4: launches stay stream-ordered
    gdc_launch_dependents = gdc_wait = None

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


def layout_problem(
    t: torch.Tensor, *, contiguous: bool = False, unit: Sequence[int] = (), align: int = 0
) -> str | None:
    """What keeps a kernel from reading ``t`` as it indexes it, or None when nothing does.

    Buffers of a :class:`flashrt.runtime.BufferSet` slot arena are strided along the slot
    dimension (the stride is the arena's row, not the buffer), so a kernel either takes a
    tensor's strides or states here what it needs:

    Args:
        t: the tensor a kernel would read or write.
        contiguous: the kernel indexes ``t`` as one row-major block (its weights, say).
        unit: dimensions the kernel steps through one element at a time (stride 1, or size 1).
        align: bytes that ``t``'s address and every stride of a dimension of size > 1 outside
            ``unit`` must be a multiple of (vector loads).
    """
    if contiguous and not t.is_contiguous():
        return "is not contiguous (row-major)"
    for d in unit:
        if t.shape[d] > 1 and t.stride(d) != 1:
            return f"has stride {t.stride(d)} in dimension {d % t.dim()}, where the kernel steps by one element"
    if align:
        units = {d % t.dim() for d in unit}
        strides = [s for d, (n, s) in enumerate(zip(t.shape, t.stride(), strict=True)) if n > 1 and d not in units]
        if t.data_ptr() % align or any(s * t.element_size() % align for s in strides):
            return f"is not aligned to {align} bytes (its address and its strides in bytes must be multiples)"
    return None


def check_layout(
    fn: str, name: str, t: torch.Tensor, *, contiguous: bool = False, unit: Sequence[int] = (), align: int = 0
) -> None:
    """Refuse a view the kernel of ``fn`` would misread: raise ``ValueError`` naming the
    argument ``name``, its shape and strides, and what the kernel needs
    (:func:`layout_problem` lists the requirements). Never silently wrong."""
    problem = layout_problem(t, contiguous=contiguous, unit=unit, align=align)
    if problem is not None:
        raise ValueError(
            f"{fn}: {name} of shape {tuple(t.shape)} and strides {tuple(t.stride())} {problem}; "
            "pass it with that layout (e.g. .contiguous())"
        )


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (Triton's CPU interpreter: an H100's 132)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@functools.cache
def grid_dependency(device: torch.device) -> bool:
    """Whether kernels on ``device`` can take part in programmatic dependent launch: a CUDA GPU
    of compute capability 9.0 or later and a Triton that has the grid-dependency calls."""
    return gdc_wait is not None and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def dependent_launch(device: torch.device, programs: int) -> dict[str, bool]:
    """Launch options of a kernel written for programmatic dependent launch: its ``GDC``
    constexpr, and ``launch_pdl`` while a graph is being captured.

    ``GDC`` (the grid-dependency calls compiled in; a kernel may also order its loads for them)
    holds where the grid fits on the GPU at once, at most one program per SM: bigger grids run in
    waves, where programs parked at :func:`inputs_ready` would hold SMs that the kernel ahead
    still needs, and are throughput-bound anyway. The launch is dependent only inside a capture:
    in eager calls the kernel ahead may have just written a weight that a kernel loads before
    :func:`inputs_ready` (an optimizer step); in a graph no node writes a weight the graph reads
    (derived weights are refreshed by the capture's warm-up; ``policies.layers.Folded`` refuses a
    refresh inside a capture). Eager and captured launches of one shape run the same compiled
    kernel."""
    gdc = grid_dependency(device) and programs <= sm_count(device)
    if gdc and torch.cuda.is_current_stream_capturing():
        return {"GDC": True, "launch_pdl": True}
    return {"GDC": gdc}


if triton is not None:

    @triton.jit
    def inputs_ready(GDC: tl.constexpr):
        """Wait until every earlier kernel has finished and its writes are visible, then let the
        next kernel, when launched dependent, start (its programs run up to their own wait, so
        at most two kernels overlap). A no-op unless the kernel was launched dependent. Call it
        before reading anything but weights and before the first store."""
        if GDC:
            gdc_wait()
            gdc_launch_dependents()
