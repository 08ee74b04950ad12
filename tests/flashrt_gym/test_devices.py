import pytest
import torch

from flashrt_gym.devices import peak_gpu_memory_mb


@pytest.mark.cuda
def test_peak_gpu_memory_counts_what_torch_held_at_its_most():
    """The peak stays after the tensor is freed (a run's summary is written at its end), and it
    counts at least the tensor's bytes; Warp's pool appears only where Warp is in use."""
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    del x
    torch.cuda.empty_cache()
    peak = peak_gpu_memory_mb()
    assert peak is not None and peak["torch_max_reserved"] >= 64
    assert peak["total"] == pytest.approx(sum(v for k, v in peak.items() if k != "total"))
    assert torch.cuda.memory_reserved() / 2**20 < 64 <= peak["torch_max_reserved"]  # the current figure would not
