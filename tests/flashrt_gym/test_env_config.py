"""The env's one config: EnvConfig is what the env checks its arguments with, what its engine
builds from, and Hydra's ``env`` schema, whose defaults the YAML files do not restate."""

from dataclasses import asdict
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from flashrt_gym import FlashRTVectorEnv
from flashrt_gym.env_config import OBS_FORMS, EnvConfig, EnvGroup

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def env_group(*overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides)).env


def test_the_env_group_is_the_dataclass_and_its_yaml_holds_no_defaults():
    group = env_group()
    assert OmegaConf.get_type(group) is EnvGroup
    fields = OmegaConf.to_container(group)
    assert fields.pop("num_envs") == "auto" and fields == asdict(EnvConfig())
    assert set(yaml.safe_load((CONFIGS / "env" / "noise.yaml").read_text())) == {"defaults"}
    residual = yaml.safe_load((CONFIGS / "env" / "residual.yaml").read_text())
    assert {k: v for k, v in residual.items() if k != "defaults"} == {"action_mode": "residual"}
    assert env_group("env=residual").action_mode == "residual"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("obs_mode", "pixels", "obs_mode must be one of"),
        ("action_mode", "torque", "action_mode must be one of"),
        ("reward_mode", "shaped", "reward_mode must be one of"),
        ("noise_bound", 0.0, "noise_bound must be a finite number > 0"),
        ("residual_scale", float("inf"), "residual_scale must be a finite number > 0"),
        ("n_action_steps", 0, "n_action_steps must be an int >= 1"),
        ("max_episode_steps", 2.5, "max_episode_steps must be an int >= 1"),
    ],
)
def test_a_bad_value_is_refused_when_the_config_is_made(field, value, message):
    with pytest.raises(ValueError, match=message):
        EnvConfig(**{field: value})
    EnvConfig(**{field: getattr(EnvConfig(), field)})  # the default passes the same check


def test_the_env_and_its_engine_hold_the_same_config(micro):
    env = FlashRTVectorEnv(2, device="cpu", weights=micro, obs_mode="dict", action_mode="residual")
    assert env.config is env.engine.cfg and env.config == EnvConfig(obs_mode="dict", action_mode="residual")
    assert env.config.obs_forms == OBS_FORMS and set(env.single_observation_space.spaces) == set(OBS_FORMS)
    env.close()
