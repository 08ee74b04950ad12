import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import AutoresetMode

import flashrt_gym  # noqa: F401  (registers FlashRT-VLA)
from flashrt.runtime import DeploymentMismatchError
from flashrt_gym import FlashRTEnv, FlashRTVectorEnv


def make(n: int = 4, **kw) -> FlashRTVectorEnv:
    kw.setdefault("pool_size", 8)
    return FlashRTVectorEnv(n, device="cpu", **kw)


def rollout(env: FlashRTVectorEnv, actions: list[np.ndarray]):
    out = []
    for a in actions:
        obs, r, te, tr, info = env.step(a)
        out.append((obs, r, te, tr, info.get("_final_obs")))
    return out


def same(a, b) -> bool:
    for x, y in zip(a, b, strict=True):
        for u, v in zip(x, y, strict=True):
            if (u is None) != (v is None) or (u is not None and not np.array_equal(u, v)):
                return False
    return True


def actions(env: FlashRTVectorEnv, k: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, env.action_space.shape).astype(np.float32) for _ in range(k)]


def test_make_and_make_vec_give_the_registered_envs_with_batched_spaces():
    single = gym.make("FlashRT-VLA", device="cpu", pool_size=4)
    assert isinstance(single.unwrapped, FlashRTEnv)
    envs = gym.make_vec("FlashRT-VLA", num_envs=3, vectorization_mode="vector_entry_point", device="cpu", pool_size=6)
    assert isinstance(envs, FlashRTVectorEnv) and envs.num_envs == 3
    assert envs.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
    assert envs.single_action_space.shape == (16,) and envs.action_space.shape == (3, 16)
    assert envs.single_action_space.high[0] == np.float32(1.0) and envs.noise_bound == 1.5
    obs, info = envs.reset(seed=1)
    assert obs.shape == (3, 15) and obs.dtype == np.float32 and obs in envs.observation_space
    assert info["instruction"].shape == (3,)
    obs, r, te, tr, info = envs.step(envs.action_space.sample())
    assert obs in envs.observation_space and r.dtype == np.float32 and te.dtype == np.bool_ and tr.dtype == np.bool_


@pytest.mark.parametrize(("mode", "shape", "dtype"), [("features", (258,), np.float32), ("rgb", (64, 64, 3), np.uint8)])
def test_observation_modes(mode, shape, dtype):
    env = make(2, obs_mode=mode)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (2, *shape) and obs.dtype == dtype and obs in env.observation_space
    d = make(2, obs_mode="dict")
    obs, _ = d.reset(seed=0)
    assert set(obs) == {"state", "features", "rgb"} and obs in d.observation_space


def test_single_env_passes_the_gymnasium_and_sb3_checkers():
    from stable_baselines3.common.env_checker import check_env as sb3_check

    env = gym.make("FlashRT-VLA", device="cpu", pool_size=4, render_mode="rgb_array")
    check_env(env.unwrapped)
    sb3_check(FlashRTEnv(device="cpu", pool_size=4))
    env.reset(seed=0)
    frame = env.render()
    assert frame.shape == (64, 64, 3) and frame.dtype == np.uint8


def test_reset_is_deterministic_per_seed_and_slots_draw_different_episodes():
    env = make(4)
    a, _ = env.reset(seed=7)
    b, _ = env.reset(seed=7)
    c, _ = env.reset(seed=8)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert len({tuple(row) for row in a}) == 4
    with pytest.raises(ValueError, match="seed must be an int"):
        env.reset(seed=[1, 2, 3, 4])


def test_reset_without_a_seed_takes_the_next_starts_without_a_cold_path():
    env = make(2, pool_size=8)
    a, _ = env.reset(seed=3)
    base = env._pool_base
    b, _ = env.reset()
    c, _ = env.reset()
    assert env._pool_base == base and not np.array_equal(a, b) and not np.array_equal(b, c)
    again, _ = env.reset(seed=3)
    assert np.array_equal(again, a)


