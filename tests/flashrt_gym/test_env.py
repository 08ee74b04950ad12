import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from gymnasium.vector import AutoresetMode

import flashrt_gym  # noqa: F401  (registers FlashRT-VLA)
from flashrt.runtime import Capsule, CapsuleError, DeploymentMismatchError
from flashrt_gym import FlashRTEnv, FlashRTVectorEnv


def make(n: int = 4, **kw) -> FlashRTVectorEnv:
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
    single = gym.make("FlashRT-VLA", device="cpu")
    assert isinstance(single.unwrapped, FlashRTEnv)
    envs = gym.make_vec("FlashRT-VLA", num_envs=3, vectorization_mode="vector_entry_point", device="cpu")
    assert isinstance(envs, FlashRTVectorEnv) and envs.num_envs == 3
    assert envs.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
    assert envs.single_action_space.shape == (16,) and envs.action_space.shape == (3, 16)
    assert envs.single_action_space.high[0] == np.float32(1.0) and envs.config.noise_bound == 1.5
    obs, info = envs.reset(seed=1)
    assert obs.shape == (3, 15) and obs.dtype == np.float32 and obs in envs.observation_space
    assert info["instruction"].shape == (3,)
    obs, r, te, tr, info = envs.step(envs.action_space.sample())
    assert obs in envs.observation_space and r.dtype == np.float32 and te.dtype == np.bool_ and tr.dtype == np.bool_
    assert all(x.flags.writeable for x in (obs, r, te, tr))  # the caller's own arrays


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

    env = gym.make("FlashRT-VLA", device="cpu", render_mode="rgb_array")
    check_env(env.unwrapped)
    sb3_check(FlashRTEnv(device="cpu"))
    env.reset(seed=0)
    frame = env.render()
    assert frame.shape == (64, 64, 3) and frame.dtype == np.uint8


def test_slot_i_of_seed_s_is_the_episode_stream_of_seed_s_plus_i():
    """Gymnasium's convention, and the streams are per slot: slot 2 of ``reset(seed=7)`` and
    slot 0 of ``reset(seed=9)`` see the same first and next episodes; other seeds other ones."""
    four, one = make(4), make(1)
    a, _ = four.reset(seed=7)
    b, _ = one.reset(seed=9)
    assert np.array_equal(a[2], b[0]) and len({tuple(row) for row in a}) == 4
    assert np.array_equal(four.reset()[0][2], one.reset()[0][0])  # the next episode of the stream
    c, _ = four.reset(seed=8)
    assert not np.array_equal(a, c)
    for bad in ([1, 2, 3], [1, 2, 3, -1], [1, 2, 3, 1.5], [1, 2, 3, True], "1234", -1, 2**64, True, 1.5):
        with pytest.raises(ValueError, match="seed must be an int"):
            four.reset(seed=bad)


def test_one_seed_a_slot_starts_each_slot_from_its_own_seed():
    """Gymnasium's list form: ``reset(seed=[s0, ..., s3])`` starts slot i as slot 0 of
    ``reset(seed=si)``; ``[s, s + 1, ...]`` is ``reset(seed=s)`` byte for byte; slots given one seed
    start alike (a search's candidates from one start) and play alike under equal actions. The
    mutation: a list read as its first seed (``reset(seed=s0)``) departs."""
    four, one = make(4), make(1)
    firsts = [one.reset(seed=s)[0][0] for s in (11, 5, 5, 20)]
    listed, _ = four.reset(seed=[11, 5, 5, 20])
    assert all(np.array_equal(listed[i], firsts[i]) for i in range(4))
    assert not np.array_equal(listed, four.reset(seed=11)[0])
    zero = [np.zeros((4, 16), np.float32)] * 3
    four.reset(seed=[5, 6, 7, 8])
    listed_run = rollout(four, zero)
    four.reset(seed=5)
    assert same(listed_run, rollout(four, zero))
    alike, _ = four.reset(seed=np.array([9, 9, 9, 9]))
    assert all(np.array_equal(alike[0], row) for row in alike[1:])
    obs = rollout(four, zero)[-1][0]
    assert all(np.array_equal(obs[0], row) for row in obs[1:])


def test_a_repeated_seed_restores_its_kept_starts_and_a_budget_of_zero_keeps_none():
    env, none = make(2), make(2, start_cache_bytes=0)
    a, _ = env.reset(seed=3)
    env.step(np.zeros((2, 16), np.float32))
    assert len(env.starts) == 1 and env.starts.nbytes == env.engine.bufs.state_nbytes
    assert np.array_equal(env.reset(seed=3)[0], a)
    assert np.array_equal(none.reset(seed=3)[0], a) and len(none.starts) == 0
    for seed in range(4, 10):  # within its budget the cache keeps the most recent
        env.reset(seed=seed)
    assert env.starts.nbytes <= env.starts.budget_bytes


