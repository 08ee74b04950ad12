"""The split step plan (:class:`flashrt_gym.simulator.SplitTicks`): a simulator whose physics runs
between the step's two captured graphs must give what the one-program step gives, byte for byte,
through autoresets and capsule restores, and a refused step must change no state. MuJoCo Warp's
own graph takes this plan (``WarpPush(capture="warp")``, tested in
``tests/flashrt_gym/sims/test_mujoco_warp.py``); here the tabletop stands in, on any machine."""

import pytest
import torch

from flashrt_gym import FlashRTVectorEnv
from flashrt_gym.sims.tabletop import Tabletop
from flashrt_gym.simulator import splits_ticks
from tests.flashrt_gym.support.split_tabletop import SplitTabletop, physics_first

N = 4


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
)


def env(split: bool, micro, device: str = "cpu") -> FlashRTVectorEnv:
    sim = SplitTabletop if split else (lambda n: Tabletop())
    return FlashRTVectorEnv(N, device=device, weights=micro, simulator=sim, max_episode_steps=3)


def acts(k: int, seed: int = 0, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(N, 16, generator=g) * 2 - 1).to(device) for _ in range(k)]


def trajectory(e: FlashRTVectorEnv, actions: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for a in actions:
        obs, r, te, tr, info = e.step_torch(a)
        out += [obs, r, te, tr, info["final_obs"], info["_final_obs"], e.engine.bufs.slot_arena.clone()]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_the_split_plan_equals_one_program_through_autoresets_and_restores(micro, device):
    """On CUDA: two captured guarded graphs with the physics launched between them equal the one
    captured program, byte for byte."""
    split, one = env(True, micro, device), env(False, micro, device)
    assert split.engine._launch == split.engine._launch_split and one.engine._launch == one.engine._launch_in_graph
    for e in (split, one):
        e.reset(seed=2)
    first = acts(4, device=device)
    got, want = trajectory(split, first), trajectory(one, first)
    assert sum(int(f.sum()) for f in want[5::7]) and same(got, want)  # slots autoreset inside the steps
    cap = split.snapshot()
    later = trajectory(split, acts(3, seed=1, device=device))
    split.restore(cap)
    assert same(trajectory(split, acts(3, seed=1, device=device)), later)


def test_a_refused_step_runs_the_physics_on_scratch_and_changes_no_state(micro):
    e = env(True, micro)
    e.reset(seed=1)
    trajectory(e, acts(1))
    before = e.engine.bufs.slot_arena.clone()
    bad = acts(1)[0]
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="action"):
        e.step_torch(bad)
    assert torch.equal(e.engine.bufs.slot_arena, before)


def test_the_plan_runs_its_parts_in_order(micro, monkeypatch):
    """Mutation: the physics before the ticks are loaded (it steps the previous step's scratch)
    departs from the one-program step."""
    e, one = env(True, micro), env(False, micro)
    for x in (e, one):
        x.reset(seed=2)
    trajectory(e, acts(1))  # the first step loads the scratch before any physics runs
    monkeypatch.setattr(e.engine, "_launch", physics_first(e.engine))
    trajectory(one, acts(1))
    assert not same(trajectory(e, acts(3, seed=5)), trajectory(one, acts(3, seed=5)))


def test_asking_for_the_plan_without_its_parts_is_refused_by_name():
    class Half(Tabletop):
        physics_outside_capture = True

        def physics(self, ticks: int) -> None: ...

    assert not splits_ticks(Tabletop()) and splits_ticks(SplitTabletop(1))
    with pytest.raises(TypeError, match="lacks begin_ticks, end_ticks"):
        splits_ticks(Half())
    with pytest.raises(TypeError, match="lacks begin_ticks, end_ticks"):
        FlashRTVectorEnv(1, device="cpu", simulator=lambda n: Half())