def test_slots_never_share_a_start_across_pool_refreshes():
    env = make(2, pool_size=4)
    env.reset(seed=0)
    only_first = np.array([True, False])
    for _ in range(3):  # slot 0 uses up the pool alone, slot 1 keeps its episode
        env.reset(options={"reset_mask": only_first})
    obs, _ = env.reset(options={"reset_mask": np.array([True, True])})
    assert not np.array_equal(obs[0], obs[1])


def test_reset_mask_resets_only_the_masked_slots():
    env = make(4)
    env.reset(seed=0)
    obs, *_ = env.step(np.zeros((4, 16), np.float32))
    mask = np.array([True, False, True, False])
    new, _ = env.reset(options={"reset_mask": mask})
    assert np.array_equal(new[~mask], obs[~mask]) and not np.array_equal(new[mask], obs[mask])
    assert (env.bufs["env.steps"].numpy()[mask] == 0).all()
    with pytest.raises(ValueError, match="reset_mask must be a numpy bool array"):
        env.reset(options={"reset_mask": [True] * 4})


def test_same_step_autoreset_reports_the_final_observation():
    auto, manual = make(4, max_episode_steps=3), make(4, max_episode_steps=3, autoreset=False)
    auto.reset(seed=3)
    manual.reset(seed=3)
    acts = actions(auto, 3)
    for a in acts[:2]:
        x, y = auto.step(a), manual.step(a)
        assert np.array_equal(x[0], y[0])
    obs, r, te, tr, info = auto.step(acts[2])
    mobs, mr, _, mtr, _ = manual.step(acts[2])
    assert tr.all() or te.any()  # everyone ends by the third chunk
    done = te | tr
    assert np.array_equal(info["_final_obs"], done) and np.array_equal(r, mr) and np.array_equal(tr, mtr)
    assert np.array_equal(info["final_obs"][done], mobs[done])  # the old episode's last observation
    assert not np.array_equal(obs[done], mobs[done])  # the returned one starts a new episode
    assert (auto.bufs["env.steps"].numpy()[done] == 0).all()
    assert np.array_equal(info["final_info"]["is_success"], te)


def test_same_capsule_and_actions_give_byte_identical_trajectories():
    env = make(4)
    env.reset(seed=11)
    rollout(env, actions(env, 2, seed=1))
    cap = env.snapshot()
    acts = actions(env, 6, seed=2)
    first = rollout(env, acts)
    rollout(env, actions(env, 3, seed=3))
    env.restore(cap)
    assert same(rollout(env, acts), first)
    other = make(4)
    other.restore(cap)  # another env of the same configuration
    assert same(rollout(other, acts), first)


def test_rollback_returns_to_the_earlier_boundary():
    env = make(3)
    obs0, _ = env.reset(seed=5)
    cap = env.snapshot()
    acts = actions(env, 3)
    first = rollout(env, acts)
    assert np.array_equal(env.rollback(cap), obs0)
    assert same(rollout(env, acts), first)


def test_fork_branches_with_equal_noise_are_identical():
    env = make(4)
    env.reset(seed=2)
    rollout(env, actions(env, 1))
    env.fork(1, [0, 2, 3])
    a = np.repeat(actions(env, 1, seed=9)[0][:1], 4, axis=0)
    obs, r, *_ = env.step(a)
    assert all(np.array_equal(obs[i], obs[1]) for i in range(4)) and np.all(r == r[1])


def test_reseeded_residual_branches_diverge_and_unreseeded_do_not():
    for reseed, expect_equal in ((False, True), (True, False)):
        env = make(4, action_mode="residual")
        env.reset(seed=4)
        env.fork(0, [1, 2, 3], reseed=reseed)
        obs, *_ = env.step(np.zeros((4, 16), np.float32))
        assert all(np.array_equal(obs[i], obs[0]) for i in range(4)) == expect_equal


