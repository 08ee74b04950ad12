"""The action expert's decoder layer as one CUDA kernel (kernels.expert_layer)."""

import ctypes
import shutil

import pytest
import torch

import flashrt.kernels.expert_layer as el
from flashrt import kernels
from flashrt.kernels import nvcc
from flashrt.policies import PRESETS, FlowPolicy
from flashrt.policies.model import layer_segments
from tests.kernels.kernel_devices import poison_allocator


def expert_inputs(device, slots=1, seed=0):
    """A tiny policy and one expert layer's inputs: the residual, positions and a context of an
    instruction (per-token mask, two keys masked out) and two frames (one per-slot flag each)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = FlowPolicy(PRESETS["tiny"](["push", "the", "red", "square"])).to(torch.bfloat16).eval()
    model.requires_grad_(False)
    c = model.cfg
    g = torch.Generator(device=device).manual_seed(seed)

    def kv(tokens):
        return torch.randn(slots, c.depth, 2, c.kv_heads, tokens, c.head_dim, device=device, generator=g).to(
            torch.bfloat16
        )

    text_mask = torch.ones(slots, c.max_text_len, dtype=torch.bool, device=device)
    text_mask[:, -2:] = False
    flag = torch.ones(slots, 1, dtype=torch.bool, device=device)
    prefix = [
        (kv(c.max_text_len), text_mask),
        (kv(c.frame_tokens), flag.expand(-1, c.frame_tokens)),
        (kv(c.frame_tokens), flag.expand(-1, c.frame_tokens)),
    ]
    x = torch.randn(slots, c.horizon, c.expert_width, device=device, generator=g).to(torch.bfloat16)
    pos0 = torch.full((slots,), c.max_text_len + 3 * c.frame_tokens, dtype=torch.int64, device=device)
    return model, prefix, x, pos0


def run_kernel(model, layer, x, pos0, context):
    eps = (layer.norm1.eps, layer.norm2.eps)
    return el.expert_layer(x, pos0, model.inv_freq, context, layer.fused_weights(), eps)


@pytest.fixture
def cluster_kernel():
    """Skips where the kernel cannot run (another GPU, no nvcc)."""
    if not el.available("cuda"):
        pytest.skip("needs an sm_90 GPU and nvcc")


def test_never_taken_on_cpu():
    model, prefix, x, _ = expert_inputs("cpu")
    layer = model.expert[0]
    assert not el.fits(x, layer_segments(prefix, 0), *layer.fused_weights())
    assert not el.available("cpu")


@pytest.mark.skipif(shutil.which("nvcc") is None and nvcc.find() is None, reason="needs the CUDA toolkit's nvcc")
def test_builds_with_nvcc_and_exports_its_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHRT_CACHE", str(tmp_path))
    el._library.cache_clear()
    try:
        lib = el._library()
        assert lib is not None
        assert [p.name for p in tmp_path.iterdir()] == [p.name for p in tmp_path.glob("expert_layer_*.so")]
        assert isinstance(lib.flashrt_expert_layer, ctypes._CFuncPtr)
    finally:
        el._library.cache_clear()


def test_a_failed_build_warns_and_leaves_the_triton_layers(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHRT_CACHE", str(tmp_path))
    monkeypatch.setattr(nvcc, "find", lambda: str(tmp_path / "nvcc"))
    (tmp_path / "nvcc").write_text("#!/bin/sh\necho 'nvcc: broken' >&2\nexit 1\n")
    (tmp_path / "nvcc").chmod(0o755)
    el._library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="broken"):
            assert el._library() is None
        assert not list(tmp_path.glob("*.so"))  # nothing half-written in the cache
    finally:
        el._library.cache_clear()


def test_refuses_rotary_frequencies_it_would_misread():
    """The kernel reads (32,) float32 frequencies; a bf16 tensor would be read as float32 pairs
    and past its end, so it is refused before any launch."""
    model, prefix, x, pos0 = expert_inputs("cpu")
    layer = model.expert[0]
    args = (x, pos0, model.inv_freq.bfloat16(), layer_segments(prefix, 0), layer.fused_weights(), (1e-6, 1e-6))
    with pytest.raises(ValueError, match=r"inv_freq must be \(32,\) float32 .* got \(32,\) torch.bfloat16"):
        el.expert_layer(*args)


@pytest.mark.cuda
@pytest.mark.parametrize("frame", [3, 60])  # 60: positions near 3 900, where wrong frequencies show most
def test_matches_the_triton_layer_and_the_reference(cluster_kernel, frame):
    model, prefix, x, pos0 = expert_inputs("cuda")
    pos0 = pos0 + (frame - 3) * model.cfg.frame_tokens
    with torch.no_grad():
        for i, layer in enumerate(model.expert):
            context = layer_segments(prefix, i)
            assert el.fits(x, context, *layer.fused_weights())
            poison_allocator("cuda")
            got = run_kernel(model, layer, x.clone(), pos0, context)
            triton_layer = layer(x.clone(), pos0, model.inv_freq, context)[0]
            with kernels.reference_only():
                ref = layer(x.clone(), pos0, model.inv_freq, context)[0]
            assert not got.isnan().any()
            # a few bf16 steps at these magnitudes (|x| up to ~8): the same roundings, sums in another order
            torch.testing.assert_close(got.float(), triton_layer.float(), atol=1e-1, rtol=5e-2)
            torch.testing.assert_close(got.float(), ref.float(), atol=1e-1, rtol=5e-2)
            assert not torch.equal(got, x)  # the layer changed the residual stream in place of x's copy


def rotary_deviation(model, layer, x, pos0, context, inv_freq):
    """(kernel against the Triton layer, the Triton layer at pos0 against pos0 + 3 705): max abs."""
    with torch.no_grad():
        eps = (layer.norm1.eps, layer.norm2.eps)
        got = el.expert_layer(x.clone(), pos0, inv_freq, context, layer.fused_weights(), eps)
        want = layer(x.clone(), pos0, model.inv_freq, context)[0]
        far = layer(x.clone(), pos0 + 57 * model.cfg.frame_tokens, model.inv_freq, context)[0]
    return (got.float() - want.float()).abs().max().item(), (far.float() - want.float()).abs().max().item()


@pytest.mark.cuda
def test_rotary_angles_follow_the_triton_layer(cluster_kernel):
    """With sharpened queries the attention depends on the rotary angles: moving the tokens 3 705
    positions changes the layer's output many times more than the kernel deviates from the
    Triton layer, so a wrong frequency or angle in the kernel shows (with random small weights
    alone the attention is near uniform, which hid a misread of the frequencies)."""
    model, prefix, x, pos0 = expert_inputs("cuda", seed=6)
    layer = model.expert[1]
    with torch.no_grad():
        layer.q.weight.mul_(4)  # scores of std ~1 against the unit-variance context keys
    deviation, shift = rotary_deviation(model, layer, x, pos0, layer_segments(prefix, 1), model.inv_freq)
    # H200: deviation 0.016 (one bf16 step), shift 0.22; the old misread of bf16 frequencies: 0.20
    assert deviation < 0.05, deviation
    assert shift > 0.15, shift  # the test is sensitive to the angles


@pytest.mark.cuda
@pytest.mark.parametrize("lengths", [(16,), (16, 65), (7, 30, 9), (16, 65, 43), (16, 65, 71)])
def test_any_context_length_matches_the_triton_layer(cluster_kernel, lengths):
    """Own keys land in any chunk, or across two chunks on two CTAs (124 context keys); 152 is
    the most the kernel takes."""
    model, _, x, pos0 = expert_inputs("cuda", seed=3)
    layer = model.expert[1]
    g = torch.Generator(device="cuda").manual_seed(sum(lengths))
    context = []
    for i, t in enumerate(lengths):
        k, v = (torch.randn(1, 1, t, el.HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16) for _ in "kv")
        mask = torch.rand(1, t, device="cuda", generator=g) > 0.2 if i == 0 else None
        context.append((k, v, mask))
    with torch.no_grad():
        assert el.fits(x, context, *layer.fused_weights())
        got = run_kernel(model, layer, x.clone(), pos0, context)
        want = layer(x.clone(), pos0, model.inv_freq, context)[0]
    torch.testing.assert_close(got.float(), want.float(), atol=1e-1, rtol=5e-2)


@pytest.mark.cuda
def test_masked_keys_are_ignored(cluster_kernel):
    model, prefix, x, pos0 = expert_inputs("cuda", seed=1)
    layer, context = model.expert[0], layer_segments(prefix, 0)
    with torch.no_grad():
        want = run_kernel(model, layer, x.clone(), pos0, context)
        k, v, _ = context[0]
        k[..., -2:, :] = 1e4  # the instruction's masked keys/values: any (finite) values give the same bytes
        v[..., -2:, :] = -1e4
        assert torch.equal(run_kernel(model, layer, x.clone(), pos0, context), want)
        k1, v1, m1 = context[1]
        context[1] = (k1, v1, torch.zeros_like(m1))  # a frame flagged invalid (one flag per slot)
        without = run_kernel(model, layer, x.clone(), pos0, context)
        assert not torch.equal(without, want)
        k1.normal_()
        v1.fill_(1e4)
        assert torch.equal(run_kernel(model, layer, x.clone(), pos0, context), without)


@pytest.mark.cuda
def test_refuses_what_it_is_not_built_for(cluster_kernel):
    model, prefix, x, _ = expert_inputs("cuda", slots=el.MAX_SLOTS + 1)
    layer, context = model.expert[0], layer_segments(prefix, 0)
    args = layer.fused_weights()
    assert not el.fits(x, context, *args)  # more slots: the Triton layers are faster
    assert el.fits(x[:-1].contiguous(), [(k[:-1], v[:-1], m[:-1]) for k, v, m in context], *args)
    x1, ctx1 = x[:1].contiguous(), [(k[:1], v[:1], m[:1]) for k, v, m in context]
    assert el.fits(x1, ctx1, *args)
    assert not el.fits(x1.float(), ctx1, *args)
    assert not el.fits(x1, ctx1, *args[:4], args[4][:-16], args[5])  # another MLP width
    long = [(torch.cat([k, k], 2), torch.cat([v, v], 2), None) for k, v, _ in ctx1[:2]]  # 162 context keys
    assert not el.fits(x1, long, *args)
    with torch.enable_grad():
        assert not el.fits(x1, ctx1, *(a.detach().requires_grad_() for a in args))


@pytest.mark.cuda
def test_each_slot_of_a_many_slot_call_is_its_own_one_slot_call(cluster_kernel):
    """A cluster a slot: every slot of an 8-slot call (its own residual, keys/values, instruction
    mask, frame flags and position) equals the bytes of a one-slot call on that slot alone."""
    slots = el.MAX_SLOTS
    model, prefix, x, pos0 = expert_inputs("cuda", slots=slots, seed=5)
    g = torch.Generator(device="cuda").manual_seed(5)
    text = torch.rand(slots, model.cfg.max_text_len, device="cuda", generator=g) < 0.7
    text[:, 0] = True
    flags = (torch.arange(slots, device="cuda") % 3 != 1)[:, None].expand(-1, model.cfg.frame_tokens)
    prefix = [(prefix[0][0], text), (prefix[1][0], flags), prefix[2]]
    pos0 = pos0 + torch.arange(slots, device="cuda") * model.cfg.frame_tokens
    layer = model.expert[4]
    context = layer_segments(prefix, 4)
    with torch.no_grad():
        many = run_kernel(model, layer, x.clone(), pos0, context)
        for i in range(slots):
            one = run_kernel(
                model,
                layer,
                x[i : i + 1].clone(),
                pos0[i : i + 1],
                [(k[i : i + 1], v[i : i + 1], m[i : i + 1]) for k, v, m in context],
            )
            assert torch.equal(one[0], many[i]), i


@pytest.mark.cuda
def test_graph_replay_matches_eager_bytes(cluster_kernel):
    model, prefix, _, _ = expert_inputs("cuda", seed=2)
    noise = torch.randn(1, model.cfg.horizon, model.cfg.action_dim, device="cuda")
    frame = torch.full((1,), 2, dtype=torch.int64, device="cuda")
    eager = model.sample(noise, prefix, frame)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        model.sample(noise, prefix, frame)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = model.sample(noise, prefix, frame)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
