"""Gymnasium's vector wrappers over FlashRTVectorEnv in each autoreset mode, and NEXT_STEP's
semantics checked against Gymnasium's own SyncVectorEnv of the one-slot env."""

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.wrappers import vector as vw

from flashrt_gym import FlashRTEnv, FlashRTVectorEnv
from tests.flashrt_gym.support.host_tabletop import HostTabletop

N, STEPS = 3, 2  # slots; chunks an episode lasts (truncation) unless it succeeds first


@pytest.fixture(autouse=True)
def small_policy(micro, monkeypatch):
    """Every env here runs conftest's ``micro`` policy (the shipped one's interface, fast on a CPU)."""
    monkeypatch.setitem(OPTIONS, "weights", micro)


OPTIONS = {"device": "cpu", "max_episode_steps": STEPS}


def make(mode: AutoresetMode | str | None, **kw) -> FlashRTVectorEnv:
    return FlashRTVectorEnv(N, autoreset_mode=mode, **OPTIONS, **kw)


def test_the_mode_is_reported_per_instance_and_checked():
    assert make(AutoresetMode.NEXT_STEP).metadata["autoreset_mode"] == AutoresetMode.NEXT_STEP
    assert make(None, autoreset=False).metadata["autoreset_mode"] == AutoresetMode.DISABLED
    assert make("next_step").autoreset
    assert FlashRTVectorEnv.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP  # the class keeps the default
    with pytest.raises(ValueError, match="autoreset_mode must be"):
        make("sometimes")
    with pytest.raises(ValueError, match="autoreset=False is autoreset_mode=DISABLED"):
        make(AutoresetMode.NEXT_STEP, autoreset=False)


def rollout(env: gym.vector.VectorEnv, k: int) -> list[tuple]:
    """``k`` steps of seeded random actions from ``reset(seed=7)``: (obs, reward, term, trunc)."""
    rng = np.random.default_rng(0)
    env.reset(seed=7)
    out = []
    for _ in range(k):
        obs, r, te, tr, _ = env.step(rng.uniform(-1, 1, env.action_space.shape).astype(np.float32))
        out.append((obs, r.astype(np.float64), te, tr))
    return out


def same(a: list[tuple], b: list[tuple]) -> bool:
    return all(np.allclose(x, y, atol=1e-5) for s, t in zip(a, b, strict=True) for x, y in zip(s, t, strict=True))


@pytest.mark.parametrize("sim", [{}, {"simulator": HostTabletop}], ids=["in-graph", "external"])
def test_next_step_autoreset_is_gymnasiums(sim):
    """Gymnasium's definition, run by Gymnasium: a SyncVectorEnv of one-slot envs (slot i seeded
    ``seed + i``, as here) in NEXT_STEP mode. The step after an episode ends returns the next
    episode's first observation, reward 0 and no end, ignoring its action; ours must equal it,
    for an in-graph and an external simulator."""
    sync = SyncVectorEnv([lambda: FlashRTEnv(**OPTIONS, **sim)] * N, autoreset_mode=AutoresetMode.NEXT_STEP)
    reference = rollout(sync, 3 * STEPS + 2)
    assert any(t[2].any() or t[3].any() for t in reference)  # episodes ended, so autoresets happened
    assert same(rollout(make(AutoresetMode.NEXT_STEP, **sim), 3 * STEPS + 2), reference)
    # mutation check: the same comparison against same-step autoreset must fail
    assert not same(rollout(make(AutoresetMode.SAME_STEP, **sim), 3 * STEPS + 2), reference)


def test_step_torch_is_same_step_and_refused_in_next_step_mode():
    with pytest.raises(RuntimeError, match="NEXT_STEP: use step"):
        make(AutoresetMode.NEXT_STEP).step_torch(torch.zeros(N, 16))
    env = make(AutoresetMode.DISABLED)
    env.reset(seed=0)
    assert env.step_torch(torch.zeros(N, 16))[-1] == {}


def test_next_step_holds_a_waiting_slot_through_capsule_verbs():
    env = make(AutoresetMode.NEXT_STEP)
    env.reset(seed=0)
    zeros = np.zeros(env.action_space.shape, np.float32)
    for _ in range(STEPS):
        *_, trunc, _ = env.step(zeros)
    assert trunc.all() and env.waiting.all()
    start = env.snapshot()  # the slots' next episodes, as they begin
    env.fork(0, [1])  # a slot written by a verb no longer waits: its next step is a real one
    assert env.waiting.tolist() == [True, False, True]
    obs, reward, term, trunc, _ = env.step(zeros)
    assert not env.waiting.any() and reward[[0, 2]].tolist() == [0, 0] and reward[1] != 0
    assert not (term | trunc).any()
    assert np.array_equal(obs[[0, 2]], env.restore(start)[[0, 2]])  # their step was the reset itself


