"""Every kernel on the views the pipeline passes it: slot buffers of a slot arena.

A slot buffer is strided along the slot dimension by the arena's row (issue 25: the noise
kernel read every slot's key at ``key + s``, i.e. from slot 0's row). Each test lays its inputs
out in a :class:`flashrt.runtime.BufferSet` among other buffers whose bytes are random, runs the
kernel (on the GPU, or in Triton's CPU interpreter), compares with the torch reference, checks
that no arena byte outside the output changed, and checks beside it that the same comparison
rejects the reference applied as a contiguity-assuming kernel would read (:func:`misread`).
"""

import pytest
import torch

import flashrt.kernels.matmul as kl
from flashrt.kernels.activation import gelu_mul_reference, gelu_mul_triton
from flashrt.kernels.flow import euler_step_reference, euler_step_triton, time_embed_reference, time_embed_triton
from flashrt.kernels.grouped_attention import attention_reference, attention_triton
from flashrt.kernels.matmul import add_matmul, add_matmul_reference, linear
from flashrt.kernels.norm import (
    add_layer_norm_reference,
    add_layer_norm_triton,
    add_rms_norm_reference,
    add_rms_norm_triton,
)
from flashrt.kernels.norm_linear import (
    rms_norm_geglu_reference,
    rms_norm_geglu_triton,
    rms_norm_qkv_rope_reference,
    rms_norm_qkv_rope_triton,
)
from flashrt.kernels.rng import draw_normal_, draw_normal_triton, normal
from flashrt.kernels.rotary import qkv_rope_reference, qkv_rope_triton
from flashrt.kernels.slot_copy import (
    masked_copy_rows,
    masked_copy_rows_reference,
    masked_copy_rows_triton,
    scatter_rows,
    scatter_rows_reference,
    scatter_rows_triton,
)
from flashrt.policies import PolicyConfig
from flashrt.policies.layers import layer_segments
from flashrt.runtime import BufferSet, slot
from tests.kernels.arena import (
    arena,
    assert_only_written,
    fill,
    misread,
    pipeline_prefix,
    policy_arena,
    rebase,
    rejects,
    unit,
    written,
)
from tests.kernels.kernel_devices import DEVICES, close, dtypes

SLOTS = 3
SMALL = PolicyConfig(vocab=("push", "the", "red", "square"), max_text_len=5, image_size=16, patch_size=8,
                     vision_width=32, vision_depth=1, vision_heads=2, vision_mlp=64, width=64, depth=2, heads=2,
                     kv_heads=1, head_dim=32, mlp=128, expert_width=48, expert_mlp=96, horizon=4)  # fmt: skip
"""A policy small enough for the interpreter: 5 instruction tokens, frames of 5, head dim 32."""


def strided(values: torch.Tensor) -> torch.Tensor:
    """``values`` (1-D) as a view with stride 3, e.g. a parameter sliced out of a larger one."""
    holder = torch.zeros(values.shape[0], 3, dtype=values.dtype, device=values.device)
    holder[:, 1] = values
    return holder[:, 1]


# -- per-slot random numbers -------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_draw_normal_reads_and_bumps_each_slots_own_key_and_counter(device):
    specs = [
        slot("policy.noise", (4, 3)),
        slot("policy.rng_key", (), torch.int64),
        slot("policy.rng_counter", (), torch.int64),
    ]
    bufs = arena(specs, 5, device)
    key, counter, noise = bufs["policy.rng_key"], bufs["policy.rng_counter"], bufs["policy.noise"]
    key.copy_(torch.arange(5, device=device) * 7919 - 2**40)  # distinct keys, negative too
    counter.copy_(torch.arange(5, device=device) * 3 + 11)
    out = noise.flatten(1)  # as PolicyPipeline.draw_noise passes it: a view, strided by the row
    assert out.data_ptr() == noise.data_ptr() and out.stride(0) == bufs.row_bytes // 4
    k0, c0 = key.clone(), counter.clone()
    wrong = normal(misread(key).clone(), misread(counter).clone(), 12)  # key + s, counter + s
    before = bufs.slot_arena.clone()

    draw_normal_triton(out, key, counter)

    close(out, normal(k0, c0, 12), torch.float32)
    assert torch.equal(counter, c0 + 1)
    mask = written(bufs, noise, counter)
    assert_only_written(before, bufs.slot_arena, mask)
    rejects(out, wrong, torch.float32)
    stray = bufs.slot_arena.clone()  # the old kernel's counter store: counter + s, inside slot 0's row
    misread(rebase(counter, stray)).add_(1)
    with pytest.raises(AssertionError, match="outside the output changed"):
        assert_only_written(before, stray, mask)


