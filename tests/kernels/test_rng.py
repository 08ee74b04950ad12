import pytest
import torch

from flashrt.kernels.rng import normal, random_bits, uniform


def keys(n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n, dtype=torch.int64) * 7919 + 3, torch.zeros(n, dtype=torch.int64)


def test_draws_are_a_pure_function_of_key_counter_and_index():
    k, c = keys()
    assert torch.equal(random_bits(k, c, 16), random_bits(k.clone(), c.clone(), 16))
    assert torch.equal(random_bits(k, c, 16), random_bits(k, c, 32)[:, :16])  # prefix-stable
    assert not torch.equal(random_bits(k, c, 16), random_bits(k, c + 1, 16))
    assert not torch.equal(random_bits(k, c, 16)[1:], random_bits(k, c, 16)[:-1])


def test_distributions():
    k, c = keys(4096)
    u = uniform(k, c, 64)
    assert 0 <= u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.01 and abs(u.std() - 0.2887) < 0.01
    z = normal(k, c, 63)
    assert z.shape == (4096, 63) and torch.isfinite(z).all()
    assert abs(z.mean()) < 0.02 and abs(z.std() - 1) < 0.02
    nxt = normal(k, c + 1, 63)
    assert abs(torch.corrcoef(torch.stack([z.flatten(), nxt.flatten()]))[0, 1]) < 0.02


@pytest.mark.cuda
def test_cuda_gives_the_same_bits_as_the_cpu():
    k, c = keys()
    assert torch.equal(random_bits(k, c, 40), random_bits(k.cuda(), c.cuda(), 40).cpu())
    torch.testing.assert_close(normal(k, c, 40), normal(k.cuda(), c.cuda(), 40).cpu(), atol=1e-5, rtol=1e-5)
