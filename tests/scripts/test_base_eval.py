"""The base policy's evaluation, shared by a job's runs through a ``base_eval`` file: written once,
read by runs that differ only in seed, action mode or worker processes, refused for any other
configuration (the mutations: another episode count, episode length or deployment)."""

import json

import pytest
from hydra import compose, initialize_config_dir

from flashrt_gym.training import ConfigError, check, make_env, setup
from tests.scripts.test_train import CONFIGS, run

SPLITS = {"validation": 2, "test": 4}


def config(*overrides: str):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=smoke", *overrides])
    check(cfg)
    return cfg


def deployment(cfg) -> str:
    env = make_env(cfg, cfg.eval.episodes, autoreset=False)
    digest = env.engine.bufs.deployment
    env.close()
    return digest


def test_the_file_is_written_once_and_read_by_runs_of_the_same_evaluation(tmp_path, micro, monkeypatch):
    path = tmp_path / "base_eval.json"
    first = config(f"policy.weights={micro}", f"base_eval={path}")
    results, seconds = setup.base_evaluation(first, SPLITS, deployment(first))
    assert path.is_file() and seconds > 0
    assert results == setup.evaluate_base(first, SPLITS)  # what a run evaluating it itself gets
    other = config(f"policy.weights={micro}", f"base_eval={path}", "env=residual", "seed=3")
    assert deployment(other) == deployment(first)  # the action mode is not part of the deployment

    def no_evaluation(*_, **__):
        raise AssertionError("the base policy was evaluated again")

    monkeypatch.setattr(setup, "evaluate_base", no_evaluation)
    read, read_seconds = setup.base_evaluation(other, SPLITS, deployment(other))
    assert read == results and read_seconds == seconds


@pytest.mark.parametrize(
    ("overrides", "splits", "differs"),
    [
        ((), {"validation": 2, "test": 8}, "splits"),  # another test episode count
        (("env.max_episode_steps=4",), SPLITS, "deployment, env"),  # another episode length
        (("eval.episodes=4", "eval.test_episodes=8"), {"validation": 4, "test": 8}, "eval_slots, splits"),
    ],
)
def test_a_file_of_another_evaluation_is_refused_naming_what_differs(tmp_path, micro, overrides, splits, differs):
    path = tmp_path / "base_eval.json"
    cfg = config(f"policy.weights={micro}", f"base_eval={path}")
    setup.base_evaluation(cfg, SPLITS, deployment(cfg))
    before = path.read_bytes()
    other = config(f"policy.weights={micro}", f"base_eval={path}", *overrides)
    with pytest.raises(ConfigError, match=f"config key 'base_eval'.*differs in: {differs}\\)"):
        setup.base_evaluation(other, splits, deployment(other))
    with pytest.raises(ConfigError, match="differs in: deployment\\)"):
        setup.base_evaluation(cfg, SPLITS, deployment(cfg) + "-other-weights")
    assert path.read_bytes() == before  # a refused file is left as it was


def test_a_file_that_is_not_a_base_evaluation_is_refused(tmp_path, micro):
    path = tmp_path / "base_eval.json"
    cfg = config(f"policy.weights={micro}", f"base_eval={path}")
    setup.base_evaluation(cfg, SPLITS, deployment(cfg))
    path.write_text(path.read_text()[:-40])  # cut short
    with pytest.raises(ConfigError, match="config key 'base_eval'.*is not a base evaluation file"):
        setup.base_evaluation(cfg, SPLITS, deployment(cfg))
    for record in ({"identity": {}, "results": {}}, {"identity": [], "results": {}, "seconds": 1}, []):
        path.write_text(json.dumps(record))
        with pytest.raises(ConfigError, match="is not a base evaluation file"):
            setup.base_evaluation(cfg, SPLITS, deployment(cfg))


def test_eval_writes_the_file_and_a_run_reads_it_instead_of_evaluating(tmp_path, micro):
    """scripts/metaworld_main.sh's order: ``eval.py base_eval=FILE`` first (all the cores), then the
    runs with ``base_eval=FILE``; the run's base figures are the file's."""
    path, w = tmp_path / "base_eval.json", f"policy.weights={micro}"
    out = run("eval.py", "experiment=smoke", w, f"base_eval={path}", "+split=test", f"hydra.run.dir={tmp_path}/e")
    written = json.loads(path.read_text())["results"]
    assert json.loads(out.stdout.strip().splitlines()[-1])["success"] == written["test"]["success"]
    assert written["validation"]["episodes"] == 2 and written["test"]["episodes"] == 4
    folder = tmp_path / "run"
    run("train.py", "experiment=smoke", w, f"base_eval={path}", "env=residual", f"hydra.run.dir={folder}")
    assert f"base policy: read from {path}" in (folder / "train.log").read_text()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["base_success"] == written["test"]["success"]
