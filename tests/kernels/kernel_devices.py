"""Where a Triton kernel can be checked against its reference: the GPU, or the CPU interpreter."""

import os

import pytest
import torch

from flashrt.kernels.backend import triton

DEVICES = [
    pytest.param("cuda", marks=pytest.mark.cuda),
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            triton is None or os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's CPU interpreter"
        ),
    ),
]


def dtypes(device: str) -> list[torch.dtype]:
    """The dtypes a kernel is checked in: bf16 and fp32 on the GPU, fp32 in the interpreter."""
    return [torch.bfloat16, torch.float32] if device == "cuda" else [torch.float32]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """``got`` has every element written and matches ``want`` to ``dtype``'s tolerance."""
    tol = (2e-2 if dtype == torch.bfloat16 else 1e-4) * scale
    assert not got.isnan().any(), "the kernel left elements unwritten"
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def poison_allocator(device: str) -> None:
    """Fill the CUDA caching allocator's free blocks with NaN, so that an output element a kernel
    never writes reads back as NaN (freshly allocated CPU memory is left as the OS gives it)."""
    if device != "cuda":
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # blocks still cached hold earlier outputs; poison fresh ones
    big = torch.full((32 << 20,), float("nan"), device=device)  # large-block pool
    small = [torch.full((1 << 18,), float("nan"), device=device) for _ in range(16)]  # small-block pool
    del big, small


class Launches(list):
    """The grids of a kernel's launches, in order; ``dependent[i]``: launch i asked for
    programmatic dependent launch; ``options[i]``: its keyword arguments (constexprs)."""

    def __init__(self) -> None:
        super().__init__()
        self.dependent: list[bool] = []
        self.options: list[dict] = []


def spy_launches(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> Launches:
    """Record every launch of the Triton kernel ``module.name`` (still launched)."""
    launches, kernel = Launches(), getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(grid)
                launches.dependent.append(bool(kwargs.get("launch_pdl", False)))
                launches.options.append(kwargs)
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(module, name, Spy())
    return launches
