"""The flow-matching step around the action expert, on weights folded at load time.

At Euler step ``s`` the expert's input is ``time_in([action_in(x); te_s])``: linear in ``x`` with
a per-step constant, so it folds to ``x @ wx.T + bias[s]`` (``wx = W_ta W_in``,
``bias[s] = W_ta b_in + W_tt te_s + b_t``); the update ``x - action_out(norm(h)) / steps`` folds
the ``-1/steps`` into the output projection. Between two passes of the expert's layers:

- :func:`euler_step`: ``x + rms_norm(h) @ w_out.T + b_out`` -> the next ``x``, ``(N, H, A)``;
- :func:`time_embed`: ``silu(x @ wx.T + bias)``, ``(N, H, E)``, then the time MLP's output layer
  ``@ w2.T + b2`` -> the expert's input.

:func:`flow_input` runs the three as one kernel where the rows are few and narrow (``tiny`` up to
32 slots): each program takes 16 rows and a block of the input's columns, and recomputes the
update and the embedding of its rows (a few hundred products) rather than wait for another
kernel. A denoise of 10 steps then launches 11 kernels here instead of 30.

Folded weights are float32 (computed once per weights by the model); ``x`` stays float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.backend import dependent_launch, tl, triton, use_triton
from kernels.matmul import MAX_ROWS, linear
from kernels.norm import add_rms_norm_reference

FUSED_MAX_WIDTH = 256
FUSED_MAX_ACTIONS = 4
"""Widest expert and action rows :func:`flow_input` takes its fused kernel for (a program holds a
16-row block of the expert's last hidden state whole, and the update's products as one
(16, A, E) tensor); wider rows (``pi0``: 1 024 by 32) take the three kernels."""


def time_embed_reference(x: torch.Tensor, wx: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference of :func:`time_embed`."""
    return F.silu(x.float() @ wx.T + bias).to(dtype)


def euler_step_reference(
    x: torch.Tensor, h: torch.Tensor, norm_w: torch.Tensor, w_out: torch.Tensor, b_out: torch.Tensor, eps: float
) -> torch.Tensor:
    """Torch reference of :func:`euler_step`."""
    y = add_rms_norm_reference(h, None, norm_w, eps)[1]
    return x + y.float() @ w_out.T + b_out


