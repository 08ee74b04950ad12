import pytest
import torch

from flashrt.kernels import rng
from flashrt.kernels.rng import normal, random_bits, reseed, slot_key, uniform


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


def wrapped(v: int) -> int:
    """``v`` modulo 2**64 as a signed int64 (two's complement)."""
    v %= 1 << 64
    return v - (1 << 64) if v >= 1 << 63 else v


EDGES = [0, 1, -1, 2**31, 2**32 - 1, 2**62 + 12345, 2**63 - 1, -(2**63), -(2**40) + 7]


def test_slot_key_is_the_seed_formula_with_wrap_around_and_distinct_over_a_range():
    seeds = torch.tensor(EDGES)
    assert slot_key(seeds).tolist() == [wrapped(s * 2654435761 + 1) for s in EDGES]  # exact, as Python's ints
    keys = slot_key(torch.arange(-(2**19), 2**19))
    assert keys.unique().numel() == keys.numel()
    assert torch.equal(keys, slot_key(torch.arange(-(2**19), 2**19)))  # deterministic
    streams = random_bits(slot_key(torch.arange(4096)), torch.zeros(4096, dtype=torch.int64), 2)
    assert streams.unique(dim=0).shape[0] == 4096  # a batch of seeds: no two slots share a stream
    assert not torch.equal(slot_key(torch.arange(8)), torch.arange(8))  # mutation check: the identity fails
    with pytest.raises(ValueError, match="seed must be an int64 tensor, got torch.int32"):
        slot_key(torch.arange(3, dtype=torch.int32))


def test_reseed_gives_every_destination_a_new_key_of_its_own():
    for source in EDGES:
        key = torch.full((1024,), source)
        salt = torch.arange(1024)
        new = reseed(key, salt)
        assert new.tolist() == [wrapped(source * 6364136223846793005 + i + 1) for i in range(1024)]
        assert new.unique().numel() == 1024 and not (new == key).any()
        assert torch.equal(new, reseed(key.clone(), salt.clone()))  # deterministic
        streams = random_bits(new, torch.zeros(1024, dtype=torch.int64), 2)
        assert streams.unique(dim=0).shape[0] == 1024
    assert reseed(torch.tensor([5, 5]), torch.tensor([3, 3])).unique().numel() == 1  # mutation: one salt, one key
    with pytest.raises(ValueError, match="salt must be an int64 tensor"):
        reseed(torch.tensor([5]), 3)


@pytest.mark.cuda
def test_slot_key_and_reseed_give_the_same_keys_on_the_gpu():
    seeds = torch.cat([torch.tensor(EDGES), torch.randint(-(2**62), 2**62, (4096,))])
    assert torch.equal(slot_key(seeds.cuda()).cpu(), slot_key(seeds))
    salt = torch.arange(seeds.numel())
    assert torch.equal(reseed(seeds.cuda(), salt.cuda()).cpu(), reseed(seeds, salt))


def shared_streams(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many of keys ``a``'s streams (first 4 numbers at counter 0) are also one of ``b``'s."""
    zero = torch.zeros(len(a), dtype=torch.int64)
    first, second = ({r.numpy().tobytes() for r in random_bits(k, zero, 4)} for k in (a, b))
    return len(first & second)


def test_keys_that_differ_only_in_their_high_bits_draw_unrelated_streams(monkeypatch):
    """Seeds 2**s + i (the evaluation splits sit at 2**40 and 2**41) share no stream with seeds
    0 ... 4 095. Mutation: a key folded to 32 bits before mixing gives 2**40 + i the stream of
    i ^ 256, every one of them."""
    low = torch.arange(4096)
    for shift in (32, 40, 41, 62):
        assert shared_streams(low + (1 << shift), low) == 0
    monkeypatch.setattr(rng, "_mix64", lambda key: (rng._mix32(key ^ (key >> 32)), torch.zeros_like(key)))
    assert shared_streams(low + (1 << 40), low) == 4096
