"""The action expert's decoder layer as one CUDA kernel (kernels.expert_layer)."""

import ctypes
import shutil

import pytest
import torch

import flashrt.kernels.expert_layer as el
from flashrt import kernels
from flashrt.kernels import nvcc
from flashrt.policies import PRESETS, FlowPolicy
from flashrt.policies.layers import layer_segments
from tests.kernels.arena import misread, pipeline_prefix, policy_arena, unit
from tests.kernels.kernel_devices import poison_allocator

SHARP_QUERIES, SHARP_OUTPUTS = 8.0, 10.0
"""Weight scales that make each expert layer matter: queries x8 attend sharply (scores of std ~2
against unit-variance keys), so the output depends on which keys there are and where they sit;
output and down projections x10 make each layer change the residual stream by about its own
size, so an identity layer is far from a real one. (At the initial std 0.02 a layer moves the
stream by 3 % and attends almost uniformly: 0.1 absolute tolerance passed an identity layer.)"""

TOLERANCE = 0.05
"""Most a layer's output may deviate from the reference, as a share of the layer's update in
each slot (:func:`update_error`). On the inputs of :func:`expert_inputs` the bf16 reference
deviates from the float32 one by 0.01 at most; an identity layer by 1, positions moved by 3 705
by 1.2 to 1.6, a fully masked context by 1.05, one dropped segment by 0.24 (the instruction, 14
of 152 keys) to 0.95 (test_comparison_passes_bf16_rounding_and_rejects_each_mutation)."""


def expert_inputs(device, slots=1, seed=0, dtype=torch.bfloat16):
    """A tiny policy with sharpened expert layers and one expert layer's inputs: the residual,
    positions and a context of an instruction (per-token mask, two keys masked out) and two
    frames (one per-slot flag each). Built on the CPU, so every device gets the same numbers."""
    torch.manual_seed(seed)
    model = FlowPolicy(PRESETS["tiny"](["push", "the", "red", "square"])).eval()
    model.requires_grad_(False)
    for layer in model.expert:
        layer.q.weight.mul_(SHARP_QUERIES)
        layer.o.weight.mul_(SHARP_OUTPUTS)
        layer.down.weight.mul_(SHARP_OUTPUTS)
    c = model.cfg
    g = torch.Generator().manual_seed(seed)

    def kv(tokens):
        return torch.randn(slots, c.depth, 2, c.kv_heads, tokens, c.head_dim, generator=g).to(device, dtype)

    text_mask = torch.ones(slots, c.max_text_len, dtype=torch.bool, device=device)
    text_mask[:, -2:] = False
    flag = torch.ones(slots, 1, dtype=torch.bool, device=device)
    prefix = [
        (kv(c.max_text_len), text_mask),
        (kv(c.frame_tokens), flag.expand(-1, c.frame_tokens)),
        (kv(c.frame_tokens), flag.expand(-1, c.frame_tokens)),
    ]
    x = torch.randn(slots, c.horizon, c.expert_width, generator=g).to(device, dtype)
    pos0 = torch.full((slots,), c.max_text_len + 3 * c.frame_tokens, dtype=torch.int64, device=device)
    return model.to(device, dtype), prefix, x, pos0


def update_error(got, want, x):
    """Largest over slots of ``|got - want| / max(|want - x|, |got - x|)``: the deviation as a
    share of what the layer computed (an identity layer's share is 1)."""
    norm = lambda t: t.float().flatten(1).norm(dim=1)  # noqa: E731
    return (norm(got - want) / torch.maximum(norm(want - x), norm(got - x))).max().item()


def assert_layer_close(got, want, x):
    """The comparison of every expert-layer test: ``got`` within :data:`TOLERANCE` of ``want``."""
    assert not got.isnan().any(), "NaN in the layer's output"
    err = update_error(got, want, x)
    assert err < TOLERANCE, f"the layer deviates by {err:.3f} of its update (tolerance {TOLERANCE})"


def mutations(model, i, x, pos0, prefix):
    """Wrong layers the comparison must reject, each the reference with one thing broken."""
    layer = model.expert[i]
    c = model.cfg

    def ref(pos0, prefix):
        with torch.no_grad(), kernels.reference_only():
            return layer(x.clone(), pos0, model.inv_freq, layer_segments(prefix, i))[0]

    def drop(*which):
        return [(kv, torch.zeros_like(m) if j in which else m) for j, (kv, m) in enumerate(prefix)]

    return {
        "identity layer": x,
        "positions shifted by 3 705": ref(pos0 + 57 * c.frame_tokens, prefix),
        "context fully masked": ref(pos0, drop(0, 1, 2)),
        "instruction dropped": ref(pos0, drop(0)),
        "ring frame dropped": ref(pos0, drop(1)),
        "newest frame dropped": ref(pos0, drop(2)),
    }


def assert_rejects_mutations(got, model, i, x, pos0, prefix):
    """Mutation checks: the comparison that passed ``got`` fails against every wrong layer."""
    for name, wrong in mutations(model, i, x, pos0, prefix).items():
        try:
            assert_layer_close(got, wrong, x)
        except AssertionError:
            continue
        pytest.fail(f"layer {i}: the comparison passed a wrong layer ({name})")


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