def wrapped(mode: AutoresetMode, folder) -> dict[str, gym.vector.VectorWrapper]:
    """Every Gymnasium vector wrapper that applies to the env in ``mode``. Not applicable here:
    HumanRendering (a window), ResizeObservation (OpenCV), the array conversions (JAX or
    array-api-compat, no dependencies of ours); in SAME_STEP mode every observation wrapper
    (Gymnasium refuses it: it would not transform ``info["final_obs"]``), and NormalizeObservation
    in any mode but NEXT_STEP."""
    box = make(mode)
    out = {
        "TransformAction": vw.TransformAction(make(mode), lambda a: a / 2, box.action_space),
        "VectorizeTransformAction": vw.VectorizeTransformAction(
            make(mode), gym.wrappers.TransformAction, func=lambda a: -a, action_space=box.single_action_space
        ),
        "ClipAction": vw.ClipAction(make(mode)),
        "RescaleAction": vw.RescaleAction(make(mode), -3.0, 3.0),
        "TransformReward": vw.TransformReward(make(mode), lambda r: r - 1),
        "VectorizeTransformReward": vw.VectorizeTransformReward(make(mode), gym.wrappers.TransformReward, func=abs),
        "ClipReward": vw.ClipReward(make(mode), -0.5, 0.5),
        "NormalizeReward": vw.NormalizeReward(make(mode)),
        "RecordEpisodeStatistics": vw.RecordEpisodeStatistics(make(mode)),
        "DictInfoToList": vw.DictInfoToList(make(mode)),
        "RecordVideo": vw.RecordVideo(make(mode, render_mode="rgb_array"), str(folder), step_trigger=lambda s: s == 2),
    }
    if mode == AutoresetMode.SAME_STEP:
        return out
    out |= {
        "TransformObservation": vw.TransformObservation(box, lambda o: o / 2, box.observation_space),
        "VectorizeTransformObservation": vw.VectorizeTransformObservation(
            make(mode),
            gym.wrappers.TransformObservation,
            func=lambda o: -o,
            observation_space=box.single_observation_space,
        ),
        "RescaleObservation": vw.RescaleObservation(make(mode), 0.0, 1.0),
        "DtypeObservation": vw.DtypeObservation(make(mode), np.float64),
        "ReshapeObservation": vw.ReshapeObservation(make(mode), (5, 3)),
        "FlattenObservation": vw.FlattenObservation(make(mode, obs_mode="dict")),
        "FilterObservation": vw.FilterObservation(make(mode, obs_mode="dict"), ["state"]),
        "GrayscaleObservation": vw.GrayscaleObservation(make(mode, obs_mode="rgb")),
    }
    if mode == AutoresetMode.NEXT_STEP:
        out["NormalizeObservation"] = vw.NormalizeObservation(make(mode))
    return out


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED])
def test_every_applicable_vector_wrapper_steps_through_episode_ends(mode, tmp_path):
    for name, env in wrapped(mode, tmp_path).items():
        obs, _ = env.reset(seed=0)
        assert obs in env.observation_space, name
        lengths = []
        for t in range(2 * STEPS + 1):
            if mode == AutoresetMode.DISABLED and t and t % STEPS == 0:  # the caller resets finished slots
                obs, _ = env.reset(options={"reset_mask": np.ones(N, np.bool_)})
            actions = env.action_space.sample() if name != "ClipAction" else np.full(env.action_space.shape, 5.0)
            obs, reward, _, _, info = env.step(actions)
            assert obs in env.observation_space and reward.shape == (N,), name
            if name == "ClipReward":
                assert np.abs(reward).max() <= 0.5
            if name == "DictInfoToList":
                assert isinstance(info, list) and len(info) == N
            if "episode" in info:
                lengths += info["episode"]["l"][info["_episode"]].tolist()
        if name == "RecordEpisodeStatistics":  # the reset step of NEXT_STEP is not counted
            assert lengths and set(lengths) <= set(range(1, STEPS + 1)), lengths
        env.close()
    assert len(list(tmp_path.glob("*.mp4"))) == 1


@pytest.mark.parametrize("wrapper", [vw.NormalizeObservation, vw.FlattenObservation, vw.DtypeObservation])
def test_observation_wrappers_refuse_same_step_as_gymnasium_says(wrapper):
    args = {vw.DtypeObservation: (np.float64,)}.get(wrapper, ())
    with pytest.raises(ValueError, match="NEXT_STEP"):
        wrapper(make(AutoresetMode.SAME_STEP), *args)


def test_sb3_under_vec_monitor_logs_episodes_and_refuses_other_modes(micro):
    from stable_baselines3 import SAC
    from stable_baselines3.common.vec_env import VecMonitor

    from flashrt_gym.sb3 import SB3VecEnv

    venv = VecMonitor(SB3VecEnv(make(AutoresetMode.SAME_STEP)))
    venv.seed(0)  # starts none of whose episodes succeeds early (an unseeded reset draws any)
    venv.reset()
    infos = []
    for _ in range(STEPS):
        *_, info = venv.step(np.zeros((N, 16), np.float32))
        infos += info
    assert [i["episode"]["l"] for i in infos if "episode" in i] == [STEPS] * N
    model = SAC("MlpPolicy", venv, learning_starts=2, batch_size=4, verbose=0).learn(4 * N)
    assert len(model.ep_info_buffer) >= N  # what SB3 logs as rollout/ep_rew_mean
    for mode in (AutoresetMode.NEXT_STEP, AutoresetMode.DISABLED):
        with pytest.raises(ValueError, match=f"SAME_STEP.*got {mode.name}"):
            SB3VecEnv(make(mode))
