"""An external simulator split over worker processes (flashrt_gym.sims.processes.Processes): through
the env it steps, autoresets and restores the bytes one process gives; a shard's failures are named.
(Meta-World's shards, and set_state's all-or-nothing across shards, are in test_metaworld.py.)"""

import os
from pathlib import Path

import numpy as np
import pytest

from flashrt_gym import FlashRTVectorEnv
from flashrt_gym.sims.processes import PositionFree, Processes
from flashrt_gym.simulator import ExternalSimulator
from tests.flashrt_gym.support.host_tabletop import HostTabletop

SHARD = PositionFree(HostTabletop)


def trajectory(env: FlashRTVectorEnv, steps: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        obs, r, te, tr, info = env.step(rng.uniform(-1, 1, env.action_space.shape).astype(np.float32))
        out += [np.asarray(x).tobytes() for x in (obs, r, te, tr, info.get("final_obs", np.zeros(0)))]
    return out


@pytest.fixture(scope="module")
def sharded():
    sim = Processes(SHARD, 5, 2)
    yield sim
    sim.close()


def test_shards_cover_the_slots_and_meet_the_protocol(sharded):
    assert isinstance(sharded, ExternalSimulator)
    assert sharded.bounds.tolist() == [0, 2, 5] and sharded.processes == 2
    assert len(set(sharded.pids)) == 2 and os.getpid() not in sharded.pids
    assert all(Path(f"/proc/{pid}").exists() for pid in sharded.pids) or not Path("/proc/self").exists()
    one = HostTabletop(5)
    assert sharded.identity() == one.identity() and sharded.state_nbytes == one.state_nbytes
    assert sharded.instructions == one.instructions and sharded.action_dim == one.action_dim


class NamesItsPolicy(HostTabletop):
    pretrained_weights = "the/policy/trained/for/it"


def test_the_policy_a_shard_names_is_forwarded_and_none_is_invented(sharded):
    """The env loads a simulator's ``pretrained_weights`` when given none: split over processes,
    the simulator still names it (Meta-World's MT10 policy); a simulator naming none gets none."""
    assert not hasattr(sharded, "pretrained_weights")
    sim = Processes(PositionFree(NamesItsPolicy), 3, 2)
    try:
        assert sim.pretrained_weights == NamesItsPolicy.pretrained_weights
    finally:
        sim.close()


def test_through_the_env_two_processes_give_one_processs_bytes(sharded):
    """Steps with autoresets, a snapshot restored and a fork into slots of both shards: the bytes of
    the simulator in this process. Mutation: a shard handed the wrong slots' actions departs."""
    envs = {
        "one": FlashRTVectorEnv(5, device="cpu", simulator=HostTabletop, max_episode_steps=3),
        "two": FlashRTVectorEnv(5, device="cpu", simulator=lambda n: sharded, max_episode_steps=3),
    }
    runs = {}
    for name, env in envs.items():
        env.reset(seed=4)
        first = trajectory(env, 4, seed=1)
        cap = env.snapshot()
        after = trajectory(env, 3, seed=2)
        env.restore(cap)
        again = trajectory(env, 3, seed=2)
        env.fork(1, [3, 4])
        runs[name] = first + after + trajectory(env, 2, seed=3)
        assert again == after
    assert runs["two"] == runs["one"]

    class Swapped(Processes):  # the mutation: each shard gets the other's slots' first actions
        def run_ticks(self, actions):
            return super().run_ticks(np.roll(np.asarray(actions), 1, axis=0))

    wrong = Swapped(SHARD, 5, 2)
    try:
        env = FlashRTVectorEnv(5, device="cpu", simulator=lambda n: wrong, max_episode_steps=3)
        env.reset(seed=4)
        assert trajectory(env, 4, seed=1) != runs["one"][: 4 * 5]
    finally:
        wrong.close()


def test_slot_indexed_calls_split_and_join_in_the_callers_order(sharded):
    one = HostTabletop(5)
    for sim in (one, sharded):
        sim.seed(np.arange(5) + 11)
        sim.reset()
        sim.run_ticks(np.random.default_rng(0).uniform(-1, 1, (5, 4, 2)).astype(np.float32))
        sim.set_instruction(1, np.array([4, 1]))
    order = np.array([4, 0, 3])
    assert np.array_equal(sharded.get_state(order), one.get_state(order))
    assert np.array_equal(sharded.instruction(), one.instruction())
    rows = one.get_state(np.array([0, 1]))
    for sim in (one, sharded):
        sim.set_state(np.array([3, 2]), rows)  # rows of shard 0's slots into shard 1's
        sim.reset(np.array([True, False, False, False, True]))
    assert np.array_equal(sharded.get_state(), one.get_state())
    assert np.array_equal(sharded.render(), one.render()) and np.array_equal(sharded.proprio(), one.proprio())
    with pytest.raises(ValueError, match="distinct and lie in"):
        sharded.get_state(np.array([5]))
    with pytest.raises(ValueError, match="one per slot"):
        sharded.seed(np.arange(4))


class Refusing(HostTabletop):
    """Refuses to draw episodes in its slot 0 (a shard's own error)."""

    def reset(self, mask=None):
        if mask is None or np.asarray(mask)[0]:
            raise ValueError("slot 0 cannot reset")
        super().reset(mask)


def test_a_shards_error_is_named_and_a_dead_worker_is_reported():
    with pytest.raises(ValueError, match=r"processes must be an int in \[1, num_slots=2\]"):
        Processes(SHARD, 2, 3)
    with pytest.raises(ValueError, match="num_slots must be an int >= 1"):
        Processes(SHARD, 0, 1)
    refusing = Processes(_refusing, 4, 2)
    try:
        named = r"shard 1 \(slots 2 to 3; a slot index in its message counts from 2\): slot 0 cannot"
        with pytest.raises(ValueError, match=named):
            refusing.reset(np.array([False, True, True, False]))
        refusing.reset(np.array([False, True, False, True]))  # the shards still answer in order
        refusing._procs[1].kill()
        refusing._procs[1].join()
        with pytest.raises(RuntimeError, match="shard 1's worker process died .* every worker has been ended"):
            refusing.success()
        assert not any(p.is_alive() for p in refusing._procs)  # shard 0's reply is not left to be misread
        with pytest.raises(RuntimeError, match="have been ended"):
            refusing.instruction()
    finally:
        refusing.close()


def _refusing(num_slots: int, first_slot: int = 0) -> Refusing:
    return Refusing(num_slots)


def test_a_shard_that_fails_to_start_names_itself():
    with pytest.raises(ValueError, match=r"shard 0 \(slots 0 to 0.*block must be an int >= 1"):
        Processes(_bad_shard, 2, 2)


def _bad_shard(num_slots: int, first_slot: int = 0) -> HostTabletop:
    if first_slot == 0:
        raise ValueError("block must be an int >= 1 (a deliberately bad argument)")
    return HostTabletop(num_slots)


def test_closing_the_env_ends_its_workers():
    env = FlashRTVectorEnv(2, device="cpu", simulator=lambda n: Processes(SHARD, n, 2))
    procs = env.engine.mirror.host._procs
    assert all(p.is_alive() for p in procs)
    env.close()
    assert not any(p.is_alive() for p in procs)