def test_reset_mask_resets_only_the_masked_slots():
    env = make(4)
    env.reset(seed=0)
    obs, *_ = env.step(np.zeros((4, 16), np.float32))
    before = env.snapshot()
    mask = np.array([True, False, True, False])
    new, _ = env.reset(options={"reset_mask": mask})
    assert np.array_equal(new[~mask], obs[~mask]) and not np.array_equal(new[mask], obs[mask])
    after = env.snapshot()
    assert torch.equal(after.rows[~torch.from_numpy(mask)], before.rows[~torch.from_numpy(mask)])
    assert (env.engine.episode.steps.numpy()[mask] == 0).all()
    with pytest.raises(ValueError, match="reset_mask must be a numpy bool array"):
        env.reset(options={"reset_mask": [True] * 4})


def forms(obs) -> list[np.ndarray]:
    """An observation's arrays (one, or a dict's in key order)."""
    return [obs[k] for k in sorted(obs)] if isinstance(obs, dict) else [obs]


@pytest.mark.parametrize("obs_mode", ["state", "dict"])
def test_same_step_autoreset_reports_the_final_observation_and_starts_the_next_episode(obs_mode):
    """The final observation equals what an env without autoreset returns at that step (every
    form, the policy's features of the last frame included), and the new episode is the slot's
    next one: what ``reset()`` without a seed starts."""
    auto, manual, nxt = (make(4, max_episode_steps=3, obs_mode=obs_mode, autoreset=a) for a in (True, False, True))
    for env in (auto, manual, nxt):
        env.reset(seed=3)
    acts = actions(auto, 3)
    for a in acts[:2]:
        assert same([forms(auto.step(a)[0])], [forms(manual.step(a)[0])])
    obs, r, te, tr, info = auto.step(acts[2])
    mobs, mr, _, mtr, _ = manual.step(acts[2])
    done = te | tr
    assert done.all() and np.array_equal(info["_final_obs"], done)  # everyone ends by the third chunk
    assert np.array_equal(r, mr) and np.array_equal(tr, mtr)
    assert same([forms(info["final_obs"])], [forms(mobs)])
    assert same([forms(obs)], [forms(nxt.reset()[0])])
    assert not same([forms(obs)], [forms(mobs)])
    assert (auto.engine.episode.steps.numpy() == 0).all()
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


def test_fork_branches_with_equal_noise_are_identical_and_the_source_is_unchanged():
    env = make(4)
    env.reset(seed=2)
    rollout(env, actions(env, 1))
    src = env.snapshot([1])
    env.fork(1, [0, 2, 3])
    assert torch.equal(env.snapshot([1]).rows, src.rows)
    a = np.repeat(actions(env, 1, seed=9)[0][:1], 4, axis=0)
    obs, r, *_ = env.step(a)
    assert all(np.array_equal(obs[i], obs[1]) for i in range(4)) and np.all(r == r[1])


def test_reseeded_branches_draw_their_own_noise_and_episodes():
    for reseed, expect_equal in ((False, True), (True, False)):
        env = make(4, action_mode="residual", max_episode_steps=1)
        env.reset(seed=4)
        env.fork(0, [1, 2, 3], reseed=reseed)
        obs, *_ = env.step(np.zeros((4, 16), np.float32))  # every slot ends: its next episode
        assert all(np.array_equal(obs[i], obs[0]) for i in range(4)) == expect_equal


