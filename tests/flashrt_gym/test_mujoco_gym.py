"""The bring-your-own-simulator example: Gymnasium's Hopper (contacts with the floor) as a
batched external simulator whose state rows are complete capsules."""

import numpy as np
import pytest

from flashrt_gym.sims.gym_external import GymnasiumMujocoSim

N = 3


def make() -> GymnasiumMujocoSim:
    sim = GymnasiumMujocoSim("Hopper-v5", N)
    sim.reset(seeds=np.arange(N) + 7)
    return sim


def chunks(count: int, ticks: int = 5) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.uniform(-1, 1, (N, ticks, 3)) for _ in range(count)]


def drive(sim: GymnasiumMujocoSim, actions: list[np.ndarray]) -> list[bytes]:
    out = []
    for a in actions:
        reward, done = sim.run_ticks(a)
        out += [reward.tobytes(), done.tobytes(), sim.observation().tobytes(), sim.get_state().tobytes()]
    return out


def test_restore_continues_byte_exactly_and_qpos_qvel_alone_diverges():
    """Rows restored into fresh envs continue exactly as the original (rewards, observations,
    state bytes). ``MujocoEnv.set_state(qpos, qvel)``, Gymnasium's own setter, loses the warm
    start and the hopper's floor contacts make the continuation differ (the ablation)."""
    sim = make()
    sim.run_ticks(chunks(1, ticks=20)[0] * 0.5)  # onto the floor
    rows, qpos = sim.get_state(), [(e.data.qpos.copy(), e.data.qvel.copy()) for e in sim.envs]
    actions = chunks(4)
    want = drive(sim, actions)
    fresh = GymnasiumMujocoSim("Hopper-v5", N)
    fresh.set_state(None, rows)
    assert drive(fresh, actions) == want
    partial = GymnasiumMujocoSim("Hopper-v5", N)  # a cold env given only positions and velocities
    for env, (q, v) in zip(partial.envs, qpos, strict=True):
        env.set_state(q, v)
    got = drive(partial, actions)
    assert any(got[i] != want[i] for i in range(2, len(want), 4))  # the observations themselves part


def test_the_reset_generator_travels_with_the_row():
    """After a restore, the slot's next (unseeded) episode starts where the original's did;
    without the generator words (the mutation) it starts elsewhere."""
    sim = make()
    rows = sim.get_state()
    sim.reset()
    want = sim.observation()
    other = GymnasiumMujocoSim("Hopper-v5", N)
    other.set_state(None, rows)
    other.reset()
    assert np.array_equal(other.observation(), want)
    cut = rows.copy()
    cut[:, 8 * other.physics_size : 8 * other.physics_size + 8] ^= 1  # one bit of each generator
    other.set_state(None, cut)
    other.reset()
    assert not np.array_equal(other.observation(), want)


def test_fork_and_bad_rows():
    sim = make()
    sim.set_state([1, 2], np.repeat(sim.get_state([0]), 2, axis=0))
    sim.run_ticks(np.repeat(chunks(1)[0][:1], N, axis=0))
    rows = sim.get_state()
    assert rows[1].tobytes() == rows[0].tobytes() == rows[2].tobytes()
    bad = rows.copy()
    bad.view(np.float64)[1, 3] = np.nan
    with pytest.raises(ValueError, match="nothing written"):
        sim.set_state(None, bad)
    assert np.array_equal(sim.get_state(), rows)
    with pytest.raises(ValueError, match="distinct"):
        sim.get_state([0, 0])
    with pytest.raises(TypeError, match="MujocoEnv"):
        GymnasiumMujocoSim("CartPole-v1", 1)