def test_draw_normal_reference_on_slot_buffers():
    """The public call off the kernel (the CPU) on the same views: each slot's own stream."""
    bufs = arena([slot("policy.noise", (2, 3)), slot("policy.rng_key", (), torch.int64),
                  slot("policy.rng_counter", (), torch.int64)], 4, "cpu")  # fmt: skip
    key, counter = bufs["policy.rng_key"], bufs["policy.rng_counter"]
    key.copy_(torch.tensor([5, 6, 7, 8]))
    counter.zero_()
    wrong = normal(misread(key).clone(), misread(counter).clone(), 6)
    draw_normal_(bufs["policy.noise"].flatten(1), key, counter)
    got = bufs["policy.noise"].flatten(1)
    assert torch.equal(got, normal(torch.tensor([5, 6, 7, 8]), torch.zeros(4, dtype=torch.int64), 6))
    assert not torch.equal(got, wrong)


# -- slot copies --------------------------------------------------------------------------------


def control_arena(device: str) -> BufferSet:
    """Per-slot masks and indexes as an env keeps them: slot buffers among others."""
    bufs = arena([slot("env.done", (), torch.bool), slot("env.start", (), torch.int64),
                  slot("env.fork_dst", (), torch.int64)], 4, device, seed=3)  # fmt: skip
    bufs["env.done"].copy_(torch.tensor([True, False, True, False]))
    bufs["env.start"].copy_(torch.tensor([5, 0, 2, 4]))
    bufs["env.fork_dst"].copy_(torch.tensor([2, 0, 3, 1]))
    return bufs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("words", [False, True])  # bytes, and the int64 words runtime.slots moves