def test_set_instruction_interrupts_without_recapture():
    env = make(2)
    env.reset(seed=0)
    p = env.engine.policy.state
    text = env.engine.instructions.texts[5]
    before = p.kv_text.clone()
    obs = env.set_instruction(text, slots=[1])
    assert env.engine.sim.instruction.tolist()[1] == 5
    assert torch.equal(p.kv_text[0], before[0]) and not torch.equal(p.kv_text[1], before[1])
    assert torch.equal(p.kv_text[1], env.engine.instructions.kv[5])
    target, goal = env.engine.sim.cfg.combos("all")[5]
    assert obs[1, 2 + 6 + target] == 1 and obs[1, 2 + 9 + goal] == 1  # the state's one-hots follow
    with pytest.raises(ValueError, match="unknown instruction"):
        env.set_instruction("dance")
    for slots, error in (([-1], ValueError), ([], ValueError), ([0.5], TypeError), ("0", TypeError)):
        with pytest.raises(error, match="slots"):
            env.set_instruction(text, slots=slots)
    assert env.engine.sim.instruction.tolist()[1] == 5


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (np.zeros((4, 15), np.float32), ValueError, "must have shape"),
        (np.zeros((4, 16), np.int64), ValueError, "floating point"),
        (np.full((4, 16), np.nan, np.float32), ValueError, "NaN"),
        (np.full((4, 16), 1.5, np.float32), ValueError, r"must lie in \[-1.0, 1.0\]"),
        (None, TypeError, "actions must be an array"),
        ("go", TypeError, "actions must be an array"),
        ({"a": 1}, TypeError, "actions must be an array"),
    ],
)
def test_bad_actions_are_refused_and_the_state_is_untouched(bad, error, match):
    env = make(4)
    env.reset(seed=0)
    before = env.engine.bufs.slot_arena.clone()
    with pytest.raises(error, match=match):
        env.step(bad)
    assert torch.equal(before, env.engine.bufs.slot_arena)


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("sim.instruction", 10**6, "sim.instruction holds indices outside"),
        ("policy.text_ids", -3, "policy.text_ids holds token ids outside"),
        ("policy.frame", -1, "negative frame"),
        ("sim.ee", float("nan"), "sim.ee holds NaN"),
        ("env.episode.steps", -5, "env.episode.steps holds negative"),
    ],
)
def test_a_capsule_holding_values_the_env_cannot_run_from_is_refused_before_any_copy(tmp_path, name, value, match):
    env = make(2)
    env.reset(seed=0)
    cap = env.snapshot()
    cap.tensor(name)[0].view(-1)[0] = value  # a well-formed capsule (its file checksum would match)
    path = cap.to("disk", path=tmp_path / "c.safetensors").path
    before = env.engine.bufs.slot_arena.clone()
    with pytest.raises(CapsuleError, match=match):
        env.restore(Capsule.load(path))
    assert torch.equal(before, env.engine.bufs.slot_arena)
    env.step(np.zeros((2, 16), np.float32))  # the env runs on


def test_a_capsule_from_another_configuration_is_refused():
    env, other = make(2), make(2, n_action_steps=2)
    env.reset(seed=0)
    other.reset(seed=0)
    before = env.engine.bufs.slot_arena.clone()
    with pytest.raises(DeploymentMismatchError):
        env.restore(other.snapshot())
    assert torch.equal(before, env.engine.bufs.slot_arena)


def test_an_fp8_policy_encodes_near_the_native_one_and_its_capsules_are_its_own():
    """``precision="fp8"`` loads the policy with e4m3 projections (emulated on a CPU): the features
    it encodes from the same starts, and after the same actions, stay near the native policy's
    but are not its bytes, and the two deployments refuse each other's capsules."""
    native, fp8 = make(2, obs_mode="features"), make(2, obs_mode="features", precision="fp8")
    assert (native.engine.policy.model.precision, fp8.engine.policy.model.precision) == ("native", "fp8")
    zeros = np.zeros(native.action_space.shape, np.float32)
    for a, b in ((native.reset(seed=0)[0], fp8.reset(seed=0)[0]), (native.step(zeros)[0], fp8.step(zeros)[0])):
        assert not np.array_equal(a, b)
        assert np.abs(a - b).max() <= 0.1 * np.abs(a).max()
    with pytest.raises(DeploymentMismatchError):
        native.restore(fp8.snapshot())


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"obs_mode": "pixels"}, ValueError, "obs_mode must be one of"),
        ({"action_mode": "delta"}, ValueError, "action_mode must be one of"),
        ({"reward_mode": "shaped"}, ValueError, "reward_mode must be one of"),
        ({"render_mode": "human"}, ValueError, "render_mode"),
        ({"noise_bound": float("nan")}, ValueError, "noise_bound must be a finite number > 0"),
        ({"residual_scale": float("inf")}, ValueError, "residual_scale must be a finite number > 0"),
        ({"noise_bound": 0}, ValueError, "noise_bound"),
        ({"n_action_steps": 9}, ValueError, r"n_action_steps must be in \[1, horizon=8\]"),
        ({"max_episode_steps": 0}, ValueError, "max_episode_steps must be an int >= 1"),
        ({"start_cache_bytes": -1}, ValueError, "start_cache_bytes must be an int >= 0"),
        ({"task": {"objects": ("pink square",)}}, ValueError, "colour in"),
        ({"task": "tabletop"}, TypeError, "task must be a TabletopConfig"),
        ({"precision": "int8"}, ValueError, "precision must be one of"),
    ],
)
def test_bad_arguments_name_the_argument(kw, error, match):
    with pytest.raises(error, match=match):
        make(2, **kw)


