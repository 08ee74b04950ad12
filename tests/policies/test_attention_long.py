"""The long-prefix flash attention against the torch reference (GPU: bf16 and fp32 at pi0's
shapes; CPU: fp32 through Triton's interpreter at small ones)."""

import pytest
import torch

from flashrt.kernels.backend import sm_count
from flashrt.kernels.grouped_attention import attention_reference
from flashrt.policies import attention_long
from tests.kernels.kernel_devices import DEVICES, close, dtypes, poison_allocator


def inputs(device, dtype, n, h, g, t, d, context, seed=0):
    """Queries, keys/values as strided views of a layer cache (as the model passes them), a key
    mask with one slot fully masked, and a context segment."""
    gen = torch.Generator(device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, device=device, generator=gen).to(dtype)  # noqa: E731
    q = r(n, h, t, d)
    cache = r(n, 2, 2, g, t + 3, d)
    k, v = cache[:, 1, 0, :, 1 : 1 + t], cache[:, 1, 1, :, 1 : 1 + t]
    mask = torch.rand(n, t, device=device, generator=gen) < 0.8
    mask[-1, : t // 2] = False
    segs = [(r(n, g, context, d), r(n, g, context, d), torch.rand(n, context, device=device, generator=gen) < 0.5)]
    return q, k, v, mask, segs if context else []


def reference(q, k, v, mask, segs):
    out = attention_reference(q.float(), k.float(), v.float(), mask, [(a.float(), b.float(), m) for a, b, m in segs])
    return torch.nan_to_num(out, 0.0)  # a row with no valid key: zeros (SDPA: NaN)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("n", "h", "g", "t", "d", "context"), [(2, 4, 1, 80, 64, 0), (2, 4, 2, 70, 32, 9), (1, 2, 1, 40, 256, 5)]
)
def test_flash_attention_matches_the_reference(device, n, h, g, t, d, context):
    for dtype in dtypes(device):
        q, k, v, mask, segs = inputs(device, dtype, n, h, g, t, d, context)
        poison_allocator(device)
        got = attention_long.attention_triton(q, k, v, mask, segs)
        want = reference(q, k, v, mask, segs)
        close(got, want, dtype)
        wrong = reference(q, k, v, None, segs)  # the mutation: the key mask ignored
        assert (got.float() - wrong).abs().max() > 0.1


@pytest.mark.cuda
@pytest.mark.parametrize(("n", "block_m"), [(1, 64), (8, 128)])
def test_pi0_block_b_takes_the_flash_kernel_and_matches(n, block_m):
    """pi0's block B (768 image + 48 language tokens, 8 heads on one KV head of 256) takes this
    kernel, bf16 within bf16 rounding of float32, in 64-row blocks at one slot and 128-row ones
    at 8; the same comparison with the language padding unmasked fails. The expert's 8 x 50
    rows do not take it."""
    q, k, v, mask, _ = inputs("cuda", torch.bfloat16, n, 8, 1, 816, 256, 0)
    mask[:] = True
    for i in range(n):
        mask[i, 700 + 10 * i :] = False  # language padding
    assert attention_long.fits(q, k, v, mask)
    assert not attention_long.fits(q[:, :, :50], k, v, mask)
    assert attention_long._tiles(256, 2, n * 8 * 816, sm_count(q.device))[0] == block_m
    got = attention_long.attention(q, k, v, mask)
    want = reference(q, k, v, mask, [])
    assert (got.float() - want).norm() < 1e-2 * want.norm()
    assert (got.float() - reference(q, k, v, None, [])).norm() > 5e-2 * want.norm()  # the mutation
    assert torch.equal(got, attention_long.attention(q, k, v, mask))  # deterministic