def flow_input_reference(
    x: torch.Tensor,
    wx: torch.Tensor,
    bias: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    update: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`flow_input`."""
    if update is not None:
        x = euler_step_reference(x, *update)
    return x, F.linear(time_embed_reference(x, wx, bias, w2.dtype), w2, b2)


if triton is not None:
    from kernels.backend import inputs_ready

    @triton.jit
    def _time_embed_kernel(
        x, wx, bias, out, E, A: tl.constexpr, A_PAD: tl.constexpr, BE: tl.constexpr, GDC: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1) * BE + tl.arange(0, BE)
        a = tl.arange(0, A_PAD)
        w = tl.load(wx + e[:, None] * A + a[None, :], mask=(e[:, None] < E) & (a[None, :] < A), other=0.0)
        b = tl.load(bias + e, mask=e < E, other=0.0)
        inputs_ready(GDC)  # the folded weights are constants of the graph: loaded before the wait
        xe = tl.load(x + row * A + a, mask=a < A, other=0.0)
        z = tl.sum(w * xe[None, :], axis=1) + b
        tl.store(out + row * E + e, (z / (1.0 + tl.exp(-z))).to(out.dtype.element_ty), mask=e < E)

    @triton.jit
    def _euler_step_kernel(
        x, h, norm_w, w_out, b_out, x_out, E, eps,
        A: tl.constexpr, A_PAD: tl.constexpr, BE: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        inputs_ready(GDC)
        row = tl.program_id(0).to(tl.int64)
        a = tl.arange(0, A_PAD)
        ssq = tl.zeros((BE,), dtype=tl.float32)
        for start in range(0, E, BE):
            e = start + tl.arange(0, BE)
            hv = tl.load(h + row * E + e, mask=e < E, other=0.0).to(tl.float32)
            ssq += hv * hv
        r = 1.0 / tl.sqrt(tl.sum(ssq, axis=0) / E + eps)
        acc = tl.zeros((A_PAD,), dtype=tl.float32)
        for start in range(0, E, BE):
            e = start + tl.arange(0, BE)
            hv = tl.load(h + row * E + e, mask=e < E, other=0.0)
            nw = tl.load(norm_w + e, mask=e < E, other=0.0).to(tl.float32)
            y = ((hv.to(tl.float32) * r).to(hv.dtype).to(tl.float32) * nw).to(hv.dtype).to(tl.float32)
            w = tl.load(w_out + a[:, None] * E + e[None, :], mask=(a[:, None] < A) & (e[None, :] < E), other=0.0)
            acc += tl.sum(w * y[None, :], axis=1)
        xa = tl.load(x + row * A + a, mask=a < A, other=0.0)
        tl.store(x_out + row * A + a, xa + acc + tl.load(b_out + a, mask=a < A, other=0.0), mask=a < A)

    @triton.jit
    def _flow_input_kernel(
        x, h, norm_w, w_out, b_out, x_out, wx, bias, w2, b2, out, rows, E, eps,
        UPDATE: tl.constexpr, A: tl.constexpr, A_PAD: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
        GDC: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        # Program (i, j): rows i*16.. and the expert input's columns j*BN..; with UPDATE, x is
        # first moved by the Euler update (every program computes it for its rows, program j = 0
        # stores it). Every weight is a constant of the graph: all are loaded before the wait.
        ks = tl.arange(0, BK)
        kin = ks < E
        a = tl.arange(0, A_PAD)
        ain = a < A
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        w = tl.load(w2 + cols[:, None] * E + ks[None, :], mask=(cols < E)[:, None] & kin[None, :], other=0.0)
        b = tl.load(b2 + cols, mask=cols < E, other=0.0).to(tl.float32)
        wt = tl.load(wx + ks[:, None] * A + a[None, :], mask=kin[:, None] & ain[None, :], other=0.0)  # (BK, A_PAD)
        bt = tl.load(bias + ks, mask=kin, other=0.0)
        if UPDATE:
            nw = tl.load(norm_w + ks, mask=kin, other=0.0).to(tl.float32)
            wo = tl.load(w_out + a[:, None] * E + ks[None, :], mask=ain[:, None] & kin[None, :], other=0.0)
            bo = tl.load(b_out + a, mask=ain, other=0.0)
        inputs_ready(GDC)
        row = tl.program_id(0).to(tl.int64) * 16 + tl.arange(0, 16)
        live = row < rows
        xr = tl.load(x + row[:, None] * A + a[None, :], mask=live[:, None] & ain[None, :], other=0.0)  # (16, A_PAD)
        if UPDATE:  # x + rms_norm(h) @ w_out.T + b_out, rounded as euler_step
            hv = tl.load(h + row[:, None] * E + ks[None, :], mask=live[:, None] & kin[None, :], other=0.0)
            hf = hv.to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=1) / E + eps)
            y = ((hf * r[:, None]).to(hv.dtype).to(tl.float32) * nw[None, :]).to(hv.dtype).to(tl.float32)
            xr = xr + tl.sum(y[:, None, :] * wo[None, :, :], axis=2) + bo[None, :]
            if tl.program_id(1) == 0:
                tl.store(x_out + row[:, None] * A + a[None, :], xr, mask=live[:, None] & ain[None, :])
        z = tl.sum(xr[:, None, :] * wt[None, :, :], axis=2) + bt[None, :]  # (16, BK)
        te = (z / (1.0 + tl.exp(-z))).to(w.dtype)  # silu, rounded as time_embed
        acc = tl.dot(te, tl.trans(w), input_precision=PRECISION) + b[None, :]  # (16, BN)
        dst = out + row[:, None] * E + cols[None, :]
        tl.store(dst, acc.to(out.dtype.element_ty), mask=live[:, None] & (cols < E)[None, :])


def time_embed_triton(x: torch.Tensor, wx: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The Triton kernel (called by :func:`time_embed` on CUDA)."""
    e, a = wx.shape
    out = torch.empty((*x.shape[:-1], e), dtype=dtype, device=x.device)
    rows = x.numel() // a
    be = min(128, triton.next_power_of_2(e))
    grid = (rows, triton.cdiv(e, be))
    if rows:
        _time_embed_kernel[grid](
            x.contiguous(), wx.contiguous(), bias, out, e, A=a, A_PAD=triton.next_power_of_2(a), BE=be,
            **dependent_launch(x.device, grid[0] * grid[1]),
        )  # fmt: skip
    return out


def euler_step_triton(
    x: torch.Tensor, h: torch.Tensor, norm_w: torch.Tensor, w_out: torch.Tensor, b_out: torch.Tensor, eps: float
) -> torch.Tensor:
    """The Triton kernel (called by :func:`euler_step` on CUDA)."""
    a, e = w_out.shape
    out = torch.empty_like(x)
    rows = x.numel() // a
    a_pad = triton.next_power_of_2(a)
    if rows:
        _euler_step_kernel[(rows,)](
            x.contiguous(), h.contiguous(), norm_w, w_out.contiguous(), b_out, out, e, eps,
            A=a, A_PAD=a_pad, BE=min(triton.next_power_of_2(e), max(64, 4096 // a_pad)),
            **dependent_launch(x.device, rows),
        )  # fmt: skip
    return out


def _flow_input_fits(x: torch.Tensor, wx: torch.Tensor, w2: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether a :func:`flow_input` call takes the fused kernel (few, narrow rows)."""
    e, a = wx.shape
    few = x.numel() <= MAX_ROWS * a and 16 <= e <= FUSED_MAX_WIDTH and a <= FUSED_MAX_ACTIONS
    return few and w2.shape == (e, e) and use_triton(x, wx, w2, *tensors)


def flow_input_triton(
    x: torch.Tensor,
    wx: torch.Tensor,
    bias: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    update: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused Triton kernel (called by :func:`flow_input` on CUDA for few, narrow rows)."""
    e, a = wx.shape
    rows = x.numel() // a
    x = x.contiguous()
    out = torch.empty((*x.shape[:-1], e), dtype=w2.dtype, device=x.device)
    x_out = x if update is None else torch.empty_like(x)
    h, norm_w, w_out, b_out, eps = (x, x, x, x, 0.0) if update is None else update  # x: unused stand-ins
    bk = max(16, triton.next_power_of_2(e))
    bn = max(16, min(64, 16384 // bk))  # the blocks of kernels.matmul's few-row projection
    grid = (triton.cdiv(rows, 16), triton.cdiv(e, bn))
    if rows:
        _flow_input_kernel[grid](
            x, h.contiguous(), norm_w, w_out.contiguous(), b_out, x_out, wx.contiguous(), bias, w2.contiguous(),
            b2, out, rows, e, eps, UPDATE=update is not None, A=a, A_PAD=triton.next_power_of_2(a), BK=bk, BN=bn,
            PRECISION="ieee" if w2.dtype == torch.float32 else "tf32",
            num_warps=4, **dependent_launch(x.device, grid[0] * grid[1]),
        )  # fmt: skip
    return x_out, out


def time_embed(x: torch.Tensor, wx: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``silu(x @ wx.T + bias)`` in ``dtype``: x ``(..., A)`` float32, wx ``(E, A)``, bias ``(E,)``
    float32 -> ``(..., E)``."""
    if x.dtype != torch.float32 or wx.shape[1:] != x.shape[-1:] or bias.shape != wx.shape[:1]:
        raise ValueError(
            f"time_embed: x (..., A) float32, wx (E, A), bias (E,); got {tuple(x.shape)} {x.dtype}, "
            f"{tuple(wx.shape)}, {tuple(bias.shape)}"
        )
    if use_triton(x, wx, bias):
        return time_embed_triton(x, wx, bias, dtype)
    return time_embed_reference(x, wx, bias, dtype)


def euler_step(
    x: torch.Tensor,
    h: torch.Tensor,
    norm_w: torch.Tensor,
    w_out: torch.Tensor,
    b_out: torch.Tensor,
    eps: float = 1e-6,
) -> torch.Tensor:
    """One folded Euler update ``x + rms_norm(h) * norm_w @ w_out.T + b_out`` (a new tensor).

    Args:
        x: ``(..., A)`` float32 actions at the current time.
        h: ``(..., E)`` the expert's last hidden state; norm_w ``(E,)`` its final norm's weight.
        w_out, b_out: ``(A, E)`` / ``(A,)`` float32, the output projection times ``-1/steps``.
    """
    a, e = w_out.shape
    if x.dtype != torch.float32 or x.shape[-1] != a or h.shape[:-1] != x.shape[:-1] or h.shape[-1] != e:
        raise ValueError(
            f"euler_step: x (..., {a}) float32 and h (..., {e}) of one batch shape; got {tuple(x.shape)} "
            f"{x.dtype}, {tuple(h.shape)}"
        )
    if use_triton(x, h, norm_w, w_out, b_out):
        return euler_step_triton(x, h, norm_w, w_out, b_out, eps)
    return euler_step_reference(x, h, norm_w, w_out, b_out, eps)


def flow_input(
    x: torch.Tensor,
    wx: torch.Tensor,
    bias: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor,
    update: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert's input at an Euler step, after that step's update of ``x`` when ``update``.

    Args:
        x: ``(..., A)`` float32 actions.
        wx, bias: ``(E, A)`` / ``(E,)`` float32, the folded time embedding of this step.
        w2, b2: ``(E, E)`` / ``(E,)``, the time MLP's output layer (the model's dtype).
        update: ``(h, norm_w, w_out, b_out, eps)`` of :func:`euler_step`, applied to ``x`` first.

    Returns:
        ``(x', input)``: x after the update (``x`` itself without one) and
        ``silu(x' @ wx.T + bias) @ w2.T + b2`` ``(..., E)`` in ``w2``'s dtype.
    """
    e, a = wx.shape
    if w2.shape != (e, e) or b2.shape != (e,):
        raise ValueError(f"flow_input: w2 ({e}, {e}) and b2 ({e},) for a ({e}, {a}) wx; got {tuple(w2.shape)}, "
                         f"{tuple(b2.shape)}")  # fmt: skip
    h = () if update is None else update[:4]
    if x.dtype == torch.float32 and x.shape[-1:] == (a,) and _flow_input_fits(x, wx, w2, bias, b2, *h):
        if update is None or (update[0].shape == (*x.shape[:-1], e) and update[2].shape == (a, e)):
            return flow_input_triton(x, wx, bias, w2, b2, update)
    if update is not None:
        x = euler_step(x, *update)
    return x, linear(time_embed(x, wx, bias, w2.dtype), w2, b2)
