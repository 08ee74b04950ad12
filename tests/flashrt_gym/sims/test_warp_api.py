"""The allocator that a looped Warp graph's body draws its scratch from
(:class:`flashrt_gym.sims.push.warp_api.KeptAllocator`): the blocks outlive Warp's frees, since
the recorded graph reads and writes them at every replay. (On CUDA the looped-equals-unrolled
test of ``test_mujoco_warp.py`` runs it inside a capture.)"""

import torch

from flashrt_gym.sims.push.warp_api import KeptAllocator


def test_kept_blocks_outlive_deallocation_and_stay_distinct():
    kept = KeptAllocator(torch.device("cpu"))
    a, b = kept.allocate(64), kept.allocate(0)  # a zero-byte request still gets its own block
    kept.deallocate(a, 64)
    kept.deallocate(b, 0)
    assert [blk.data_ptr() for blk in kept.blocks] == [a, b] and a != b
    assert [blk.numel() for blk in kept.blocks] == [64, 1]
    kept.blocks[0].fill_(7)  # still the caller's memory after the free: nothing reused it
    again = KeptAllocator(torch.device("cpu")).allocate(64)
    assert again != a and int(kept.blocks[0].sum()) == 7 * 64
