"""The action expert's decoder layer at few slots as one CUDA kernel (``kernels/cuda/expert_layer.cu``).

At one slot an expert layer is five Triton kernels whose cost is their chain of dependent steps,
not their work (docs/PERFORMANCE.md). The CUDA kernel runs the whole layer on a cluster of 8
CTAs a slot: each loads its slices of the weights into shared memory before it waits for the
kernel ahead, then the CTAs pass activations through distributed shared memory. Thread-block
clusters are not reachable from Triton, so this one kernel is CUDA C++, built on first use with
the CUDA toolkit's ``nvcc`` for sm_90a and loaded through ``ctypes`` (its launcher takes the
current stream, so it is captured like any other kernel).

:func:`fits` says whether a call can take it: an sm_90 GPU, ``nvcc`` found, no autograd, and
exactly the shapes it is compiled for (``tiny``'s expert at up to :data:`MAX_SLOTS` slots).
Elsewhere the Triton kernels run. The kernel reads, before its wait, only what is written at
least two kernels ahead of it in a step (weights, the prefix's keys/values and masks, the
positions); the kernel just ahead of an expert layer is the layer before it or the time MLP.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from flashrt.kernels import nvcc
from flashrt.kernels.backend import check_layout, dependent_launch, grid_dependency, layout_problem, use_triton
from flashrt.kernels.rotary import check_positions

SOURCE = Path(__file__).with_name("cuda") / "expert_layer.cu"
WIDTH, HEADS, HEAD_DIM, TOKENS, MLP = 192, 4, 64, 8, 768
MAX_CONTEXT = 152
"""The shapes the kernel is compiled for (``tiny``'s expert: one key/value head), and the most
context keys it takes (10 chunks of 16 keys with the 8 own keys)."""
MAX_SLOTS = 8
"""Most slots a call takes it for (one cluster of 8 CTAs a slot). Up to 8 slots it beats the
Triton layers in a chain of layers; at 16 (128 CTAs) the weight loads no longer overlap the
kernel ahead, so the Triton layers run there (measured: docs/PERFORMANCE.md, "Kernels: the
measurements behind their design")."""
_SHAPES = (
    (WIDTH,),
    ((HEADS + 2) * HEAD_DIM, WIDTH),
    (WIDTH, HEADS * HEAD_DIM),
    (WIDTH,),
    (2 * MLP, WIDTH),
    (WIDTH, MLP),
)


class _Segment(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("m", ctypes.c_void_p)] + [
        (name, ctypes.c_longlong) for name in ("sk_n", "sk_t", "sv_n", "sv_t", "sm_n", "sm_t")
    ] + [("len", ctypes.c_int)]  # fmt: skip


class _Params(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p) for name in ("x", "n1", "wqkv", "wo", "n2", "wgu", "wd", "pos0", "inv_freq")
    ] + [("s_pos0", ctypes.c_longlong), ("seg", _Segment * 3), ("nseg", ctypes.c_int), ("eps1", ctypes.c_float),
         ("eps2", ctypes.c_float), ("scale", ctypes.c_float)]  # fmt: skip


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel library (:func:`flashrt.kernels.nvcc.build`), or None where no ``nvcc`` is found
    or the build fails (the Triton layers run instead)."""
    lib = nvcc.build(
        SOURCE, ["-gencode=arch=compute_90a,code=sm_90a"], "kernels.expert_layer (the Triton layers run instead)"
    )
    if lib is not None:
        lib.flashrt_expert_layer.argtypes = [ctypes.POINTER(_Params), ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        lib.flashrt_expert_layer.restype = ctypes.c_int
    return lib


def available(device: torch.device | str) -> bool:
    """Whether calls on ``device`` can take the kernel: an sm_90 GPU (the build targets sm_90a),
    Triton's dependent-launch calls, and the library built (``nvcc`` found)."""
    device = torch.device(device)
    if device.type != "cuda" or not grid_dependency(device):
        return False
    return torch.cuda.get_device_capability(device) == (9, 0) and _library() is not None


def runs_for(*weights: torch.Tensor) -> bool:
    """Whether a layer with these weights (norm1, q/k/v, o, norm2, gate/up, down: bf16, the
    compiled shapes) can take the kernel on their device."""
    if tuple(w.shape for w in weights) != _SHAPES:
        return False
    if any(w.dtype != torch.bfloat16 or not w.is_contiguous() for w in weights):
        return False
    return available(weights[0].device)


def fits(x: torch.Tensor, context: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
         *weights: torch.Tensor) -> bool:  # fmt: skip
    """Whether an expert layer over ``x`` (N, T, E) and ``context`` takes the CUDA kernel;
    ``weights`` as :func:`runs_for` takes them."""
    if not use_triton(x, *weights) or x.shape[1:] != (TOKENS, WIDTH) or x.shape[0] > MAX_SLOTS:
        return False
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        return False
    if not 1 <= len(context) <= 3 or sum(k.shape[2] for k, _, _ in context) > MAX_CONTEXT:
        return False
    for k, v, m in context:
        if k.dim() != 4 or k.shape[:2] != (x.shape[0], 1) or k.shape[3] != HEAD_DIM or v.shape != k.shape:
            return False
        if k.dtype != x.dtype or v.dtype != x.dtype or any(_kv_layout(t) for t in (k, v)):
            return False
        if m is not None and (m.dtype != torch.bool or m.shape != (k.shape[0], k.shape[2])):
            return False
    return runs_for(*weights)


def _kv_layout(t: torch.Tensor) -> str | None:
    """What keeps the kernel from reading keys/values ``t`` (N, 1, T, 64): it takes their slot and
    token strides, and loads rows of 16 bytes."""
    return layout_problem(t, unit=(-1,), align=16)


def expert_layer(
    x: torch.Tensor,
    pos0: torch.Tensor,
    inv_freq: torch.Tensor,
    context: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    weights: Sequence[torch.Tensor],
    eps: tuple[float, float],
) -> torch.Tensor:
    """One decoder layer over ``x`` (N, 8, 192) in place (returned), attending to ``context``
    (up to three segments of keys/values (N, 1, T_i, 64) and bool masks (N, T_i) or None) and to
    its own tokens at positions ``pos0 + t`` ((N,) int64); as ``policies.layers.DecoderLayer.forward``
    computes it, with ``inv_freq`` the (32,) float32 rotary frequencies. ``weights``: norm1, q/k/v, o,
    norm2, gate/up, down (:func:`runs_for`); ``eps``: the two norms' epsilons. Call it where
    :func:`fits` holds. Takes the strides of ``pos0`` and of the context's keys, values and
    masks (e.g. slot buffers' views); ``x``, ``inv_freq`` and the weights must be contiguous."""
    check_positions(pos0, x.shape[0], "expert_layer")
    if inv_freq.shape != (HEAD_DIM // 2,) or inv_freq.dtype != torch.float32 or inv_freq.device != x.device:
        raise ValueError(
            f"expert_layer: inv_freq must be ({HEAD_DIM // 2},) float32 on {x.device} (the kernel reads float32), "
            f"got {tuple(inv_freq.shape)} {inv_freq.dtype} on {inv_freq.device}; FlowPolicy keeps its inv_freq float32"
        )
    _check_layouts(x, inv_freq, context, weights)
    lib = _library()
    p = _Params()
    p.x, p.pos0, p.inv_freq, p.s_pos0 = x.data_ptr(), pos0.data_ptr(), inv_freq.data_ptr(), pos0.stride(0)
    p.n1, p.wqkv, p.wo, p.n2, p.wgu, p.wd = (w.data_ptr() for w in weights)
    for i, (k, v, m) in enumerate(context):
        s = p.seg[i]
        s.k, s.v, s.len = k.data_ptr(), v.data_ptr(), k.shape[2]
        s.sk_n, s.sk_t, s.sv_n, s.sv_t = k.stride(0), k.stride(2), v.stride(0), v.stride(2)
        if m is not None:
            s.m, s.sm_n, s.sm_t = m.data_ptr(), m.stride(0), m.stride(1)
    p.nseg, (p.eps1, p.eps2) = len(context), eps
    p.scale = math.log2(math.e) / math.sqrt(HEAD_DIM)
    dependent = int(dependent_launch(x.device, 8 * x.shape[0]).get("launch_pdl", False))
    stream = ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
    err = lib.flashrt_expert_layer(ctypes.byref(p), x.shape[0], stream, dependent)
    if err:
        raise RuntimeError(f"expert_layer: the CUDA launch failed with cudaError {err}")
    return x


def _check_layouts(
    x: torch.Tensor,
    inv_freq: torch.Tensor,
    context: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    weights: Sequence[torch.Tensor],
) -> None:
    """Refuse what the kernel would misread: it indexes x, inv_freq and the weights as
    contiguous blocks, and each segment by its slot and token strides (one key/value head);
    pos0 it reads at any stride."""
    check_layout("expert_layer", "x", x, contiguous=True)
    check_layout("expert_layer", "inv_freq", inv_freq, contiguous=True)
    for name, w in zip(("norm1", "qkv", "o", "norm2", "gate_up", "down"), weights, strict=True):
        check_layout("expert_layer", f"the {name} weight", w, contiguous=True)
    if not 1 <= len(context) <= 3:
        raise ValueError(f"expert_layer: 1 to 3 context segments, got {len(context)}")
    for i, (k, v, m) in enumerate(context):
        for what, t in (("keys", k), ("values", v)):
            if t.shape != (x.shape[0], 1, k.shape[2], HEAD_DIM):
                raise ValueError(
                    f"expert_layer: context segment {i}'s {what} must be ({x.shape[0]}, 1, T, {HEAD_DIM}), "
                    f"got {tuple(t.shape)}"
                )
            check_layout("expert_layer", f"context segment {i}'s {what}", t, unit=(-1,), align=16)
        if m is not None and m.shape != (k.shape[0], k.shape[2]):
            raise ValueError(
                f"expert_layer: context segment {i}'s mask must be {(k.shape[0], k.shape[2])}, got {tuple(m.shape)}"
            )
