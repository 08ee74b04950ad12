"""The allocator that a looped Warp graph's body draws its scratch from
(:class:`flashrt_gym.sims.push.warp_api.KeptAllocator`): the blocks outlive Warp's frees, since
the recorded graph reads and writes them at every replay. (On CUDA the looped-equals-unrolled
test of ``test_mujoco_warp.py`` runs it inside a capture.)"""

import os
import subprocess
import sys

import pytest
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


DROPPED_IN_A_CAPTURE = """
import gc, sys, torch
from flashrt_gym.sims.push import warp_api
if sys.argv[1] == "own_pool":  # the mutation: each allocator a pool of its own
    warp_api.kept_pool = lambda index: torch.cuda.MemPool()
kept = warp_api.KeptAllocator(torch.device("cuda"))
side = torch.cuda.Stream()
with kept.serving(side):
    kept.allocate(1 << 20)
cycle = [kept]
cycle.append(cycle)  # only the garbage collector drops it, as it drops an env
del kept, cycle
x = torch.zeros(4, device="cuda")
graph = torch.cuda.CUDAGraph()
torch.cuda.synchronize()
with torch.cuda.stream(side):
    graph.capture_begin()
    x += 1
    gc.collect()  # inside another capture, as a collection at any allocation may be
    graph.capture_end()
graph.replay()
print("replayed", float(x.sum()))
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_kept_allocator_dropped_inside_a_capture_leaves_it_intact():
    """An env (and its looped graph's allocator) is dropped by the garbage collector, which may
    run inside another graph's capture. The kept blocks' pool outlives every allocator, so the
    capture goes on. Mutation: a pool of each allocator's own is emptied when it is dropped,
    which torch refuses during a capture by aborting the process (a separate one here)."""

    def run(variant: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-c", DROPPED_IN_A_CAPTURE, variant]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=os.environ.copy())

    shared = run("shared_pool")
    assert shared.returncode == 0 and "replayed 4.0" in shared.stdout, shared.stderr[-2000:]
    assert run("own_pool").returncode != 0
