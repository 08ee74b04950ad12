"""GraphSAC and its device replay buffer: SB3's update term for term, storage semantics,
save / load; on the GPU, the captured update equal to the eager one."""

import pickle

import numpy as np
import pytest
import torch
from gymnasium import spaces
from stable_baselines3 import SAC
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.logger import configure
from stable_baselines3.common.type_aliases import ReplayBufferSamples

from flashrt_gym.learners.graph_sac import DeviceReplayBuffer, GraphSAC, LayerNormSACPolicy
from flashrt_gym.sb3 import SB3VecEnv

OBS, ACT = spaces.Box(-1, 1, (3,), np.float32), spaces.Box(-1, 1, (2,), np.float32)


def fill(buf: DeviceReplayBuffer, steps: int, n_envs: int = 2) -> None:
    """Step t, env e: obs = 10 t + e, next_obs = obs + 0.5; env 0 terminates at t = 1, env 1 is
    cut by the time limit at t = 1 (not a true end: it must still bootstrap)."""
    for t in range(steps):
        obs = np.array([[10 * t + e] * 3 for e in range(n_envs)], np.float32)
        done = np.array([t == 1] * n_envs)
        infos = [{"TimeLimit.truncated": t == 1 and e == 1} for e in range(n_envs)]
        buf.add(obs, obs + 0.5, np.full((n_envs, 2), t / 10, np.float32), np.full(n_envs, t, np.float32), done, infos)


def test_device_buffer_samples_stored_rows_with_timeouts_removed():
    buf = DeviceReplayBuffer(8, OBS, ACT, device="cpu", n_envs=2)  # 4 vector steps of 2 slots
    fill(buf, 5)  # the fifth step overwrites the first
    assert buf.full and buf.pos == 1 and buf.size() == 4
    torch.manual_seed(0)
    s = buf.sample(4096)
    t = s.observations[:, 0] // 10
    assert set(t.tolist()) == {1.0, 2.0, 3.0, 4.0}  # step 0 was overwritten
    assert torch.equal(s.next_observations, s.observations + 0.5)
    assert torch.equal(s.rewards[:, 0], t) and torch.allclose(s.actions[:, 0], t / 10)
    env = s.observations[:, 0] % 10
    assert torch.equal(s.dones[:, 0], ((t == 1) & (env == 0)).float())  # the time-limit cut is not an end


def test_device_buffer_rejects_what_it_cannot_store():
    with pytest.raises(ValueError, match="Box observation space"):
        DeviceReplayBuffer(8, spaces.Dict({"a": OBS}), ACT, device="cpu")
    with pytest.raises(ValueError, match="optimize_memory_usage"):
        DeviceReplayBuffer(8, OBS, ACT, device="cpu", optimize_memory_usage=True)


def test_device_buffer_pickles_round_trip():
    buf = DeviceReplayBuffer(8, OBS, ACT, device="cpu", n_envs=2)
    fill(buf, 3)
    back = pickle.loads(pickle.dumps(buf))
    back.device = "cpu"
    torch.manual_seed(1)
    a = buf.sample(64)
    torch.manual_seed(1)
    b = back.sample(64)
    assert all(torch.equal(x, y) for x, y in zip(a[:5], b[:5], strict=True))
    fill(back, 1)  # still writable where it left off
    assert back.pos == 0 and back.full


def models(**kw):
    env = SB3VecEnv(num_envs=2, device="cpu", graphs=False, max_episode_steps=3)
    args = dict(learning_starts=0, batch_size=16, buffer_size=64, seed=0, device="cpu", **kw)
    args["policy_kwargs"] = {"net_arch": [32, 32]}
    sb3, ours = SAC("MlpPolicy", env, **args), GraphSAC("MlpPolicy", env, **args)
    ours.policy.load_state_dict(sb3.policy.state_dict())
    return sb3, ours


