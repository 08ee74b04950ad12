"""Each fused Triton kernel against its torch reference, on fresh random inputs.

On a GPU in bf16 (the run-time dtype) and float32; on the CPU through Triton's interpreter in
float32 (the interpreter has no bf16 matrix product). Outputs the kernel allocates come from
allocator blocks poisoned with NaN; outputs written into given views are pre-filled with NaN.
"""

import pytest
import torch

import flashrt.kernels.grouped_attention as ga
import flashrt.kernels.norm as kn
from flashrt.kernels.activation import gelu_mul_reference, gelu_mul_triton
from flashrt.kernels.backend import sm_count
from flashrt.kernels.flow import euler_step_reference, euler_step_triton, time_embed_reference, time_embed_triton
from flashrt.kernels.grouped_attention import attention, attention_reference, attention_triton
from flashrt.kernels.matmul import PartialProduct
from flashrt.kernels.norm import (
    add_ada_rms_norm,
    add_ada_rms_norm_reference,
    add_layer_norm,
    add_layer_norm_reference,
    add_layer_norm_triton,
    add_partials,
    add_rms_norm,
    add_rms_norm_reference,
    add_rms_norm_triton,
    gated_add,
    gated_add_reference,
)
from flashrt.kernels.norm_linear import (
    rms_norm_geglu,
    rms_norm_geglu_reference,
    rms_norm_geglu_triton,
    rms_norm_qkv_rope,
    rms_norm_qkv_rope_reference,
    rms_norm_qkv_rope_triton,
)
from flashrt.kernels.rng import draw_normal_reference, draw_normal_triton
from flashrt.kernels.rotary import qkv_rope_reference, qkv_rope_triton
from tests.kernels.kernel_devices import DEVICES, close, dtypes, poison_allocator, spy_launches


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rows", "width"), [(7, 192), (21, 256), (5, 1000), (300, 256)])
def test_add_rms_norm_and_add_layer_norm(device, rows, width):
    """Full-shape and broadcast residuals, several rows a program with a ragged end."""
    g = torch.Generator(device=device).manual_seed(width)
    for dtype in dtypes(device):
        x = (1 + torch.randn(3, rows, width, device=device, generator=g)).to(dtype)
        full = torch.randn(3, rows, width, device=device, generator=g).to(dtype)
        w, b = ((1 + 0.1 * torch.randn(width, device=device, generator=g)).to(dtype) for _ in range(2))
        for d in (None, full, full[0]):  # full[0]: (rows, W), repeated for each of the 3 leading rows
            poison_allocator(device)
            h, y = add_rms_norm_triton(x, d, w, 1e-6)
            h_ref, y_ref = add_rms_norm_reference(x, d, w, 1e-6)
            assert torch.equal(h, h_ref)  # the residual sum is rounded exactly as torch does
            close(y, y_ref, dtype)
            poison_allocator(device)
            h, y = add_layer_norm_triton(x, d, w, b, 1e-5)
            h_ref, y_ref = add_layer_norm_reference(x, d, w, b, 1e-5)
            assert torch.equal(h, h_ref)
            close(y, y_ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rows", "width"), [(21, 256), (5, 1152)])
def test_layer_norm_adds_the_bias_of_the_projection_that_made_its_delta(device, rows, width):
    """``delta_bias``, read at its stride, is added to the delta in float32 and the sum to x,
    rounded once, as the reference does; the residual matches ``x + F.linear(a, W, bias)`` to the
    dtype's rounding. The same comparison fails with the bias reversed and with it left out."""
    g = torch.Generator(device=device).manual_seed(width + rows)
    for dtype in dtypes(device):
        x = (1 + torch.randn(3, rows, width, device=device, generator=g)).to(dtype)
        a = torch.randn(3, rows, 64, device=device, generator=g).to(dtype)
        weight = (torch.randn(width, 64, device=device, generator=g) / 8).to(dtype)
        strided = torch.randn(2 * width, device=device, generator=g).to(dtype)[::2]  # a bias at stride 2
        w, b = ((1 + 0.1 * torch.randn(width, device=device, generator=g)).to(dtype) for _ in range(2))
        delta = torch.nn.functional.linear(a, weight)
        poison_allocator(device)
        h, y = add_layer_norm_triton(x, delta, w, b, 1e-5, strided)
        h_ref, y_ref = add_layer_norm_reference(x, delta, w, b, 1e-5, strided.contiguous())
        assert torch.equal(h, h_ref)
        close(y, y_ref, dtype)
        close(h, x + torch.nn.functional.linear(a, weight, strided), dtype)
        for wrong in (strided.flip(0), torch.zeros_like(strided)):
            with pytest.raises(AssertionError):
                close(h, add_layer_norm_reference(x, delta, w, b, 1e-5, wrong)[0], dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_slot", [False, True])
def test_adaptive_norm_and_gated_add_match_pi05s_reference(device, per_slot, monkeypatch):
    """pi0.5's gated residual add and adaptive RMSNorm (scale and shift from a modulation, one
    for every slot or one per slot; a gate read at its stride) against the reference, the sums
    exactly. The same comparisons fail against the ungated add, and against each slot's
    neighbour's modulation."""
    if device == "cpu":
        monkeypatch.setattr(kn, "use_triton", lambda *tensors: True)
    launches = spy_launches(monkeypatch, kn, "_add_norm_kernel")
    n, t, w = 3, 50, 1024
    g = torch.Generator(device=device).manual_seed(w + per_slot)
    mods = (n, 3, w) if per_slot else (3, w)
    for dtype in dtypes(device):
        x = (1 + torch.randn(n, t, w, device=device, generator=g)).to(dtype)
        delta = torch.randn(n, t, w, device=device, generator=g).to(dtype)
        m1, m2 = (1 + 0.5 * torch.randn(*mods, device=device, generator=g) for _ in range(2))
        gate = m1.select(-2, 2)
        poison_allocator(device)
        h, y = add_ada_rms_norm(x, delta, gate, m2, 1e-6)
        h_ref, y_ref = add_ada_rms_norm_reference(x, delta, gate, m2, 1e-6)
        assert torch.equal(h, h_ref)  # the gated delta and the sum rounded as torch rounds them
        close(y, y_ref, dtype)
        _, y0 = add_ada_rms_norm(x, None, None, m1, 1e-6)
        close(y0, add_ada_rms_norm_reference(x, None, None, m1, 1e-6)[1], dtype)
        assert torch.equal(gated_add(x, delta, gate), gated_add_reference(x, delta, gate))
        strided = torch.stack([gate, torch.full_like(gate, 7.0)], -1)[..., 0]  # the gate every other float
        assert torch.equal(gated_add(x, delta, strided), gated_add_reference(x, delta, gate))
        with pytest.raises(AssertionError):  # mutation: the delta added without its gate
            close(h, x + delta, dtype)
        if per_slot:  # mutation: every slot normalised with the next slot's modulation
            with pytest.raises(AssertionError):
                close(y, add_ada_rms_norm_reference(x, delta, gate, m2.roll(1, 0), 1e-6)[1], dtype)
    assert len(launches) == 4 * len(dtypes(device))


@pytest.mark.parametrize("device", DEVICES)
def test_norms_add_a_projections_partial_products_in_order(device, monkeypatch):
    """A PartialProduct delta (4 float32 parts, pi0's expert rows): add_rms_norm and add_partials
    add their sum in float32 and round once; pi0.5's gated add and adaptive norm round the sum first, then
    gate it; the residual sums exactly as the references. The same comparisons fail against the
    sum without its last part and, in bf16, against the sum gated before its rounding."""
    if device == "cpu":
        monkeypatch.setattr(kn, "use_triton", lambda *tensors: True)
    launches = spy_launches(monkeypatch, kn, "_add_norm_kernel")
    n, t, w = 1, 50, 1024
    g = torch.Generator(device=device).manual_seed(7)
    for dtype in dtypes(device):
        x = (1 + torch.randn(n, t, w, device=device, generator=g)).to(dtype)
        delta = PartialProduct(torch.randn(4, n, t, w, device=device, generator=g))
        dropped = PartialProduct(delta.parts[:-1])
        nw = (1 + 0.1 * torch.randn(w, device=device, generator=g)).to(dtype)
        mod = 1 + 0.5 * torch.randn(3, w, device=device, generator=g)
        gate = mod[2]
        poison_allocator(device)
        h, y = add_rms_norm(x, delta, nw, 1e-6)
        h_ref, y_ref = add_rms_norm_reference(x, delta, nw, 1e-6)
        assert torch.equal(h, h_ref) and torch.equal(h_ref, (x.float() + delta.total()).to(dtype))
        close(y, y_ref, dtype)
        strided = torch.cat([x, x], -1)[..., ::2]  # x's values at stride 2 (an arena-style view)
        strided.copy_(x)
        assert torch.equal(add_rms_norm(strided, delta, nw, 1e-6)[0], h)
        with pytest.raises(AssertionError):  # mutation: the last part dropped
            close(h, add_rms_norm_reference(x, dropped, nw, 1e-6)[0], dtype)
        h, y = add_ada_rms_norm(x, delta, gate, mod, 1e-6)
        h_ref, y_ref = add_ada_rms_norm_reference(x, delta, gate, mod, 1e-6)
        assert torch.equal(h, h_ref)
        close(y, y_ref, dtype)
        rounded = delta.total().to(dtype)
        assert torch.equal(gated_add(x, delta, gate), gated_add_reference(x, rounded, gate))
        with pytest.raises(AssertionError):
            close(gated_add(x, delta, gate), gated_add_reference(x, dropped.total().to(dtype), gate), dtype)
        if dtype == torch.bfloat16:  # mutation: the float32 sum gated before it is rounded
            assert not torch.equal(h, x + (delta.total() * gate).to(dtype))
        added = add_partials(x, delta)
        assert torch.equal(added, (x.float() + delta.total()).to(dtype))
        with pytest.raises(AssertionError):
            close(added, add_partials(x, dropped), dtype)
    assert len(launches) == 7 * len(dtypes(device))


def test_a_partial_product_of_the_wrong_shape_is_named():
    x, w = torch.zeros(1, 5, 8), torch.ones(8)
    with pytest.raises(ValueError, match=r"parts must be float32 \(S, \*x.shape\) for x \(1, 5, 8\).*linear_partials"):
        add_rms_norm(x, PartialProduct(torch.zeros(2, 5, 8)), w)
    with pytest.raises(ValueError, match="parts must be float32"):
        gated_add(x, PartialProduct(torch.zeros(2, 1, 5, 8, dtype=torch.float64)), torch.zeros(8))
    with pytest.raises(TypeError, match="add_rms_norm takes a PartialProduct"):
        add_layer_norm(x, PartialProduct(torch.zeros(2, 1, 5, 8)), w, w)
    with pytest.raises(TypeError, match="add_partials: delta must be a PartialProduct, got Tensor"):
        add_partials(x, x)


def test_adaptive_norm_names_a_modulation_of_the_wrong_shape():
    x = torch.zeros(2, 5, 8)
    with pytest.raises(ValueError, match=r"modulation must be float32 \(3, 8\), or \(2, 3, 8\) one per slot"):
        add_ada_rms_norm(x, None, None, torch.zeros(2, 8))
    with pytest.raises(ValueError, match=r"gate must be float32 \(8,\)"):
        gated_add(x, x, torch.zeros(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="come with its gate"):
        add_ada_rms_norm(x, x, None, torch.zeros(3, 8))


def test_norm_residuals_must_match_x_or_its_trailing_dims():
    x, w = torch.zeros(2, 3, 8), torch.ones(8)
    with pytest.raises(ValueError, match="trailing dims"):
        add_layer_norm(x, torch.zeros(2, 8), w, w)
    with pytest.raises(ValueError, match=r"delta_bias must be \(8,\), the bias of the projection that made delta"):
        add_layer_norm(x, x, w, w, delta_bias=torch.ones(4))
    with pytest.raises(ValueError, match="delta_bias needs the delta it belongs to"):
        add_layer_norm(x, None, w, w, delta_bias=w)
    with pytest.raises(ValueError, match=r"must be \(8,\)"):
        add_rms_norm(x, None, torch.ones(4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [768, 1500])
def test_gelu_mul(device, m):
    g = torch.Generator(device=device).manual_seed(m)
    for dtype in dtypes(device):
        gate_up = (2 * torch.randn(5, 3, 2 * m, device=device, generator=g)).to(dtype)
        poison_allocator(device)
        close(gelu_mul_triton(gate_up), gelu_mul_reference(gate_up), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("heads", "kv_heads", "d", "n", "t"), [(4, 1, 64, 3, 9), (8, 2, 32, 3, 9), (4, 1, 64, 40, 65)])
def test_qkv_rope_writes_rotated_heads_into_a_cache_view(device, heads, kv_heads, d, n, t):
    """Small and large token counts (one token a program, and blocks of tokens with a ragged end)."""
    n = min(n, 8) if device == "cpu" else n  # the interpreter: 8 slots of 65 tokens are still many blocks
    g = torch.Generator(device=device).manual_seed(heads * d)
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    for dtype in dtypes(device):
        qkv = torch.randn(n, t, (heads + 2 * kv_heads) * d, device=device, generator=g).to(dtype)
        pos0 = torch.randint(0, 500, (n,), device=device, generator=g)
        cache = torch.full((n, 4, 2, kv_heads, t + 5, d), float("nan"), device=device, dtype=dtype)
        poison_allocator(device)
        q, k, v = qkv_rope_triton(qkv, pos0, inv, heads, kv_heads, cache[:, 2, :, :, 5:])
        q_ref, k_ref, v_ref = qkv_rope_reference(qkv, pos0, inv, heads, kv_heads)
        close(q, q_ref, dtype, scale=2)
        close(k, k_ref, dtype, scale=2)
        assert torch.equal(v, v_ref)
        assert k.data_ptr() == cache[:, 2, 0, :, 5:].data_ptr()  # written in place, nowhere else
        assert cache[:, [0, 1, 3]].isnan().all() and cache[..., :5, :].isnan().all()


def norm_linear_inputs(device, dtype, g, rows_shape, width, out):
    """Residual rows, an RMSNorm weight near 1 and a projection scaled as trained layers are."""
    x = (2 * torch.randn(*rows_shape, width, device=device, generator=g)).to(dtype)
    nw = (1 + 0.1 * torch.randn(width, device=device, generator=g)).to(dtype)
    w = (torch.randn(out, width, device=device, generator=g) / width**0.5).to(dtype)
    return x, nw, w


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("rows_shape", "width", "m"),
    [((1, 8), 192, 768), ((40, 65), 256, 1024), ((5, 3), 100, 40)],  # one slot; 64-row blocks; ragged
)
def test_rms_norm_geglu_matches_norm_then_linear_then_gelu_mul(device, rows_shape, width, m):
    """The tiny expert at one slot, the frame encode's shape over many rows (a ragged last row
    block), and widths and column counts off the block sizes."""
    if device == "cpu":  # the interpreter: 8 slots' frames are still many 64-row blocks and a ragged last one
        rows_shape = (min(rows_shape[0], 8), *rows_shape[1:])
    g = torch.Generator(device=device).manual_seed(width + m)
    for dtype in dtypes(device):
        x, nw, w = norm_linear_inputs(device, dtype, g, rows_shape, width, 2 * m)
        poison_allocator(device)
        got = rms_norm_geglu_triton(x, nw, 1e-6, w)
        assert got.shape == (*rows_shape, m)
        close(got, rms_norm_geglu_reference(x, nw, 1e-6, w), dtype, scale=2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "d", "n", "t", "width"),
    [(4, 1, 64, 1, 8, 192), (4, 1, 64, 40, 65, 256), (8, 2, 32, 3, 9, 100)],
)
def test_rms_norm_qkv_rope_writes_rotated_heads_into_a_cache_view(device, heads, kv_heads, d, n, t, width):
    n = min(n, 8) if device == "cpu" else n  # the interpreter: 8 slots of 65 rows are still many row blocks
    g = torch.Generator(device=device).manual_seed(heads * d + width)
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    for dtype in dtypes(device):
        x, nw, w = norm_linear_inputs(device, dtype, g, (n, t), width, (heads + 2 * kv_heads) * d)
        pos0 = torch.randint(0, 500, (n,), device=device, generator=g)
        cache = torch.full((n, 4, 2, kv_heads, t + 5, d), float("nan"), device=device, dtype=dtype)
        poison_allocator(device)
        q, k, v = rms_norm_qkv_rope_triton(x, nw, 1e-6, w, pos0, inv, heads, kv_heads, cache[:, 2, :, :, 5:])
        q_ref, k_ref, v_ref = rms_norm_qkv_rope_reference(x, nw, 1e-6, w, pos0, inv, heads, kv_heads)
        for got, want in ((q, q_ref), (k, k_ref), (v, v_ref)):
            close(got, want, dtype, scale=2)
        assert q.shape == (n, heads, t, d)
        assert k.data_ptr() == cache[:, 2, 0, :, 5:].data_ptr()  # written in place, nowhere else
        assert cache[:, [0, 1, 3]].isnan().all() and cache[..., :5, :].isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_norm_linear_takes_the_fused_kernel_only_for_few_narrow_rows(device, monkeypatch):
    """Up to the row limits one fused launch; one row more, or rows wider than the fused kernel
    holds, or a head dim under 32, take the unfused chain. Both agree with the reference."""
    import flashrt.kernels.norm_linear as nl

    launches = spy_launches(monkeypatch, nl, "_norm_linear_kernel")
    if device == "cpu":  # the interpreter runs the kernel on CPU tensors, as on a GPU
        monkeypatch.setattr(nl, "use_triton", lambda *tensors: True)
    g = torch.Generator(device=device).manual_seed(5)
    dtype = dtypes(device)[0]
    inv = 10000.0 ** (-torch.arange(0, 16, dtype=torch.float32, device=device) / 16)
    cases = [
        ("geglu", nl.GEGLU_MAX_ROWS, 32, 32, True),
        ("geglu", nl.GEGLU_MAX_ROWS + 1, 32, 32, False),
        ("geglu", 8, nl.FUSED_MAX_WIDTH + 8, 32, False),
        ("qkv", nl.QKV_ROPE_MAX_ROWS, 32, 32, True),
        ("qkv", nl.QKV_ROPE_MAX_ROWS + 1, 32, 32, False),
        ("qkv", 8, 32, 16, False),
    ]
    for form, rows, width, d, fused in cases:
        launches.clear()
        if form == "geglu":
            x, nw, w = norm_linear_inputs(device, dtype, g, (1, rows), width, 2 * d)
            got, want = [rms_norm_geglu(x, nw, 1e-6, w)], [rms_norm_geglu_reference(x, nw, 1e-6, w)]
        else:
            x, nw, w = norm_linear_inputs(device, dtype, g, (1, rows), width, 4 * d)
            args = (torch.zeros(1, dtype=torch.int64, device=device), inv[: d // 2], 2, 1)
            got = rms_norm_qkv_rope(x, nw, 1e-6, w, *args)
            want = rms_norm_qkv_rope_reference(x, nw, 1e-6, w, *args)
        assert bool(launches) == fused, (form, rows, width, d)
        for a, b in zip(got, want, strict=True):
            close(a, b, dtype, scale=2)


def test_norm_linear_off_the_fused_path_is_the_unfused_chain():
    """Where the fused kernel does not run (here the CPU), the calls are the unfused chain."""
    g = torch.Generator().manual_seed(0)
    x, nw, w = norm_linear_inputs("cpu", torch.float32, g, (2, 5), 64, 6 * 32)
    assert torch.equal(rms_norm_geglu(x, nw, 1e-6, w), rms_norm_geglu_reference(x, nw, 1e-6, w))
    pos0, inv = torch.tensor([3, 40]), torch.rand(16)
    got = rms_norm_qkv_rope(x, nw, 1e-6, w, pos0, inv, 4, 1)
    for a, b in zip(got, rms_norm_qkv_rope_reference(x, nw, 1e-6, w, pos0, inv, 4, 1), strict=True):
        assert torch.equal(a, b)


def test_norm_linear_names_the_mismatched_weight():
    x, nw, w = torch.zeros(2, 3, 8), torch.ones(8), torch.zeros(12, 8)
    with pytest.raises(ValueError, match=r"norm weight must be \(8,\)"):
        rms_norm_geglu(x, torch.ones(4), 1e-6, w)
    with pytest.raises(ValueError, match=r"must be \(out, 8\) as nn.Linear stores it"):
        rms_norm_geglu(x, nw, 1e-6, w.t())
    with pytest.raises(ValueError, match="even row count"):
        rms_norm_geglu(x, nw, 1e-6, torch.zeros(11, 8))
    with pytest.raises(ValueError, match="pos0 must be"):
        rms_norm_qkv_rope(x, nw, 1e-6, w, torch.zeros(3, dtype=torch.int64), torch.ones(1), 1, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "tq", "tk", "context", "d", "n"),
    [
        (4, 1, 8, 8, (16, 65, 65), 64, 3),  # the expert over instruction, ring and newest frame
        (4, 1, 8, 8, (16, 65, 65), 64, 200),  # more programs than SMs: the throughput launch shape
        (4, 1, 65, 65, (16, 65), 64, 3),  # a frame over instruction and ring
        (4, 1, 65, 65, (81,), 64, 40),
        (4, 1, 16, 16, (), 64, 3),
        (8, 2, 50, 50, (48, 82), 128, 3),
        (2, 2, 3, 5, (7, 1, 4, 9), 16, 3),  # more segments than one launch reads: concatenated first
        (4, 1, 8, 8, (300, 400), 64, 3),  # few programs, many key blocks: keys split over programs
        (8, 1, 50, 50, (48, 769), 256, 1),  # pi0's expert at one slot: split, head dim 256
        (8, 1, 50, 50, (48, 769), 256, 6),  # at a few slots: 64-row programs (bf16)
        (8, 1, 50, 50, (48, 769), 256, 40),  # at many: 128-row programs of 8 warps (bf16)
    ],
)
def test_attention_over_context_segments_and_own_keys(device, heads, kv_heads, tq, tk, context, d, n, monkeypatch):
    """The kernel over context segments read in place (per-token masks, per-slot flags, none) and
    the own keys equals the float32 reference over their concatenation, at every launch shape;
    mutation: against the reference without the context it fails."""
    if device == "cpu" and d == 256 and n > 1:
        pytest.skip("pi0's taller programs are bf16 launch shapes; the interpreter's float32 takes one slot's tiles")
    if device == "cpu" and n >= 40:
        # The interpreter runs every program in Python: a throughput shape (more programs than SMs)
        # takes the same launch decisions over a stand-in of 8 SMs and proportionally fewer slots.
        n = max(3, -(-n * 8 // sm_count(torch.device("cpu"))))
        monkeypatch.setattr(ga, "sm_count", lambda _: 8)
    g = torch.Generator(device=device).manual_seed(tq * 1000 + sum(context))
    for dtype in dtypes(device):
        rnd = lambda *s, dt=dtype: torch.randn(*s, device=device, generator=g).to(dt)  # noqa: E731
        q = rnd(n, tq, heads, d).transpose(1, 2)  # strided, as the projection lays it out
        k, v = rnd(n, kv_heads, tk, d), rnd(n, kv_heads, tk, d)
        own_mask = torch.rand(n, tk, device=device, generator=g) < 0.8
        own_mask[:, 0] = True
        segments = []
        for i, tc in enumerate(context):
            cache = rnd(n, 3, 2, kv_heads, tc, d)[:, 1]  # one layer of an (N, S, 2, g, T, d) cache
            if i % 3 == 0:
                cmask = torch.rand(n, tc, device=device, generator=g) < 0.5
            elif i % 3 == 1:  # one flag per slot, expanded over the segment's tokens (stride 0)
                cmask = (torch.rand(n, 1, device=device, generator=g) < 0.5).expand(-1, tc)
            else:
                cmask = None
            segments.append((cache[:, 0], cache[:, 1], cmask))
        for ctx in ((), segments) if context else ((),):
            for mask in (None, own_mask):
                poison_allocator(device)
                got = attention_triton(q, k, v, mask, ctx)
                f = lambda x: None if x is None else x.float()  # noqa: E731 - reference in float32
                want = attention_reference(f(q), f(k), f(v), mask, [(f(a), f(b), m) for a, b, m in ctx])
                close(got, want, dtype)
                if ctx:  # mutation: the same comparison with the context dropped fails
                    with pytest.raises(AssertionError):
                        close(got, attention_reference(f(q), f(k), f(v), mask), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_over_segments_not_on_16_byte_rows(device):
    """Row alignment is a launch-time fact the kernel relies on for vector loads; a segment
    whose rows do not start on 16 bytes (an odd element offset) must still read correctly."""
    g = torch.Generator(device=device).manual_seed(5)
    n, tq, d = 3, 8, 64
    for dtype in dtypes(device):
        rnd = lambda *s, dt=dtype: torch.randn(*s, device=device, generator=g).to(dt)  # noqa: E731
        q, k, v = rnd(n, 4, tq, d), rnd(n, 1, tq, d), rnd(n, 1, tq, d)
        flat = rnd(2 * n * 65 * d + 1)[1:]  # one element off: no row on a 16-byte boundary
        ring = flat.view(n, 2, 1, 65, d)
        segments = [(rnd(n, 1, 16, d), rnd(n, 1, 16, d), None), (ring[:, 0], ring[:, 1], None)]
        got = attention_triton(q, k, v, None, segments)
        f = lambda x: x.float()  # noqa: E731
        close(got, attention_reference(f(q), f(k), f(v), None, [(f(a), f(b), m) for a, b, m in segments]), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("context", [(16, 65), (300, 400)])  # one program per slot; keys split over programs
def test_attention_rows_with_no_valid_key_are_zero(device, context):
    """Slot 0 has every key masked out, by a per-token mask and by per-slot flags: its rows are
    zeros (SDPA would give NaN); slot 1 keeps its keys and matches the reference."""
    g = torch.Generator(device=device).manual_seed(sum(context))
    n, tq, d = 2, 8, 64
    for dtype in dtypes(device):
        rnd = lambda *s, dt=dtype: torch.randn(*s, device=device, generator=g).to(dt)  # noqa: E731
        q, k, v = rnd(n, 4, tq, d), rnd(n, 1, tq, d), rnd(n, 1, tq, d)
        tokens = torch.ones(n, context[0], dtype=torch.bool, device=device)
        tokens[0] = False
        flag = torch.tensor([[False], [True]], device=device)
        segments = [(rnd(n, 1, context[0], d), rnd(n, 1, context[0], d), tokens)]
        segments.append((rnd(n, 1, context[1], d), rnd(n, 1, context[1], d), flag.expand(-1, context[1])))
        poison_allocator(device)
        got = attention_triton(q, k, v, flag.expand(-1, tq), segments)
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        f = lambda x: x.float()  # noqa: E731
        want = attention_reference(
            f(q[1:]), f(k[1:]), f(v[1:]), None, [(f(a[1:]), f(b[1:]), None) for a, b, _ in segments]
        )
        close(got[1:], want, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_splits_the_keys_only_when_programs_are_few(device, monkeypatch):
    """Three slots over 708 keys (three programs, twelve key blocks each) take the split launch
    and its merge; one program per slot on more than half the SMs does not. Both match the
    reference."""
    import flashrt.kernels.grouped_attention as ga

    merges = spy_launches(monkeypatch, ga, "_combine_kernel")
    g = torch.Generator(device=device).manual_seed(11)
    for n, split in ((3, True), (sm_count(torch.device(device)) // 2 + 1, False)):
        for dtype in dtypes(device):
            rnd = lambda *s, dt=dtype: torch.randn(*s, device=device, generator=g).to(dt)  # noqa: E731
            q, k, v = rnd(n, 4, 8, 64), rnd(n, 1, 8, 64), rnd(n, 1, 8, 64)
            segments = [(rnd(n, 1, 300, 64), rnd(n, 1, 300, 64), None), (rnd(n, 1, 400, 64), rnd(n, 1, 400, 64), None)]
            merges.clear()
            got = attention_triton(q, k, v, None, segments)
            assert bool(merges) == split
            f = lambda x: x.float()  # noqa: E731
            want = attention_reference(f(q), f(k), f(v), None, [(f(a), f(b), None) for a, b, _ in segments])
            close(got, want, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_a_wide_head_sweeps_each_source_on_blocks_of_its_own(device, monkeypatch):
    """pi0's expert layout at head dim 256: language and the state token after it (per-token
    mask), images (a per-slot flag) and the own keys, each swept by a loop of its own from a
    block boundary. Matches the reference; mutation: the same comparison against attention
    without the state token (the language block's last key) fails."""
    import flashrt.kernels.grouped_attention as ga

    launches = spy_launches(monkeypatch, ga, "_attention_kernel")
    g = torch.Generator(device=device).manual_seed(21)
    for dtype in dtypes(device):
        rnd = lambda *s, dt=dtype: torch.randn(*s, device=device, generator=g).to(dt)  # noqa: E731
        n, d = 2, 256
        q, k, v = rnd(n, 50, 8, d).transpose(1, 2), rnd(n, 1, 50, d), rnd(n, 1, 50, d)
        block = rnd(n, 2, 1, 70 + 48 + 1, d) * 2  # block B's keys/values: images, language, state
        text = torch.rand(n, 48, device=device, generator=g) < 0.7
        flag = torch.tensor([[True], [True]], device=device)
        segments = [
            (block[:, 0, :, 70:], block[:, 1, :, 70:], torch.cat([text, flag], 1)),
            (block[:, 0, :, :70], block[:, 1, :, :70], flag.expand(-1, 70)),
        ]
        poison_allocator(device)
        got = attention_triton(q, k, v, None, segments)
        fq, fk, fv = q.float(), k.float(), v.float()
        full = [(a.float(), b.float(), m) for a, b, m in segments]
        close(got, attention_reference(fq, fk, fv, None, full), dtype)
        without_state = [(a[:, :, :48], b[:, :, :48], m[:, :48]) for a, b, m in full[:1]] + full[1:]
        with pytest.raises(AssertionError):
            close(got, attention_reference(fq, fk, fv, None, without_state), dtype)
    assert launches and all(o["PER_SOURCE"] for o in launches.options)


@pytest.mark.parametrize("device", DEVICES)
def test_the_merge_of_a_wide_head_tiles_its_dims_over_programs(device, monkeypatch):
    """pi0's expert at one slot (head dim 256, keys split over programs): the merge runs as four
    programs per row block, each on 64 of the dims, and matches the reference. Mutation: the
    same merge launched with one program per row block (every program on dims 0..63 alone)
    leaves the other dims unmerged, and the comparison fails."""
    import flashrt.kernels.grouped_attention as ga

    g = torch.Generator(device=device).manual_seed(13)
    rnd = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    q, k, v = rnd(1, 50, 8, 256).transpose(1, 2), rnd(1, 1, 50, 256), rnd(1, 1, 50, 256)
    segments = [(rnd(1, 1, tc, 256), rnd(1, 1, tc, 256), None) for tc in (48, 769)]
    want = attention_reference(q, k, v, None, segments)
    merges = spy_launches(monkeypatch, ga, "_combine_kernel")
    poison_allocator(device)
    got = attention_triton(q, k, v, None, segments)
    close(got, want, torch.float32)
    assert merges and all(grid[2] == 256 // ga.COMBINE_DIMS for grid in merges)
    got.fill_(float("nan"))  # the block the next call's output likely reuses: no correct values left in it
    del got

    merge = ga._combine_kernel

    class FirstDimsOnly:
        def __getitem__(self, grid):
            return merge[(*grid[:2], 1)]

    monkeypatch.setattr(ga, "_combine_kernel", FirstDimsOnly())
    poison_allocator(device)
    with pytest.raises(AssertionError):
        close(attention_triton(q, k, v, None, segments), want, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_attention_gives_few_query_rows_16_row_programs_over_one_key_block(device, monkeypatch):
    """The expert's 32 query rows per slot (4 heads x 8 tokens over 89 keys) run as two 16-row
    programs per slot, each over every key in one block, while the programs fit on half the SMs;
    with more slots, one 32-row program per slot sweeps 64-key blocks. Both match the reference."""
    import flashrt.kernels.grouped_attention as ga

    launches = spy_launches(monkeypatch, ga, "_attention_kernel")
    g = torch.Generator(device=device).manual_seed(12)
    many = sm_count(torch.device(device)) // 2 + 1
    for n, grid in ((3, (2, 3, 1)), (many, (1, many, 1))):
        rnd = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
        q, k, v = rnd(n, 8, 4, 64).transpose(1, 2), rnd(n, 1, 8, 64), rnd(n, 1, 8, 64)
        text = torch.rand(n, 16, device=device, generator=g) < 0.7
        segments = [(rnd(n, 1, 16, 64), rnd(n, 1, 16, 64), text), (rnd(n, 1, 65, 64), rnd(n, 1, 65, 64), None)]
        launches.clear()
        got = attention_triton(q, k, v, None, segments)
        assert launches == [grid]
        close(got, attention_reference(q, k, v, None, segments), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_plain_self_attention_takes_the_kernel_only_below_one_head_per_sm(device, monkeypatch):
    """The vision tower's attention (no context, no mask) runs the kernel while slots x heads fit
    on the SMs (where it launches dependent in a graph); beyond, SDPA's fused kernels."""
    import flashrt.kernels.grouped_attention as ga

    if device == "cpu":  # the interpreter runs the kernel on CPU tensors, as on a GPU
        monkeypatch.setattr(ga, "use_triton", lambda *tensors: True)
    launches = spy_launches(monkeypatch, ga, "_attention_kernel")
    g = torch.Generator(device=device).manual_seed(13)
    fit = sm_count(torch.device(device)) // 4
    for n, kernel in ((fit, True), (fit + 1, False)):
        q, k, v = (torch.randn(n, 4, 8, 16, device=device, generator=g) for _ in range(3))
        launches.clear()
        close(attention(q, k, v, None), attention_reference(q, k, v, None), torch.float32)
        assert bool(launches) == kernel


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("heads", "d", "context", "n", "on_load", "halves"),
    [(8, 256, (48, 140), 2, True, True), (8, 256, (48, 140), 40, True, False), (4, 64, (16, 65), 2, False, False)],
)
def test_attention_rotates_queries_and_own_keys_by_rope_tables(device, heads, d, context, n, on_load, halves,
                                                               monkeypatch):  # fmt: skip
    """Queries and own keys arrive as unrotated views of the q/k/v projection with the rotation
    tables of their positions. At pi0's head dim 256 the kernel rotates them as it loads them
    (a ROPE launch: as halves at 2 slots, as joined rows at 40, whose programs outnumber the
    SMs: 160 of 128 rows in bf16), at 64 torch rotates them first; each matches ``qkv_rope``'s
    rotation followed by the reference attention, also with a sin table strided apart from its
    cos table.
    Mutations, each the same comparison: tables one position later (visible because the context
    keys keep the positions they were rotated at), and own keys left unrotated."""
    import flashrt.kernels.grouped_attention as ga
    from flashrt.kernels.rotary import rope_tables, split_heads

    launches = spy_launches(monkeypatch, ga, "_attention_kernel")
    if device == "cpu" and n > 2:  # the interpreter: more programs than SMs over a stand-in of 8 SMs and 2 slots
        n = 2
        monkeypatch.setattr(ga, "sm_count", lambda _: 8)
    g = torch.Generator(device=device).manual_seed(d)
    t = 50
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    pos0 = torch.randint(0, 300, (n,), device=device, generator=g)
    for dtype in dtypes(device):
        rnd = lambda *s, dt=dtype: torch.randn(*s, device=device, generator=g).to(dt)  # noqa: E731
        qkv = rnd(n, t, (heads + 2) * d)
        segments = [(rnd(n, 1, tc, d), rnd(n, 1, tc, d), None) for tc in context]
        segments[0] = (*segments[0][:2], torch.rand(n, context[0], device=device, generator=g) < 0.7)
        q, k, v = split_heads(qkv, heads, 1)
        poison_allocator(device)
        before = len(launches.options)
        got = attention_triton(q, k, v, None, segments, rope_tables(pos0, t, inv, dtype))
        assert [(o["ROPE"], o["HALVES"]) for o in launches.options[before:]] == [(on_load, halves)]
        f = lambda x: x.float()  # noqa: E731 - reference in float32
        full = [(f(a), f(b), m) for a, b, m in segments]
        qr, kr, vr = qkv_rope_reference(qkv, pos0, inv, heads, 1)
        close(got, attention_reference(f(qr), f(kr), f(vr), None, full), dtype)
        shifted = qkv_rope_reference(qkv, pos0 + 1, inv, heads, 1)
        with pytest.raises(AssertionError):
            close(got, attention_reference(*map(f, shifted), None, full), dtype)
        with pytest.raises(AssertionError):
            close(got, attention_reference(f(qr), f(k), f(vr), None, full), dtype)
        cos, sin = rope_tables(pos0, t, inv, dtype)
        wide = torch.zeros(n, 1, t, d, dtype=dtype, device=device)
        wide[..., : d // 2] = sin  # a sin table strided apart from its cos table
        strided = attention_triton(q, k, v, None, segments, (cos, wide[..., : d // 2]))
        close(strided, attention_reference(f(qr), f(kr), f(vr), None, full), dtype)


def test_attention_names_rope_tables_that_do_not_fit():
    from flashrt.kernels.rotary import rope_tables

    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 1, 8, 16)
    inv = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float32) / 16)
    tables = rope_tables(torch.tensor([0, 3]), 8, inv, torch.float32)
    with pytest.raises(ValueError, match=r"rope cos table is \(2, 1, 7, 8\) torch.float32; it must be \(2, 1, 8, 8\)"):
        attention(q, k, k, None, rope=rope_tables(torch.tensor([0, 3]), 7, inv, torch.float32))
    with pytest.raises(ValueError, match="rope sin table .* torch.bfloat16; it must be .* torch.float32"):
        attention(q, k, k, None, rope=(tables[0], tables[1].bfloat16()))
    with pytest.raises(ValueError, match="5 own keys for 8 queries"):
        attention(q, k[:, :, :5], k[:, :, :5], None, rope=tables)


def test_attention_names_the_segment_that_does_not_fit():
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 1, 8, 16)
    seg = torch.randn(2, 1, 5, 16)
    with pytest.raises(ValueError, match="context segment 1 "):
        attention(q, k, k, None, [(seg, seg, None), (seg[:, :, :, :8], seg[:, :, :, :8], None)])
    with pytest.raises(ValueError, match="segment 0's mask is \\(2, 4\\); it must be \\(2, 5\\)"):
        attention(q, k, k, None, [(seg, seg, torch.ones(2, 4, dtype=torch.bool))])
    with pytest.raises(ValueError, match="segment 0's mask must be bool"):
        attention(q, k, k, None, [(seg, seg, torch.ones(2, 5))])
    with pytest.raises(ValueError, match="the own mask must be bool"):
        attention(q, k, k, torch.ones(2, 8, dtype=torch.int64), [(seg, seg, None)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("a", "e"), [(2, 192), (32, 1024), (7, 100)])
def test_time_embed_and_euler_step(device, a, e):
    g = torch.Generator(device=device).manual_seed(a * e)
    x = torch.randn(4, 8, a, device=device, generator=g)
    wx, bias = torch.randn(e, a, device=device, generator=g), torch.randn(e, device=device, generator=g)
    w_out, b_out = 0.05 * torch.randn(a, e, device=device, generator=g), torch.randn(a, device=device, generator=g)
    for dtype in dtypes(device):
        poison_allocator(device)
        close(time_embed_triton(x, wx, bias, dtype), time_embed_reference(x, wx, bias, dtype), dtype)
        h = torch.randn(4, 8, e, device=device, generator=g).to(dtype)
        nw = (1 + 0.1 * torch.randn(e, device=device, generator=g)).to(dtype)
        poison_allocator(device)
        got = euler_step_triton(x, h, nw, w_out, b_out, 1e-6)
        close(got, euler_step_reference(x, h, nw, w_out, b_out, 1e-6), torch.float32, scale=10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [16, 1600, 7])
def test_draw_normal_into_a_strided_slot_view(device, n):
    slots = 33
    key = torch.arange(slots, device=device) * 2654435761 + 1 - 2**40  # negative keys too
    counter = torch.randint(0, 1000, (slots,), device=device)
    arena = torch.full((slots, n + 3), float("nan"), device=device)
    got_counter, want_counter = counter.clone(), counter.clone()
    draw_normal_triton(arena[:, 1 : n + 1], key, got_counter)
    want = torch.empty(slots, n, device=device)
    draw_normal_reference(want, key, want_counter)
    torch.testing.assert_close(arena[:, 1 : n + 1], want, atol=2e-5, rtol=2e-5)
    assert arena[:, 0].isnan().all() and arena[:, n + 1 :].isnan().all()
    assert torch.equal(got_counter, want_counter)
