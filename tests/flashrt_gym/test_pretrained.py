import functools

import pytest
import torch

from flashrt.policies import PRESETS, load, tiny
from flashrt_gym.assets import TINY, TINY_METAWORLD, TINY_MUJOCO, load_pretrained
from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.evaluation import VALIDATION_SEED, base_policy
from flashrt_gym.sims.tabletop import TabletopConfig


def test_shipped_policy_loads_by_default_and_fits_the_task():
    model, weights_id = load_pretrained()
    assert model.cfg == tiny(TabletopConfig().vocabulary)
    assert (TINY / "model.safetensors").stat().st_size <= 30 * 2**20
    assert len(weights_id) == 64 and all(torch.isfinite(p).all() for p in model.parameters())


def test_shipped_policy_pushes_objects_to_goals_far_above_chance():
    env = FlashRTVectorEnv(16, device="cpu", action_mode="residual", autoreset=False)
    # random actions succeed in about 1 % of these episodes; the scripted expert in all of them
    assert base_policy(env, VALIDATION_SEED).success >= 0.15


def test_mujoco_push_loads_its_own_shipped_policy_which_pushes_far_above_chance():
    """The MuJoCo push simulator names the tiny VLA fine-tuned on its camera images, and the env
    loads it when given no weights; closed loop on seen instructions (validation starts) it
    succeeds far above chance (random actions: about 1 %; README has its rates)."""
    pytest.importorskip("mujoco")
    from flashrt_gym.sims import mujoco_push

    env = FlashRTVectorEnv(32, device="cpu", action_mode="residual", autoreset=False, simulator=mujoco_push)
    shipped, _ = load(TINY_MUJOCO)
    assert (TINY_MUJOCO / "model.safetensors").stat().st_size <= 30 * 2**20
    assert shipped.cfg == tiny(TabletopConfig().vocabulary)
    loaded = dict(env.engine.policy.model.named_parameters())
    assert all(torch.equal(loaded[name], p) for name, p in shipped.named_parameters())
    assert base_policy(env, VALIDATION_SEED).success >= 0.15


def test_metaworld_mt10_loads_its_own_shipped_policy_which_succeeds_far_above_chance():
    """Meta-World names the tiny VLA cloned on MT10, and the env (its slots split over two worker
    processes) loads it when given no weights; closed loop from 20 validation starts, two a task, it
    succeeds far above chance (uniform random actions almost never succeed on MT10; README has its
    per-task rates)."""
    pytest.importorskip("metaworld")
    from flashrt_gym import sims
    from flashrt_gym.demos.metaworld import MetaWorldTask

    env = FlashRTVectorEnv(
        20,
        device="cpu",
        action_mode="residual",
        autoreset=False,
        simulator=functools.partial(sims.metaworld, processes=2),
    )
    shipped, _ = load(TINY_METAWORLD)
    assert (TINY_METAWORLD / "model.safetensors").stat().st_size <= 30 * 2**20
    assert shipped.cfg == PRESETS["tiny_metaworld"](MetaWorldTask("MT10").vocabulary)
    loaded = dict(env.engine.policy.model.named_parameters())
    assert all(torch.equal(loaded[name], p) for name, p in shipped.named_parameters())
    assert base_policy(env, VALIDATION_SEED).success >= 0.25
    env.close()