def test_slot_copies_take_masks_indexes_and_rows_of_any_stride(device, words):
    """Masked gather (autoreset) and scatter (fork) with the mask and index read from slot buffers
    of another arena, into a live arena, from rows with a row stride of their own."""
    live = arena([slot("sim.state", (37,)), slot("policy.rng_key", (), torch.int64)], 4, device, seed=1)
    control = control_arena(device)
    row = live.row_bytes
    wide = torch.randint(0, 255, (6, row + 64), generator=torch.Generator().manual_seed(2), dtype=torch.uint8).to(
        device
    )
    dst, src = live.slot_arena, wide[:, 32 : 32 + row]  # source rows strided by row + 64 bytes
    if words:
        dst, src = dst.view(torch.int64), wide.view(torch.int64)[:, 4 : 4 + row // 8]
    mask, index, targets = control["env.done"], control["env.start"], control["env.fork_dst"][:3]
    controls, sources = control.slot_arena.clone(), wide.clone()

    want, wrong, wrong_rows = dst.clone(), dst.clone(), dst.clone()
    masked_copy_rows_reference(want, src, mask, index)
    masked_copy_rows_reference(wrong, src, unit(misread(mask)), misread(index) % 6)  # mask + s, index + s
    masked_copy_rows_reference(wrong_rows, misread(src), mask, index)  # source rows read as contiguous
    masked_copy_rows_triton(dst, src, mask, index)
    assert torch.equal(dst, want)
    assert not torch.equal(dst, wrong) and not torch.equal(dst, wrong_rows)  # mutation checks

    for source in (dst[1:2], src[:3]):  # a fork (one row of the live arena itself), then a row per target
        want, wrong = dst.clone(), dst.clone()
        scatter_rows_reference(want, targets, want[1:2] if source.shape[0] == 1 else source)
        scatter_rows_reference(wrong, misread(targets) % 4, wrong[1:2] if source.shape[0] == 1 else source)
        scatter_rows_triton(dst, targets, source)
        assert torch.equal(dst, want)
        assert not torch.equal(dst, wrong)

    want = dst.clone()  # the public calls, whichever implementation they take, on the same views
    masked_copy_rows_reference(want, src, mask, index)
    scatter_rows_reference(want, targets, src[3:6])
    masked_copy_rows(dst, src, mask, index)
    scatter_rows(dst, targets, src[3:6])
    assert torch.equal(dst, want)
    assert torch.equal(control.slot_arena, controls) and torch.equal(wide, sources)  # read only


# -- attention and rotary over the policy's buffers ---------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_attention_reads_context_segments_in_place(device):
    for dtype in dtypes(device):
        cfg, bufs = SMALL, policy_arena(SMALL, SLOTS, device, dtype)
        context = layer_segments(pipeline_prefix(cfg, bufs), 1)
        g = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(SLOTS, n, 4, 32, generator=g).to(device).to(dtype) for n in (2, 1, 1))
        before = bufs.slot_arena.clone()
        got = attention_triton(q, k, v, None, context)
        f = lambda x: x.float()  # noqa: E731
        want = attention_reference(f(q), f(k), f(v), None, [(f(a), f(b), m) for a, b, m in context])
        close(got, want, dtype)
        assert torch.equal(bufs.slot_arena, before)  # attention writes nothing in the arena
        wrong = attention_reference(f(q), f(k), f(v), None, [(f(misread(a)), f(misread(b)), unit(misread(m)))
                                                              for a, b, m in context])  # fmt: skip
        rejects(got, wrong, dtype)


def rotary_inputs(cfg: PolicyConfig, device: str, dtype: torch.dtype):
    """A frame's residual rows, RMSNorm weight (strided), fused q/k/v weight and frequencies (strided)."""
    g = torch.Generator().manual_seed(8)
    t, w = cfg.frame_tokens, cfg.width
    x = (2 * torch.randn(SLOTS, t, w, generator=g).to(device)).to(dtype)
    nw = strided((1 + 0.1 * torch.randn(w, generator=g).to(device)).to(dtype))
    weight = (torch.randn((cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim, w, generator=g).to(device) / w**0.5).to(dtype)
    inv = strided(10000.0 ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float32, device=device) / cfg.head_dim))
    return x, nw, weight, inv


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [True, False])
def test_rotary_writes_keys_values_into_a_cache_layer_at_slot_positions(device, fused):
    """Keys/values into one layer of ``policy.kv_obs``, positions read from the slot buffer
    ``policy.frame`` (strided), norm weight and frequencies strided views."""
    for dtype in dtypes(device):
        cfg, bufs = SMALL, policy_arena(SMALL, SLOTS, device, dtype)
        x, nw, weight, inv = rotary_inputs(cfg, device, dtype)
        pos0, kv_out = bufs["policy.frame"], bufs["policy.kv_obs"][:, 1]
        args = (pos0, inv, cfg.heads, cfg.kv_heads)
        if fused:
            run, ref, inputs = rms_norm_qkv_rope_triton, rms_norm_qkv_rope_reference, (x, nw, 1e-6, weight)
        else:
            run, ref, inputs = qkv_rope_triton, qkv_rope_reference, (torch.nn.functional.linear(x, weight),)
        before = bufs.slot_arena.clone()
        want = ref(*inputs, pos0.clone(), inv.clone(), cfg.heads, cfg.kv_heads)
        wrong_pos = ref(*inputs, misread(pos0).clone(), inv, cfg.heads, cfg.kv_heads)
        wrong_freq = ref(*inputs, pos0, misread(inv), cfg.heads, cfg.kv_heads)
        got = run(*inputs, *args, kv_out)
        for a, b in zip(got, want, strict=True):
            close(a, b, dtype, scale=2)
        assert got[1].data_ptr() == kv_out.data_ptr()
        assert_only_written(before, bufs.slot_arena, written(bufs, kv_out))
        rejects(got[0], wrong_pos[0], dtype, scale=2)
        rejects(got[0], wrong_freq[0], dtype, scale=2)
        stray = before.clone()  # keys/values stored as if the cache layer were contiguous
        ref(*inputs, *args, misread(rebase(kv_out, stray)))
        with pytest.raises(AssertionError, match="outside the output changed"):
            assert_only_written(before, stray, written(bufs, kv_out))