def test_set_instruction_interrupts_without_recapture():
    env = make(2)
    env.reset(seed=0)
    text = env.task.instructions[5]
    before = env.bufs["policy.kv_text"].clone()
    obs = env.set_instruction(text, slots=[1])
    assert env.bufs["sim.instruction"].tolist()[1] == 5
    assert torch.equal(env.bufs["policy.kv_text"][0], before[0]) and not torch.equal(
        env.bufs["policy.kv_text"][1], before[1]
    )
    target, goal = env.task.cfg.combos("all")[5]
    assert obs[1, 2 + 6 + target] == 1 and obs[1, 2 + 9 + goal] == 1  # the state's one-hots follow
    with pytest.raises(ValueError, match="unknown instruction"):
        env.set_instruction("dance")


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (np.zeros((4, 15), np.float32), "must have shape"),
        (np.zeros((4, 16), np.int64), "floating point"),
        (np.full((4, 16), np.nan, np.float32), "NaN"),
        (np.full((4, 16), 1.5, np.float32), r"must lie in \[-1.0, 1.0\]"),
    ],
)
def test_bad_actions_are_refused_and_the_state_is_untouched(bad, match):
    env = make(4)
    env.reset(seed=0)
    before = env.bufs.slot_arena.clone()
    with pytest.raises(ValueError, match=match):
        env.step(bad)
    assert torch.equal(before, env.bufs.slot_arena)


def test_a_capsule_from_another_configuration_is_refused():
    env, other = make(2), make(2, n_action_steps=2)
    env.reset(seed=0)
    other.reset(seed=0)
    before = env.bufs.slot_arena.clone()
    with pytest.raises(DeploymentMismatchError):
        env.restore(other.snapshot())
    assert torch.equal(before, env.bufs.slot_arena)


def test_bad_arguments():
    for kw, match in (
        ({"obs_mode": "pixels"}, "obs_mode must be one of"),
        ({"action_mode": "delta"}, "action_mode must be one of"),
        ({"reward_mode": "shaped"}, "reward_mode must be one of"),
        ({"pool_size": 2}, "pool_size"),
        ({"render_mode": "human"}, "render_mode"),
    ):
        with pytest.raises(ValueError, match=match):
            make(4, **kw)


def test_episodes_truncate_after_max_episode_steps_and_the_pool_refreshes():
    env = make(2, max_episode_steps=2, pool_size=4)
    env.reset(seed=0)
    first_base = env._pool_base
    for _ in range(8):  # far more episodes than the pool holds
        env.step(np.zeros((2, 16), np.float32))
        assert (env.bufs["env.steps"].numpy() <= 2).all()
    assert env._pool_base != first_base


class ReadsBackEveryStep(FlashRTVectorEnv):
    """The env without its host-side bound: every pool check reads ``env.next_start`` back."""

    def _refresh_pool(self) -> None:
        self._next_start_bound = None
        super()._refresh_pool()


def test_the_pool_check_skips_read_backs_only_where_no_refresh_can_be_due(monkeypatch):
    """Steps, resets, snapshot/restore and fork near the pool's end: the env that skips
    read-backs by its bound refreshes the pool exactly when the one that reads back every step
    does, so both give the same observations and pool bases throughout."""
    kw = {"device": "cpu", "pool_size": 12, "max_episode_steps": 1}  # every slot takes a start each step
    fast, slow = FlashRTVectorEnv(3, **kw), ReadsBackEveryStep(3, **kw)
    trace = {}
    for name, env in (("fast", fast), ("slow", slow)):
        acts = actions(env, 6, seed=1)
        log = [(env.reset(seed=0)[0], env._pool_base)]
        step = lambda a, env=env, log=log: log.append((env.step(a)[0], env._pool_base))  # noqa: E731
        step(acts[0])
        step(acts[1])
        late = env.snapshot()  # next starts 9..11 of 12: the next step uses the pool up
        step(acts[2])
        log.append((env.reset(seed=0)[0], env._pool_base))  # next starts back to 3..5
        log.append((env.restore(late), env._pool_base))  # and forward to 9..11 again
        step(acts[3])
        step(acts[4])
        log.append((env.fork(1, [0, 2]), env._pool_base))
        for a in acts:
            step(a)
        log.append((env.reset(options={"reset_mask": np.array([True, False, True])})[0], env._pool_base))
        step(acts[5])
        trace[name] = log
    bases = [base for _, base in trace["slow"]]
    assert len(set(bases)) >= 3, "the sequence must cross pool refreshes to test anything"
    for (obs_f, base_f), (obs_s, base_s) in zip(trace["fast"], trace["slow"], strict=True):
        assert base_f == base_s and np.array_equal(obs_f, obs_s)
    env = FlashRTVectorEnv(3, device="cpu", pool_size=12)
    env.reset(seed=0)  # next starts 3..5 of 12 rows; a step moves each by at most 3
    nxt = env.bufs["env.next_start"]
    reads = []
    original = torch.Tensor.max
    monkeypatch.setattr(
        torch.Tensor, "max", lambda t, *a, **k: reads.append(t.data_ptr() == nxt.data_ptr()) or original(t, *a, **k)
    )
    for _ in range(2):  # at most 8, then 11: no refresh can be due
        env.step(actions(env, 1)[0])
    assert not any(reads), "no refresh can be due within two steps of a reset: no read-back"
    env.step(actions(env, 1)[0])  # at most 14: one may be
    assert any(reads), "a refresh may be due: the step must read back"


