"""The env under CUDA graph replay (run on the GPU machine: pytest -m cuda)."""

import numpy as np
import pytest
import torch

from flashrt_gym import FlashRTVectorEnv

pytestmark = pytest.mark.cuda


def run(env: FlashRTVectorEnv, acts) -> list:
    out = []
    for a in acts:
        obs, r, te, tr, info = env.step_torch(a)
        out.append([obs, r, te, tr, info["final_obs"], info["_final_obs"]])
    torch.cuda.synchronize()
    return out


def equal(a, b) -> bool:
    return all(torch.equal(x, y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def test_graph_and_eager_trajectories_are_byte_identical_through_autoresets():
    kw = {"device": "cuda", "pool_size": 32, "max_episode_steps": 3}
    graph, eager = FlashRTVectorEnv(8, **kw), FlashRTVectorEnv(8, graphs=False, **kw)
    g = torch.Generator(device="cuda").manual_seed(0)
    acts = [torch.rand(8, 16, device="cuda", generator=g) * 2 - 1 for _ in range(8)]
    graph.reset(seed=1)
    eager.reset(seed=1)
    a, b = run(graph, acts), run(eager, acts)
    assert any(step[5].any() for step in a)  # autoresets happened inside the replays
    assert equal(a, b)


def test_capsule_restore_and_fork_under_replay_are_exact():
    env = FlashRTVectorEnv(16, device="cuda", pool_size=64)
    env.reset(seed=3)
    g = torch.Generator(device="cuda").manual_seed(1)
    acts = [torch.rand(16, 16, device="cuda", generator=g) * 2 - 1 for _ in range(5)]
    run(env, acts[:2])
    cap = env.snapshot()
    first = run(env, acts)
    env.restore(cap)
    assert equal(run(env, acts), first)
    env.fork(4, range(16))
    obs, *_ = env.step(np.zeros((16, 16), np.float32))
    assert all(np.array_equal(obs[i], obs[4]) for i in range(16))


@pytest.mark.parametrize(("bad", "match"), [(float("nan"), "NaN"), (1.5, r"must lie in \[-1.0, 1.0\]")])
def test_bad_device_actions_are_refused_by_the_guard_and_the_state_is_untouched(bad, match):
    kw = {"device": "cuda", "pool_size": 16}
    env, eager = FlashRTVectorEnv(4, **kw), FlashRTVectorEnv(4, graphs=False, **kw)
    env.reset(seed=2)
    eager.reset(seed=2)
    good = torch.full((4, 16), 0.25, device="cuda")
    run(env, [good])  # captured
    before = (env.bufs.slot_arena.clone(), env.bufs.shared_arena.clone())
    wrong = good.clone()
    wrong[2, 5] = bad
    for _ in range(2):
        with pytest.raises(ValueError, match=match):
            env.step_torch(wrong)
    assert torch.equal(before[0], env.bufs.slot_arena) and torch.equal(before[1], env.bufs.shared_arena)
    assert equal(run(env, [good, -good]), run(eager, [good, good, -good])[1:])
