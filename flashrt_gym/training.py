"""Training SB3 agents that steer the frozen VLA: the objects a Hydra config describes, and
``train(cfg)``, the loop behind ``scripts/train.py`` (kept apart from ``@hydra.main`` so that
tests and notebooks call it directly).

Config values are read once, here, into plain objects; nothing in the training loop looks at
the config again.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.vec_env import VecMonitor
from tqdm import tqdm

from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.sb3 import SB3VecEnv

AGENT_KEYS = {"_target_", "policy", "utd", "kwargs"}


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config key '{key}': {msg}")


AUTO = {"total_steps": (200_000, 3_000), "eval.episodes": (256, 32)}  # (GPU, CPU-only) budgets


def resolve_budget(cfg: DictConfig) -> None:
    """Replace ``auto`` budgets by the GPU or the CPU-only default, in place."""
    gpu = device_of(cfg) == "cuda"
    for key, (on_gpu, on_cpu) in AUTO.items():
        if OmegaConf.select(cfg, key) == "auto":
            OmegaConf.update(cfg, key, on_gpu if gpu else on_cpu)


def check(cfg: DictConfig) -> None:
    """Fail early, naming the key, on values that cannot work."""
    _require(cfg.runtime.device in ("auto", "cpu", "cuda"), "runtime.device", "must be auto, cpu or cuda")
    resolve_budget(cfg)
    for key in ("total_steps", "eval.episodes"):
        _require(
            isinstance(OmegaConf.select(cfg, key), int),
            key,
            f"must be an int or auto, got {OmegaConf.select(cfg, key)!r}",
        )
    _require(cfg.total_steps > 0, "total_steps", f"must be > 0, got {cfg.total_steps}")
    _require(cfg.eval.every > 0, "eval.every", f"must be > 0, got {cfg.eval.every}")
    _require(cfg.eval.episodes > 0, "eval.episodes", f"must be > 0, got {cfg.eval.episodes}")
    _require(cfg.env.num_envs > 0, "env.num_envs", f"must be > 0, got {cfg.env.num_envs}")
    extra = set(cfg.agent) - AGENT_KEYS
    _require(not extra, "agent", f"unknown keys {sorted(extra)}; put algorithm arguments under agent.kwargs")
    _require(cfg.agent.utd > 0, "agent.utd", f"must be > 0, got {cfg.agent.utd}")
    try:
        cls = get_class(cfg.agent._target_)
    except Exception as e:
        raise ConfigError(f"config key 'agent._target_': cannot import {cfg.agent._target_!r} ({e})") from e
    _require(issubclass(cls, BaseAlgorithm), "agent._target_", f"{cfg.agent._target_} is not an SB3 algorithm")
    if "." in cfg.agent.policy:
        try:
            get_class(cfg.agent.policy)
        except Exception as e:
            raise ConfigError(f"config key 'agent.policy': cannot import {cfg.agent.policy!r} ({e})") from e
    if cfg.resume:
        _require(Path(cfg.resume).is_file(), "resume", f"no checkpoint file at {cfg.resume}")


def device_of(cfg: DictConfig) -> str:
    if cfg.runtime.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.runtime.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("config key 'runtime.device': cuda was asked for but no GPU is visible")
    return cfg.runtime.device


def make_env(
    cfg: DictConfig, num_envs: int, *, autoreset: bool = True, action_mode: str | None = None
) -> FlashRTVectorEnv:
    """The env of ``cfg`` (``env``, ``task``, ``policy`` and ``runtime`` groups) with ``num_envs`` slots."""
    env_cfg = OmegaConf.to_container(cfg.env, resolve=True)
    env_cfg.pop("num_envs")
    if not autoreset:  # evaluation: one episode per slot, so one pool start per slot is enough
        env_cfg["pool_size"] = num_envs
    if action_mode is not None:
        env_cfg["action_mode"] = action_mode
    return FlashRTVectorEnv(
        num_envs,
        task=OmegaConf.to_container(cfg.task, resolve=True),
        weights=cfg.policy.weights,
        device=device_of(cfg),
        graphs=cfg.runtime.graphs,
        autoreset=autoreset,
        **env_cfg,
    )


def build_agent(cfg: DictConfig, venv: Any, tensorboard_log: str | None) -> BaseAlgorithm:
    """The SB3 algorithm of ``cfg.agent``: ``_target_`` class, ``policy``, ``kwargs``, and ``utd``
    (gradient updates per collected transition, for off-policy agents)."""
    cls = get_class(cfg.agent._target_)
    policy = get_class(cfg.agent.policy) if "." in cfg.agent.policy else cfg.agent.policy  # a class, or SB3's alias
    kwargs = OmegaConf.to_container(cfg.agent.kwargs, resolve=True)
    if issubclass(cls, OffPolicyAlgorithm):  # one vec step collects num_envs transitions
        kwargs["gradient_steps"] = max(1, round(cfg.agent.utd * venv.num_envs))
    return cls(
        policy,
        venv,
        seed=cfg.seed,
        device=device_of(cfg),
        tensorboard_log=tensorboard_log,
        verbose=0,
        **kwargs,
    )


@dataclass
class EvalResult:
    success: float
    mean_return: float
    action_dim: int  # of the env evaluated (for callers that build actions)


def evaluate(env: FlashRTVectorEnv, act: Any, seed: int) -> EvalResult:
    """One episode per slot of ``env`` (built with ``autoreset=False``) from seed ``seed``:
    success rate and mean return. ``act(obs) -> actions``; finished slots stop counting."""
    obs, _ = env.reset(seed=seed)
    alive = np.ones(env.num_envs, dtype=bool)
    ret = np.zeros(env.num_envs)
    success = np.zeros(env.num_envs, dtype=bool)
    while alive.any():
        obs, reward, term, trunc, _ = env.step(act(obs))
        ret += reward * alive
        success |= term & alive
        alive &= ~(term | trunc)
    return EvalResult(float(success.mean()), float(ret.mean()), env.single_action_space.shape[0])


def evaluate_base(cfg: DictConfig) -> EvalResult:
    """The unsteered VLA (its own per-slot noise, no correction) on the evaluation episodes."""
    env = make_env(cfg, cfg.eval.episodes, autoreset=False, action_mode="residual")
    zeros = np.zeros((env.num_envs, *env.single_action_space.shape), np.float32)
    return evaluate(env, lambda _: zeros, cfg.eval.seed)


class Progress(BaseCallback):
    """A tqdm bar over env steps and the env-steps-per-second metric."""

    def __init__(self, total: int) -> None:
        super().__init__()
        self.total = total

    def _on_training_start(self) -> None:
        self.bar = tqdm(total=self.total, initial=self.num_timesteps, desc="train", unit="step")
        self.t0, self.n0 = time.perf_counter(), self.num_timesteps

    def _on_step(self) -> bool:
        self.bar.update(self.training_env.num_envs)
        rate = (self.num_timesteps - self.n0) / max(1e-9, time.perf_counter() - self.t0)
        self.logger.record("time/env_steps_per_s", rate)
        return True

    def _on_training_end(self) -> None:
        self.bar.close()


class EvalAndCheckpoint(BaseCallback):
    """Every ``every`` env steps: evaluate the steered policy beside the base policy, log
    ``eval/*``, append to the learning curve, save a checkpoint (SB3 zip, replay buffer)."""

    def __init__(self, every: int, run: Run) -> None:
        super().__init__()
        self.every, self.run, self.next = every, run, every

    def _on_training_start(self) -> None:  # a resumed run keeps the same evaluation grid
        self.next = (self.num_timesteps // self.every + 1) * self.every

    def _on_step(self) -> bool:
        if self.num_timesteps >= self.next:
            self.next += self.every
            self.run.evaluate_and_save(self.model)
        return True


class Run:
    """One training run's state on disk: checkpoints, the learning curve, the summary."""

    def __init__(self, cfg: DictConfig, out: Path, eval_env: FlashRTVectorEnv, base: EvalResult) -> None:
        self.cfg, self.out, self.eval_env, self.base = cfg, out, eval_env, base
        self.curve: list[dict[str, float]] = []
        curve = out / "curve.json"
        if curve.is_file():  # a resumed run continues its curve
            self.curve = json.loads(curve.read_text())
        self.t0 = time.perf_counter()

    def evaluate_and_save(self, model: BaseAlgorithm) -> EvalResult:
        res = evaluate(self.eval_env, lambda o: model.predict(o, deterministic=True)[0], self.cfg.eval.seed)
        point = {
            "env_steps": model.num_timesteps,
            "success": res.success,
            "return": res.mean_return,
            "base_success": self.base.success,
            "base_return": self.base.mean_return,
            "wall_s": time.perf_counter() - self.t0,
        }
        self.curve.append(point)
        for k in ("success", "return", "base_success", "base_return"):
            model.logger.record(f"eval/{k}", point[k])
        model.logger.dump(model.num_timesteps)
        ckpt = self.out / "checkpoints"
        ckpt.mkdir(parents=True, exist_ok=True)
        model.save(ckpt / "last.zip")
        if hasattr(model, "replay_buffer") and model.replay_buffer is not None:
            model.save_replay_buffer(ckpt / "last_replay_buffer.pkl")
        (self.out / "curve.json").write_text(json.dumps(self.curve, indent=2))
        tqdm.write(f"[{model.num_timesteps} env steps] success {res.success:.1%} (base {self.base.success:.1%})")
        return res


def plot_curve(curve: list[dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [p["env_steps"] for p in curve]
    ax.plot(x, [p["success"] for p in curve], marker="o", label="steered")
    ax.plot(x, [p["base_success"] for p in curve], linestyle="--", label="base policy")
    ax.set(xlabel="env steps (chunks)", ylabel="success rate", ylim=(0, 1), title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train(cfg: DictConfig, out: str | Path = ".") -> dict[str, Any]:
    """Train ``cfg.agent`` on FlashRT-VLA; write checkpoints, ``curve.json``, ``curve.png`` and
    ``summary.json`` under ``out``; print base vs steered success. Returns the summary."""
    check(cfg)  # also resolves the auto budgets
    torch.set_float32_matmul_precision("high")  # the agent's float32 GEMMs on tensor cores (TF32)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    venv = VecMonitor(SB3VecEnv(make_env(cfg, cfg.env.num_envs)))
    eval_env = make_env(cfg, cfg.eval.episodes, autoreset=False)
    base = evaluate_base(cfg)
    tb = str(out / "tb") if cfg.logger.tensorboard else None
    if cfg.resume:
        model = get_class(cfg.agent._target_).load(cfg.resume, env=venv, device=device_of(cfg))
        buffer = Path(cfg.resume).with_name(Path(cfg.resume).stem + "_replay_buffer.pkl")
        if buffer.is_file():
            model.load_replay_buffer(buffer)
        model.tensorboard_log = tb
    else:
        model = build_agent(cfg, venv, tb)
    run = Run(cfg, out, eval_env, base)
    start, remaining = model.num_timesteps, cfg.total_steps - model.num_timesteps
    t0 = time.perf_counter()
    if remaining > 0:
        model.learn(
            remaining,
            callback=[Progress(cfg.total_steps), EvalAndCheckpoint(cfg.eval.every, run)],
            reset_num_timesteps=not cfg.resume,
            tb_log_name="run",
        )
    last = run.curve[-1] if run.curve else None
    if last is not None and last["env_steps"] == model.num_timesteps:  # evaluated at the last step already
        final = EvalResult(last["success"], last["return"], eval_env.single_action_space.shape[0])
    else:
        final = run.evaluate_and_save(model)
    seconds = time.perf_counter() - t0
    plot_curve(run.curve, out / "curve.png", f"{cfg.agent._target_.rsplit('.', 1)[-1]} steering, seed {cfg.seed}")
    summary = {
        "agent": cfg.agent._target_,
        "seed": cfg.seed,
        "env_steps": model.num_timesteps,
        "base_success": base.success,
        "success": final.success,
        "base_return": base.mean_return,
        "return": final.mean_return,
        "train_seconds": seconds,
        "env_steps_per_s": (model.num_timesteps - start) / seconds if seconds > 0 else 0.0,
        "device": device_of(cfg),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"base policy success {base.success:.1%} -> steered {final.success:.1%} after {model.num_timesteps} env steps"
    )
    return summary
