"""The one-slot env through ``gym.make``, as Gymnasium 1.x users reach it: capsule verbs through
``unwrapped`` / ``get_wrapper_attr``, errors in its own shapes, and the registered episode limit."""

import importlib.util
import warnings

import gymnasium as gym
import numpy as np
import pytest

import flashrt_gym  # noqa: F401  (registers the ids)
from flashrt_gym import FlashRTEnv


@pytest.fixture
def make(micro):
    """``gym.make("FlashRT-VLA", ...)`` on conftest's fast ``micro`` policy."""
    return lambda **kw: gym.make("FlashRT-VLA", device="cpu", weights=micro, **kw)


def episode(env: gym.Env, seed: int, k: int) -> list[tuple]:
    """Up to ``k`` zero-action steps from ``reset(seed=seed)``, to the episode's end."""
    env.reset(seed=seed)
    out = []
    for _ in range(k):
        obs, reward, term, trunc, _ = env.step(np.zeros(env.action_space.shape, np.float32))
        out.append((obs, reward, term, trunc))
        if term or trunc:
            break
    return out


def test_capsule_verbs_through_unwrapped_and_get_wrapper_attr(make):
    env = make()
    first, _ = env.reset(seed=3)
    cap = env.unwrapped.snapshot()
    assert env.get_wrapper_attr("snapshot")().nbytes == cap.nbytes
    assert repr(cap).endswith("tier=device (cpu))")  # the gpu tier's copy here is in CPU memory: not "tier=gpu"
    ahead = [env.step(np.full(16, 0.5, np.float32))[0] for _ in range(3)]
    assert np.array_equal(env.get_wrapper_attr("rollback")(cap), first)
    assert all(np.array_equal(env.step(np.full(16, 0.5, np.float32))[0], a) for a in ahead)  # the same future
    assert np.array_equal(env.unwrapped.restore(cap), first)
    text = env.get_wrapper_attr("instructions")[-1]
    env.unwrapped.set_instruction(text)
    assert env.unwrapped.instructions[env.unwrapped.vec.engine.sim.instruction[0]] == text
    with pytest.raises(ValueError, match=r"\.instructions\) are \["):
        env.unwrapped.set_instruction("dance")


@pytest.mark.parametrize(
    ("kw", "want", "what"), [({}, 16, "horizon"), ({"repeat_over_horizon": True}, 2, "action_dim, repeated")]
)
def test_a_wrong_action_shape_is_reported_in_the_single_envs_own_shape(make, kw, want, what):
    env = make(**kw)
    env.reset(seed=0)
    with pytest.raises(ValueError, match=rf"action must have shape \({want},\) \({what}.*got \({want - 1},\)"):
        env.step(np.zeros(want - 1, np.float32))
    env.step(np.zeros(want, np.float32))  # still usable


def test_every_registered_id_carries_its_envs_episode_limit():
    ids = [i for i in gym.registry if i.startswith("FlashRT-")]
    assert {"FlashRT-VLA", "FlashRT-MuJoCoPush", "FlashRT-MuJoCoWarpPush"} <= set(ids)
    for i in ids:
        spec = gym.spec(i)
        own = getattr(spec.vector_entry_point, "keywords", {}).get("max_episode_steps", 40)
        assert spec.max_episode_steps == own, i
    assert gym.spec("FlashRT-VLA").max_episode_steps == gym.spec("FlashRT-MuJoCoPush").max_episode_steps == 40


def test_the_time_limit_ends_an_episode_on_the_envs_own_step_once(make, micro):
    limited, alone = episode(make(), 0, 60), episode(make(max_episode_steps=-1), 0, 60)  # -1: no TimeLimit
    assert len(limited) == 40 and limited[-1][3] and not any(t[3] for t in limited[:-1])
    flags = lambda ep: [(t[2], t[3]) for t in ep]  # noqa: E731
    assert flags(limited) == flags(alone)  # the TimeLimit adds no truncation of its own
    assert flags(episode(make(max_episode_steps=39), 0, 60)) != flags(alone)  # mutation check: another limit differs
    short = make(max_episode_steps=3)  # a shorter TimeLimit; the env's own count restarts at each reset
    assert [len(episode(short, s, 60)) for s in (0, None)] == [3, 3]
    vec = gym.make_vec("FlashRT-VLA", 2, vectorization_mode="vector_entry_point", device="cpu", weights=micro)
    assert vec.config.max_episode_steps == 40
    assert FlashRTEnv(device="cpu", weights=micro, max_episode_steps=50).vec.config.max_episode_steps == 50


@pytest.mark.skipif(importlib.util.find_spec("mujoco_warp") is not None, reason="MuJoCo Warp is installed here")
def test_a_missing_simulator_dependency_names_the_pinned_extra():
    with pytest.raises(ImportError, match=r'pip install -e "\.\[mujoco-warp\]"'):
        gym.make("FlashRT-MuJoCoWarpPush", device="cpu")


@pytest.mark.parametrize("obs_mode", ["features", "dict"])
def test_feature_bounds_are_finite_and_hold_so_neither_checker_warns(micro, obs_mode):
    from gymnasium.utils.env_checker import check_env
    from stable_baselines3.common.env_checker import check_env as sb3_check

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(FlashRTEnv(device="cpu", weights=micro, obs_mode=obs_mode), skip_render_check=True)
        sb3_check(FlashRTEnv(device="cpu", weights=micro, obs_mode=obs_mode))
    assert not [str(w.message) for w in caught if "infinity" in str(w.message) or "bound" in str(w.message)]
    env = FlashRTEnv(device="cpu", weights=micro, obs_mode=obs_mode, max_episode_steps=2)
    env.reset(seed=0)
    for _ in range(6):  # through episode ends: every observation lies in the space
        obs, _, term, trunc, _ = env.step(env.action_space.sample())
        assert obs in env.observation_space
        if term or trunc:
            env.reset()
