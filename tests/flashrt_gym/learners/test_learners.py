"""The learner seam: a second device learner (tests/flashrt_gym/support/cem_learner.py and its YAML,
nothing else) is checked, budgeted, trained, saved and loaded back by the same training code as
FastSAC; a class that is not a learner is refused."""

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from flashrt_gym.learners import MEMBERS, missing_members
from flashrt_gym.learners.fast_sac import FastSAC
from flashrt_gym.training import LOOPS, ConfigError, check, loop_of, train
from flashrt_gym.training.device_loop import load_learner
from tests.flashrt_gym.support.cem_learner import CEMLearner

ROOT = Path(__file__).resolve().parents[3]
EXTRA = Path(__file__).parent / "configs"  # where the test learner's one YAML lives (configs/agent/cem.yaml)


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=[f"hydra.searchpath=[file://{EXTRA}]", *overrides])


def test_the_second_learner_runs_through_the_device_loop_on_its_own_budget():
    cfg = config("agent=cem", "runtime.device=cpu")
    assert loop_of(cfg) == "device" and LOOPS["device"].accepts(CEMLearner)
    check(cfg)
    assert cfg.env.num_envs == 8  # CEMLearner.budget's, not FastSAC's 16
    fast = config("runtime.device=cpu")
    check(fast)
    assert fast.env.num_envs == 16
    with pytest.raises(ConfigError, match=r"config key 'agent.kwargs': CEMConfig: out of range: lr=2\.0"):
        check(config("agent=cem", "runtime.device=cpu", "agent.kwargs.lr=2.0"))
    with pytest.raises(ConfigError, match=r"config key 'agent.kwargs': unknown keys \['gamma'\]; CEMLearner takes"):
        check(config("agent=cem", "runtime.device=cpu", "+agent.kwargs.gamma=0.9"))


def test_the_second_learner_trains_saves_and_loads_end_to_end(tmp_path, micro):
    cfg = config("agent=cem", "experiment=smoke", f"policy.weights={micro}")
    summary = train(cfg, tmp_path)
    assert summary["agent"] == "tests.flashrt_gym.support.cem_learner.CEMLearner" and summary["env_steps"] == 16
    assert summary["updates"] == 2 and summary["ranks"][0]["stored"] == 16  # 2 slots a step, an update per 8
    assert {p["split"] for p in json.loads((tmp_path / "curve.json").read_text())} == {"validation", "test"}
    ckpt = tmp_path / "checkpoints" / "last.safetensors"
    learner = load_learner(cfg, ckpt, 15, 16, torch.device("cpu"))
    assert isinstance(learner, CEMLearner) and learner.updates == 2
    assert not torch.equal(learner.mean, torch.zeros(16))  # the trained Gaussian came back, not a fresh one


def test_a_class_that_is_not_a_learner_is_refused_naming_what_it_lacks():
    assert missing_members(CEMLearner) == [] and missing_members(FastSAC) == []
    half = type("Half", (), {"act": None, "store": None})
    assert missing_members(half) == [m for m in MEMBERS if m not in ("act", "store")]
    with pytest.raises(ConfigError, match=r"config key 'agent._target_': .*CEMConfig is neither .* it defines config_"):
        check(config("agent=cem", "agent._target_=tests.flashrt_gym.support.cem_learner.CEMConfig"))
