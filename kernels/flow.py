"""The flow-matching step around the action expert, on weights folded at load time.

At Euler step ``s`` the expert's input is ``time_in([action_in(x); te_s])``: linear in ``x`` with
a per-step constant, so it folds to ``x @ wx.T + bias[s]`` (``wx = W_ta W_in``,
``bias[s] = W_ta b_in + W_tt te_s + b_t``); the update ``x - action_out(norm(h)) / steps`` folds
the ``-1/steps`` into the output projection. Two kernels per step remain:

- :func:`time_embed`: ``silu(x @ wx.T + bias)`` -> the expert's input, ``(N, H, E)``;
- :func:`euler_step`: ``x + rms_norm(h) @ w_out.T + b_out`` -> the next ``x``, ``(N, H, A)``.

Folded weights are float32 (computed once per weights by the model); ``x`` stays float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashrt.kernels.backend import check_layout, dependent_launch, tl, triton, use_triton
from flashrt.kernels.norm import add_rms_norm_reference


def time_embed_reference(x: torch.Tensor, wx: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Torch reference of :func:`time_embed`."""
    return F.silu(x.float() @ wx.T + bias).to(dtype)


def euler_step_reference(
    x: torch.Tensor, h: torch.Tensor, norm_w: torch.Tensor, w_out: torch.Tensor, b_out: torch.Tensor, eps: float
) -> torch.Tensor:
    """Torch reference of :func:`euler_step`."""
    y = add_rms_norm_reference(h, None, norm_w, eps)[1]
    return x + y.float() @ w_out.T + b_out


if triton is not None:
    from flashrt.kernels.backend import inputs_ready

    @triton.jit
    def _time_embed_kernel(
        x, wx, bias, out, E, s_bias, A: tl.constexpr, A_PAD: tl.constexpr, BE: tl.constexpr, GDC: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1) * BE + tl.arange(0, BE)
        a = tl.arange(0, A_PAD)
        w = tl.load(wx + e[:, None] * A + a[None, :], mask=(e[:, None] < E) & (a[None, :] < A), other=0.0)
        b = tl.load(bias + e * s_bias, mask=e < E, other=0.0)
        inputs_ready(GDC)  # the folded weights are constants of the graph: loaded before the wait
        xe = tl.load(x + row * A + a, mask=a < A, other=0.0)
        z = tl.sum(w * xe[None, :], axis=1) + b
        tl.store(out + row * E + e, (z / (1.0 + tl.exp(-z))).to(out.dtype.element_ty), mask=e < E)

    @triton.jit
    def _euler_step_kernel(
        x, h, norm_w, w_out, b_out, x_out, E, eps, s_nw, s_b,
        A: tl.constexpr, A_PAD: tl.constexpr, E_PAD: tl.constexpr, GDC: tl.constexpr,
    ):  # fmt: skip
        # One row a program, the whole row at once: the folded weights are constants of the graph,
        # loaded (into registers) before the wait of a dependent launch, so after it only the
        # row's own loads and one reduction are left.
        row = tl.program_id(0).to(tl.int64)
        a, e = tl.arange(0, A_PAD), tl.arange(0, E_PAD)
        w = tl.load(w_out + a[:, None] * E + e[None, :], mask=(a[:, None] < A) & (e[None, :] < E), other=0.0)
        nw = tl.load(norm_w + e * s_nw, mask=e < E, other=0.0).to(tl.float32)
        b = tl.load(b_out + a * s_b, mask=a < A, other=0.0)
        inputs_ready(GDC)
        hv = tl.load(h + row * E + e, mask=e < E, other=0.0)
        hf = hv.to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / E + eps)
        y = ((hf * r).to(hv.dtype).to(tl.float32) * nw).to(hv.dtype).to(tl.float32)
        xa = tl.load(x + row * A + a, mask=a < A, other=0.0)
        tl.store(x_out + row * A + a, xa + tl.sum(w * y[None, :], axis=1) + b, mask=a < A)


def time_embed_triton(x: torch.Tensor, wx: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The Triton kernel (called by :func:`time_embed` on CUDA): x any strides (read through a
    contiguous copy), bias any stride, wx contiguous (loaded before the wait of a dependent
    launch, so never a copy made just ahead)."""
    check_layout("time_embed_triton", "wx", wx, contiguous=True)
    e, a = wx.shape
    out = torch.empty((*x.shape[:-1], e), dtype=dtype, device=x.device)
    rows = x.numel() // a
    be = min(128, triton.next_power_of_2(e))
    grid = (rows, triton.cdiv(e, be))
    if rows:
        _time_embed_kernel[grid](
            x.contiguous(), wx, bias, out, e, bias.stride(0), A=a, A_PAD=triton.next_power_of_2(a), BE=be,
            **dependent_launch(x.device, grid[0] * grid[1]),
        )  # fmt: skip
    return out


def euler_step_triton(
    x: torch.Tensor, h: torch.Tensor, norm_w: torch.Tensor, w_out: torch.Tensor, b_out: torch.Tensor, eps: float
) -> torch.Tensor:
    """The Triton kernel (called by :func:`euler_step` on CUDA): x and h any strides (read
    through contiguous copies), norm_w and b_out any stride, w_out contiguous."""
    check_layout("euler_step_triton", "w_out", w_out, contiguous=True)
    a, e = w_out.shape
    out = x.new_empty(x.shape)  # row-major, as the kernel writes it (empty_like keeps a permuted x's strides)
    rows = x.numel() // a
    a_pad, e_pad = triton.next_power_of_2(a), triton.next_power_of_2(e)
    if rows:  # ~64 weights a thread: 4 warps at least, 16 at most (pi0: 32 x 1024 on 16)
        _euler_step_kernel[(rows,)](
            x.contiguous(), h.contiguous(), norm_w, w_out, b_out, out, e, eps, norm_w.stride(0), b_out.stride(0),
            A=a, A_PAD=a_pad, E_PAD=e_pad, num_warps=min(16, max(4, a_pad * e_pad // 2048)),
            **dependent_launch(x.device, rows),
        )  # fmt: skip
    return out


def time_embed(x: torch.Tensor, wx: torch.Tensor, bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``silu(x @ wx.T + bias)`` in ``dtype``: x ``(..., A)`` float32, wx ``(E, A)``, bias ``(E,)``
    float32 -> ``(..., E)``."""
    if x.dtype != torch.float32 or wx.shape[1:] != x.shape[-1:] or bias.shape != wx.shape[:1]:
        raise ValueError(
            f"time_embed: x (..., A) float32, wx (E, A), bias (E,); got {tuple(x.shape)} {x.dtype}, "
            f"{tuple(wx.shape)}, {tuple(bias.shape)}"
        )
    if use_triton(x, wx, bias) and wx.is_contiguous():
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
    if use_triton(x, h, norm_w, w_out, b_out) and w_out.is_contiguous():
        return euler_step_triton(x, h, norm_w, w_out, b_out, eps)
    return euler_step_reference(x, h, norm_w, w_out, b_out, eps)