# -- kernels that read slot buffers through a contiguous copy ------------------------------------


def activation_arena(device: str, dtype: torch.dtype) -> BufferSet:
    """Per-slot activations as slot buffers, e.g. a residual stream kept in the arena."""
    specs = [slot("x", (3, 64), dtype), slot("delta", (3, 64), dtype), slot("gate_up", (3, 96), dtype),
             slot("actions", (4, 2)), slot("hidden", (4, 48), dtype)]  # fmt: skip
    bufs = arena(specs, SLOTS, device, seed=5)
    fill(bufs, x=2.0, delta=1.0, gate_up=2.0, actions=1.0, hidden=1.0)
    return bufs


@pytest.mark.parametrize("device", DEVICES)
def test_row_kernels_read_slot_buffers_and_strided_parameters(device, monkeypatch):
    """Norms, the gated activation, the GeGLU projection, the few-row linear layer, the flow step
    and the in-place accumulation, each given slot buffers as inputs and 1-D parameters as
    strided views."""
    if device == "cpu":  # the interpreter runs the kernels on CPU tensors, as on a GPU
        monkeypatch.setattr(kl, "use_triton", lambda *tensors: True)
    for dtype in dtypes(device):
        bufs = activation_arena(device, dtype)
        before = bufs.slot_arena.clone()
        g = torch.Generator().manual_seed(9)
        for got, ref, src, param in row_kernel_cases(bufs, dtype, g):
            close(got, ref(src, param), dtype, scale=2)
            rejects(got, ref(misread(src), param), dtype, scale=2)  # rows read as if contiguous
            if param is not None:
                rejects(got, ref(src, misread(param)), dtype, scale=2)  # a parameter read as if contiguous
        check_flow_step(bufs, dtype, g)
        assert torch.equal(bufs.slot_arena, before)  # these kernels write nothing in the arena

        # accumulated in place onto a slot buffer: no flat view covers it, so torch's addmm runs
        x, gate_up = bufs["x"], bufs["gate_up"]
        down = (torch.randn(64, 96, generator=g).to(device) / 96**0.5).to(dtype)
        want = add_matmul_reference(x.clone(), gate_up, down)
        got = add_matmul(x, gate_up, down)
        assert got.data_ptr() == x.data_ptr()
        close(x, want, dtype)
        assert_only_written(before, bufs.slot_arena, written(bufs, x))


