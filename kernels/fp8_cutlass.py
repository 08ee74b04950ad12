"""FP8 GEMMs with fused epilogues on Hopper (``kernels/cuda/fp8_gemm.cu``, CUTLASS 3).

``torch._scaled_mm`` (:mod:`flashrt.kernels.fp8`) multiplies e4m3 rows by an e4m3 weight at
cuBLAS's rate, but its epilogue stops at the scales and a bias, so whatever follows a projection
is a kernel of its own that reads the bf16 product back. These GEMMs are CUTLASS's
warp-specialised Hopper kernels (TMA loads, fast accumulation, persistent tiles) with the same
row and channel scales and one of four epilogues, in float32 before the one rounding to bf16:

- ``"scale"``: ``s = (xq @ wq^T) * sx * sw``, what ``torch._scaled_mm`` computes;
- ``"add"``: ``s + c``, the residual add inside the projection (``c`` bf16, may be ``out``);
- ``"gelu"``: ``gelu_tanh(s)``, the gate half of a GeGLU;
- ``"mul"``: ``s * c``, the up half times ``c = gelu(gate)`` (``c`` may be ``out``).

So a gate/up projection and its GeGLU become two GEMMs (the gate half writing ``gelu(gate)``,
the up half multiplying it in place) and the ``(rows, 2 f)`` bf16 product is never written.

The library is built on first use with the CUDA toolkit's ``nvcc`` (:mod:`flashrt.kernels.nvcc`,
cached on disk) for sm_90a, against CUTLASS's headers from the ``nvidia-cutlass`` package (the
``fp8`` extra). :func:`available` says whether it runs: an sm_90 GPU, ``nvcc``, the headers and
a build that succeeded; elsewhere callers keep ``torch._scaled_mm`` and the separate kernels.
Each call takes the current stream, so it is captured in a CUDA graph like any other kernel.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from pathlib import Path

import torch

from flashrt.kernels import nvcc
from flashrt.kernels.activation import gelu_mul
from flashrt.kernels.backend import use_triton
from flashrt.kernels.fp8 import E4M3, Fp8Weight, Rows, linear_rows, quantize_rows

VERSION = 1
"""Bumped when these GEMMs' numerics change: deployment digests of FP8 policies that run them
name it."""
SOURCE = Path(__file__).with_name("cuda") / "fp8_gemm.cu"
EPILOGUES = {"scale": 0, "add": 1, "gelu": 2, "mul": 3}
TILES = {"pingpong_128x128": 0, "cooperative_256x128": 1, "cooperative_128x256": 2}
"""The compiled tiles: a 128 x 128 tile a consumer warp group, two taking turns (pingpong, on
1 x 2 clusters: the shape cuBLAS picks for pi0's products), and a 256 x 128 (2 x 1 clusters) or
128 x 256 (1 x 2) tile shared by two warp groups (cooperative)."""
RASTERS = {"heuristic": 0, "along_m": 1, "along_n": 2}
"""The order the persistent kernel hands out tiles in: CUTLASS's choice, down the rows first, or
along the columns first."""
TALL = 32768
"""Rows from which :func:`gemm`'s default launch is the cooperative 128 x 256 tile stepping along
``n``; fewer rows take the pingpong 128 x 128 tile stepping along ``m`` (swizzle 1 both: the
fastest launches measured at pi0's batch 64 and 8 rows, docs/FP8.md)."""
MIN_ROWS = 4096
"""Fewest rows a layer takes these GEMMs for (:func:`fits`): pi0's block B from batch 8 on
(817 rows a slot); fewer rows keep ``torch._scaled_mm`` (measured: docs/FP8.md)."""
SPLIT_MAX_ROWS = 16384
"""Rows below which :func:`geglu` splits the gate/up projection into two GEMMs with the GeGLU in
their epilogues; from here on ``torch._scaled_mm`` and the separate GeGLU kernel are faster
(cuBLAS's larger lead on the wide product outweighs the bytes saved; docs/FP8.md)."""
FLAGS = ("-arch=sm_90a", "-DNDEBUG", "--expt-relaxed-constexpr")
_STATUS = {1: "CUTLASS refused the shapes or their alignment", 2: "the workspace is too small", 3: "launch failed"}


def include_dir() -> Path | None:
    """CUTLASS's headers from the installed ``nvidia-cutlass`` package, or None."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "source" / "include"
    return path if (path / "cutlass" / "cutlass.h").is_file() else None


@functools.cache
def _library() -> ctypes.CDLL | None:
    include = include_dir()
    if include is None:
        return None
    lib = nvcc.build(SOURCE, [*FLAGS, f"-I{include}"], "fp8_cutlass")
    if lib is None:
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.flashrt_fp8_gemm.argtypes = [ctypes.c_int, ctypes.c_int, ptr, i64, ptr, i64, ptr, ptr, ptr, i64, ptr, i64]
    lib.flashrt_fp8_gemm.argtypes += [ctypes.c_int] * 6 + [ptr, ctypes.c_size_t, ptr]
    lib.flashrt_fp8_gemm.restype = ctypes.c_int
    lib.flashrt_fp8_gemm_workspace.argtypes = [ctypes.c_int] * 6
    lib.flashrt_fp8_gemm_workspace.restype = ctypes.c_size_t
    return lib


def available(device: torch.device | str) -> bool:
    """Whether :func:`gemm` runs on ``device``: a Hopper (sm_90) GPU, ``nvcc`` and CUTLASS's
    headers found, and the library built (built here on the first call that asks)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device) != (9, 0):
        return False
    return _library() is not None


def fits(rows: Rows, dtype: torch.dtype) -> bool:
    """Whether a layer whose activations are ``rows`` (quantised from ``dtype``) takes these
    GEMMs: at least :data:`MIN_ROWS` rows of bf16 activations where :func:`available`."""
    q = rows[0]
    big = dtype == torch.bfloat16 and q.numel() >= MIN_ROWS * q.shape[-1]
    return big and use_triton(q) and available(q.device)  # under reference_only, the references run


def geglu(rows: Rows, weight: Fp8Weight) -> Rows:
    """``gelu_tanh(gate) * up`` of the product of ``rows`` and a gate/up weight (``(2 f, k)``, gate
    rows first), quantised per row for the down projection. Below :data:`SPLIT_MAX_ROWS` rows the
    gate half's GEMM writes ``gelu(gate)`` (bf16) and the up half's multiplies it in place, so the
    ``(rows, 2 f)`` product is never written, then :func:`flashrt.kernels.fp8.quantize_rows`;
    from there on ``torch._scaled_mm`` and :func:`flashrt.kernels.activation.gelu_mul`.

    Raises:
        ValueError: an odd number of weight rows, or what :func:`gemm` raises.
    """
    n = weight.data.shape[0]
    if n % 2:
        raise ValueError(f"fp8_cutlass.geglu: the gate/up weight needs an even number of rows, got {n}")
    if rows[0].numel() >= SPLIT_MAX_ROWS * rows[0].shape[-1]:
        return gelu_mul(linear_rows(rows, weight), fp8=True)
    f = n // 2
    gate, up = Fp8Weight(weight.data[:f], weight.scale[:f]), Fp8Weight(weight.data[f:], weight.scale[f:])
    g = gemm(rows, gate, "gelu")
    return quantize_rows(gemm(rows, up, "mul", c=g, out=g))


def _matrix(name: str, t: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype) -> None:
    if t.dtype != dtype or tuple(t.shape) != shape or t.stride(1) != 1 or t.stride(0) % 16:
        raise ValueError(
            f"fp8_cutlass.gemm: {name} must be {dtype} {shape}, rows contiguous with a row stride that is a "
            f"multiple of 16 elements; got {t.dtype} {tuple(t.shape)} strides {t.stride()}"
        )


def gemm(
    rows: Rows,
    weight: Fp8Weight,
    epilogue: str = "scale",
    c: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tile: str | None = None,
    swizzle: int | None = None,
    raster: str | None = None,
) -> torch.Tensor:
    """``epilogue((xq @ wq^T) * sx * sw)`` (see the module docstring) -> ``(..., n)`` bf16.

    Args:
        rows: the activations quantised per row (:data:`flashrt.kernels.fp8.Rows`), e4m3
            ``(..., k)``, the last dimension contiguous.
        weight: e4m3 ``(n, k)`` with float32 ``(n,)`` scales; a row slice of a larger weight
            (the gate or up half) is fine.
        epilogue: ``"scale"``, ``"add"``, ``"gelu"`` or ``"mul"``.
        c: the bf16 ``(..., n)`` operand of ``"add"`` and ``"mul"`` (may be ``out``).
        out: where to write (bf16 ``(..., n)``); a new tensor when None.
        tile: a key of :data:`TILES`.
        swizzle: 1, 2, 4 or 8.
        raster: a key of :data:`RASTERS`.
        (``tile``, ``swizzle`` and ``raster`` default to the launch :data:`TALL` picks.)

    Returns:
        ``out`` (or the new tensor), ``(..., n)`` bf16.

    Raises:
        ValueError: an unknown epilogue, tile, swizzle or raster, ``c`` missing or given where it is not read,
            operands of the wrong dtype, shape or layout, or a device :func:`available` refuses.
        RuntimeError: CUTLASS refused or failed the launch.
    """
    q, s = rows
    n, k = weight.data.shape
    if epilogue not in EPILOGUES:
        raise ValueError(f"fp8_cutlass.gemm: epilogue must be one of {sorted(EPILOGUES)}, got {epilogue!r}")
    m = q.numel() // k if k else 0
    tall = m >= TALL
    tile = ("cooperative_128x256" if tall else "pingpong_128x128") if tile is None else tile
    swizzle = 1 if swizzle is None else swizzle
    raster = ("along_n" if tall else "along_m") if raster is None else raster
    if tile not in TILES:
        raise ValueError(f"fp8_cutlass.gemm: tile must be one of {sorted(TILES)}, got {tile!r}")
    if swizzle not in (1, 2, 4, 8) or raster not in RASTERS:
        raise ValueError(f"fp8_cutlass.gemm: swizzle must be 1, 2, 4 or 8 and raster one of {sorted(RASTERS)}")
    if (c is None) != (epilogue in ("scale", "gelu")):
        raise ValueError(f"fp8_cutlass.gemm: epilogue {epilogue!r} {'reads' if c is None else 'takes no'} c")
    if not available(q.device):
        raise ValueError(f"fp8_cutlass.gemm: needs a Hopper GPU, nvcc and nvidia-cutlass's headers ({q.device})")
    lead = q.shape[:-1]
    q2, s2 = q.reshape(m, k), s.reshape(m)
    _matrix("rows", q2, (m, k), E4M3)
    _matrix("weight", weight.data, (n, k), E4M3)
    if s2.dtype != torch.float32 or not s2.is_contiguous() or weight.scale.dtype != torch.float32:
        raise ValueError("fp8_cutlass.gemm: the row and channel scales must be contiguous float32")
    d = torch.empty((m, n), dtype=torch.bfloat16, device=q.device) if out is None else out.view(m, n)
    _matrix("out", d, (m, n), torch.bfloat16)
    c2 = None if c is None else c.view(m, n)
    if c2 is not None:
        _matrix("c", c2, (m, n), torch.bfloat16)
    if m:
        lib = _library()
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        tid, eid = TILES[tile], EPILOGUES[epilogue]
        size = lib.flashrt_fp8_gemm_workspace(tid, eid, m, n, k, sms)
        ws = torch.empty(size, dtype=torch.uint8, device=q.device) if size else None
        status = lib.flashrt_fp8_gemm(
            tid, eid, q2.data_ptr(), q2.stride(0), weight.data.data_ptr(), weight.data.stride(0), s2.data_ptr(),
            weight.scale.data_ptr(), 0 if c2 is None else c2.data_ptr(), 0 if c2 is None else c2.stride(0),
            d.data_ptr(), d.stride(0), m, n, k, sms, swizzle, RASTERS[raster], 0 if ws is None else ws.data_ptr(), size,
            torch.cuda.current_stream(q.device).cuda_stream,
        )  # fmt: skip
        if status:
            raise RuntimeError(f"fp8_cutlass.gemm: {_STATUS.get(status, status)} (m={m}, n={n}, k={k}, {tile})")
    return d.view(*lead, n)
