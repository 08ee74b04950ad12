"""Bring your own simulator: Gymnasium's ``Pusher-v5`` wrapped by :class:`GymnasiumMujocoSim`,
registered, made with ``make_vec`` and stepped through a VLA, with exact snapshot / restore and a
partial-row ablation that departs; the adapter's members one by one; and the protocol check that
names every missing member (at registration for a class, at the first make for a factory)."""

import functools
import types
from dataclasses import replace

import gymnasium as gym
import numpy as np
import pytest
import torch

pytest.importorskip("mujoco", reason="the adapter needs the mujoco extra")

import mujoco

import flashrt_gym
from flashrt_gym.sims.gymnasium_mujoco import GymnasiumMujocoSim, default_instruction
from flashrt_gym.sims.push.mujoco_cpu import MujocoPush
from flashrt_gym.sims.tabletop import Tabletop
from flashrt_gym.simulator import ExternalSimulator, Simulator, check_simulator, missing_members, protocol_members
from tests.flashrt_gym.support.host_tabletop import HostTabletop

N = 3
WORDS = ["push", "the", "cylinder", "to", "goal", "pusher"]


def near_goal(obs: np.ndarray, info: dict) -> bool:
    """Pusher's success rule: the cylinder within 5 cm of the goal."""
    return info["reward_dist"] > -0.05


def pusher(num_slots: int, cls: type = GymnasiumMujocoSim, **kw) -> GymnasiumMujocoSim:
    kw = {"instruction": "push the cylinder to the goal", "success": near_goal, "proprio": slice(0, 7), **kw}
    return cls("Pusher-v5", num_slots, **kw)


class QposQvel(GymnasiumMujocoSim):
    """The physics ablation: rows that hold time, positions and velocities only (no warm start),
    what ``MujocoEnv.set_state(qpos, qvel)`` restores."""

    physics_signature = int(mujoco.mjtState.mjSTATE_TIME | mujoco.mjtState.mjSTATE_QPOS | mujoco.mjtState.mjSTATE_QVEL)


class KeepsGenerators(GymnasiumMujocoSim):
    """The generator ablation: a restore that leaves the envs' reset generators as they are, as
    rows without them would."""

    def set_state(self, slots, states) -> None:
        where = range(self.num_slots) if slots is None else list(slots)
        kept = [self.envs[i].np_random for i in where]
        super().set_state(slots, states)
        for i, rng in zip(where, kept, strict=True):
            self.envs[i].np_random = rng


@pytest.fixture(scope="module")
def renders() -> None:
    try:
        pusher(1).render()
    except RuntimeError as e:
        pytest.skip(f"no OpenGL context for mujoco.Renderer here: {e}")


@pytest.fixture(scope="module")
def pusher_vla(tmp_path_factory):
    """A random policy for Pusher: 7-D actions and proprio, its instruction's words, one 64x64
    camera, one layer of width 64 (fast on a CPU)."""
    from flashrt.policies import FlowPolicy, save
    from flashrt.policies.config import tiny

    cfg = replace(
        tiny(WORDS), action_dim=7, proprio_dim=7,
        width=64, depth=1, heads=2, head_dim=32, mlp=128, vision_width=64, vision_depth=1, vision_heads=2,
        vision_mlp=128, expert_width=64, expert_mlp=128, steps=2,
    )  # fmt: skip
    torch.manual_seed(0)
    return save(FlowPolicy(cfg), tmp_path_factory.mktemp("pusher_vla"))


def chunks(count: int, ticks: int = 4, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, (N, ticks, 7)).astype(np.float32) for _ in range(count)]


def drive(sim: GymnasiumMujocoSim, actions: list[np.ndarray]) -> list[bytes]:
    out = []
    for a in actions:
        dense, sparse = sim.run_ticks(a)
        out += [dense.tobytes(), sparse.tobytes(), sim.observation().tobytes(), sim.get_state().tobytes()]
    return out


