"""The training entry points end to end, as a user runs them (subprocesses, tiny budgets)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
from hydra import compose, initialize_config_dir

from flashrt_gym.cli import train as cli_train
from flashrt_gym.evaluation import EvalResult
from flashrt_gym.splits import SPLITS, TRAIN_STRIDE
from flashrt_gym.training import ConfigError, check, loop_of, make_env, runlog, setup, train
from flashrt_gym.training.runlog import Progress, RunLog, success_interval
from flashrt_gym.training.sb3_loop import build_agent, sb3_replay_path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = str(ROOT / "configs")


def run(script: str, *args: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # subprocesses side by side on CI's two cores
    cmd = [sys.executable, *launcher, str(ROOT / "scripts" / script), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def config(*overrides: str):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose(config_name="train", overrides=["experiment=smoke", *overrides])


@pytest.mark.parametrize(
    "overrides",
    [
        ["agent=sac"],
        ["agent=ppo"],
        ["agent=sac_sb3"],
        ["agent=sac", "agent.policy=flashrt_gym.learners.graph_sac.LayerNormSACPolicy"],
        ["agent=sac", "env=residual"],
        ["agent=sac", "runtime=eager", "runtime.device=cpu"],
        ["agent=sac", "logger=none"],
        ["agent=sac", "env.obs_mode=features"],
    ],
)
def test_every_sb3_config_composes_and_instantiates(overrides):
    cfg = config(*overrides)
    check(cfg)
    env = make_env(cfg, cfg.env.num_envs)
    from flashrt_gym.sb3 import SB3VecEnv

    agent = build_agent(cfg, SB3VecEnv(env), None)
    assert agent.__class__.__name__ == cfg.agent._target_.rsplit(".", 1)[-1]


def test_presets_compose_and_the_default_is_the_fast_learner():
    for overrides, loop in ((["experiment=quick"], "device"), (["experiment=dsrl_sac"], "sb3"), ([], "device")):
        with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
            cfg = compose(config_name="train", overrides=overrides)
        check(cfg)
        assert loop_of(cfg) == loop
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="train", overrides=["runtime.device=cpu"])
    check(cfg)  # auto budgets: the CPU column
    assert (cfg.env.num_envs, cfg.agent.kwargs.batch_size, cfg.eval.test_episodes) == (16, 256, 256)
    assert (cfg.time_limit_s, cfg.time_limit_includes_eval) == (570, True)  # the final evaluation inside 10 minutes
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose(config_name="collect_demos")
        assert cfg.task.objects[0] == "red square"
        assert cfg.device == cfg.runtime.device  # one runtime group for every job
        cfg = compose(config_name="pretrain", overrides=["env.n_action_steps=8"])
        assert cfg.preset == "tiny" and cfg.n_action_steps == 8  # the env group's cadence


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("total_steps=0", "total_steps"),
        ("eval.every=-1", "eval.every"),
        ("runtime.device=tpu", "runtime.device"),
        ("agent._target_=stable_baselines3.NOPE", "agent._target_"),
        ("agent=sac,agent.policy=flashrt_gym.learners.graph_sac.NopePolicy", "agent.policy"),
        ("+agent.learning_rate=0.1", "agent"),
        ("+agent.kwargs.nope=1", "agent.kwargs"),
        ("agent.kwargs.gamma=1.5", "agent.kwargs"),
        ("resume=/nonexistent.zip", "resume"),
        ("seed=-1", "seed"),
        ("eval.test_episodes=3", "eval.test_episodes"),
        ("time_limit_s=0", "time_limit_s"),
    ],
)
def test_bad_values_fail_early_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        check(config(*override.split(",")))


def test_sb3_end_to_end_then_resume_then_eval(tmp_path, micro):
    first, w = tmp_path / "first", f"policy.weights={micro}"  # the micro policy: the pipeline, not the VLA's rates
    out = run("train.py", "experiment=smoke", "agent=sac", "save_replay_buffer=true", f"hydra.run.dir={first}", w)
    assert "base policy success" in out.stdout
    logged = (first / "train.log").read_text()  # Hydra's log file holds the run, not only the console
    assert "GraphSAC on cpu: 2 slots" in logged and "[16 env steps" in logged and "validation success" in logged
    assert "base policy success" in logged and "(Wilson 95% intervals)" in logged
    assert logged.splitlines()[0].endswith(setup.CPU_NOTE)  # the first line says what a CPU run shows
    summary = json.loads((first / "summary.json").read_text())
    assert summary["env_steps"] >= 16 and 0 <= summary["success"] <= 1
    assert summary["gpu_memory_MB"] is None  # a CPU run holds none (CUDA: tests/flashrt_gym/test_devices.py)
    for name in (
        "config.yaml",
        "curve.json",
        "curve.png",
        "checkpoints/last.zip",
        "checkpoints/last_replay_buffer.pkl",
    ):
        assert (first / name).is_file(), name
    assert list((first / "checkpoints").glob("sb3_*_steps.zip"))  # SB3's CheckpointCallback
    assert sb3_replay_path(first / "checkpoints/last.zip").is_file()
    second = tmp_path / "second"
    resume = [f"resume={first}/checkpoints/last.zip", "resume_replay_buffer=true", "total_steps=24"]
    run("train.py", "experiment=smoke", "agent=sac", f"hydra.run.dir={second}", w, *resume)
    assert json.loads((second / "summary.json").read_text())["env_steps"] >= 24
    ev = run(
        "eval.py",
        "experiment=smoke",
        w,
        "agent=sac",
        f"+checkpoint={first}/checkpoints/last.zip",
        f"hydra.run.dir={tmp_path}/e",
    )
    assert json.loads(ev.stdout.strip().splitlines()[-1])["episodes"] == 2


def test_fast_learner_multirun_then_resume_without_pickle_then_eval_and_aggregate(tmp_path):
    """The default learner (FastSAC) over two seeds through Hydra's multirun: each run trains on
    its own starts, writes its folder (safetensors, no pickle, test points); one resumes with its
    replay ring (only when asked: without the flag the ring starts empty, test_fast_sac's round
    trip); eval.py reads a checkpoint; aggregate.py summarises the two."""
    sweep = tmp_path / "sweep"
    run("train.py", "-m", "experiment=smoke", "seed=0,1", "save_replay_buffer=true", f"hydra.sweep.dir={sweep}")
    runs = sorted(p.parent for p in sweep.rglob("summary.json"))
    summaries = [json.loads((r / "summary.json").read_text()) for r in runs]
    assert [s["ranks"][0]["reset_seed"] for s in summaries] == [0, TRAIN_STRIDE]  # own starts each
    assert all(not s <= v < s + TRAIN_STRIDE for s in (0, TRAIN_STRIDE) for v in SPLITS.values())
    first, summary = runs[0], summaries[0]
    for r in runs:  # each job of the multirun logs into its own folder
        logged = (r / "train.log").read_text()
        assert logged.count("FastSAC on cpu: 2 slots") == 1 and "on 4 test starts" in logged
    assert summary["env_steps"] == 16 and 0 <= summary["success"] <= 1 and summary["updates"] > 0
    assert set(summary["test_success_at"]) == {"8", "16"} and summary["test_episodes"] == 4
    assert summary["ranks"] == [{"rank": 0, "reset_seed": 0, "slots": 2, "batch_size": 8, "stored": 16}]
    for name in ("config.yaml", "curve.json", "curve.png", "checkpoints/last.safetensors"):
        assert (first / name).is_file(), name
    assert (first / "checkpoints/replay_rank0.safetensors").is_file()
    assert not list(sweep.rglob("*.pkl")) and not list(sweep.rglob("*.zip"))
    assert {p["split"] for p in json.loads((first / "curve.json").read_text())} == {"validation", "test"}
    ckpt = first / "checkpoints/last.safetensors"
    again = train(config(f"resume='{ckpt}'", "resume_replay_buffer=true", "total_steps=24"), tmp_path / "resumed")
    assert again["env_steps"] == 24 and again["ranks"][0]["stored"] == 24  # the step count and the ring came back
    videos = tmp_path / "videos"
    ev = run(
        "eval.py", "experiment=smoke", f"+checkpoint='{ckpt}'", "+split=test", f"+video={videos}",
        f"hydra.run.dir={tmp_path}/e",
    )  # fmt: skip
    assert json.loads(ev.stdout.strip().splitlines()[-1])["split"] == "test"
    assert sorted(p.name for p in videos.glob("*.mp4")) == [f"base-vs-steered-episode-{i}.mp4" for i in (0, 1)]
    strip = plt.imread(videos / "strip.png")  # six frames, the base policy's row above the steered one's
    assert strip.shape[:2] == (2 * 64 + 4, 6 * 64 + 5 * 4)
    out = run("aggregate.py", str(sweep))
    assert "| default | 2 |" in out.stdout
    assert (
        (sweep / "summary.md").is_file() and (sweep / "curves.png").is_file() and (sweep / "aggregate.json").is_file()
    )


def test_two_ranks_under_torchrun_split_the_slots_seeds_and_batch(tmp_path, micro):
    """torchrun with two gloo ranks: each rank steps its own half of the slots from its own
    seeds, samples half the global batch, and the run reports the configured totals."""
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
    args = ("experiment=smoke", "env.num_envs=4", "total_steps=24", "eval.test_at=[]", f"hydra.run.dir={tmp_path}")
    run("train.py", *args, f"policy.weights={micro}", launcher=launcher)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["num_envs"] == 4 and summary["env_steps"] == 24
    ranks = summary["ranks"]
    assert [r["reset_seed"] for r in ranks] == [0, 2]  # [s, s + 2) and [s + 2, s + 4): disjoint
    assert [r["slots"] for r in ranks] == [2, 2] and sum(r["batch_size"] for r in ranks) == 8
    assert [r["stored"] for r in ranks] == [12, 12]


@pytest.mark.parametrize("task", ["tabletop", "mujoco_push"])
def test_eval_of_the_base_policy_records_videos(tmp_path, task, micro):
    args = ("experiment=smoke", f"task={task}", f"+video={tmp_path}/videos", f"hydra.run.dir={tmp_path}/e")
    args += (f"policy.weights={micro}",)  # the micro policy: the videos, not the VLA's rates
    result = json.loads(run("eval.py", *args).stdout.strip().splitlines()[-1])
    assert result["checkpoint"] is None and 0 <= result["success"] <= 1 and result["split"] == "validation"
    assert sorted(p.name for p in (tmp_path / "videos").glob("*.mp4")) == ["base-episode-0.mp4", "base-episode-1.mp4"]


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


def test_a_task_with_a_simulator_of_its_own_builds_that_env():
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "configs")):
        cfg = compose("train", ["task=mujoco_push", "runtime=cpu", "env.num_envs=2"])
    env = make_env(cfg, 2, autoreset=False)
    assert env.engine.mirror is not None and env.reset(seed=0)[0].shape == (2, 15)


def test_each_job_of_a_sequential_multirun_counts_its_wall_times_from_its_own_start(tmp_path, monkeypatch):
    """The first job counts from the process's launch (imports included); a later job of the same
    process from its own start, not from the launch (which would add the earlier jobs' time)."""
    starts = []
    monkeypatch.setattr(cli_train, "train", lambda cfg, out, launch: starts.append(launch) or {})
    clock = iter([1000.0, 2000.0])
    monkeypatch.setattr(cli_train, "time", type("Clock", (), {"time": staticmethod(lambda: next(clock))}))
    monkeypatch.setattr(
        sys, "argv", ["flashrt-train", "-m", "experiment=smoke", "seed=0,1,2", f"hydra.sweep.dir={tmp_path}"]
    )
    cli_train.main(launch=100.0)
    assert starts == [100.0, 1000.0, 2000.0]


def test_wall_times_count_from_the_given_launch_and_the_summary_has_intervals(tmp_path, monkeypatch):
    cfg = config("logger=none")
    check(cfg)
    base = {"validation": EvalResult(0.25, 1.0, 2), "test": EvalResult(0.5, 2.0, 4)}
    log = RunLog(cfg, tmp_path, 100.0, base)
    monkeypatch.setattr(runlog.time, "time", lambda: 130.0)
    assert log.point(8, "validation", EvalResult(0.5, 1.5, 2))["wall_s"] == 30.0
    log.point(16, "test", EvalResult(0.75, 2.5, 4))
    summary = runlog.summarize(cfg, log, 16, 10.0, 16)
    assert summary["wall_s"] == 30.0 and summary["test_episodes"] == 4
    assert summary["success_ci95"] == success_interval(0.75, 4) and summary["base_success_ci95"] == success_interval(
        0.5, 4
    )
    log.finish(summary)
    assert json.loads((tmp_path / "summary.json").read_text())["success"] == 0.75
    assert (tmp_path / "curve.png").is_file()


def test_the_summary_has_each_instructions_test_success_beside_the_base_policys(tmp_path):
    """The final test point's per-instruction figures (a task each on MT10) reach ``curve.json`` and
    ``summary.json``'s ``test_by_instruction``, the base policy's rate on the same split beside
    each; validation points carry none."""
    cfg = config("logger=none")
    base_test = EvalResult(0.5, 2.0, 4, {"open the drawer": (2, 2), "press the button": (0, 2)})
    log = RunLog(cfg, tmp_path, 100.0, {"validation": EvalResult(0.25, 1.0, 2), "test": base_test})
    assert "by_instruction" not in log.point(8, "validation", EvalResult(0.5, 1.5, 2, {"open the drawer": (1, 2)}))
    log.point(16, "test", EvalResult(0.75, 2.5, 4, {"open the drawer": (2, 2), "press the button": (1, 2)}))
    summary = runlog.summarize(cfg, log, 16, 10.0, 16)
    assert summary["test_by_instruction"] == {
        "open the drawer": {"success": 1.0, "base_success": 1.0, "episodes": 2},
        "press the button": {"success": 0.5, "base_success": 0.0, "episodes": 2},
    }
    log.finish(summary)
    assert json.loads((tmp_path / "summary.json").read_text())["test_by_instruction"] == summary["test_by_instruction"]


def test_success_interval_is_wilsons():
    # Wilson's 95 % interval of 14 successes in 32 (Brown, Cai & DasGupta 2001, eq. 4) by hand
    z, n, k = 1.959963984540054, 32, 14
    p = k / n
    mid, half = (
        (p + z * z / (2 * n)) / (1 + z * z / n),
        z / (1 + z * z / n) * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5,
    )
    assert success_interval(p, n) == pytest.approx((mid - half, mid + half), abs=1e-9)
    assert success_interval(p, n) != pytest.approx(
        (p - z * (p * (1 - p) / n) ** 0.5, p + z * (p * (1 - p) / n) ** 0.5)
    )  # not Wald's


def test_progress_bar_under_a_time_limit_aims_at_the_steps_the_rate_reaches(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(runlog.time, "time", lambda: now[0])
    bar = Progress(total=100_000, initial=0, stop_at=1100.0)
    now[0] = 1010.0
    bar.update(500)  # 50 env steps/s, 90 s left: 4 500 more
    assert (bar.bar.n, bar.bar.total) == (500, 5000)
    unlimited = Progress(total=100_000, initial=0, stop_at=None)
    unlimited.update(500)
    assert unlimited.bar.total == 100_000
    bar.validated(0.5)
    assert bar.bar.postfix == "validation=50.0%"


def test_a_time_limit_that_includes_the_evaluation_stops_training_early_enough_for_it():
    cfg = config("time_limit_s=600", "time_limit_includes_eval=true")
    check(cfg)
    assert runlog.deadline(cfg, 100.0, final_eval_s=250.0) == 450.0
    cfg.time_limit_includes_eval = False
    assert runlog.deadline(cfg, 100.0, final_eval_s=250.0) == 700.0
    cfg.time_limit_s = None
    assert runlog.deadline(cfg, 100.0, final_eval_s=250.0) is None
    with pytest.raises(ConfigError, match="config key 'time_limit_includes_eval'"):
        check(config("time_limit_includes_eval=7"))
