"""pi0's prefix attention in e4m3 against the bf16 flash kernel the step runs, on one GPU.

The last FP8-only lever for pi0 at batch 64 (docs/FP8.md): the prefix's self-attention (8 query
heads on one key/value head of dim 256, ~800 tokens, 18 layers) with its two products on the
tensor cores in e4m3, at twice bf16's peak. The kernel here is
:mod:`flashrt.policies.attention_long`'s schedule with

- ``q`` quantised per row inside the kernel (its block is loaded once), or read pre-quantised;
- ``k`` in e4m3 with a scale per token, applied to the logits' columns;
- ``v`` in e4m3 with a scale per channel (applied to the output's columns), stored transposed
  (``(d, T)``: the k-major operand Hopper's e4m3 MMA takes), or as rows (Triton transposes it);
- the probabilities rounded to e4m3 before ``P @ V`` (softmax and its sums in float32), or kept in
  bf16 with ``v`` widened to bf16 in the kernel.

Quantising ``k`` and ``v`` is not timed (a real path would fold it into the kernel that writes
them), so the comparison favours FP8. For each ``--batches`` size: µs a call (the mean and the
fastest of ``REPLAYS`` replays of a captured graph of ``CALLS`` calls), TFLOP/s, and the relative
(Frobenius) error on two slots against the float32 attention of the bf16 inputs, against the
float32 attention of the same quantised operands (the kernel's own error), and, as a mutation,
with ``v``'s channel scales shifted by one (must be far).

    python scripts/bench_fp8_attention.py --batches 64 8 --out bench_fp8_attention.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from benchlib import provenance

from flashrt.kernels.backend import tl, triton
from flashrt.policies import PRESETS
from flashrt.policies.attention_long import attention_triton
from flashrt.runtime import atomic_write
from flashrt_gym.sims.tabletop import TabletopConfig

CALLS, REPLAYS = 10, 5
E4M3_MAX = 448.0
TILES = ((128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3), (64, 128, 4, 3), (64, 64, 4, 3))
"""``(BM, BN, warps, stages)`` tried for the e4m3 kernel; the bf16 kernel runs its own choice."""


@triton.jit
def _e4m3_flash_kernel(
    q, k, ks, v, vs, out,
    sq_n, sq_h, sq_t, sk_n, sk_g, sk_t, sks_n, sks_g, sv_n, sv_g, sv_r, svs_n, svs_g, so_n, so_t, so_h,
    TQ, TK, GROUP, KV_HEADS, scale,
    BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
    Q8: tl.constexpr, V_T: tl.constexpr, P8: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(1)
    n, g = pid // KV_HEADS, pid % KV_HEADS
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    live = rows < GROUP * TQ
    head = g * GROUP + rows // TQ
    tok = rows % TQ
    cols = tl.arange(0, D)
    qp = q + n.to(tl.int64) * sq_n + head[:, None] * sq_h + tok[:, None] * sq_t + cols[None, :]
    if Q8:  # pre-quantised with unit scale: timing only
        qb = tl.load(qp, mask=live[:, None], other=0.0)
        qs = tl.full([BM], 1.0, tl.float32)
    else:
        qf = tl.load(qp, mask=live[:, None], other=0.0).to(tl.float32)
        qs = tl.maximum(tl.max(tl.abs(qf), axis=1), 1e-12) / 448.0
        qb = (qf / qs[:, None]).to(tl.float8e4nv)
    qs = qs * scale
    kbase = k + n.to(tl.int64) * sk_n + g * sk_g
    ksbase = ks + n.to(tl.int64) * sks_n + g * sks_g
    vbase = v + n.to(tl.int64) * sv_n + g * sv_g
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in range(0, TK, BN):
        keys = start + tl.arange(0, BN)
        kin = keys < TK
        kb = tl.load(kbase + keys[:, None] * sk_t + cols[None, :], mask=kin[:, None], other=0.0)
        kscale = tl.load(ksbase + keys, mask=kin, other=0.0)
        s = tl.dot(qb, tl.trans(kb)) * qs[:, None] * kscale[None, :]  # float32, log2 units
        s = tl.where(kin[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_T:  # (d, T): k-major for the MMA
            vb = tl.trans(tl.load(vbase + cols[:, None] * sv_r + keys[None, :], mask=kin[None, :], other=0.0))
        else:
            vb = tl.load(vbase + keys[:, None] * sv_r + cols[None, :], mask=kin[:, None], other=0.0)
        if P8:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), vb)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), vb.to(tl.bfloat16))
        m_i = m_new
    vscale = tl.load(vs + n.to(tl.int64) * svs_n + g * svs_g + cols)
    o = acc * vscale[None, :] / l_i[:, None]
    op = out + n.to(tl.int64) * so_n + tok[:, None] * so_t + head[:, None] * so_h + cols[None, :]
    tl.store(op, o.to(out.dtype.element_ty), mask=live[:, None])


class Quantised:
    """``k`` (N, g, T, d) in e4m3 with per-token scales (N, g, T); ``v`` in e4m3 with per-channel
    scales (N, g, d), as rows (N, g, T, d) and transposed (N, g, d, T padded to 16)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_scale = k.float().abs().amax(-1).clamp_min(1e-12) / E4M3_MAX
        self.k = (k.float() / self.k_scale[..., None]).to(torch.float8_e4m3fn)
        self.v_scale = v.float().abs().amax(-2).clamp_min(1e-12) / E4M3_MAX
        self.v_rows = (v.float() / self.v_scale[:, :, None, :]).to(torch.float8_e4m3fn)
        t = v.shape[2]
        self.v_t = torch.zeros(*v.shape[:2], v.shape[3], -(-t // 16) * 16, device=v.device, dtype=torch.float8_e4m3fn)
        self.v_t[..., :t] = self.v_rows.transpose(-1, -2)

    def slots(self, m: int) -> Quantised:
        """The first ``m`` slots (views)."""
        out = object.__new__(Quantised)
        out.__dict__ = {name: t[:m] for name, t in self.__dict__.items()}
        return out


def e4m3_attention(
    q: torch.Tensor, kv: Quantised, tile: tuple[int, int, int, int], v_t: bool = True, p8: bool = True
) -> torch.Tensor:
    """The e4m3 kernel on ``q`` (N, h, T, d; bf16, or e4m3 with unit scales); returns (N, T, h, d) bf16."""
    n, h, tq, d = q.shape
    g, tk = kv.k.shape[1], kv.k.shape[2]
    out = torch.empty((n, tq, h, d), device=q.device, dtype=torch.bfloat16)
    v = kv.v_t if v_t else kv.v_rows
    bm, bn, warps, stages = tile
    _e4m3_flash_kernel[(triton.cdiv(h // g * tq, bm), n * g)](
        q, kv.k, kv.k_scale, v, kv.v_scale, out, *q.stride()[:3], *kv.k.stride()[:3], *kv.k_scale.stride()[:2],
        *v.stride()[:3], *kv.v_scale.stride()[:2], *out.stride()[:3], tq, tk, h // g, g,
        math.log2(math.e) / math.sqrt(d), BM=bm, BN=bn, D=d, Q8=q.dtype == torch.float8_e4m3fn, V_T=v_t, P8=p8,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float32 softmax attention, (N, T, h, d)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    return (torch.softmax(q.float() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v).transpose(1, 2)


def emulated(q: torch.Tensor, kv: Quantised, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """float32 attention of the quantised operands, q quantised per row as the kernel does
    (``v_scale``: the channel scales to dequantise ``v`` with)."""
    qs = q.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    qd = (q.float() / qs).to(torch.float8_e4m3fn).float() * qs
    kd = kv.k.float() * kv.k_scale[..., None]
    vd = kv.v_rows.float() * (kv.v_scale if v_scale is None else v_scale)[:, :, None, :]
    return reference(qd, kd, vd)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def graph_us(fn) -> tuple[float, float]:
    """(mean, fastest) µs a call of ``fn`` replayed ``CALLS`` times in a captured graph."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    return sum(times) / len(times), min(times)


def measure(batch: int, tokens: int, heads: int, kv_heads: int, d: int) -> dict:
    """One batch size's row (see the module docstring)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, tokens, d, device="cuda", generator=gen).bfloat16()
    k = (2 * torch.randn(batch, kv_heads, tokens, d, device="cuda", generator=gen)).bfloat16()
    v = torch.randn(batch, kv_heads, tokens, d, device="cuda", generator=gen).bfloat16()
    kv = Quantised(k, v)
    flop = 4 * batch * heads * tokens * tokens * d
    two, kv2 = slice(0, 2), kv.slots(2)
    exact = reference(q[two], k[two], v[two])
    quantised = emulated(q[two], kv2)
    mean, best = graph_us(lambda: attention_triton(q, k, v, None))
    row: dict = {
        "shape": {"batch": batch, "tokens": tokens, "heads": heads, "kv_heads": kv_heads, "d": d},
        "bf16": {"us_mean": mean, "us_best": best, "tflops": flop / best / 1e6,
                 "err_vs_fp32": rel(attention_triton(q[two], k[two], v[two], None), exact)},
    }  # fmt: skip
    q8 = (q.float() / q.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) * E4M3_MAX).to(torch.float8_e4m3fn)
    variants = [(f"e4m3_{'x'.join(map(str, t))}", t, True, True, False) for t in TILES]
    variants += [
        ("e4m3_128x128x8x2_q_prequantised", (128, 128, 8, 2), True, True, True),
        ("e4m3_128x128x8x2_v_rows", (128, 128, 8, 2), False, True, False),
        ("e4m3_qk_bf16_pv_128x128x8x2", (128, 128, 8, 2), True, False, False),
    ]
    for name, tile, v_t, p8, q_pre in variants:
        mean, best = graph_us(lambda: e4m3_attention(q8 if q_pre else q, kv, tile, v_t, p8))  # noqa: B023
        speed = row["bf16"]["us_best"] / best
        entry = {"us_mean": mean, "us_best": best, "tflops": flop / best / 1e6, "vs_bf16": speed}
        if not q_pre:  # its q scales are not the data's: timing only
            out = e4m3_attention(q[two], kv2, tile, v_t, p8)
            entry |= {"err_vs_fp32": rel(out, exact), "err_vs_quantised_fp32": rel(out, quantised)}
        row[name] = entry
    shifted = e4m3_attention(q[two], kv2, TILES[1])
    row["mutation_v_scales_shifted"] = {
        "err_vs_fp32": rel(emulated(q[two], kv2, kv2.v_scale.roll(1, -1)), exact),
        "kernel_err_vs_mutated": rel(shifted, emulated(q[two], kv2, kv2.v_scale.roll(1, -1))),
    }
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[64, 8])
    p.add_argument("--out", type=Path, default=Path("bench_fp8_attention.json"))
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("bench_fp8_attention.py needs a GPU with e4m3 tensor cores (compute capability 9.0, Hopper)")
    cfg = PRESETS["lerobot_pi0"](TabletopConfig().vocabulary)
    result = {"provenance": provenance(), "calls": CALLS, "replays": REPLAYS, "rows": {}}
    for batch in args.batches:
        row = measure(batch, cfg.frame_tokens, cfg.heads, cfg.kv_heads, cfg.head_dim)
        result["rows"][str(batch)] = row
        print(json.dumps({batch: row}), flush=True)
    atomic_write(args.out, lambda f: f.write(json.dumps(result, indent=1).encode()))
    print(f"\n{'batch':>5} {'variant':<36} {'us mean':>9} {'us best':>9} {'TFLOP/s':>8} {'x bf16':>7} {'err fp32':>9}")
    for batch, row in result["rows"].items():
        for name, e in row.items():
            if isinstance(e, dict) and "us_best" in e:
                err = e.get("err_vs_fp32")
                print(f"{batch:>5} {name:<36} {e['us_mean']:>9.1f} {e['us_best']:>9.1f} {e['tflops']:>8.0f} "
                      f"{e.get('vs_bf16', 1.0):>7.2f} {'' if err is None else f'{err:.4f}':>9}")  # fmt: skip


if __name__ == "__main__":
    main()
