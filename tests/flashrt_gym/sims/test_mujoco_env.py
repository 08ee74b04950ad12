"""The MuJoCo push simulator (MuJoCo's C library on the CPU) through the env as an external
simulator: capsules hold its whole state (exact restore and continue, fork, reseed, refused
restores), an incomplete state row diverges, instructions reach it, runs are deterministic, the
shipped tiny policy runs on it, and it is registered with Gymnasium.

Most tests steer a micro policy of random weights (the tiny preset's interface, far fewer
numbers) to keep the CPU suite fast; what they check does not depend on the policy's size."""

import functools

import gymnasium as gym
import mujoco
import numpy as np
import pytest
import torch

from flashrt_gym import FlashRTVectorEnv
from flashrt_gym.sims import MujocoPush, mujoco_push
from flashrt_gym.sims.tabletop import TabletopConfig
from flashrt_gym.simulator import ExternalSimulator, is_external


class QposQvelPush(MujocoPush):
    """The ablation: a state row that holds time, qpos and qvel only of the physics (a restore
    keeps the warm start, controls and the rest as the simulator last had them)."""

    physics_signature = int(mujoco.mjtState.mjSTATE_TIME | mujoco.mjtState.mjSTATE_QPOS | mujoco.mjtState.mjSTATE_QVEL)


def env(n: int, weights, cls=MujocoPush, **kw) -> FlashRTVectorEnv:
    return FlashRTVectorEnv(n, device="cpu", weights=weights, simulator=cls, **kw)


def acts(n: int, k: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, (n, 16)).astype(np.float32) for _ in range(k)]


def trajectory(e: FlashRTVectorEnv, actions: list[np.ndarray]) -> list[np.ndarray]:
    out = []
    for a in actions:
        obs, r, te, tr, info = e.step(a)
        out += [obs, r, te, tr, info.get("final_obs", np.zeros(0)), e.engine.mirror.host.get_state()]
    return out


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_mujoco_push_is_an_external_simulator():
    sim = MujocoPush(2)
    assert isinstance(sim, ExternalSimulator) and is_external(sim)
    assert sim.render().shape == (2, 1, 64, 64, 3) and sim.get_state().shape == (2, sim.state_nbytes)
    assert sim.observation().shape == (2, sim.observation_dim) and np.abs(sim.observation()).max() <= 1.0


def test_the_shipped_tiny_policy_runs_on_mujoco_push():
    """The tabletop's policy steers the MuJoCo task: its camera image is the simulator's render,
    its proprio the end-effector, and the env's observations are the simulator's."""
    e = FlashRTVectorEnv(2, device="cpu", simulator=MujocoPush, obs_mode="dict")
    obs, info = e.reset(seed=3)
    host = e.engine.mirror.host
    assert np.array_equal(obs["rgb"], host.render()[:, 0]) and np.array_equal(obs["state"], host.observation())
    assert np.array_equal(info["instruction"], host.instruction())
    before = host.observation()
    obs, reward, *_ = e.step(np.zeros((2, 16), np.float32))
    assert np.array_equal(obs["rgb"], host.render()[:, 0]) and np.isfinite(reward).all()
    assert not np.array_equal(host.observation()[:, :2], before[:, :2])  # the chunk moved the end-effector
    assert np.array_equal(obs["features"][:, -2:], host.proprio())


def test_a_policy_of_three_cameras_reads_the_scenes_three_views(tmp_path):
    """pi0 reads three cameras: a policy made for three (pi0's layout: images first, padded
    proprio and actions) runs on the scene configured with three views, each view reaching its
    camera input; a scene of one camera is refused by name."""
    from dataclasses import replace

    from flashrt.policies import FlowPolicy, save
    from flashrt.policies.config import tiny

    cfg = replace(
        tiny(TabletopConfig().vocabulary), num_cameras=3, image_size=32, proprio_dim=8, action_dim=8,
        width=64, depth=1, heads=2, head_dim=32, mlp=128, vision_width=64, vision_depth=1, vision_heads=2,
        vision_mlp=128, expert_width=64, expert_mlp=128, steps=2, prefix_order="images_first", n_obs_steps=1,
    )  # fmt: skip
    torch.manual_seed(0)
    weights = save(FlowPolicy(cfg), tmp_path / "three_cameras")
    push = {"cameras": ["top", "opposite", "centre"], "table": {"image_size": 32}}
    e = env(2, weights, functools.partial(MujocoPush, cfg=push))
    e.reset(seed=5)
    host = e.engine.mirror.host
    image = e.engine.policy.state.image.cpu().numpy()
    assert image.shape == (2, 3, 32, 32, 3) and np.array_equal(image, host.render())
    assert len({image[:, k].tobytes() for k in range(3)}) == 3
    _, reward, *_ = e.step(np.zeros((2, e.single_action_space.shape[0]), np.float32))
    assert np.isfinite(reward).all() and np.array_equal(e.engine.policy.state.image.cpu().numpy(), host.render())
    with pytest.raises(ValueError, match="num_cameras is 3, the simulator's 1"):
        env(1, weights, functools.partial(MujocoPush, cfg={"table": {"image_size": 32}}))