def test_comparison_passes_bf16_rounding_and_rejects_each_mutation():
    """The CPU counterpart of the kernel's test, on the same inputs: the bf16 reference passes
    against the float32 one (rounding, as the kernel's deviation is), and every mutation fails."""
    model32, prefix32, x32, pos0 = expert_inputs("cpu", slots=2, dtype=torch.float32)
    model16, prefix16, x16, _ = expert_inputs("cpu", slots=2, dtype=torch.bfloat16)
    with torch.no_grad():
        for frame in (3, 60):
            at = pos0 + (frame - 3) * model32.cfg.frame_tokens
            for i in range(model32.cfg.depth):
                want = model32.expert[i](x32.clone(), at, model32.inv_freq, layer_segments(prefix32, i))[0]
                got = model16.expert[i](x16.clone(), at, model16.inv_freq, layer_segments(prefix16, i))[0]
                assert_layer_close(got, want, x32)
                assert_rejects_mutations(got, model32, i, x32, at, prefix32)


def test_refuses_views_it_would_misread():
    """The kernel indexes x contiguously and loads keys/values in 16-byte rows: other views are
    refused by name before any launch (fits() sends them to the Triton layers)."""
    model, prefix, x, pos0 = expert_inputs("cpu", slots=2)
    layer, context = model.expert[0], layer_segments(prefix, 0)
    call = lambda x, context: el.expert_layer(x, pos0, model.inv_freq, context, layer.fused_weights(), (1e-6, 1e-6))  # noqa: E731
    padded = torch.zeros(2, 8, 200, dtype=x.dtype)[..., :192]
    with pytest.raises(ValueError, match=r"x of shape \(2, 8, 192\) and strides \(1600, 200, 1\) is not contiguous"):
        call(padded, context)
    k, v, m = context[0]
    odd = torch.zeros(k.numel() + 1, dtype=k.dtype)[1:].view(k.shape)  # rows off 16-byte boundaries
    with pytest.raises(ValueError, match="context segment 0's keys .* is not aligned to 16 bytes"):
        call(x, [(odd, v, m), *context[1:]])
    with pytest.raises(ValueError, match=r"context segment 0's mask must be \(2, 16\)"):
        call(x, [(k, v, m[:, :5]), *context[1:]])
    assert not el.fits(padded, context, *layer.fused_weights())


@pytest.mark.cuda
@pytest.mark.parametrize("frame", [3, 60])  # 60: positions near 3 900, where wrong frequencies show most
def test_matches_the_triton_layer_and_the_reference(cluster_kernel, frame):
    """Every layer against the Triton layer and the torch reference, and the mutation checks:
    the same comparison fails for an identity layer, shifted positions, a masked context and
    each dropped segment."""
    model, prefix, x, pos0 = expert_inputs("cuda", slots=2)
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
            assert_layer_close(got, triton_layer, x)
            assert_layer_close(got, ref, x)
            assert_rejects_mutations(got, model, i, x, pos0, prefix)


@pytest.mark.cuda
def test_reads_context_and_positions_from_slot_buffers(cluster_kernel):
    """The prefix as the pipeline passes it: keys/values, token masks and frame flags are views of
    the policy's slot arena (strided by its row), positions a slot buffer. The kernel matches the
    reference on the same views and writes nothing in the arena; the reference on those views
    read as if contiguous (slot 0's row onwards) is rejected by the same comparison."""
    slots = 4
    model, _, x, _ = expert_inputs("cuda", slots=slots, seed=7)
    c = model.cfg
    bufs = policy_arena(c, slots, "cuda", torch.bfloat16)
    pos0 = bufs["policy.frame"]
    pos0.copy_(c.max_text_len + c.frame_tokens * torch.tensor([3, 10, 25, 60]))
    prefix = pipeline_prefix(c, bufs)
    before = bufs.slot_arena.clone()
    with torch.no_grad():
        for i in (0, 3):
            layer, context = model.expert[i], layer_segments(prefix, i)
            assert el.fits(x, context, *layer.fused_weights())
            got = run_kernel(model, layer, x.clone(), pos0, context)
            misread_context = [(misread(k), misread(v), unit(misread(m))) for k, v, m in context]
            with kernels.reference_only():
                want = layer(x.clone(), pos0, model.inv_freq, context)[0]
                wrong_context = layer(x.clone(), pos0, model.inv_freq, misread_context)[0]
                wrong_positions = layer(x.clone(), misread(pos0), model.inv_freq, context)[0]
            assert_layer_close(got, want, x)
            for wrong in (wrong_context, wrong_positions):
                with pytest.raises(AssertionError, match="deviates"):
                    assert_layer_close(got, wrong, x)
    assert torch.equal(bufs.slot_arena, before)


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
        masked = [(k, v, torch.zeros(k.shape[0], k.shape[2], dtype=torch.bool, device="cuda")) for k, v, _ in context]
        wrong = layer(x.clone(), pos0, model.inv_freq, masked)[0]
    assert_layer_close(got, want, x)
    with pytest.raises(AssertionError, match="deviates"):  # mutation check: every context key dropped
        assert_layer_close(got, wrong, x)


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