@pytest.mark.parametrize("ent_coef", ["auto", 0.1])
def test_gradient_step_is_sb3s(ent_coef):
    """From the same weights, batch and random stream, GraphSAC's update equals SAC's exactly."""
    sb3, ours = models(ent_coef=ent_coef, target_entropy=-1.0)
    g = torch.Generator().manual_seed(0)
    o, a = sb3.observation_space.shape[0], sb3.action_space.shape[0]
    r = lambda *shape: torch.rand(*shape, generator=g) * 2 - 1  # noqa: E731
    batch = ReplayBufferSamples(r(16, o), r(16, a), r(16, o), (r(16, 1) > 0.5).float(), r(16, 1))
    for m in (sb3, ours):
        m.replay_buffer.sample = lambda *a, **k: batch
        m.set_logger(configure(None, []))
        torch.manual_seed(3)
        m.train(gradient_steps=3, batch_size=16)
    for (name, a), b in zip(sb3.policy.state_dict().items(), ours.policy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    if ent_coef == "auto":
        assert torch.equal(sb3.log_ent_coef, ours.log_ent_coef)
    assert ours._n_updates == sb3._n_updates == 3


def test_learn_save_load_and_continue(tmp_path):
    """GraphSAC runs SB3's learn loop on the env, and a saved model with its replay buffer
    continues where it stopped."""
    env = SB3VecEnv(num_envs=4, device="cpu", graphs=False, max_episode_steps=3)
    kw = {"learning_starts": 8, "batch_size": 8, "gradient_steps": 2, "policy_kwargs": {"net_arch": [32]}}
    model = GraphSAC("MlpPolicy", env, seed=0, device="cpu", **kw)
    model.learn(24)
    assert model._n_updates == 2 * (24 - 8) // 4 and model.replay_buffer.size() == 6
    model.save(tmp_path / "m.zip")
    model.save_replay_buffer(tmp_path / "rb.pkl")
    back = GraphSAC.load(tmp_path / "m.zip", env=env, device="cpu")
    back.load_replay_buffer(tmp_path / "rb.pkl")
    assert back.replay_buffer.size() == 6 and back.replay_buffer.device == torch.device("cpu")
    for a, b in zip(model.policy.state_dict().values(), back.policy.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    back.learn(8, reset_num_timesteps=False)
    assert back.num_timesteps == 32 and back._n_updates == model._n_updates + 4


def test_state_lives_in_one_buffer_set_and_stays_there_through_load(tmp_path):
    """Every tensor the step touches is a view of the model's BufferSet; SB3's load and
    load_replay_buffer copy into those views (captured pointers never move); saved files hold
    compact copies, not the arena."""
    env = SB3VecEnv(num_envs=2, device="cpu", graphs=False, max_episode_steps=3)
    kw = {"learning_starts": 4, "batch_size": 8, "buffer_size": 20_000, "policy_kwargs": {"net_arch": [16]}}
    model = GraphSAC("MlpPolicy", env, seed=0, device="cpu", **kw)
    arena = model.bufs.shared_arena
    lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()

    def inside(t: torch.Tensor) -> bool:
        return lo <= t.data_ptr() < hi

    tensors = [*model.policy.parameters(), model.log_ent_coef, *model.replay_buffer.storage.values()]
    tensors += [
        v for opt in (model.actor.optimizer, model.critic.optimizer) for st in opt.state.values() for v in st.values()
    ]
    assert all(inside(t) for t in tensors)
    model.learn(12)
    model.save(tmp_path / "m.zip")
    model.save_replay_buffer(tmp_path / "rb.pkl")
    assert (tmp_path / "m.zip").stat().st_size < arena.numel() / 4  # the replay storage stayed out of it
    back = GraphSAC.load(tmp_path / "m.zip", env=env, device="cpu")
    back.load_replay_buffer(tmp_path / "rb.pkl")
    back.capture()  # binds what load put elsewhere: values copied into the views
    assert torch.equal(back.log_ent_coef, model.log_ent_coef)
    assert torch.equal(back.replay_buffer.storage["observations"], model.replay_buffer.storage["observations"])
    b_arena = back.bufs.shared_arena
    assert all(
        b_arena.data_ptr() <= p.data_ptr() < b_arena.data_ptr() + b_arena.numel() for p in back.policy.parameters()
    )
    assert b_arena.data_ptr() <= back.log_ent_coef.data_ptr() < b_arena.data_ptr() + b_arena.numel()
    back.learn(4, reset_num_timesteps=False)


def test_layer_norm_policy_normalises_every_hidden_layer(tmp_path):
    env = SB3VecEnv(num_envs=2, device="cpu", graphs=False, max_episode_steps=3)
    kw = {"learning_starts": 4, "batch_size": 8, "policy_kwargs": {"net_arch": [32, 16]}, "device": "cpu"}
    model = GraphSAC(LayerNormSACPolicy, env, seed=0, **kw)
    p = model.policy
    for mlp, widths in [(p.actor.latent_pi, [32, 16]), *[(q, [32, 16]) for q in p.critic.q_networks]]:
        norms = [m.normalized_shape[0] for m in mlp if isinstance(m, torch.nn.LayerNorm)]
        assert norms == widths  # after each hidden layer, none after the critic's output
        kinds = [type(m).__name__ for m in mlp]
        assert kinds[:3] == ["Linear", "LayerNorm", "ReLU"]
    model.learn(8)
    model.save(tmp_path / "m.zip")
    back = GraphSAC.load(tmp_path / "m.zip", env=env, device="cpu")
    assert isinstance(back.policy, LayerNormSACPolicy)
    for a, b in zip(model.critic_target.state_dict().values(), back.critic_target.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_rejects_other_replay_buffers():
    env = SB3VecEnv(num_envs=2, device="cpu", graphs=False)
    with pytest.raises(ValueError, match="DeviceReplayBuffer"):
        GraphSAC("MlpPolicy", env, replay_buffer_class=ReplayBuffer, device="cpu")


@pytest.mark.cuda
def test_captured_update_equals_eager():
    """On the GPU: replays of the captured gradient step follow the eager path's parameters
    and entropy coefficient from the same seed."""
    env = SB3VecEnv(num_envs=4, max_episode_steps=3)
    kw = {"learning_starts": 0, "batch_size": 32, "seed": 0, "policy_kwargs": {"net_arch": [64, 64]}}
    graph, eager = (GraphSAC("MlpPolicy", env, use_graphs=u, **kw) for u in (True, False))
    eager.policy.load_state_dict(graph.policy.state_dict())

    obs = env.reset()
    for _ in range(8):
        act = np.random.default_rng(0).uniform(-1, 1, (4, env.action_space.shape[0])).astype(np.float32)
        nxt, rew, done, infos = env.step(act)
        for m in (graph, eager):
            m.replay_buffer.add(obs, nxt, act, rew, done, infos)
        obs = nxt
    before = {k: v.clone() for k, v in graph.policy.state_dict().items()}
    graph.capture(32)  # warm-up and capture leave the state as it was
    assert all(torch.equal(before[k], v) for k, v in graph.policy.state_dict().items())
    for m in (graph, eager):
        m.set_logger(configure(None, []))
        torch.manual_seed(7)  # the replays draw from the generator's state at each replay
        m.train(gradient_steps=10, batch_size=32)
    for a, b in zip(graph.policy.state_dict().values(), eager.policy.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(graph.log_ent_coef, eager.log_ent_coef)
