"""The FP8 gate/up projection with the GeGLU in its epilogue (kernels.fp8_geglu)."""

import pytest
import torch

import flashrt.kernels.activation as ka
import flashrt.kernels.fp8 as f8
import flashrt.kernels.fp8_geglu as fg
from tests.kernels.kernel_devices import DEVICES, poison_allocator, spy_launches


def unfused(x: torch.Tensor, weight: f8.Fp8Weight) -> torch.Tensor:
    """The path the kernel replaces, emulated: the quantised gate/up product rounded to bf16 (as
    the GEMM writes it), then the GeGLU in float32."""
    return ka.gelu_mul_reference(f8.linear_emulated(x, weight).float())


@pytest.mark.parametrize("device", DEVICES)
def test_gate_up_geglu_is_the_geglu_of_the_quantised_product(device, monkeypatch):
    """One kernel gives the GeGLU of the quantised gate and up products: the unfused path's
    values to bf16 rounding (the sums of ``k`` differ in order; Triton's CPU interpreter rounds
    to bf16 toward zero, four times on the way, where the GPU rounds to nearest), over row and
    channel counts that leave partial tiles and a ``k`` that leaves a partial step, from rows of
    a wider buffer too. Mutations: one up channel's scale doubled, and the gate and up halves
    swapped, are caught."""
    launches = spy_launches(monkeypatch, fg, "_gate_up_geglu_kernel")
    rtol = 1.6e-2 if device == "cuda" else 2.0**-5
    g = torch.Generator(device=device).manual_seed(12)
    for n_rows, m, k in ((70, 96, 256), (130, 128, 192)):
        x = torch.randn(n_rows, k, device=device, generator=g).bfloat16()
        w = torch.randn(2 * m, k, device=device, generator=g) / k**0.5
        q, rows = f8.quantize_weight(w), f8.quantize_rows(x)
        want = unfused(x, q)
        poison_allocator(device)
        before = len(launches)
        got = fg.gate_up_geglu(rows, q)
        assert len(launches) == before + 1 and got.dtype == torch.bfloat16 and got.shape == (n_rows, m)
        torch.testing.assert_close(got.float(), want, rtol=rtol, atol=1e-2)
        strided = (torch.cat([rows[0], rows[0]], -1)[:, :k], rows[1])
        assert torch.equal(fg.gate_up_geglu(strided, q), got)
        bad = f8.Fp8Weight(q.data, q.scale.clone())
        c = int(want.abs().amax(0).argmax())  # the channel of the largest outputs: not rounding
        bad.scale[m + c] *= 2
        assert (fg.gate_up_geglu(rows, bad).float() - want)[:, c].abs().max() > 10 * 1e-2
        swapped = f8.Fp8Weight(q.data.roll(m, 0), q.scale.roll(m, 0))
        assert not torch.allclose(fg.gate_up_geglu(rows, swapped).float(), want, rtol=rtol, atol=1e-2)


def test_gate_up_geglu_refuses_shapes_it_cannot_take():
    q = f8.quantize_weight(torch.randn(64, 32))
    rows = f8.quantize_rows_reference(torch.randn(3, 32))
    with pytest.raises(ValueError, match="k = 32"):
        fg.gate_up_geglu(f8.quantize_rows_reference(torch.randn(3, 48)), q)
    with pytest.raises(ValueError, match="even n"):
        fg.gate_up_geglu(rows, f8.quantize_weight(torch.randn(48, 32)))
