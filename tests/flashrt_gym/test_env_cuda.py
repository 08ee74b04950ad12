"""The env on the GPU, under CUDA graph replay (run on the GPU machine: pytest -m cuda).

Graph against eager alone cannot see a kernel that is wrong in both, so whole steps with the
kernels are also compared with whole steps with the torch references, field by field over the
whole state arena, each comparison beside a mutation that it must reject.
"""

import numpy as np
import pytest
import torch

from flashrt import kernels, runtime
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


def noise(n: int, k: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.rand(n, 16, device="cuda", generator=g) * 2 - 1 for _ in range(k)]


def test_graph_and_eager_trajectories_are_byte_identical_through_autoresets():
    kw = {"device": "cuda", "max_episode_steps": 3}
    graph, eager = FlashRTVectorEnv(8, **kw), FlashRTVectorEnv(8, graphs=False, **kw)
    acts = noise(8, 8)
    graph.reset(seed=1)
    eager.reset(seed=1)
    a, b = run(graph, acts), run(eager, acts)
    assert any(step[5].any() for step in a)  # autoresets happened inside the replays
    assert equal(a, b)


def test_capsule_restore_and_fork_under_replay_are_exact():
    env = FlashRTVectorEnv(16, device="cuda")
    env.reset(seed=3)
    acts = noise(16, 5, seed=1)
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
    env, eager = FlashRTVectorEnv(4, device="cuda"), FlashRTVectorEnv(4, device="cuda", graphs=False)
    env.reset(seed=2)
    eager.reset(seed=2)
    good = torch.full((4, 16), 0.25, device="cuda")
    run(env, [good])  # captured
    bufs = env.engine.bufs
    before = (bufs.slot_arena.clone(), bufs.shared_arena.clone())
    wrong = good.clone()
    wrong[2, 5] = bad
    for _ in range(2):
        with pytest.raises(ValueError, match=match):
            env.step_torch(wrong)
    assert torch.equal(before[0], bufs.slot_arena) and torch.equal(before[1], bufs.shared_arena)
    assert equal(run(env, [good, -good]), run(eager, [good, good, -good])[1:])


# -- the kernels against the references, whole steps, every field ---------------------------------
def arena_mismatches(a: runtime.BufferSet, b: runtime.BufferSet) -> list[str]:
    """The state buffers where two sets differ: integer and flag fields (RNG keys and counters,
    steps, instructions, frames, flags) at all; float fields by more than 5 % of the field's
    scale (bf16 rounding of the two implementations stays far below; a wrong field does not)."""
    bad = []
    for name in a.names("slot", "shared"):
        x, y = a[name], b[name]
        if x.is_floating_point():
            scale = max(1.0, float(y.float().abs().max()))
            if not torch.isfinite(x).all() or float((x.float() - y.float()).abs().max()) > 0.05 * scale:
                bad.append(name)
        elif not torch.equal(x, y):
            bad.append(name)
    return bad


def twin_envs(action_mode: str, n: int = 6) -> tuple[FlashRTVectorEnv, FlashRTVectorEnv]:
    kw = {"device": "cuda", "action_mode": action_mode, "max_episode_steps": 4}
    fused = FlashRTVectorEnv(n, **kw)
    with kernels.reference_only():
        ref = FlashRTVectorEnv(n, **kw)
    fused.reset(seed=5)
    with kernels.reference_only():
        ref.reset(seed=5)
    ref.engine.bufs.slot_arena.copy_(fused.engine.bufs.slot_arena)  # the same state, byte for byte
    ref.engine.bufs.shared_arena.copy_(fused.engine.bufs.shared_arena)
    return fused, ref


