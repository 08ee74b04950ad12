import torch

from flashrt.policies import tiny
from flashrt_gym.assets import TINY, load_pretrained
from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.evaluation import VALIDATION_SEED, base_policy
from flashrt_gym.tasks import TabletopConfig


def test_shipped_policy_loads_by_default_and_fits_the_task():
    model, weights_id = load_pretrained()
    assert model.cfg == tiny(TabletopConfig().vocabulary)
    assert (TINY / "model.safetensors").stat().st_size <= 30 * 2**20
    assert len(weights_id) == 64 and all(torch.isfinite(p).all() for p in model.parameters())


def test_shipped_policy_pushes_objects_to_goals_far_above_chance():
    env = FlashRTVectorEnv(16, device="cpu", action_mode="residual", autoreset=False)
    # random actions succeed in about 1 % of these episodes; the scripted expert in all of them
    assert base_policy(env, VALIDATION_SEED).success >= 0.15
