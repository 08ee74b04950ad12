"""FP8 projections (kernels.fp8): the quantisation on any machine, the e4m3 GEMM on an FP8 GPU."""

import functools

import pytest
import torch

import flashrt.kernels.activation as ka
import flashrt.kernels.fp8 as f8
import flashrt.kernels.norm as kn
from tests.kernels.kernel_devices import DEVICES, dtypes, spy_launches

HALF_ULP = 2.0**-4
"""e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself."""
SUBNORMAL_STEP = 2.0**-9
"""e4m3's subnormal spacing (in units of the scale): below 2^-6 values are rounded to this grid."""

needs_fp8 = pytest.mark.skipif(
    not f8.supported("cuda" if torch.cuda.is_available() else "cpu"),
    reason="needs an FP8 GPU (compute capability >= 8.9)",
)


def rows(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes (1e-3 to 1e3), as channels of a real weight differ."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * torch.logspace(-3, 3, n)[:, None]


def test_weight_round_trip_per_output_channel():
    w = rows(32, 64)
    q = f8.quantize_weight(w)
    assert q.data.dtype == torch.float8_e4m3fn and q.data.shape == (32, 64) and q.scale.shape == (32,)
    torch.testing.assert_close(q.scale, w.abs().amax(1) / 448.0, rtol=1e-6, atol=0)  # one scale per row
    assert torch.equal(q.data.float().abs().amax(1), torch.full((32,), 448.0))  # each row spans e4m3's range
    err = (q.dequantize() - w).abs()
    bound = torch.maximum(HALF_ULP * w.abs(), SUBNORMAL_STEP / 2 * q.scale[:, None])
    assert (err <= bound * (1 + 1e-6)).all()
    # per channel: the smallest row (1e-3) is as accurate, relative to itself, as the largest (1e3)
    rel = (q.dequantize() - w).norm(dim=1) / w.norm(dim=1)
    assert rel.max() < 0.05
    # the mutation: one scale for the whole matrix (per tensor) loses the small rows
    per_tensor = (w / (w.abs().max() / 448)).to(torch.float8_e4m3fn).float() * (w.abs().max() / 448)
    assert ((per_tensor - w).norm(dim=1) / w.norm(dim=1)).max() > 0.5


def test_activation_rows_saturate_at_448_and_keep_their_sign():
    x = rows(16, 48, seed=1)
    x[3, 5] = 1e30  # an outlier takes its row's scale; the rest of that row underflows, finitely
    x[4] = 0.0  # a zero row gets a nonzero scale and zeros
    q, s = f8.quantize_rows(x)
    qf = q.float()
    assert torch.isfinite(qf).all() and qf.abs().max() == 448.0
    assert torch.equal(qf.abs().amax(1)[[0, 1, 2, 3, 5]], torch.full((5,), 448.0))
    assert s.shape == (16, 1) and (s > 0).all() and not qf[4].any()
    assert torch.equal(torch.sign(qf[qf != 0]), torch.sign(x[qf != 0]))
    # saturating: a row max whose float32 ``amax * (448 / amax)`` rounds past 448 still maps onto 448
    amax = torch.tensor([[3.756744861602783, -1.0, 2.0]])
    assert (amax[0, 0] * (448.0 / amax[0, 0])).item() > 448.0
    edge, _ = f8.quantize_rows(amax)
    assert edge.float()[0, 0].item() == 448.0


def test_bad_input_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="multiples of 16"):
        f8.quantize_weight(torch.randn(24, 588), "patch_embed")
    with pytest.raises(ValueError, match="2-D floating-point"):
        f8.quantize_weight(torch.randn(16))
    with pytest.raises(ValueError, match="2-D floating-point"):
        f8.quantize_weight(torch.ones(16, 16, dtype=torch.int32))
    w = torch.randn(16, 32)
    w[2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinity"):
        f8.quantize_weight(w)
    with pytest.raises(ValueError, match="bf16/fp16/fp32 activations"):
        f8.quantize_rows(torch.ones(2, 16, dtype=torch.int64))
    q = f8.quantize_weight(torch.randn(16, 32))
    with pytest.raises(ValueError, match="must match the weight's k"):
        f8.linear(torch.randn(3, 48), q)
    with pytest.raises(ValueError, match="use quantize_weight"):
        f8.linear(torch.randn(3, 32), f8.Fp8Weight(q.data.float(), q.scale))
    with pytest.raises(ValueError, match="bias must be"):
        f8.linear(torch.randn(3, 32), q, torch.zeros(8))
    with pytest.raises(ValueError, match="for inference"):
        f8.linear(torch.randn(3, 32, requires_grad=True), q)


def test_emulated_linear_is_the_quantised_product():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(2, 5, 64, generator=g), torch.randn(32, 64, generator=g) / 8, torch.randn(32, generator=g)
    q = f8.quantize_weight(w)
    xq, xs = f8.quantize_rows(x)
    want = (xq.float() * xs) @ (q.data.float() * q.scale[:, None]).t() + b
    torch.testing.assert_close(f8.linear(x, q, b), want, rtol=1e-6, atol=1e-6)
    exact = x @ w.t() + b
    assert ((f8.linear(x, q, b) - exact).norm() / exact.norm()).item() < 0.06  # e4m3 on both sides


def test_the_layout_and_scales_are_those_scaled_mm_reads():
    """torch's own ``_scaled_mm`` (its CPU implementation, where this torch has one) with the
    operands as :func:`fp8.linear` passes them computes the emulated product; with the weight
    scales of another channel order it does not."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 64, generator=g), torch.randn(48, 64, generator=g) / 8
    q = f8.quantize_weight(w)
    xq, xs = f8.quantize_rows(x)
    try:
        got = torch._scaled_mm(xq, q.data.t(), scale_a=xs, scale_b=q.scale.view(1, -1), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"this torch has no CPU _scaled_mm: {e}")
    want = f8.linear_emulated(x, q).bfloat16()
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    wrong = torch._scaled_mm(xq, q.data.t(), scale_a=xs, scale_b=q.scale.flip(0).view(1, -1), out_dtype=torch.bfloat16)
    assert not torch.allclose(wrong.float(), want.float(), rtol=1e-1, atol=1e-1)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rows_kernel_matches_the_reference_bit_for_bit(dtype):
    """On the GPU (Triton's CPU interpreter rounds some values to e4m3 wrongly, so it is not
    a witness here): the kernel's scales and e4m3 bytes are the reference's."""
    g = torch.Generator(device="cuda").manual_seed(4)
    for shape in ((3, 7, 64), (50, 1024), (5, 4304), (2, 16384)):
        x = (torch.randn(*shape, device="cuda", generator=g) * 3).to(dtype)
        x[0, ..., 0] = 0.0
        x[-1] = 0.0
        assert f8.use_triton(x)
        q, s = f8.quantize_rows(x)
        rq, rs = f8.quantize_rows_reference(x)
        assert q.shape == x.shape and s.shape == (*x.shape[:-1], 1)
        assert torch.equal(s, rs)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.cuda
@needs_fp8
def test_scaled_mm_path_matches_the_emulation_and_captures():
    """bf16 activations on an FP8 GPU take one FP8 tensor-core kernel (``torch._scaled_mm``;
    over few rows the Triton one): it equals the emulated product to bf16 rounding (both round
    once; the sums differ in order), at pi0's shapes and at one row; a graph replays
    ``torch._scaled_mm``. Mutation: one output channel's scale x2 is caught."""
    g = torch.Generator(device="cuda").manual_seed(5)
    for m, k, n in ((1, 1024, 2560), (50, 4096, 1024), (816, 2048, 32768)):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
        b = torch.randn(n, device="cuda", generator=g).bfloat16()
        q = f8.quantize_weight(w)
        assert f8.runs_scaled_mm(x)
        got, want = f8.linear(x, q, b), f8.linear_emulated(x.float(), q, b.float())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2)
        bad = f8.Fp8Weight(q.data, q.scale.clone())
        bad.scale[n // 3] *= 2
        err = (f8.linear(x, bad, b).float() - want)[:, n // 3].abs().max()
        assert err > 10 * 1e-2
    replays_as_called(torch.randn(f8.FEW_ROWS + 36, 1024, device="cuda", generator=g).bfloat16(), g)


def replays_as_called(x: torch.Tensor, g: torch.Generator) -> None:
    """:func:`fp8.linear` of ``x`` captured in a CUDA graph and replayed equals its eager call."""
    q = f8.quantize_weight(torch.randn(2560, x.shape[-1], device="cuda", generator=g) / 32)
    assert f8.runs_scaled_mm(x)
    eager = f8.linear(x, q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f8.linear(x, q)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("device", DEVICES)
def test_few_rows_kernel_is_the_quantised_product(device, monkeypatch):
    """Over few rows (the expert's 50 tokens at one slot, one state token, a ragged 17) the
    product is one Triton kernel, e4m3 x e4m3 on the tensor cores with the scales and the bias
    in its epilogue: the emulated product to bf16 rounding (both round once; the sums differ in
    order), at pi0's expert shapes, from rows of a wider buffer too, inside a captured graph on
    CUDA. Mutation: one output channel's scale x2 is caught."""
    if device == "cpu":
        monkeypatch.setattr(f8, "use_triton", lambda *tensors: True)
    launches = spy_launches(monkeypatch, f8, "_few_rows_kernel")
    g = torch.Generator(device=device).manual_seed(11)
    for m, k, n in ((50, 1024, 2560), (1, 4096, 1024), (17, 192, 96)):
        x = torch.randn(m, k, device=device, generator=g).bfloat16()
        w = torch.randn(n, k, device=device, generator=g) / k**0.5
        b = torch.randn(n, device=device, generator=g).bfloat16()
        q, rows = f8.quantize_weight(w), f8.quantize_rows(x)
        assert f8.few_rows(rows, q)
        want = f8.linear_emulated(x.float(), q, b.float())
        before = len(launches)
        got = f8.linear_rows_triton(rows, q, b)
        assert len(launches) == before + 1 and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(f8.linear_rows_triton(rows, q).float() + b.float(), want, rtol=1.6e-2, atol=2e-2)
        strided = (torch.cat([rows[0], rows[0]], -1)[:, :k], rows[1])  # rows of a wider buffer
        assert torch.equal(f8.linear_rows_triton(strided, q, b), got)
        bad, c = f8.Fp8Weight(q.data, q.scale.clone()), int((want - b.float())[0].abs().argmax())
        bad.scale[c] *= 2  # the channel of the largest product: its error is that product, not rounding
        assert (f8.linear_rows_triton(rows, bad, b).float() - want)[0, c].abs() > 10 * 1e-2
    assert not f8.few_rows(f8.quantize_rows(torch.randn(f8.FEW_ROWS + 1, k, device=device)), q)
    if device == "cuda":
        replays_as_called(torch.randn(50, 1024, device=device, generator=g).bfloat16(), g)
        assert launches.dependent[-1]  # captured: launched dependent


NORM_SCALE_RTOL = 1e-6
"""How far a float32 norm's e4m3 scales may be from those of its own float32 output on the GPU
(a few float32 ulps). The norm's sum over the row is reduced in another order in the kernel
variant that quantises (its layouts differ), so its float32 output can move by an ulp or two:
measured on an H100 at ``449250d``, 12 of 63 rows' scales 1.1 to 1.3e-7 apart, every e4m3 value
equal. In bf16, the dtype FP8 layers run in, that ulp is rounded away: bit for bit there."""


def same_rows(got: f8.Rows, want: f8.Rows, exact: bool, scale_rtol: float = 0.0) -> None:
    """Quantised rows equal: scales bit for bit (or within ``scale_rtol``); e4m3 values bit for
    bit (``exact``), or within one e4m3 step, which covers Triton's CPU interpreter too: a value
    rounding up to a power of two comes out as half of it there (the interpreter drops the carry
    into the exponent: 126.95 gives 64, not 128), also where the reference, from an input an ulp
    away, rounded down to the e4m3 value below that power of two."""
    (q, s), (rq, rs) = got, want
    assert q.dtype == rq.dtype == f8.E4M3 and q.shape == rq.shape and s.shape == rs.shape
    if scale_rtol:
        torch.testing.assert_close(s, rs, rtol=scale_rtol, atol=0.0)
    else:
        assert torch.equal(s, rs)
    if exact:
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
        return
    a, b = q.float(), rq.float()
    step = torch.maximum(b.abs() / 8, torch.full_like(b, SUBNORMAL_STEP))
    dropped_carry = ((2 * a - b).abs() <= step * (1 + 1e-6)) & (torch.frexp(2 * a).mantissa.abs() == 0.5)
    assert (((a - b).abs() <= step * (1 + 1e-6)) | dropped_carry).all()


@pytest.mark.parametrize("device", DEVICES)
def test_norms_and_gelu_mul_quantise_what_they_would_return_in_their_kernel(device, monkeypatch):
    """``fp8=True``: the RMSNorm, pi0.5's adaptive RMSNorm, the LayerNorm and the GeGLU kernels
    return :func:`fp8.quantize_rows` of the output they return without it (the residual sums
    unchanged), one kernel each. On the GPU bit for bit in bf16, and the GeGLU in float32 too; a
    float32 norm's scales within :data:`NORM_SCALE_RTOL` and its values within one e4m3 step (its
    sum is reduced in another order); in Triton's CPU interpreter, which rounds some values to
    e4m3 wrongly, the scales bit for bit and the values within one e4m3 step. Mutation: rows
    compared with their neighbours' outputs fail."""
    if device == "cpu":
        for module in (kn, ka):
            monkeypatch.setattr(module, "use_triton", lambda *tensors: True)
    launches = spy_launches(monkeypatch, kn, "_add_norm_kernel")
    exact = device == "cuda"
    g = torch.Generator(device=device).manual_seed(8)
    for dtype in dtypes(device):
        n, t, w = 3, 21, 256
        x = (1 + torch.randn(n, t, w, device=device, generator=g)).to(dtype)
        delta = torch.randn(n, t, w, device=device, generator=g).to(dtype)
        weight, bias = ((1 + 0.1 * torch.randn(w, device=device, generator=g)).to(dtype) for _ in range(2))
        gate, mod = torch.rand(n, w, device=device, generator=g), 1 + torch.randn(n, 3, w, device=device, generator=g)
        float32_gpu = exact and dtype == torch.float32
        norm_exact, norm_rtol = exact and not float32_gpu, NORM_SCALE_RTOL if float32_gpu else 0.0
        norms = {
            "rms": functools.partial(kn.add_rms_norm, x, delta, weight, 1e-6),
            "ada": functools.partial(kn.add_ada_rms_norm, x, delta, gate, mod, 1e-6),
            "layer": functools.partial(kn.add_layer_norm, x, delta, weight, bias, 1e-5),
        }
        for name, norm in norms.items():
            before = len(launches)
            h8, rows = norm(fp8=True)
            assert len(launches) == before + 1, name  # one kernel: the norm quantises its own output
            h, y = norm()
            assert torch.equal(h8, h), name
            same_rows(rows, f8.quantize_rows_reference(y), norm_exact, norm_rtol)
            with pytest.raises(AssertionError):
                same_rows(rows, f8.quantize_rows_reference(y.roll(1, dims=-2)), norm_exact, norm_rtol)
        view = torch.cat([x, x], -1)[..., :w]  # rows at a stride of 2w, as a slice of a wider buffer
        _, rows = kn.add_rms_norm(view, delta, weight, 1e-6, fp8=True)
        y = kn.add_rms_norm(x, delta, weight, 1e-6)[1]
        same_rows(rows, f8.quantize_rows_reference(y), norm_exact, norm_rtol)
        for shape in ((5, 600), (2, 3, 2048)):  # m = 300 (a ragged block) and 1024
            gate_up = torch.randn(*shape, device=device, generator=g).to(dtype)
            out = ka.gelu_mul(gate_up)
            rows = ka.gelu_mul(gate_up, fp8=True)
            same_rows(rows, f8.quantize_rows_reference(out), exact)
            with pytest.raises(AssertionError):
                same_rows(rows, f8.quantize_rows_reference(out.roll(1, dims=-2)), exact)
            strided = torch.cat([gate_up, gate_up], -1)[..., : shape[-1]]
            same_rows(ka.gelu_mul(strided, fp8=True), f8.quantize_rows_reference(out), exact)


GELU_SCALE_RTOL = 2.0**-8
"""How far the fused GELU's scales may be from those of torch's GELU: one bf16 ulp. The kernel
takes tanh through exp, torch through tanhf: the two float32 GELUs can differ by an ulp, which
rounding to bf16 can carry into a row's largest value."""


@pytest.mark.parametrize("device", DEVICES)
def test_gelu_quantises_torch_gelu_in_one_kernel(device, monkeypatch):
    """``gelu(x, fp8=True)`` is :func:`fp8.quantize_rows` of ``F.gelu(x, approximate="tanh")``
    in one kernel: scales within :data:`GELU_SCALE_RTOL`, values within one e4m3 step, at
    SigLIP's 4 304-wide rows (a 4 096-lane head and a tail), at a power of two and at a
    strided view. Mutation: rows compared with their neighbours' GELUs fail."""
    if device == "cpu":
        monkeypatch.setattr(ka, "use_triton", lambda *tensors: True)
    launches = spy_launches(monkeypatch, ka, "_gelu_fp8_kernel")
    g = torch.Generator(device=device).manual_seed(10)
    for dtype in dtypes(device):
        for shape in ((3, 5, 4304), (7, 600), (2, 1024)):  # a head and a tail; a head alone
            x = (3 * torch.randn(*shape, device=device, generator=g)).to(dtype)
            want = torch.nn.functional.gelu(x, approximate="tanh")
            before = len(launches)
            rows = ka.gelu(x, fp8=True)
            assert len(launches) == before + 1
            same_rows(rows, f8.quantize_rows_reference(want), False, GELU_SCALE_RTOL)
            with pytest.raises(AssertionError):
                same_rows(rows, f8.quantize_rows_reference(want.roll(1, dims=-2)), False, GELU_SCALE_RTOL)
            strided = torch.cat([x, x], -1)[..., : shape[-1]]
            same_rows(ka.gelu(strided, fp8=True), f8.quantize_rows_reference(want), False, GELU_SCALE_RTOL)
            assert torch.equal(ka.gelu(x), want)
            width = f8.pad_k(torch.empty(1, shape[-1])).shape[-1]  # 4 352, 640, 1 024
            padded = torch.nn.functional.pad(want, (0, width - shape[-1]))
            q, _ = rows = ka.gelu(x, fp8=True, width=width)
            assert q.shape[-1] == width and not q[..., shape[-1] :].float().any()
            same_rows(rows, f8.quantize_rows_reference(padded), False, GELU_SCALE_RTOL)
            assert torch.equal(ka.gelu(x, width=width), padded)
    with pytest.raises(ValueError, match="floating-point"):
        ka.gelu(torch.ones(2, 16, dtype=torch.int64, device=device), fp8=True)
    with pytest.raises(ValueError, match="width 8 is below"):
        ka.gelu(torch.ones(2, 16, device=device), fp8=True, width=8)


def test_a_weight_padded_in_k_gives_the_same_product():
    """:func:`fp8.pad_k` pads ``k`` with zero columns to a multiple of :data:`fp8.K_STEP` (and
    leaves a multiple as it is): the same scales, and the same product for an input padded
    alike. Mutation: the input padded on the wrong side (its columns shifted) gives another."""
    w = rows(64, 4304)
    padded = f8.pad_k(w)
    assert padded.shape == (64, 4352) and f8.pad_k(padded).shape == (64, 4352)
    a, b = f8.quantize_weight(w), f8.quantize_weight(padded)
    assert torch.equal(a.scale, b.scale) and torch.equal(a.data.float(), b.data[:, :4304].float())
    x = torch.randn(5, 4304, generator=torch.Generator().manual_seed(3))
    want = f8.linear_emulated(x, a)
    assert torch.equal(f8.linear_emulated(torch.nn.functional.pad(x, (0, 48)), b), want)
    assert not torch.allclose(f8.linear_emulated(torch.nn.functional.pad(x, (48, 0)), b), want, rtol=0.1)


def test_linear_rows_is_linear_of_the_rows_activations():
    """:func:`fp8.linear_rows` of :func:`fp8.quantize_rows` of x is :func:`fp8.linear` of x, bit
    for bit (the same product); rows of another format are refused with the fix."""
    g = torch.Generator().manual_seed(9)
    x, w, b = torch.randn(2, 5, 64, generator=g), torch.randn(32, 64, generator=g) / 8, torch.randn(32, generator=g)
    q = f8.quantize_weight(w)
    assert torch.equal(f8.linear_rows(f8.quantize_rows(x), q, b, dtype=x.dtype), f8.linear(x, q, b))
    with pytest.raises(ValueError, match="quantize_rows's output"):
        f8.linear_rows((x, torch.ones(2, 5, 1)), q)
    with pytest.raises(ValueError, match="must match the weight's k"):
        f8.linear_rows(f8.quantize_rows(torch.randn(3, 48)), q, dtype=torch.float32)