# -- through the env -------------------------------------------------------------------------------
def trajectory(envs, actions: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for a in actions:
        obs, reward, terminated, truncated, info = envs.step(a)
        out += [obs, reward, terminated, truncated, info.get("final_obs", np.zeros(0))]
        out.append(envs.engine.mirror.host.get_state())
    return out


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def registered() -> None:
    """``Test-Pusher`` and its ablation ``Test-KeepsGenerators``, as the README registers Pusher."""
    for env_id, cls in (("Test-Pusher", GymnasiumMujocoSim), ("Test-KeepsGenerators", KeepsGenerators)):
        factory = functools.partial(pusher, cls=cls)  # factory(num_envs) -> pusher(num_envs, cls=cls)
        flashrt_gym.register_simulator(env_id, factory, device="cpu", max_episode_steps=4)


def test_pusher_registers_steps_and_restores_exactly_and_a_partial_row_departs(renders, registered, pusher_vla):
    """The README's example end to end: register, make_vec, step, snapshot, restore. The restored
    run repeats the original's outputs and host rows byte for byte, across an autoreset; a restore
    without the reset generators (the ablation) gives other episodes after the autoreset."""
    for env_id, exact in (("Test-Pusher", True), ("Test-KeepsGenerators", False)):
        envs = gym.make_vec(env_id, num_envs=N, vectorization_mode="vector_entry_point", weights=pusher_vla)
        obs, _ = envs.reset(seed=3)
        assert obs.shape == (N, 23) and envs.engine.mirror is not None
        assert envs.engine.instructions.texts == ("push the cylinder to the goal",)
        rng = np.random.default_rng(0)
        steps = [rng.uniform(-1, 1, envs.action_space.shape).astype(np.float32) for _ in range(6)]
        trajectory(envs, steps[:2])
        cap = envs.snapshot()
        first = trajectory(envs, steps[2:])
        assert first[6 + 3].all()  # truncated at the 4th step: the last two ran after an autoreset
        envs.restore(cap)
        assert same(trajectory(envs, steps[2:]), first) == exact


def test_the_pusher_env_sees_the_camera_and_proprio(renders, registered, pusher_vla):
    envs = gym.make_vec(
        "Test-Pusher", num_envs=N, vectorization_mode="vector_entry_point", weights=pusher_vla, obs_mode="dict"
    )
    obs, _ = envs.reset(seed=0)
    host = envs.engine.mirror.host
    assert np.array_equal(obs["rgb"], host.render()[:, 0]) and obs["rgb"].std() > 0
    assert np.array_equal(obs["features"][:, -7:], host.observation()[:, :7])


def test_a_policy_that_does_not_fit_the_pusher_is_refused(registered):
    with pytest.raises(ValueError, match="action_dim is 2, the simulator's 7"):
        gym.make_vec("Test-Pusher", num_envs=1, vectorization_mode="vector_entry_point")  # the shipped tiny


# -- the adapter ---------------------------------------------------------------------------------
def test_the_adapter_meets_the_external_protocol():
    sim = pusher(2)
    assert isinstance(sim, ExternalSimulator) and missing_members(sim) == (ExternalSimulator, [])
    assert (sim.action_dim, sim.proprio_dim, sim.observation_dim) == (7, 7, 23)
    assert sim.instructions == ("push the cylinder to the goal",)
    assert GymnasiumMujocoSim("Pusher-v5", 1).instructions == ("pusher",)
    assert default_instruction("HalfCheetah-v5") == "half cheetah"
    assert default_instruction("ALE/InvertedDoublePendulum-v5") == "inverted double pendulum"


def test_restore_into_fresh_envs_continues_byte_exactly():
    sim = pusher(N)
    sim.run_ticks(chunks(1, ticks=20)[0])
    rows = sim.get_state()
    actions = chunks(4, seed=1)
    want = drive(sim, actions)
    fresh = pusher(N)
    fresh.reset(seeds=np.arange(N) + 100)  # other generators and episodes than the rows'
    fresh.set_state(None, rows)
    assert np.array_equal(fresh.get_state(), rows)
    assert drive(fresh, actions) == want


def test_a_row_copied_into_other_slots_forks_it():
    sim = pusher(N)
    sim.set_state([1, 2], np.repeat(sim.get_state([0]), 2, axis=0))
    sim.run_ticks(np.repeat(chunks(1)[0][:1], N, axis=0))
    rows = sim.get_state()
    assert rows[1].tobytes() == rows[0].tobytes() == rows[2].tobytes()


def test_rows_without_the_warm_start_depart_on_contacts():
    """Hopper on its floor: restoring full rows repeats the run byte for byte; rows of time,
    positions and velocities only (the ablation) leave the solver's warm start of a later time,
    and the continuation's state departs (on some of these seeds: where the contacts are active)."""
    departs = []
    for cls in (GymnasiumMujocoSim, QposQvel):
        for seed in range(6):
            rng = np.random.default_rng(seed)
            sim = cls("Hopper-v5", N)
            sim.run_ticks(0.5 * rng.uniform(-1, 1, (N, 20, 3)))  # onto the floor
            rows, actions = sim.get_state(), [rng.uniform(-1, 1, (N, 5, 3)) for _ in range(4)]
            want = drive(sim, actions)
            sim.set_state(None, rows)
            departs.append(drive(sim, actions) != want)
    assert not any(departs[:6]) and any(departs[6:])


def test_seeds_use_all_64_bits_and_match_gymnasium_reset():
    """Slot seeds ``s`` start the episode ``env.reset(seed=s mod 2**64)`` starts; seeds that
    differ only above bit 31 start different episodes (a fold to 32 bits, the mutation, would not)."""
    sim = pusher(3)
    seeds = np.array([5, 5 + (1 << 32), -1], dtype=np.int64)
    sim.reset(seeds=seeds)
    obs = sim.observation()
    ref = gym.make("Pusher-v5").unwrapped
    for i, s in enumerate(seeds.tolist()):
        assert np.array_equal(obs[i], ref.reset(seed=s % (1 << 64))[0].astype(np.float32))
    assert not np.array_equal(obs[0], obs[1])
    folded = pusher(2)
    folded.reset(seeds=seeds[:2] & 0xFFFFFFFF)
    assert np.array_equal(folded.observation()[0], folded.observation()[1])
    sim.seed(np.array([5], dtype=np.int64), np.array([2]))  # reseed one slot: its next reset repeats slot 0's
    sim.reset(np.array([False, False, True]))
    assert np.array_equal(sim.observation()[2], obs[0])


def test_the_reset_generator_travels_with_the_row():
    sim = pusher(N)
    rows = sim.get_state()
    sim.reset()
    want = sim.observation()
    other = pusher(N)
    other.reset(seeds=np.arange(N) + 100)
    other.set_state(None, rows)
    other.reset()
    assert np.array_equal(other.observation(), want)
    cut = rows.copy()
    cut[:, 8 * other.physics_size : 8 * other.physics_size + 8] ^= 2  # one bit of each generator's state
    other.set_state(None, cut)
    other.reset()
    assert not np.array_equal(other.observation(), want)


def test_success_from_a_rule_or_an_info_key_freezes_the_slot():
    sim = pusher(2, success=lambda obs, info: obs[0] > 0.05)  # the first joint past 0.05 rad
    a = np.zeros((2, 8, 7), np.float32)
    a[0, :, 0] = 1.0  # slot 0 turns its first joint past 0.05 in 5 ticks; slot 1 stays
    dense, sparse = sim.run_ticks(a)
    assert sim.success().tolist() == [True, False] and sparse.tolist() == [1.0, 0.0]
    row = sim.get_state([0])
    dense, sparse = sim.run_ticks(a)
    assert np.array_equal(sim.get_state([0]), row) and dense[0] == 0 and sparse.tolist() == [0.0, 0.0]
    sim.reset(np.array([True, False]))
    assert sim.success().tolist() == [False, False]
    keyed = pusher(1, success="reward_near")  # any info value: its truth
    keyed.run_ticks(np.zeros((1, 1, 7), np.float32))
    assert keyed.success().tolist() == [True]
    with pytest.raises(ValueError, match=r"no key 'done' \(it has \['reward_ctrl', 'reward_dist', 'reward_near'\]\)"):
        pusher(1, success="done").run_ticks(np.zeros((1, 1, 7), np.float32))
    assert pusher(1, success=None).run_ticks(np.zeros((1, 2, 7), np.float32))[1].tolist() == [0.0]


def test_actions_map_onto_the_env_box():
    """Pusher's box is [-2, 2]: a policy action of 0.5 is a control of 1.0 (and 3 clips to 2)."""
    sim = pusher(1)
    sim.run_ticks(np.array([[[0.5, 3.0, -1.0, 0, 0, 0, 0]]], np.float32))
    assert sim.envs[0].data.ctrl[:3].tolist() == [1.0, 2.0, -2.0]
    with pytest.raises(ValueError, match=r"shape \(1, T, 7\)"):
        sim.run_ticks(np.zeros((1, 2, 6)))
    with pytest.raises(ValueError, match="NaN"):
        sim.run_ticks(np.full((1, 1, 7), np.nan))


def test_render_proprio_and_instruction(renders):
    sim = pusher(2)
    img = sim.render()
    assert img.shape == (2, 1, 64, 64, 3) and img.dtype == np.uint8 and img.std() > 0
    assert np.array_equal(sim.proprio(), sim.observation()[:, :7]) and sim.proprio().dtype == np.float32
    rows = sim.get_state()
    sim.run_ticks(chunks(1, ticks=10)[0][:2])
    moved = sim.render()
    assert not np.array_equal(moved, img)
    sim.set_state(None, rows)
    assert np.array_equal(sim.render(), img)  # the image is a function of the row
    assert pusher(1, image_size=32).render().shape == (1, 1, 32, 32, 3)
    several = pusher(2, instruction=["push the cylinder", "push the cylinder to the goal"])
    several.set_instruction(1, np.array([1]))
    assert several.instruction().tolist() == [0, 1]
    several.reset()
    assert several.instruction().tolist() == [0, 1]  # a reset keeps a slot's instruction
    with pytest.raises(ValueError, match=r"instruction index must be an int in \[0, 2\)"):
        several.set_instruction(2)


def test_bad_rows_and_options_are_refused_before_anything_moves():
    sim = pusher(N)
    sim.run_ticks(chunks(1)[0])
    rows = sim.get_state()
    p = sim.physics_size
    for corrupt in ("nan", "increment", "instruction", "flag"):
        bad = rows.copy()
        words = bad.view(np.float64)
        if corrupt == "nan":
            words[1, 3] = np.nan
        elif corrupt == "increment":
            words[2:, p + 2 : p + 3].view(np.uint64)[:] ^= np.uint64(1)
        elif corrupt == "instruction":
            words[2:, p + 6 : p + 7].view(np.int64)[:] = 4
        else:
            words[2:, p + 7 : p + 8].view(np.int64)[:] = 2
        with pytest.raises(ValueError, match="nothing written"):
            sim.set_state(np.array([2, 0, 1]), bad)
        assert np.array_equal(sim.get_state(), rows)
    with pytest.raises(ValueError, match="nothing written"):
        sim.set_state(None, rows[:, :-8])
    with pytest.raises(ValueError, match="distinct"):
        sim.get_state([0, 0])
    with pytest.raises(TypeError, match="MujocoEnv"):
        GymnasiumMujocoSim("CartPole-v1", 1)
    with pytest.raises(ValueError, match="proprio must index the 23"):
        pusher(1, proprio=[30])
    with pytest.raises(ValueError, match="camera must be -1"):
        pusher(1, camera="top")
    with pytest.raises(ValueError, match="image_size must be an int in"):
        pusher(1, image_size=4096)
    with pytest.raises(TypeError, match="success must be"):
        pusher(1, success=3)


# -- the protocol check --------------------------------------------------------------------------
def lacking(sim: object, protocol: type, name: str) -> types.SimpleNamespace:
    """``sim``'s protocol members, bound, except ``name`` (the mutation)."""
    attrs, methods = protocol_members(protocol)
    return types.SimpleNamespace(**{n: getattr(sim, n) for n in attrs + methods if n != name})


def test_check_names_every_missing_member():
    """Complete simulators pass; a copy without any one member (each in turn) is refused naming
    exactly that member; the adapter as it was (13 members short) is refused naming all 13."""
    good = pusher(2)
    check_simulator(good)
    for sim in (MujocoPush(2), HostTabletop(2), Tabletop(), Tabletop, MujocoPush):
        check_simulator(sim)
    attrs, methods = protocol_members(ExternalSimulator)
    check_simulator(types.SimpleNamespace(**{n: getattr(good, n) for n in attrs + methods}))
    for name in attrs + methods:
        sim = lacking(good, ExternalSimulator, name)
        assert missing_members(sim) == (ExternalSimulator, [name])
        with pytest.raises(TypeError, match=rf"lacks {name}\. Define"):
            check_simulator(sim)
    before = ("action_dim", "state_nbytes", "reset", "run_ticks", "observation", "get_state", "set_state")
    with pytest.raises(TypeError) as e:
        check_simulator(types.SimpleNamespace(**{n: getattr(good, n) for n in before}))
    named = str(e.value).split("lacks ")[1].split(". ")[0].split(", ")
    assert len(named) == 13 and set(named) == set(attrs + methods) - set(before)
    tabletop = Tabletop()
    in_graph = types.SimpleNamespace(**{n: getattr(Tabletop, n, None) for n in protocol_members(Simulator)[1]})
    with pytest.raises(TypeError, match=r"not a complete flashrt_gym\.simulator\.Simulator: it lacks instructions, "):
        check_simulator(in_graph)
    assert missing_members(tabletop) == (Simulator, [])


class NoRender(GymnasiumMujocoSim):
    render = None  # the mutation: a protocol method that is not callable


def test_register_checks_a_class_now_and_a_factory_at_the_first_make(pusher_vla):
    with pytest.raises(TypeError, match=r"NoRender is not a complete .*ExternalSimulator: it lacks render\."):
        flashrt_gym.register_simulator("Test-NoRender", functools.partial(NoRender, "Pusher-v5"))
    assert "Test-NoRender" not in gym.registry

    def factory(num_envs: int) -> types.SimpleNamespace:
        return lacking(pusher(num_envs), ExternalSimulator, "instructions")

    flashrt_gym.register_simulator("Test-Lacking", factory, device="cpu")  # a function: checked when made
    with pytest.raises(TypeError, match=r"lacks instructions\. Define"):
        gym.make_vec("Test-Lacking", num_envs=2, vectorization_mode="vector_entry_point", weights=pusher_vla)