@pytest.mark.parametrize("action_mode", ["noise", "residual"])
def test_whole_steps_with_the_kernels_match_the_references_field_by_field(action_mode):
    fused, ref = twin_envs(action_mode)
    acts = noise(6, 6, seed=3)
    for t, a in enumerate(acts):
        run(fused, [a])
        with kernels.reference_only():
            run(ref, [a])
        assert arena_mismatches(fused.engine.bufs, ref.engine.bufs) == [], f"step {t}"
    # mutation: the same comparison after a step in which the reference draws every slot's noise
    # from slot 0's RNG key (what a kernel that ignored the key's stride did) or takes another
    # slot's action; the buffers themselves (keys, counters) are left as they should be
    key = ref.engine.policy.state.rng_key
    saved = key.clone()
    if action_mode == "residual":
        key.copy_(key[:1].expand_as(key))
    run(fused, [acts[0]])
    with kernels.reference_only():
        run(ref, [acts[0].roll(1, dims=0) if action_mode == "noise" else acts[0]])
    key.copy_(saved)
    assert arena_mismatches(fused.engine.bufs, ref.engine.bufs) != []


# -- fork semantics on the GPU --------------------------------------------------------------------
@pytest.mark.parametrize("action_mode", ["noise", "residual"])
def test_forked_slots_given_equal_actions_stay_identical_and_the_source_is_unchanged(action_mode):
    """The issue's repro: residual mode, fork of slot 0 into 1..3, a zero residual."""
    env = FlashRTVectorEnv(4, device="cuda", action_mode=action_mode)
    zero = np.zeros((4, 16), np.float32)
    env.reset(seed=8)
    env.step(zero)
    src = env.snapshot([0])
    env.fork(0, [1, 2, 3])
    assert torch.equal(env.snapshot([0]).rows, src.rows)
    for _ in range(3):
        obs, rew, *_ = env.step(zero)
        assert all(np.array_equal(obs[i], obs[0]) for i in range(4)) and np.all(rew == rew[0])


def test_reseeded_residual_branches_diverge():
    env = FlashRTVectorEnv(4, device="cuda", action_mode="residual")
    zero = np.zeros((4, 16), np.float32)
    env.reset(seed=8)
    env.step(zero)
    env.fork(0, [1, 2, 3], reseed=True)
    obs, rew, *_ = env.step(zero)
    assert len({tuple(row) for row in obs}) == 4 and len(set(rew.tolist())) == 4


# -- capsule completeness and its ablation on the GPU ----------------------------------------------
def test_restoring_only_part_of_the_state_diverges():
    """A capsule without the history ring restores a state whose continuation differs from the
    uninterrupted one; the whole capsule's continuation equals it byte for byte."""
    env = FlashRTVectorEnv(8, device="cuda", max_episode_steps=40)
    env.reset(seed=4)
    acts = noise(8, 6, seed=5)
    run(env, acts[:3])
    bufs = env.engine.bufs
    whole = runtime.snapshot(bufs)
    partial = runtime.snapshot(bufs, names=[n for n in bufs.names("slot", "shared") if "ring" not in n])
    want = run(env, acts[3:])
    env.restore(whole)
    assert equal(run(env, acts[3:]), want)
    env.restore(whole)
    run(env, acts[:2])  # the ring now holds other frames
    runtime.restore(bufs, partial)
    assert not equal(run(env, acts[3:]), want)


def test_corrupted_and_foreign_capsule_files_are_refused_on_the_gpu(tmp_path):
    env = FlashRTVectorEnv(2, device="cuda")
    env.reset(seed=0)
    path = env.snapshot().to("disk", path=tmp_path / "c.safetensors").path
    before = env.engine.bufs.slot_arena.clone()
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0xFF
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(raw))
    with pytest.raises(runtime.CapsuleFileError):
        env.restore(runtime.Capsule.load(bad, device="cuda"))
    other = FlashRTVectorEnv(2, device="cuda", n_action_steps=2)
    other.reset(seed=0)
    foreign = other.snapshot().to("disk", path=tmp_path / "o.safetensors").path
    with pytest.raises(runtime.DeploymentMismatchError):
        env.restore(runtime.Capsule.load(foreign, device="cuda"))
    assert torch.equal(before, env.engine.bufs.slot_arena)
