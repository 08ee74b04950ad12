"""FP8 GEMMs with fused epilogues (kernels.fp8_cutlass): each epilogue against the float32 product
of the same dequantised operands, with mutations beside; argument checks on any machine."""

import pytest
import torch

import flashrt.kernels.fp8 as f8
import flashrt.kernels.fp8_cutlass as fc

needs_cutlass = pytest.mark.skipif(
    not (torch.cuda.is_available() and fc.available("cuda")),
    reason="needs a Hopper GPU, nvcc and nvidia-cutlass's headers",
)
BOUND = 2e-2
"""Worst channel's relative difference allowed from the float32 product of the dequantised operands:
the GEMM's own error (fast accumulation, bf16 output, tanh.approx in GELU), not the quantisation's
(both sides use the same e4m3 values); measured ~3e-3."""


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def operands(m: int, n: int, k: int, seed: int) -> tuple[f8.Rows, f8.Fp8Weight, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = f8.quantize_rows(
        torch.randn(m, k, device="cuda", generator=g).bfloat16()
        * torch.logspace(-2, 2, m, device="cuda")[:, None].bfloat16()
    )
    w = f8.quantize_weight(
        torch.randn(n, k, device="cuda", generator=g) * torch.logspace(-2, 1, n, device="cuda")[:, None] / k**0.5
    )
    exact = (rows[0].float() * rows[1]) @ w.dequantize().t()
    return rows, w, exact


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The worst output channel's relative difference (one wrong channel is caught whole)."""
    return ((got.float() - want).norm(dim=0) / want.norm(dim=0)).max().item()


@pytest.mark.cuda
@needs_cutlass
@pytest.mark.parametrize("tile", sorted(fc.TILES))
@pytest.mark.parametrize("shape", [(300, 4304, 1152), (1000, 2048, 2048), (17, 256, 4352)])
def test_epilogues_match_the_float32_product(tile: str, shape: tuple[int, int, int]):
    m, n, k = shape
    rows, w, exact = operands(m, n, k, seed=m)
    c = torch.randn(m, n, device="cuda").bfloat16()
    want = {
        "scale": exact,
        "add": exact + c.float(),
        "gelu": gelu_tanh(exact),
        "mul": exact * c.float(),
    }
    for epi, ref in want.items():
        got = fc.gemm(rows, w, epi, c=c if epi in ("add", "mul") else None, tile=tile)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        assert relative(got, ref) < BOUND, epi
    # the tile order does not change a value: each tile sums its k in the same order
    for swizzle, raster in ((8, "along_n"), (4, "along_m")):
        torch.testing.assert_close(
            fc.gemm(rows, w, tile=tile, swizzle=swizzle, raster=raster), fc.gemm(rows, w, tile=tile), rtol=0, atol=0
        )
    # mutations: each must fail the same comparison
    wrong_scale = w.scale.clone()
    wrong_scale[n // 2] *= 2  # one channel's scale x2
    assert relative(fc.gemm(rows, f8.Fp8Weight(w.data, wrong_scale), tile=tile), exact) > 5 * BOUND
    assert relative(fc.gemm(rows, w, "add", c=c, tile=tile), exact) > 5 * BOUND  # the residual must be added
    shifted = f8.Fp8Weight(w.data.view(torch.uint8).roll(1, 0).view(f8.E4M3), w.scale.roll(1, 0))  # channels off by one
    assert relative(fc.gemm(rows, shifted, tile=tile), exact) > 5 * BOUND


@pytest.mark.cuda
@needs_cutlass
def test_in_place_geglu_split_and_graph_replay():
    """The gate half writes gelu(gate), the up half multiplies it in place: gelu(gate) * up, also
    under graph replay, matching pi0's GeGLU on the same e4m3 product."""
    m, f, k = 777, 1024, 2048
    rows, w, exact = operands(m, 2 * f, k, seed=3)
    gate, up = f8.Fp8Weight(w.data[:f], w.scale[:f]), f8.Fp8Weight(w.data[f:], w.scale[f:])
    want = gelu_tanh(exact[:, :f]) * exact[:, f:]

    def split() -> torch.Tensor:
        g = fc.gemm(rows, gate, "gelu")
        return fc.gemm(rows, up, "mul", c=g, out=g)

    eager = split()
    assert relative(eager, want) < BOUND
    assert relative(gelu_tanh(exact[:, f:]) * exact[:, :f], want) > 5 * BOUND  # halves swapped: caught
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        split()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = split()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"epilogue": "relu"}, "epilogue must be one of"), ({"tile": "64x64"}, "tile must be one of"),
     ({"swizzle": 3}, "swizzle must be 1, 2, 4 or 8"), ({"raster": "diagonal"}, "raster one of"),
     ({"epilogue": "add"}, "reads c"), ({"c": torch.zeros(4, 32)}, "takes no c")],
)  # fmt: skip
def test_bad_arguments_name_the_problem(kwargs: dict, match: str):
    rows = f8.quantize_rows(torch.randn(4, 32))
    w = f8.quantize_weight(torch.randn(32, 32))
    with pytest.raises(ValueError, match=match):
        fc.gemm(rows, w, **kwargs)


def test_without_a_hopper_gpu_it_is_unavailable_and_says_so():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("a Hopper GPU is here")
    assert not fc.available("cpu")
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        fc.gemm(f8.quantize_rows(torch.randn(4, 32)), f8.quantize_weight(torch.randn(32, 32)))
