"""External simulators through the env: the tabletop stepped on the host must give what the
in-graph tabletop gives, byte for byte, and capsules must hold the host's state."""

import numpy as np
import pytest
import torch

from flashrt_gym import FlashRTVectorEnv
from flashrt_gym.engine.host_link import NO_HOST_LINK, HostLink, Mirror, NoHostLink
from flashrt_gym.simulator import ExternalSimulator
from tests.flashrt_gym.support.host_tabletop import HostTabletop


def external(n: int, **kw) -> FlashRTVectorEnv:
    drop = kw.pop("drop", None)
    cls = kw.pop("cls", HostTabletop)
    return FlashRTVectorEnv(n, device="cpu", simulator=lambda k: cls(k, drop=drop), **kw)


def acts(n: int, k: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, (n, 16)).astype(np.float32) for _ in range(k)]


def trajectory(env: FlashRTVectorEnv, actions: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for a in actions:
        obs, r, te, tr, info = env.step(a)
        out += [obs, r, te, tr, info.get("final_obs", np.zeros(0))]
    return out


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


class LateHostTabletop(HostTabletop):
    """A wrong host step: every chunk's actions one tick late (the mutation)."""

    def run_ticks(self, actions: np.ndarray):
        return super().run_ticks(np.roll(actions, 1, axis=1))


def test_the_host_tabletop_meets_the_protocol():
    assert isinstance(HostTabletop(2), ExternalSimulator)


def test_the_engine_hands_off_through_one_link_chosen_at_construction():
    """Every verb's host hand-off is a HostLink method: the mirror for an external simulator, the
    no-op link for an in-graph one (whose verbs then run no host code at all)."""
    hand_offs = [n for n in vars(HostLink) if n.startswith("host_")]
    assert hand_offs == ["host_start", "host_restore", "host_fork", "host_reseed", "host_set_instruction"]
    for link in (NoHostLink, Mirror):
        assert all(callable(getattr(link, n, None)) for n in hand_offs), link
    host, in_graph = external(2), FlashRTVectorEnv(2, device="cpu")
    assert host.engine.link is host.engine.mirror and isinstance(host.engine.mirror, Mirror)
    assert in_graph.engine.link is NO_HOST_LINK and in_graph.engine.mirror is None


def test_the_external_path_equals_the_in_graph_path_through_autoresets():
    kw = {"max_episode_steps": 3, "obs_mode": "dict"}
    ext, ing, late = external(3, **kw), FlashRTVectorEnv(3, device="cpu", **kw), external(3, cls=LateHostTabletop, **kw)
    for env in (ext, ing, late):
        env.reset(seed=5)
    steps = acts(3, 5)
    flat = lambda t: [v for x in t for v in (x.values() if isinstance(x, dict) else [x])]  # noqa: E731
    want = flat(trajectory(ing, steps))
    assert same(flat(trajectory(ext, steps)), want)
    assert not same(flat(trajectory(late, steps)), want)


def test_a_capsule_holds_the_host_state_and_a_partial_one_diverges():
    for drop, exact in ((None, True), ("sim.obj_vel", False)):
        env = external(4, drop=drop)
        env.reset(seed=2)
        trajectory(env, acts(4, 2))
        cap = env.snapshot()
        steps = acts(4, 4, seed=1)
        first = trajectory(env, steps)
        trajectory(env, acts(4, 3, seed=2))
        env.restore(cap)
        assert same(trajectory(env, steps), first) == exact


def test_fork_copies_the_host_state_and_reseed_gives_other_next_episodes():
    for reseed in (False, True):
        env = external(3, max_episode_steps=1)
        env.reset(seed=7)
        env.fork(0, [1, 2], reseed=reseed)
        obs, *_ = env.step(np.zeros((3, 16), np.float32))  # every slot ends: its next episode
        assert (np.array_equal(obs[0], obs[1]) and np.array_equal(obs[0], obs[2])) != reseed


def test_a_restore_the_host_refuses_changes_nothing(monkeypatch):
    env = external(2)
    env.reset(seed=0)
    cap = env.snapshot()
    env.step(np.zeros((2, 16), np.float32))
    before = env.engine.bufs.slot_arena.clone()
    host = env.engine.mirror.host
    rows = host.get_state()

    def refuse(slots, states):
        raise ValueError("set_state: a row holds an unknown instruction")

    monkeypatch.setattr(host, "set_state", refuse)
    with pytest.raises(ValueError, match="unknown instruction"):
        env.restore(cap)
    assert torch.equal(before, env.engine.bufs.slot_arena) and np.array_equal(rows, host.get_state())


def test_set_instruction_reaches_the_host():
    env = external(2)
    env.reset(seed=0)
    text = env.engine.instructions.texts[5]
    env.set_instruction(text, slots=[1])
    assert env.engine.mirror.host.instruction()[1] == 5 and env.engine.sim.instruction.tolist()[1] == 5


def test_a_registered_simulator_makes_both_env_forms():
    import gymnasium as gym

    from flashrt_gym import register_simulator

    register_simulator("Test-HostTabletop", HostTabletop, device="cpu", max_episode_steps=2)
    envs = gym.make_vec("Test-HostTabletop", num_envs=2, vectorization_mode="vector_entry_point")
    assert envs.engine.mirror is not None and envs.reset(seed=0)[0].shape == (2, 15)
    with pytest.raises(TypeError, match="callable"):
        register_simulator("Test-Bad", HostTabletop(2))