@pytest.mark.parametrize(("cls", "exact"), [(MujocoPush, True), (QposQvelPush, False)], ids=["whole", "qpos_qvel"])
def test_restore_and_continue_is_exact_and_a_qpos_qvel_row_diverges(micro, cls, exact):
    """Snapshot mid-episode, continue, run elsewhere, restore: the continuation repeats byte for
    byte (observations, rewards, flags, the host's rows). With rows of time, qpos and qvel only
    (the ablation) the continuation departs: the solver's warm start was not restored."""
    e = env(3, micro, cls)
    e.reset(seed=2)
    trajectory(e, acts(3, 2))
    cap = e.snapshot()
    steps = acts(3, 3, seed=1)
    first = trajectory(e, steps)
    trajectory(e, acts(3, 2, seed=2))
    e.restore(cap)
    assert same(trajectory(e, steps), first) == exact


def test_fork_copies_the_host_state_and_reseed_gives_other_next_episodes(micro):
    for reseed in (False, True):
        e = env(3, micro, max_episode_steps=1)
        e.reset(seed=7)
        e.fork(0, [1, 2], reseed=reseed)
        host = e.engine.mirror.host
        rows, physics = host.get_state(), 8 * host.physics_size
        assert all(np.array_equal(rows[i, :physics], rows[0, :physics]) for i in (1, 2))  # the same physics
        assert np.array_equal(rows[1], rows[0]) != reseed  # and the same stream unless reseeded
        obs, *_ = e.step(np.zeros((3, 16), np.float32))  # every slot ends: its next episode
        assert (np.array_equal(obs[0], obs[1]) and np.array_equal(obs[0], obs[2])) != reseed


def test_a_restore_the_simulator_refuses_changes_nothing(micro):
    """A capsule whose state row holds NaN physics passes the env's checks but not the
    simulator's: the restore raises and neither the env's buffers nor the simulator change."""
    e = env(2, micro)
    e.reset(seed=0)
    good = e.snapshot()
    e.engine.mirror.state.state[1, :8] = torch.tensor([np.nan], dtype=torch.float64).view(torch.uint8)
    bad = e.snapshot()
    e.restore(good)
    e.step(np.zeros((2, 16), np.float32))
    arena, rows = e.engine.bufs.slot_arena.clone(), e.engine.mirror.host.get_state()
    with pytest.raises(ValueError, match="non-finite physics"):
        e.restore(bad)
    assert torch.equal(arena, e.engine.bufs.slot_arena) and np.array_equal(rows, e.engine.mirror.host.get_state())


def test_set_instruction_reaches_the_simulator(micro):
    e = env(2, micro)
    e.reset(seed=0)
    texts = e.engine.instructions.texts
    obs = e.set_instruction(texts[5], slots=[1])
    host = e.engine.mirror.host
    assert host.instruction()[1] == 5 and e.engine.sim.instruction.tolist()[1] == 5
    assert np.array_equal(obs, host.observation())  # the one-hots follow the new instruction
    with pytest.raises(ValueError, match="instruction index"):
        host.set_instruction(len(texts))


def test_runs_are_deterministic_through_autoresets(micro):
    """Two envs from the same seed under the same actions agree byte for byte through
    autoresets; other actions (the mutation) give another run."""
    steps = acts(2, 4, seed=3)
    runs = []
    for a in (steps, steps, [x[::-1].copy() for x in steps]):
        e = env(2, micro, max_episode_steps=2)
        e.reset(seed=11)
        runs.append(trajectory(e, a))
    assert any(x.size for x in runs[0][4::6])  # episodes ended and restarted inside the steps
    assert same(runs[0], runs[1]) and not same(runs[0], runs[2])


def test_make_and_make_vec_build_the_registered_mujoco_task(micro):
    single = gym.make("FlashRT-MuJoCoPush", weights=micro, device="cpu")
    obs, _ = single.reset(seed=1)
    assert single.observation_space.contains(obs)
    obs, reward, _, _, info = single.step(single.action_space.sample())
    assert single.observation_space.contains(obs) and isinstance(reward, float) and "is_success" in info
    vec = gym.make_vec(
        "FlashRT-MuJoCoPush", num_envs=2, vectorization_mode="vector_entry_point", weights=micro, device="cpu"
    )
    obs, _ = vec.reset(seed=1)
    assert obs.shape == (2, 15) and isinstance(vec.unwrapped.engine.mirror.host, MujocoPush)
    assert vec.unwrapped.engine.mirror.host.num_slots == 2


def test_a_registered_id_takes_another_simulator_factory(micro):
    """make_vec's simulator= overrides the registered factory: the held-out split, configured by
    its fields (as a Hydra config holds them)."""
    table = TabletopConfig(split="heldout")
    held_out = functools.partial(mujoco_push, cfg={"table": {"split": "heldout"}})
    e = gym.make_vec(
        "FlashRT-MuJoCoPush",
        4,
        vectorization_mode="vector_entry_point",
        simulator=held_out,
        weights=micro,
        device="cpu",
    )
    _, info = e.reset(seed=0)
    held = {table.combos("all").index(c) for c in table.heldout}
    assert set(info["instruction"].tolist()) <= held