def row_kernel_cases(bufs: BufferSet, dtype: torch.dtype, g: torch.Generator) -> list:
    """(kernel output, reference, its slot-buffer input, its strided 1-D parameter or None)."""
    x, delta, gate_up, device = bufs["x"], bufs["delta"], bufs["gate_up"], bufs.device

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g).to(device)).to(dtype)

    w, b = strided(1 + rnd(64, scale=0.1)), strided(rnd(64))
    proj, lin = rnd(2 * 48, 64, scale=64**-0.5), rnd(64, 64, scale=64**-0.5)
    return [
        (add_rms_norm_triton(x, delta, w, 1e-6)[1], lambda x, w: add_rms_norm_reference(x, delta, w, 1e-6)[1], x, w),
        (add_layer_norm_triton(x, delta, w, b, 1e-5)[1],
         lambda x, b: add_layer_norm_reference(x, delta, w, b, 1e-5)[1], x, b),
        (gelu_mul_triton(gate_up), lambda x, _: gelu_mul_reference(x), gate_up, None),
        (rms_norm_geglu_triton(x, w, 1e-6, proj), lambda x, w: rms_norm_geglu_reference(x, w, 1e-6, proj), x, w),
        (linear(x, lin, b), lambda x, b: torch.nn.functional.linear(x, lin, b), x, b),
    ]  # fmt: skip


def check_flow_step(bufs: BufferSet, dtype: torch.dtype, g: torch.Generator) -> None:
    """The folded time embedding and Euler step over the actions slot buffer (float32) and the
    expert's hidden state, parameters strided; and a dense but permuted x."""
    actions, hidden, device = bufs["actions"], bufs["hidden"], bufs.device
    wx, bias = torch.randn(48, 2, generator=g).to(device), strided(torch.randn(48, generator=g).to(device))
    w_out = 0.05 * torch.randn(2, 48, generator=g).to(device)
    b_out = strided(torch.randn(2, generator=g).to(device))
    nw = strided((1 + 0.1 * torch.randn(48, generator=g).to(device)).to(dtype))
    got = time_embed_triton(actions, wx, bias, dtype)
    close(got, time_embed_reference(actions, wx, bias, dtype), dtype)
    rejects(got, time_embed_reference(misread(actions), wx, bias, dtype), dtype)
    rejects(got, time_embed_reference(actions, wx, misread(bias), dtype), dtype)
    got = euler_step_triton(actions, hidden, nw, w_out, b_out, 1e-6)
    close(got, euler_step_reference(actions, hidden, nw, w_out, b_out, 1e-6), torch.float32, scale=10)
    rejects(got, euler_step_reference(actions, misread(hidden), nw, w_out, b_out, 1e-6), torch.float32, scale=10)
    rejects(got, euler_step_reference(actions, hidden, nw, w_out, misread(b_out), 1e-6), torch.float32, scale=10)
    permuted = actions.clone().transpose(0, 1)  # dense but permuted: empty_like would keep its strides
    got = euler_step_triton(permuted, hidden.transpose(0, 1), nw, w_out, b_out, 1e-6)
    want = euler_step_reference(permuted, hidden.transpose(0, 1), nw, w_out, b_out, 1e-6)
    close(got, want, torch.float32, scale=10)
    row_major = want.contiguous().flatten()  # what the kernel writes, read back through x's strides
    rejects(got, torch.as_strided(row_major, permuted.shape, permuted.stride()), torch.float32, scale=10)


def test_views_a_kernel_cannot_take_are_refused_with_their_strides():
    """A direct kernel call on a view it would misread raises, naming the tensor and its strides."""
    x = torch.zeros(4, 3, 8)
    with pytest.raises(ValueError, match=r"out of shape \(3, 8\) and strides \(1, 3\) has stride 3 in dimension 1"):
        draw_normal_triton(torch.zeros(8, 3).t(), torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"weight of shape \(16, 8\) and strides \(1, 16\) is not contiguous"):
        rms_norm_geglu_triton(x, torch.ones(8), 1e-6, torch.zeros(8, 16).t())
    with pytest.raises(ValueError, match=r"dst of shape \(4, 3\) and strides \(1, 4\)"):
        masked_copy_rows_triton(torch.zeros(3, 4).t(), torch.zeros(4, 3), torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="key and counter must be int64"):
        draw_normal_(torch.zeros(3, 4), torch.zeros(3), torch.zeros(3))
    with pytest.raises(ValueError, match="bool mask"):
        masked_copy_rows(torch.zeros(4, 3), torch.zeros(4, 3), torch.ones(4))
