"""Linear layers over few rows: ``a @ W^T (+ bias)``, or accumulated onto a residual in place.

At one slot a projection is a few rows by a few hundred columns, and its cost is the launch and
the weight's trip from L2, not arithmetic: there a Triton program per column block is faster
than cuBLAS. Inside a captured graph the Triton kernel also starts before the kernel ahead of it
finishes (programmatic dependent launch, :mod:`flashrt.kernels.backend`): it loads its weight
block first and waits for its input after, which cuBLAS cannot (measurements: docs/PERFORMANCE.md,
"Kernels: the measurements behind their design"). So the action expert's output and down
projections, its time MLP's output layer and the vision tower's projections at one slot run
here, and the policy step at one slot is all Triton but for a few elementwise ops.

A program holds ``BN`` weight rows whole (``k`` at most :data:`MAX_K`) and 16 input rows. Wider
inputs (up to :data:`MAX_LOOP_K`: pi0's expert output projection, 2048 wide) and weights larger
than :data:`MAX_WEIGHT` (pi0.5's expert q/k/v and gate/up), over at most :data:`LOOP_ROWS` rows,
take a second kernel that sweeps ``k`` in blocks: a program holds every row and 16 to 64 weight
rows, so the weight is read once, by as many programs as possible.
Either way the product is rounded once to the output dtype after the bias or the residual is
added (and the GELU of :func:`linear_gelu` taken) in float32, as cuBLAS's ``addmm`` and
cuBLASLt's GELU epilogue round. More rows or wider inputs take cuBLAS, which is faster there
(pi0's down projection, 4096 wide: docs/PERFORMANCE.md).

The blocked kernel also takes a gated MLP's input half, :func:`linear_geglu`: a program sweeps
matching gate and up rows and takes ``gelu_tanh(gate) * up`` in its epilogue, so the gate/up
product is never written (one kernel where the expert ran two). Over more rows and inputs up to
:data:`TILE_MAX_K` wide (``tiny``'s layers at many slots) the same kernel runs in tiles of
:data:`TILE_ROWS` rows, a grid of row blocks by column blocks: there cuBLAS's product would
write ``(rows, 2m)`` and :func:`flashrt.kernels.gelu_mul` read it back; the tiles keep the pair
in registers, which saves that buffer and its bytes and ties with or beats cuBLAS's faster GEMM
at ``tiny``'s shapes (docs/PERFORMANCE.md).

A blocked sweep is a chain of dependent steps a program, so its time follows the steps, not the
rows (docs/PERFORMANCE.md). :func:`linear_partials` splits a wide input's ``k`` over several
programs a column block, each sweeping a slice, and leaves the float32 partial products
(:class:`PartialProduct`) to the kernel that reads the product anyway: the residual add before
a norm (:func:`flashrt.kernels.add_rms_norm`), which sums them in order. No reduce kernel runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from flashrt.kernels.activation import gelu_mul, gelu_mul_reference
from flashrt.kernels.backend import check_layout, dependent_launch, sm_count, tl, triton, use_triton

MAX_ROWS = 256
MAX_K = 1024
"""Most rows and widest inputs a call takes the Triton kernel for (``tiny``'s expert at up to 32
slots; its down projection is 768 wide). Beyond them cuBLAS's tiled GEMM wins."""
MAX_WEIGHT = 1 << 20
"""Largest weight (elements) the whole-row kernel takes: it reads the weight once per 16 rows, so
a big one over a few dozen rows (pi0.5's expert q/k/v and gate/up, 2.6 M and 8.4 M elements, at
50 rows) is several times faster in the blocked-``k`` kernel (docs/PERFORMANCE.md). ``tiny``'s
largest is 0.5 M."""
LOOP_ROWS = 64
MAX_LOOP_K = 2048
"""Most rows and widest inputs the blocked-``k`` kernel takes (one block of rows, so each weight
row is read by one program)."""
TILE_ROWS, TILE_COLS, TILE_WARPS, TILE_STAGES = 128, 64, 8, 3
"""A program of :func:`linear_geglu`'s tiled kernel: rows, output columns (as many gate and up
rows of the weight each), warps, and pipeline stages of its ``k`` sweep (64 bf16 elements a
step). ``scripts/bench_geglu.py --sweep`` times other tiles at the policies' shapes."""
TILE_MAX_K = 512
"""The widest input :func:`linear_geglu` takes its tiled kernel for over more than
:data:`LOOP_ROWS` rows. Per gated output the chain moves 10 bytes
in bf16 (the gate/up pair written and read back, the product written) for ``4k`` FLOPs, the
tiles 2 bytes: up to this width the bytes saved make up for the tiles' lower FLOP rate than
cuBLAS's; wider inputs (pi0's 1 024 and 2 048) are arithmetic-bound, and cuBLAS's GEMM wins
there."""
MAX_TILE_BLOCKS = 65535
"""Most row blocks of a tiled launch (CUDA's limit on a grid's second dimension)."""
SPLIT_BN = 32
SPLITS = (8, 4, 2)
SPLIT_MAX_K = 4096
"""Weight rows a program of the split-``k`` kernel takes, the slice counts of ``k`` it tries, most
first, and the widest input it takes (pi0's expert output and down projections, 2 048 and 4 096
wide, 1 024 outputs, at 50 rows: 4 slices, 128 programs, measured fastest: docs/PERFORMANCE.md)."""