def test_torch_native_step_keeps_tensors():
    env = make(2)
    env.reset(seed=0)
    obs, r, te, tr, _ = env.step_torch(torch.zeros(2, 16))
    assert all(isinstance(x, torch.Tensor) for x in (obs, r, te, tr)) and r.device == env.device


def test_sb3_adapter_contract_and_learning_smoke():
    from stable_baselines3 import PPO, SAC

    from flashrt_gym.sb3 import SB3VecEnv

    venv = SB3VecEnv(device="cpu", num_envs=2, pool_size=8, max_episode_steps=2)
    venv.seed(3)
    obs = venv.reset()
    assert obs.shape == (2, 15) and len(venv.reset_infos) == 2
    obs2 = SB3VecEnv(device="cpu", num_envs=2, pool_size=8)
    obs2.seed(3)
    assert np.array_equal(obs2.reset(), obs)
    venv.step_async(np.zeros((2, 16), np.float32))
    venv.step_wait()
    _, _, d, infos = venv.step(np.zeros((2, 16), np.float32))
    assert d.all() and all("terminal_observation" in i and "TimeLimit.truncated" in i for i in infos)
    assert venv.get_attr("num_envs") == [2, 2] and venv.env_is_wrapped(object) == [False, False]
    assert len(venv.env_method("snapshot", indices=[0])) == 1
    SAC("MlpPolicy", venv, learning_starts=4, batch_size=8, train_freq=1, verbose=0).learn(12)
    PPO("MlpPolicy", venv, n_steps=4, batch_size=4, n_epochs=1, verbose=0).learn(8)


def test_record_video_writes_episode_videos(tmp_path):
    from gymnasium.wrappers import RecordVideo

    env = RecordVideo(
        gym.make("FlashRT-VLA", device="cpu", pool_size=4, max_episode_steps=3, render_mode="rgb_array"),
        str(tmp_path),
        episode_trigger=lambda _: True,
        disable_logger=True,
    )
    env.reset(seed=0)
    done = False
    while not done:
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        done = term or trunc
    env.close()
    videos = list(tmp_path.glob("*.mp4"))
    assert len(videos) == 1 and videos[0].stat().st_size > 0


def test_repeat_over_horizon_steps_exactly_like_the_tiled_chunk():
    short, full = make(3, repeat_over_horizon=True), make(3)
    assert short.single_action_space.shape == (2,) and short.action_space.shape == (3, 2)
    short.reset(seed=5)
    full.reset(seed=5)
    acts = actions(short, 6)
    assert same(rollout(short, acts), rollout(full, [np.tile(a, (1, 8)) for a in acts]))
    with pytest.raises(ValueError, match="repeated over the horizon"):
        short.step(np.zeros((3, 16), np.float32))
    check_env(FlashRTEnv(device="cpu", pool_size=4, repeat_over_horizon=True), skip_render_check=True)
