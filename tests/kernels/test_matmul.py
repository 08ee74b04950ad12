"""Few-row linear layers (kernels.matmul) and programmatic dependent launch inside graphs."""

import pytest
import torch
import torch.nn.functional as F

import flashrt.kernels.matmul as kl
from flashrt.kernels import (
    PartialProduct,
    add_layer_norm,
    add_matmul,
    linear,
    linear_geglu,
    linear_gelu,
    linear_partials,
    reference_only,
)
from flashrt.kernels.matmul import add_matmul_reference, linear_geglu_reference, linear_gelu_reference
from tests.kernels.kernel_devices import DEVICES, close, dtypes, poison_allocator, spy_launches


def inputs(device, dtype, g, rows_shape, k, n):
    a = torch.randn(*rows_shape, k, device=device, generator=g).to(dtype)
    w = (torch.randn(n, k, device=device, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, device=device, generator=g).to(dtype)
    return a, w, b


@pytest.fixture
def triton_on_cpu(device, monkeypatch):
    """The interpreter runs the kernel on CPU tensors, as on a GPU."""
    if device == "cpu":
        monkeypatch.setattr(kl, "use_triton", lambda *tensors: True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("rows_shape", "k", "n"),
    [((1, 8), 192, 192), ((1, 8), 768, 192), ((3, 7), 256, 20), ((16, 16), 100, 70)],  # expert o / down; ragged
)
def test_linear_and_add_matmul_match_torch(device, rows_shape, k, n, triton_on_cpu, monkeypatch):
    launches = spy_launches(monkeypatch, kl, "_linear_kernel")
    g = torch.Generator(device=device).manual_seed(k + n)
    for dtype in dtypes(device):
        a, w, b = inputs(device, dtype, g, rows_shape, k, n)
        poison_allocator(device)
        close(linear(a, w, b), F.linear(a, w, b), dtype)
        close(linear(a, w), F.linear(a, w), dtype)
        x = torch.randn(*rows_shape, n, device=device, generator=g).to(dtype)
        want = add_matmul_reference(x.clone(), a, w)
        got = add_matmul(x, a, w)
        assert got.data_ptr() == x.data_ptr()  # accumulated in place, no copy of x
        close(got, want, dtype)
    assert len(launches) == 3 * len(dtypes(device))  # every call took the kernel


@pytest.mark.parametrize("device", DEVICES)
def test_linear_takes_the_kernel_only_for_few_narrow_rows(device, triton_on_cpu, monkeypatch):
    """Up to MAX_ROWS rows of at most MAX_K inputs one launch; one row more, wider inputs, a
    weight of another dtype or a strided residual take torch. All agree with torch."""
    launches = spy_launches(monkeypatch, kl, "_linear_kernel")
    g = torch.Generator(device=device).manual_seed(1)
    dtype = dtypes(device)[0]
    for rows, k, kernel in ((kl.MAX_ROWS, 32, True), (kl.MAX_ROWS + 1, 32, False), (4, kl.MAX_LOOP_K + 8, False)):
        launches.clear()
        a, w, b = inputs(device, dtype, g, (rows,), k, 24)
        close(linear(a, w, b), F.linear(a, w, b), dtype)
        assert bool(launches) == kernel, (rows, k)
    a, w, _ = inputs(device, dtype, g, (4,), 32, 24)
    launches.clear()
    x = torch.randn(24, 4, device=device, generator=g).to(dtype).t()  # not contiguous: torch's addmm_
    want = x + a @ w.T
    close(add_matmul(x, a, w), want, dtype)
    assert not launches


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rows", "k", "n"), [(50, 2048, 48), (3, 1032, 40), (3, 1024, 1040)])
def test_wide_inputs_over_few_rows_sweep_k_in_blocks(device, rows, k, n, triton_on_cpu, monkeypatch):
    """Inputs wider than MAX_K (pi0's expert o; a ragged last block of k) or a weight larger than
    MAX_WEIGHT, over at most LOOP_ROWS rows, take the blocked-k kernel and match torch; the same
    comparison against the product without its last block of k fails, and one row more takes
    torch."""
    launches = spy_launches(monkeypatch, kl, "_linear_loop_kernel")
    g = torch.Generator(device=device).manual_seed(k)
    for dtype in dtypes(device):
        a, w, b = inputs(device, dtype, g, (rows,), k, n)
        poison_allocator(device)
        close(linear(a, w, b), F.linear(a, w, b), dtype)
        x = torch.randn(rows, n, device=device, generator=g).to(dtype)
        x0 = x.clone()
        want = add_matmul_reference(x.clone(), a, w)
        got = add_matmul(x, a, w)
        assert got.data_ptr() == x.data_ptr()
        close(got, want, dtype)
        bk = kl.loop_tiles(n, a.element_size())[1]
        last = (k - 1) // bk * bk  # where the last block of k starts
        dropped = add_matmul_reference(x0, a[:, :last].contiguous(), w[:, :last].contiguous())
        with pytest.raises(AssertionError):
            close(got, dropped, dtype)
    assert len(launches) == 2 * len(dtypes(device))
    launches.clear()
    a, w, _ = inputs(device, dtypes(device)[0], g, (kl.LOOP_ROWS + 1,), k, n)
    close(linear(a, w), F.linear(a, w), dtypes(device)[0])
    assert not launches


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rows", "k", "m"), [(50, 1024, 96), (3, 1032, 40)])
def test_linear_geglu_over_few_rows_is_one_blocked_kernel(device, rows, k, m, triton_on_cpu, monkeypatch):
    """The gated MLP's input half (pi0's expert: 50 rows; a ragged k) in the blocked kernel's
    epilogue matches linear then gelu_mul; the same comparison against the halves swapped (the
    GELU of the up rows) fails, and one row more than LOOP_ROWS takes the chain."""
    launches = spy_launches(monkeypatch, kl, "_linear_loop_kernel")
    g = torch.Generator(device=device).manual_seed(k + m)
    for dtype in dtypes(device):
        a, w, _ = inputs(device, dtype, g, (rows,), k, 2 * m)
        poison_allocator(device)
        got = linear_geglu(a, w)
        assert got.shape == (rows, m) and got.dtype == dtype
        close(got, linear_geglu_reference(a.float(), w.float()), dtype)
        with pytest.raises(AssertionError):
            close(got, linear_geglu_reference(a.float(), w.float().roll(m, 0)), dtype)
    assert len(launches) == len(dtypes(device))
    launches.clear()
    a, w, _ = inputs(device, dtypes(device)[0], g, (kl.LOOP_ROWS + 1,), k, 2 * m)
    close(linear_geglu(a, w), linear_geglu_reference(a.float(), w.float()), dtypes(device)[0])
    assert not launches
    with pytest.raises(ValueError, match="even row count"):
        linear_geglu(a, w[1:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("rows_shape", "k", "m"),
    [((2, 100), 256, 96), ((3, 70), 192, 64), ((1, 300), 100, 40)],  # tiny's prefix and expert; ragged
)
def test_linear_geglu_over_many_narrow_rows_is_one_tiled_kernel(device, rows_shape, k, m, triton_on_cpu, monkeypatch):
    """More rows than LOOP_ROWS of inputs up to TILE_MAX_K wide (tiny's layers at many slots;
    ragged last row, column and k blocks) take the blocked kernel in tiles of TILE_ROWS rows, one
    launch, and match linear then gelu_mul. The same comparison fails against the halves swapped,
    against the product without its last block of k, and against the first row block written
    again where the second belongs (a tile that ignored its row offset)."""
    launches = spy_launches(monkeypatch, kl, "_linear_loop_kernel")
    g = torch.Generator(device=device).manual_seed(k + m)
    rows = rows_shape[0] * rows_shape[1]
    for dtype in dtypes(device):
        a, w, _ = inputs(device, dtype, g, rows_shape, k, 2 * m)
        poison_allocator(device)
        got = linear_geglu(a, w)
        assert got.shape == (*rows_shape, m) and got.dtype == dtype
        want = linear_geglu_reference(a.float(), w.float())
        close(got, want, dtype)
        with pytest.raises(AssertionError):
            close(got, linear_geglu_reference(a.float(), w.float().roll(m, 0)), dtype)
        bk = 128 // a.element_size()
        last = (k - 1) // bk * bk
        with pytest.raises(AssertionError):
            close(got, linear_geglu_reference(a[..., :last].float(), w[:, :last].float()), dtype)
        flat, shifted = want.reshape(rows, m), want.reshape(rows, m).clone()
        second = min(rows, 2 * kl.TILE_ROWS) - kl.TILE_ROWS
        shifted[kl.TILE_ROWS : kl.TILE_ROWS + second] = flat[:second]
        with pytest.raises(AssertionError):
            close(got.reshape(rows, m), shifted, dtype)
    grid = (-(-m // kl.TILE_COLS), -(-rows // kl.TILE_ROWS))
    assert launches == [grid] * len(dtypes(device))
    wide = torch.randn(*rows_shape, k + 8, device=device, generator=g).to(a.dtype)
    wide[..., :k] = a
    assert torch.equal(linear_geglu(wide[..., :k], w), got)  # a strided view (a slot arena's) reads as its copy
    assert all(o["BM"] == kl.TILE_ROWS for o in launches.options)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_geglu_keeps_cublas_for_wide_inputs_over_many_rows(device, triton_on_cpu, monkeypatch):
    """Inputs wider than TILE_MAX_K over more than LOOP_ROWS rows (pi0's, arithmetic-bound) take
    the chain, linear then gelu_mul; at TILE_MAX_K the tiles; at LOOP_ROWS rows one row block."""
    launches = spy_launches(monkeypatch, kl, "_linear_loop_kernel")
    g = torch.Generator(device=device).manual_seed(3)
    dtype = dtypes(device)[0]
    for rows, k, grid in (
        (kl.LOOP_ROWS + 1, kl.TILE_MAX_K + 8, None),
        (kl.LOOP_ROWS + 1, kl.TILE_MAX_K, (1, 1)),
        (kl.LOOP_ROWS, 32, (2,)),
    ):
        launches.clear()
        a, w, _ = inputs(device, dtype, g, (rows,), k, 64)
        close(linear_geglu(a, w), linear_geglu_reference(a.float(), w.float()), dtype)
        assert launches == ([] if grid is None else [grid]), (rows, k)


SPLIT_SHAPES = [
    pytest.param((1, 50), 2048, 1024, 4, id="pi0-o"),
    pytest.param((1, 50), 4096, 1024, 4, id="pi0-down"),
    ((1, 50), 2048, 96, 8),
    ((3,), 4096, 40, 8),  # a ragged last column block
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rows_shape", "k", "n", "want_splits"), SPLIT_SHAPES)
def test_linear_partials_split_wide_inputs_over_few_rows(device, rows_shape, k, n, want_splits, triton_on_cpu,
                                                        monkeypatch):  # fmt: skip
    """Inputs wider than MAX_K over few rows: one launch whose part s is the product of slice s
    of k, float32, the parts summing to the product. The same comparisons against the parts in
    another order, and against the total without its last part, fail; one row more than
    LOOP_ROWS, or an input of MAX_K, is one float32 part from torch."""
    if device == "cpu" and n > 100:
        pytest.skip("the interpreter takes minutes at this size")
    launches = spy_launches(monkeypatch, kl, "_split_kernel")
    g = torch.Generator(device=device).manual_seed(k + n)
    for dtype in dtypes(device):
        a, w, _ = inputs(device, dtype, g, rows_shape, k, n)
        assert kl.splits(a, w) == want_splits
        poison_allocator(device)
        got = linear_partials(a, w)
        assert got.parts.shape == (want_splits, *rows_shape, n) and got.parts.dtype == torch.float32
        af, wf = a.float(), w.float()
        ks = k // want_splits
        cuts = [slice(i * ks, (i + 1) * ks) for i in range(want_splits)]
        slices = torch.stack([af[..., cut] @ wf[:, cut].T for cut in cuts])
        close(got.parts, slices, torch.float32)
        close(got.total(), af @ wf.T, torch.float32)
        with pytest.raises(AssertionError):  # mutation: the slices' parts in reverse order
            close(got.parts, slices.flip(0), torch.float32)
        with pytest.raises(AssertionError):  # mutation: the last slice dropped
            close(PartialProduct(got.parts[:-1]).total(), af @ wf.T, torch.float32)
        strided = torch.cat([a, a], -1)[..., ::2]  # a's values at stride 2 (an arena-style view)
        strided.copy_(a)
        assert torch.equal(linear_partials(strided, w).parts, got.parts)
    assert len(launches) == 2 * len(dtypes(device))
    launches.clear()
    for rows, width in ((kl.LOOP_ROWS + 1, k), (4, kl.MAX_K)):
        a, w, _ = inputs(device, dtypes(device)[0], g, (rows,), width, n)
        assert kl.splits(a, w) == 0
        got = linear_partials(a, w)
        assert got.parts.shape == (1, rows, n)
        close(got.total(), a.float() @ w.float().T, torch.float32)
    assert not launches


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("rows_shape", "kernel"), [((1, 64), True), ((3, 7), True), ((4, 65), False)])
def test_linear_gelu_matches_linear_then_gelu(device, rows_shape, kernel, triton_on_cpu, monkeypatch):
    """GELU (tanh form) on the float32 accumulator against linear, then GELU: the vision MLP's
    fc1 at one frame and ragged rows take the few-row kernel; more rows than MAX_ROWS take
    cuBLASLt's epilogue on the GPU (the reference in the interpreter)."""
    launches = spy_launches(monkeypatch, kl, "_linear_kernel")
    g = torch.Generator(device=device).manual_seed(rows_shape[1])
    for dtype in dtypes(device):
        a, w, b = inputs(device, dtype, g, rows_shape, 256, 1024)
        poison_allocator(device)
        got = kl.linear_gelu(a, w, b)
        assert got.shape == (*rows_shape, 1024) and got.dtype == dtype
        close(got, linear_gelu_reference(a.float(), w.float(), b.float()), dtype)
    assert len(launches) == (len(dtypes(device)) if kernel else 0)


@pytest.mark.cuda
def test_linear_gelu_over_many_rows_is_cublaslt_epilogue_and_reference_is_exact():
    g = torch.Generator(device="cuda").manual_seed(4160)
    for dtype in dtypes("cuda"):
        a, w, b = inputs("cuda", dtype, g, (595, 7), 256, 1024)
        close(linear_gelu(a, w, b), linear_gelu_reference(a.float(), w.float(), b.float()), dtype)
        with torch.no_grad(), reference_only():
            assert torch.equal(linear_gelu(a, w, b), linear_gelu_reference(a, w, b))


def test_add_matmul_accumulates_in_place_only_outside_autograd():
    x, a, w = torch.randn(2, 3, 4), torch.randn(2, 3, 5), torch.randn(4, 5, requires_grad=True)
    want = x + a @ w.detach().T
    with torch.no_grad():
        inplace = x.clone()
        got = add_matmul(inplace, a, w)
    torch.testing.assert_close(got, want)
    assert got.data_ptr() == inplace.data_ptr()  # no copy of x into a new output
    x0 = x.clone()
    got = add_matmul(x, a, w)  # autograd records: x is left as it was, the gradient flows
    assert torch.equal(x, x0) and got.data_ptr() != x.data_ptr()
    got.sum().backward()
    torch.testing.assert_close(w.grad, a.reshape(-1, 5).sum(0).expand(4, 5))


def test_linear_names_the_mismatched_weight():
    a = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"must be \(out, 8\) as nn.Linear stores it"):
        linear(a, torch.zeros(8, 5))
    with pytest.raises(ValueError, match=r"must be \(out, 8\)"):
        add_matmul(torch.zeros(3, 5), a, torch.zeros(5, 7))
    with pytest.raises(ValueError, match=r"x \(3, 6\) must be a's rows \(3,\) by the weight's 5 outputs"):
        add_matmul(torch.zeros(3, 6), a, torch.zeros(5, 8))


@pytest.mark.cuda
def test_dependent_launches_in_a_graph_replay_the_eager_chain(monkeypatch):
    """A chain of 30 MLP blocks (LayerNorm, projection + GELU, projection accumulated onto the
    residual), each kernel reading the last one's output: inside a capture each launch is
    dependent (it starts before the one ahead finishes and loads its weight first); replayed, the
    chain gives the eager bytes. A dependent launch that read its input or wrote before the wait
    would race and differ."""
    import flashrt.kernels.norm as kn
    from flashrt.kernels.backend import grid_dependency

    if not grid_dependency(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs compute capability 9.0 and Triton 3.4")
    launches = spy_launches(monkeypatch, kl, "_linear_kernel")
    norms = spy_launches(monkeypatch, kn, "_add_norm_kernel")
    g = torch.Generator(device="cuda").manual_seed(0)
    weights = [inputs("cuda", torch.bfloat16, g, (1,), 192, 768)[1:] for _ in range(30)]
    downs = [inputs("cuda", torch.bfloat16, g, (1,), 768, 192)[1] for _ in range(30)]
    ln = torch.randn(2, 192, device="cuda", generator=g) * 0.1
    ln_w, ln_b = (ln[0] + 1).to(torch.bfloat16), ln[1].to(torch.bfloat16)
    x0 = torch.randn(8, 192, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.empty_like(x0)

    def chain() -> None:
        x.copy_(x0)
        for (w, b), down in zip(weights, downs, strict=True):
            add_matmul(x, linear_gelu(add_layer_norm(x, None, ln_w, ln_b)[1], w, b), down)

    chain()
    eager = x.clone()
    assert not any(launches.dependent) and not any(norms.dependent) and len(norms) == 30
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain()  # warm-up off the default stream, as graph capture wants
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    launches.clear()
    launches.dependent.clear()
    norms.dependent.clear()
    with torch.cuda.graph(graph):
        chain()
    assert len(launches.dependent) == 60 and all(launches.dependent)
    assert len(norms.dependent) == 30 and all(norms.dependent)
    for _ in range(20):
        x.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(x, eager)