class PartialProduct(NamedTuple):
    """``a @ W^T`` as ``parts`` ``(S, ..., n)`` float32: the products of ``S`` consecutive slices
    of ``k``. The kernel that consumes it sums them in order (``parts[0] + parts[1] + ...``), so
    no kernel of its own reduces them (:func:`linear_partials`)."""

    parts: torch.Tensor

    def total(self) -> torch.Tensor:
        """The parts summed in their order: float32 ``(..., n)``, as a consumer kernel sums them."""
        total = self.parts[0]
        for part in self.parts[1:]:
            total = total + part
        return total


def linear_gelu_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`linear_gelu`."""
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def linear_geglu_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`linear_geglu`."""
    return gelu_mul_reference(F.linear(x, weight))


def add_matmul_reference(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`add_matmul` (in place unless autograd records through it; any
    strides of x, e.g. a slot buffer's view, which no flat view of its rows covers)."""
    a2 = a.reshape(-1, a.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or a.requires_grad or weight.requires_grad):
        return torch.addmm(x.reshape(-1, x.shape[-1]), a2, weight.t()).view(x.shape)
    if x.is_contiguous():
        x.view(-1, x.shape[-1]).addmm_(a2, weight.t())
    else:  # the same product and rounding, then copied into x's strides
        x.copy_(torch.addmm(x.reshape(-1, x.shape[-1]), a2, weight.t()).view(x.shape))
    return x


if triton is not None:
    from flashrt.kernels.activation import geglu
    from flashrt.kernels.backend import inputs_ready

    @triton.jit
    def _linear_kernel(
        a, weight, bias, out, rows, K, N, s_bias,
        HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, GELU: tl.constexpr, BM: tl.constexpr,
        BN: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        w = tl.load(weight + cols[:, None] * K + ks[None, :], mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
        if HAS_BIAS:
            b = tl.load(bias + cols * s_bias, mask=cols < N, other=0.0).to(tl.float32)
        inputs_ready(GDC)  # the weight is a constant of the graph: loaded before the wait
        row = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        live = row < rows
        x = tl.load(a + row[:, None] * K + ks[None, :], mask=live[:, None] & (ks[None, :] < K), other=0.0)
        acc = tl.dot(x, tl.trans(w), input_precision=PRECISION)  # (BM, BN) float32
        if HAS_BIAS:
            acc += b[None, :]
        _finish(acc, out, row, live, cols, N, ACCUMULATE, GELU)

    @triton.jit
    def _finish(acc, out, row, live, cols, N, ACCUMULATE: tl.constexpr, GELU: tl.constexpr):
        """Add the residual and take the GELU on the float32 product, then round once and store."""
        dst = out + row[:, None] * N + cols[None, :]
        keep = live[:, None] & (cols < N)[None, :]
        if ACCUMULATE:
            acc += tl.load(dst, mask=keep, other=0.0).to(tl.float32)
        if GELU:  # tanh form, on the float32 accumulator
            z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
            acc = 0.5 * acc * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
        tl.store(dst, acc.to(out.dtype.element_ty), mask=keep)

    @triton.jit
    def _linear_loop_kernel(
        a, weight, bias, out, rows, K, N, s_bias,
        HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, GELU: tl.constexpr, GEGLU: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # Program (j, i): rows i*BM.. (one block, i = 0, unless tiled) by weight rows j*BN.., k
        # swept in BK blocks (pipelined). GEGLU: output columns j*BN.. of N, from gate rows j*BN..
        # and up rows N + j*BN.. . The column blocks of a row block run together and share its
        # rows in L2.
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        row = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)
        live = row < rows
        ks = tl.arange(0, BK)
        inputs_ready(GDC)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        up = tl.zeros((BM, BN), dtype=tl.float32)
        w_rows = weight + cols[:, None].to(tl.int64) * K
        for k0 in range(0, K, BK):
            kin = (k0 + ks) < K
            x = tl.load(a + row[:, None] * K + (k0 + ks)[None, :], mask=live[:, None] & kin[None, :], other=0.0)
            w_mask = (cols[:, None] < N) & kin[None, :]
            w = tl.load(w_rows + (k0 + ks)[None, :], mask=w_mask, other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
            if GEGLU:
                wu = tl.load(w_rows + N.to(tl.int64) * K + (k0 + ks)[None, :], mask=w_mask, other=0.0)
                up += tl.dot(x, tl.trans(wu), input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias + cols * s_bias, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if GEGLU:  # rounded as the chain kernels.linear -> kernels.gelu_mul rounds
            dtype = out.dtype.element_ty
            acc = geglu(acc.to(dtype).to(tl.float32), up.to(dtype).to(tl.float32), dtype)
        _finish(acc, out, row, live, cols, N, ACCUMULATE, GELU)

    @triton.jit
    def _split_kernel(
        a, weight, parts, rows, K, N, KS,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # Program (j, s): every row (at most BM) by weight rows j*BN.., k slice s*KS.. swept in BK
        # blocks (pipelined); the float32 product stored as part s.
        cols = tl.program_id(0) * BN + tl.arange(0, BN)
        s = tl.program_id(1)
        row = tl.arange(0, BM)
        live = row < rows
        ks = tl.arange(0, BK)
        inputs_ready(GDC)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        w_rows = weight + cols[:, None].to(tl.int64) * K
        for k0 in range(s * KS, s * KS + KS, BK):
            x = tl.load(a + row[:, None] * K + (k0 + ks)[None, :], mask=live[:, None], other=0.0)
            w = tl.load(w_rows + (k0 + ks)[None, :], mask=(cols < N)[:, None], other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        dst = parts + (s * rows + row[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(dst, acc, mask=live[:, None] & (cols < N)[None, :])


def _launch(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    accumulate: bool = False,
    gelu: bool = False,
    geglu: bool = False,
) -> None:
    """Run ``a @ weight^T`` (+ bias, + out, GELU) into ``out``; ``geglu``: the blocked kernel's
    ``gelu_tanh(gate) * up`` over the weight's two halves (``out`` has half its rows' columns)."""
    check_layout("kernels.matmul", "a", a, contiguous=True)
    check_layout("kernels.matmul", "weight", weight, contiguous=True)
    check_layout("kernels.matmul", "out", out, contiguous=True)
    n, k = weight.shape
    rows = a.numel() // k
    if not rows:
        return
    args = (a, weight, out if bias is None else bias, out, rows, k, n, 1 if bias is None else bias.stride(0))
    options = dict(
        HAS_BIAS=bias is not None, ACCUMULATE=accumulate, GELU=gelu,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=4,
    )  # fmt: skip
    if geglu and rows > LOOP_ROWS:  # tiles of rows by columns (each half's, then the GeGLU)
        n = n // 2
        grid = (triton.cdiv(n, TILE_COLS), triton.cdiv(rows, TILE_ROWS))
        options.update(num_warps=TILE_WARPS)
        _linear_loop_kernel[grid](
            *args[:6], n, *args[7:], GEGLU=True, BM=TILE_ROWS, BN=TILE_COLS, BK=128 // a.element_size(),
            num_stages=TILE_STAGES, **options, **dependent_launch(a.device, grid[0] * grid[1]),
        )  # fmt: skip
        return
    if geglu or not _whole_rows(rows, k, n):  # blocked k: every row in one program
        bn, bk = loop_tiles(n, a.element_size())
        if geglu:  # half the rows a program, from each half: the same weight bytes
            n, bn = n // 2, max(16, bn // 2)
            args = (*args[:6], n, *args[7:])
        grid = (triton.cdiv(n, bn),)
        bm = max(16, triton.next_power_of_2(rows))
        _linear_loop_kernel[grid](
            *args, GEGLU=geglu, BM=bm, BN=bn, BK=bk, num_stages=4, **options,
            **dependent_launch(a.device, grid[0]),
        )  # fmt: skip
        return
    bk = max(16, triton.next_power_of_2(k))
    bn = max(16, min(64, 16384 // bk))  # a 32 KB bf16 weight block a program
    grid = (triton.cdiv(rows, 16), triton.cdiv(n, bn))
    _linear_kernel[grid](*args, BM=16, BN=bn, BK=bk, **options, **dependent_launch(a.device, grid[0] * grid[1]))


def loop_tiles(n: int, itemsize: int) -> tuple[int, int]:
    """``(BN, BK)`` of the blocked kernel for ``n`` weight rows: the widest of 64, 32 and 16 rows a
    program that still gives 64 programs or more (pi0's 8 192 gate/up rows: 64; 2 560 q/k/v: 32;
    1 024: 16), and ``k`` steps of 256 (16 rows) or 128 bf16 elements, half as many in float32,
    so that 4 steps of a 64-row block and the weight block fit in shared memory (the tiles
    measured fastest: docs/PERFORMANCE.md)."""
    bn = next((bn for bn in (64, 32) if n >= 64 * bn), 16)
    return bn, (256 if bn == 16 else 128) * 2 // itemsize


def splits(a: torch.Tensor, weight: torch.Tensor) -> int:
    """Slices of ``k`` that :func:`linear_partials` splits ``a @ weight^T`` into on its kernel, or 0
    where the kernel does not take the call: inputs wider than :data:`MAX_K` (to
    :data:`SPLIT_MAX_K`) over at most :data:`LOOP_ROWS` rows, on Triton. The most slices of
    :data:`SPLITS` that keep every program on an SM of its own (a dependent launch) and cut ``k``
    into whole blocks."""
    n, k = weight.shape
    rows = a.numel() // max(k, 1)
    if not (MAX_K < k <= SPLIT_MAX_K and 0 < rows <= LOOP_ROWS) or a.dtype != weight.dtype:
        return 0
    if not (weight.is_contiguous() and use_triton(a, weight)):
        return 0
    bk = _split_bk(a.element_size())
    blocks = triton.cdiv(n, SPLIT_BN)
    return next((s for s in SPLITS if blocks * s <= sm_count(a.device) and k % (s * bk) == 0), 0)


def _split_bk(itemsize: int) -> int:
    """The split kernel's ``k`` step: 128 bf16 elements, 64 float32 (the blocked kernel's tiles)."""
    return 256 // itemsize


def linear_partials(a: torch.Tensor, weight: torch.Tensor) -> PartialProduct:
    """``a @ weight^T`` for ``a (..., k)``, ``weight (n, k)`` as float32 partial products over
    slices of ``k`` (:class:`PartialProduct` ``(S, ..., n)``), for a consumer that adds the
    product to the residual stream (:func:`flashrt.kernels.add_rms_norm`,
    :func:`flashrt.kernels.add_ada_rms_norm`, :func:`flashrt.kernels.gated_add`). ``a`` may have
    any strides (a strided one is read through a contiguous copy).

    Where :func:`splits` says so, one launch of ``S`` programs a block of :data:`SPLIT_BN`
    weight rows, each sweeping ``k / S``; elsewhere one part, the float32 product."""
    _check("linear_partials", a, weight)
    s = splits(a, weight)
    if not s:
        return PartialProduct(F.linear(a.float(), weight.float()).unsqueeze(0))
    a = a.contiguous()  # the weight is (splits takes only contiguous ones)
    n, k = weight.shape
    rows = a.numel() // k
    parts = torch.empty((s, *a.shape[:-1], n), device=a.device, dtype=torch.float32)
    grid = (triton.cdiv(n, SPLIT_BN), s)
    _split_kernel[grid](
        a, weight, parts, rows, k, n, k // s, BM=max(16, triton.next_power_of_2(rows)), BN=SPLIT_BN,
        BK=_split_bk(a.element_size()), PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=4, **dependent_launch(a.device, grid[0] * grid[1]),
    )  # fmt: skip
    return PartialProduct(parts)


def _whole_rows(rows: int, k: int, n: int) -> bool:
    """Whether a call within the kernels' limits takes the whole-row kernel (else the blocked one)."""
    return k <= MAX_K and rows <= MAX_ROWS and n * k <= MAX_WEIGHT


def _blocked_rows(rows: int, k: int) -> bool:
    """Whether the blocked-``k`` kernel can take a call (its one block of rows, inputs up to
    :data:`MAX_LOOP_K` wide)."""
    return k <= MAX_LOOP_K and rows <= LOOP_ROWS


def _tiled_rows(rows: int, k: int) -> bool:
    """Whether :func:`linear_geglu`'s tiled kernel can take a call the blocked one cannot (more
    than :data:`LOOP_ROWS` rows of inputs up to :data:`TILE_MAX_K` wide)."""
    return k <= TILE_MAX_K and LOOP_ROWS < rows <= MAX_TILE_BLOCKS * TILE_ROWS


def _fits(
    a: torch.Tensor, weight: torch.Tensor, *tensors: torch.Tensor, blocked: bool = False, tiled: bool = False
) -> bool:
    """Whether a call takes a Triton kernel (``blocked``: the blocked-``k`` one, ``tiled`` also its
    tiles over many rows; else torch, which also reports dtype mismatches)."""
    n, k = weight.shape
    rows = a.numel() // max(k, 1)
    few = 16 <= k and (
        _blocked_rows(rows, k) or (tiled and _tiled_rows(rows, k)) or (not blocked and _whole_rows(rows, k, n))
    )
    same = all(t.dtype == a.dtype for t in (weight, *tensors))
    return few and same and weight.is_contiguous() and use_triton(a, weight, *tensors)


def _check(name: str, a: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 2 or a.shape[-1:] != weight.shape[1:]:
        raise ValueError(
            f"{name}: the weight must be (out, {a.shape[-1]}) as nn.Linear stores it for inputs "
            f"(..., {a.shape[-1]}), got {tuple(weight.shape)}"
        )


def linear(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(a, weight, bias)``: a ``(..., k)``, weight ``(n, k)``, bias ``(n,)`` -> ``(..., n)``."""
    _check("linear", a, weight)
    if _fits(a, weight, *([] if bias is None else [bias])):
        out = a.new_empty((*a.shape[:-1], weight.shape[0]))
        _launch(a.contiguous(), weight, bias, out)
        return out
    return F.linear(a, weight, bias)


def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x @ weight.T + bias)`` for ``x (..., k)``, ``weight (m, k)``, ``bias (m,)``.

    On CUDA the GELU is taken on the float32 accumulator (rounded once; the reference rounds the
    product, then the GELU): in this module's kernel over few rows, else in the epilogue of one
    cuBLASLt matmul, so no pass over the (tokens x m) output runs apart from it."""
    _check("linear_gelu", x, weight)
    if _fits(x, weight, bias):
        out = x.new_empty((*x.shape[:-1], weight.shape[0]))
        _launch(x.contiguous(), weight, bias, out, gelu=True)
        return out
    if x.is_cuda and use_triton(x, weight, bias):  # cuBLASLt's bias + GELU (tanh) epilogue
        out = torch._addmm_activation(bias, x.reshape(-1, x.shape[-1]), weight.t(), use_gelu=True)
        return out.view(*x.shape[:-1], weight.shape[0])
    return linear_gelu_reference(x, weight, bias)


def linear_geglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x @ W_gate^T) * (x @ W_up^T)`` for ``x (..., k)`` and the fused gate/up weight
    ``(2m, k)``, gate rows first -> ``(..., m)``: :func:`flashrt.kernels.gelu_mul` of
    :func:`linear`, rounded as that chain rounds.

    Over few rows (the action expert's tokens) the blocked-``k`` kernel takes it whole, the
    activation in its epilogue; over more rows of inputs up to :data:`TILE_MAX_K` wide, the same
    kernel in tiles; elsewhere (pi0's wide inputs over many rows) the chain runs."""
    _check("linear_geglu", x, weight)
    if weight.shape[0] % 2:
        raise ValueError(
            f"linear_geglu: the weight needs an even row count (gate and up halves), got {weight.shape[0]}"
        )
    if _fits(x, weight, blocked=True, tiled=True):
        out = x.new_empty((*x.shape[:-1], weight.shape[0] // 2))
        _launch(x.contiguous(), weight, None, out, geglu=True)
        return out
    return gelu_mul(linear(x, weight))


def add_matmul(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x + a @ weight^T`` over the last dim: x ``(..., n)``, a ``(..., k)``, weight ``(n, k)``.

    Unless autograd records through it, the product accumulates into ``x`` in place and ``x`` is
    returned (x must be a residual sum no one else reads): an out-of-place add would first copy x,
    one more graph node per layer.
    """
    _check("add_matmul", a, weight)
    if x.shape[:-1] != a.shape[:-1] or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"add_matmul: x {tuple(x.shape)} must be a's rows {tuple(a.shape[:-1])} by the weight's "
            f"{weight.shape[0]} outputs"
        )
    if x.is_contiguous() and _fits(a, weight, x):
        _launch(a.contiguous(), weight, None, x, accumulate=True)
        return x
    return add_matmul_reference(x, a, weight)