def test_a_device_this_machine_lacks_is_named():
    with pytest.raises(ValueError, match="device must be"):
        FlashRTVectorEnv(2, device="tpu")


@pytest.mark.parametrize("n", [2.5, True, 0, "4"])
def test_num_envs_must_be_a_positive_int(n):
    with pytest.raises(ValueError, match="num_envs must be an int >= 1"):
        FlashRTVectorEnv(n, device="cpu")


def test_fork_arguments_are_checked_before_anything_moves():
    env = make(3)
    env.reset(seed=0)
    before = env.engine.bufs.slot_arena.clone()
    for src, dst, error in ((1.7, [0], TypeError), (0, [1.0], TypeError), (0, [3], ValueError), (-1, [0], ValueError)):
        with pytest.raises(error, match="slots"):
            env.fork(src, dst)
    assert torch.equal(before, env.engine.bufs.slot_arena)


def test_episodes_truncate_after_max_episode_steps_for_ever():
    env = make(2, max_episode_steps=2)
    env.reset(seed=0)
    for _ in range(9):
        env.step(np.zeros((2, 16), np.float32))
        assert (env.engine.episode.steps.numpy() <= 1).all()


def test_torch_native_step_keeps_tensors():
    env = make(2)
    env.reset(seed=0)
    obs, r, te, tr, info = env.step_torch(torch.zeros(2, 16))
    assert all(isinstance(x, torch.Tensor) for x in (obs, r, te, tr, info["_final_obs"])) and r.device == env.device
    with pytest.raises(TypeError, match="torch.Tensor"):
        env.step_torch(np.zeros((2, 16), np.float32))


def test_a_closed_env_refuses_every_call():
    env = make(2)
    env.reset(seed=0)
    env.close()
    for call in (lambda: env.step(np.zeros((2, 16), np.float32)), lambda: env.reset(seed=0), env.snapshot):
        with pytest.raises(RuntimeError, match="closed"):
            call()


def test_single_env_refuses_a_step_after_the_episode_ended():
    env = FlashRTEnv(device="cpu", max_episode_steps=1)
    env.reset(seed=0)
    _, _, term, trunc, _ = env.step(np.zeros(16, np.float32))
    assert term or trunc
    with pytest.raises(gym.error.ResetNeeded, match="call reset"):
        env.step(np.zeros(16, np.float32))
    env.reset()
    env.step(np.zeros(16, np.float32))


def test_sb3_adapter_contract_and_learning_smoke():
    from stable_baselines3 import PPO, SAC

    from flashrt_gym.sb3 import SB3VecEnv

    venv = SB3VecEnv(device="cpu", num_envs=2, max_episode_steps=2)
    venv.seed(3)
    obs = venv.reset()
    assert obs.shape == (2, 15) and len(venv.reset_infos) == 2
    obs2 = SB3VecEnv(device="cpu", num_envs=2)
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
        gym.make("FlashRT-VLA", device="cpu", max_episode_steps=3, render_mode="rgb_array"),
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


def test_the_vector_wrappers_of_gymnasium_work_on_it(tmp_path):
    """Gymnasium's vector ``RecordVideo`` (frames as one sequence per slot) and
    ``RecordEpisodeStatistics`` (same-step autoreset) over the vector env."""
    from gymnasium.wrappers.vector import RecordEpisodeStatistics, RecordVideo

    env = make(2, max_episode_steps=2, render_mode="rgb_array")
    env = RecordEpisodeStatistics(RecordVideo(env, str(tmp_path), step_trigger=lambda s: s == 0, video_length=3))
    env.reset(seed=0)
    episodes = []
    for _ in range(4):
        *_, info = env.step(np.zeros((2, 16), np.float32))
        if "episode" in info:
            episodes.append(info["episode"]["l"][info["_episode"]])
    env.close()
    assert np.concatenate(episodes).tolist() == [2, 2, 2, 2]
    assert len(list(tmp_path.glob("*.mp4"))) == 1


def test_repeat_over_horizon_steps_exactly_like_the_tiled_chunk():
    short, full = make(3, repeat_over_horizon=True), make(3)
    assert short.single_action_space.shape == (2,) and short.action_space.shape == (3, 2)
    short.reset(seed=5)
    full.reset(seed=5)
    acts = actions(short, 6)
    assert same(rollout(short, acts), rollout(full, [np.tile(a, (1, 8)) for a in acts]))
    with pytest.raises(ValueError, match="repeated over the horizon"):
        short.step(np.zeros((3, 16), np.float32))
    check_env(FlashRTEnv(device="cpu", repeat_over_horizon=True), skip_render_check=True)
