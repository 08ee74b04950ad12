"""The training entry points end to end, as a user runs them (subprocesses, tiny budgets)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from flashrt_gym.training import ConfigError, build_agent, check, make_env

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = str(ROOT / "configs")


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def config(*overrides: str):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=["experiment=smoke", *overrides])


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["agent=ppo"],
        ["agent=sac_sb3"],
        ["agent.policy=flashrt_gym.graph_sac.LayerNormSACPolicy"],
        ["env=residual"],
        ["runtime=eager", "runtime.device=cpu"],
        ["logger=none"],
        ["env.obs_mode=features"],
    ],
)
def test_every_config_composes_and_instantiates(overrides):
    cfg = config(*overrides)
    check(cfg)
    env = make_env(cfg, cfg.env.num_envs)
    from flashrt_gym.sb3 import SB3VecEnv

    agent = build_agent(cfg, SB3VecEnv(env), None)
    assert agent.__class__.__name__ == cfg.agent._target_.rsplit(".", 1)[-1]


def test_presets_compose():
    for name in ("quick", "dsrl_sac"):
        with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
            cfg = compose(config_name="train", overrides=[f"experiment={name}"])
        check(cfg)
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="collect_demos")
        assert cfg.task.objects[0] == "red square"
        cfg = compose(config_name="pretrain")
        assert cfg.preset == "tiny"


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("total_steps=0", "total_steps"),
        ("eval.every=-1", "eval.every"),
        ("runtime.device=tpu", "runtime.device"),
        ("agent._target_=stable_baselines3.NOPE", "agent._target_"),
        ("agent.policy=flashrt_gym.graph_sac.NopePolicy", "agent.policy"),
        ("+agent.learning_rate=0.1", "agent"),
        ("resume=/nonexistent.zip", "resume"),
    ],
)
def test_bad_values_fail_early_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        check(config(override))


def test_train_end_to_end_then_resume_then_eval(tmp_path):
    first = tmp_path / "first"
    out = run("train.py", "experiment=smoke", f"hydra.run.dir={first}")
    assert "base policy success" in out.stdout
    summary = json.loads((first / "summary.json").read_text())
    assert summary["env_steps"] >= 16 and 0 <= summary["success"] <= 1
    for name in (
        "config.yaml",
        "curve.json",
        "curve.png",
        "checkpoints/last.zip",
        "checkpoints/last_replay_buffer.pkl",
    ):
        assert (first / name).is_file(), name
    second = tmp_path / "second"
    run(
        "train.py",
        "experiment=smoke",
        f"hydra.run.dir={second}",
        f"resume={first}/checkpoints/last.zip",
        "total_steps=24",
    )
    assert json.loads((second / "summary.json").read_text())["env_steps"] >= 24
    ev = run("eval.py", "experiment=smoke", f"+checkpoint={first}/checkpoints/last.zip", f"hydra.run.dir={tmp_path}/e")
    assert json.loads(ev.stdout.strip().splitlines()[-1])["episodes"] == 2


def test_a_two_job_multirun_runs_and_aggregates(tmp_path):
    sweep = tmp_path / "sweep"
    run("train.py", "-m", "experiment=smoke", "seed=0,1", f"hydra.sweep.dir={sweep}")
    out = run("aggregate.py", str(sweep))
    assert "| default | 2 |" in out.stdout
    assert (sweep / "summary.md").is_file() and (sweep / "curves.png").is_file()


def test_eval_of_the_base_policy_records_videos(tmp_path):
    out = run("eval.py", "experiment=smoke", f"+video={tmp_path}/videos", f"hydra.run.dir={tmp_path}/e")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["checkpoint"] is None and 0 <= result["success"] <= 1
    assert len(list((tmp_path / "videos").glob("*.mp4"))) == 2


@pytest.mark.parametrize(
    ("override", "plugin"),
    [
        ("hydra/launcher=slurm", "hydra_plugins.hydra_submitit_launcher"),
        ("hydra/launcher=ray_cluster", "hydra_plugins.hydra_ray_launcher"),
        ("hydra/sweeper=optuna_search", "hydra_plugins.hydra_optuna_sweeper"),
    ],
)
def test_launcher_and_sweeper_presets_compose_when_their_plugin_is_installed(override, plugin):
    pytest.importorskip(plugin)
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="train", overrides=[override], return_hydra_config=True)
    assert cfg.hydra.launcher or cfg.hydra.sweeper
