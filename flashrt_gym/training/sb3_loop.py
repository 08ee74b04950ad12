"""The training loop of a stable-baselines3 algorithm (``agent=sac`` for
:class:`~flashrt_gym.learners.graph_sac.GraphSAC`, ``agent=sac_sb3``, ``agent=ppo``): SB3's own
loop over :class:`~flashrt_gym.sb3.SB3VecEnv`, its checkpoint callback, and the run's evaluation
points as a callback.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback, CheckpointCallback
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.vec_env import VecMonitor

from flashrt_gym.evaluation import evaluate
from flashrt_gym.learners import CPU_BUDGET
from flashrt_gym.sb3 import SB3VecEnv
from flashrt_gym.splits import train_seed
from flashrt_gym.training.runlog import Progress, RunLog, deadline, summarize
from flashrt_gym.training.setup import ConfigError, base_evaluation, device_of, make_env, require

AGENT_KEYS = {"_target_", "policy", "utd", "kwargs"}
"""The keys of an SB3 agent config."""

GPU_BUDGET: Mapping[str, Any] = {
    "env.num_envs": 64,
    "total_steps": 200_000,
    "time_limit_s": None,
    "time_limit_includes_eval": False,
    "eval.every": 10_000,
    "eval.episodes": 512,
    "eval.test_episodes": 1024,
    "agent.kwargs.batch_size": 256,
    "agent.kwargs.buffer_size": 200_000,
}
"""An SB3 algorithm's run on a GPU: tens of slots through SB3's NumPy loop."""


def accepts(cls: type) -> bool:
    """Whether this loop runs ``cls``: a stable-baselines3 algorithm."""
    return issubclass(cls, BaseAlgorithm)


def budget(cls: type, device: str) -> Mapping[str, Any]:
    """The ``auto`` values of an SB3 run on ``device`` (``"cpu"`` or ``"cuda"``), whatever ``cls``."""
    return CPU_BUDGET if device == "cpu" else GPU_BUDGET


def check_agent(cfg: DictConfig, cls: type) -> None:
    """Fail early on an SB3 agent config that cannot work.

    Args:
        cfg: the run's config. cls: the algorithm ``agent._target_`` names.

    Raises:
        ConfigError: an unknown key, a ``utd`` <= 0 or a policy class that cannot be imported.
    """
    extra = set(cfg.agent) - AGENT_KEYS
    require(not extra, "agent", f"unknown keys {sorted(extra)}; put algorithm arguments under agent.kwargs")
    require(cfg.agent.utd > 0, "agent.utd", f"must be > 0, got {cfg.agent.utd}")
    if "." in cfg.agent.policy:
        try:
            get_class(cfg.agent.policy)
        except Exception as e:
            raise ConfigError(f"config key 'agent.policy': cannot import {cfg.agent.policy!r} ({e})") from e


def build_agent(cfg: DictConfig, venv: Any, tensorboard_log: str | None) -> BaseAlgorithm:
    """The SB3 algorithm of ``cfg.agent``.

    Args:
        cfg: the run's config: ``agent._target_`` (the class), ``policy``, ``kwargs`` and ``utd``
            (gradient updates per collected transition, for off-policy agents).
        venv: the SB3 vector env. tensorboard_log: SB3's tensorboard folder, or None.

    Returns:
        The algorithm, untrained.
    """
    cls = get_class(cfg.agent._target_)
    policy = get_class(cfg.agent.policy) if "." in cfg.agent.policy else cfg.agent.policy  # a class, or SB3's alias
    kwargs = OmegaConf.to_container(cfg.agent.kwargs, resolve=True)
    if issubclass(cls, OffPolicyAlgorithm):  # one vec step collects num_envs transitions
        kwargs["gradient_steps"] = max(1, round(cfg.agent.utd * venv.num_envs))
    return cls(policy, venv, seed=cfg.seed, device=device_of(cfg), tensorboard_log=tensorboard_log, verbose=0, **kwargs)


def sb3_replay_path(checkpoint: str | Path) -> Path:
    """Where SB3 saved the replay buffer of ``checkpoint``.

    Args:
        checkpoint: an SB3 ``.zip``.

    Returns:
        ``CheckpointCallback``'s name for it, or ``<stem>_replay_buffer.pkl`` beside ``last.zip``.
    """
    checkpoint = Path(checkpoint)
    m = re.fullmatch(r"(.+)_(\d+)_steps", checkpoint.stem)
    name = f"{m[1]}_replay_buffer_{m[2]}_steps.pkl" if m else f"{checkpoint.stem}_replay_buffer.pkl"
    return checkpoint.with_name(name)


class Evaluations(BaseCallback):
    """What SB3's ``EvalCallback`` cannot do here: the same validation starts at every point,
    one episode per slot of a batched env, the base policy's rate beside the steered one, and
    test points at fixed env steps. Also moves the run's :class:`Progress` bar.

    Args:
        every: env steps between validation points. test_at: env steps of the test points.
        run: records one point, ``run(env_steps, split, milestone)``.
        deadline: when training stops (``time.time()``), or None. progress: the run's bar.
    """

    def __init__(
        self,
        every: int,
        test_at: list[int],
        run: Callable[[int, str, int | None], None],
        deadline: float | None,
        progress: Progress,
    ) -> None:
        super().__init__()
        self.every, self.test_at, self.run, self.deadline = every, sorted(test_at), run, deadline
        self.progress = progress

    def _on_training_start(self) -> None:  # a resumed run keeps the same evaluation grid
        self.next = (self.num_timesteps // self.every + 1) * self.every
        self.last = self.num_timesteps

    def _on_step(self) -> bool:
        self.progress.update(self.num_timesteps)
        if self.num_timesteps >= self.next:
            self.next += self.every
            self.run(self.num_timesteps, "validation", None)
        for m in self.test_at:
            if self.last < m <= self.num_timesteps:
                self.run(self.num_timesteps, "test", m)
        self.last = self.num_timesteps
        return self.deadline is None or time.time() < self.deadline  # False stops learn()


def train(cfg: DictConfig, out: Path, launch: float) -> dict[str, Any]:
    """Train an SB3 algorithm: ``SB3VecEnv``, SB3's own loop and checkpoint callback, the run's bar.

    Args:
        cfg: the run's checked config. out: the run folder. launch: the job's start.

    Returns:
        The run's summary.
    """
    venv = VecMonitor(SB3VecEnv(make_env(cfg, cfg.env.num_envs)))
    eval_env = make_env(cfg, cfg.eval.episodes, autoreset=False)
    splits = {"validation": cfg.eval.episodes, "test": cfg.eval.test_episodes}
    base, base_s = base_evaluation(cfg, splits, eval_env.engine.bufs.deployment)
    stop_at = deadline(cfg, launch, base_s)  # the final evaluation runs the same episodes
    tb = str(out / "tb") if cfg.logger.tensorboard else None
    if cfg.resume:
        model = get_class(cfg.agent._target_).load(cfg.resume, env=venv, device=device_of(cfg))
        if cfg.resume_replay_buffer:  # a pickle: load only files from a trusted place
            model.load_replay_buffer(sb3_replay_path(cfg.resume))
        model.tensorboard_log = tb
    else:
        model = build_agent(cfg, venv, tb)
    venv.seed(train_seed(cfg.seed, cfg.env.num_envs))  # this run's own episode starts (SB3 seeded it with cfg.seed)
    progress = Progress(cfg.total_steps, model.num_timesteps, stop_at)
    log = RunLog(cfg, out, launch, base, progress)

    def run(env_steps: int, split: str, milestone: int | None = None) -> None:
        act = lambda obs: model.predict(obs, deterministic=True)[0]  # noqa: E731
        episodes = cfg.eval.episodes if split == "validation" else cfg.eval.test_episodes
        log.point(env_steps, split, evaluate(eval_env, act, split, episodes), milestone)

    ckpt = out / "checkpoints"
    save_every = max(cfg.eval.every // cfg.env.num_envs, 1)
    callbacks = [
        CheckpointCallback(save_every, str(ckpt), name_prefix="sb3", save_replay_buffer=cfg.save_replay_buffer),
        Evaluations(cfg.eval.every, list(cfg.eval.test_at), run, stop_at, progress),
    ]
    start, remaining = model.num_timesteps, cfg.total_steps - model.num_timesteps
    t0 = time.time()
    if remaining > 0:
        model.learn(remaining, callback=callbacks, reset_num_timesteps=not cfg.resume, tb_log_name="run")
    train_s = time.time() - t0
    progress.close()
    model.save(ckpt / "last.zip")
    if cfg.save_replay_buffer and hasattr(model, "save_replay_buffer"):
        model.save_replay_buffer(sb3_replay_path(ckpt / "last.zip"))
    if not any(p["split"] == "validation" and p["env_steps"] == model.num_timesteps for p in log.curve):
        run(model.num_timesteps, "validation")
    run(model.num_timesteps, "test")
    return log.finish(summarize(cfg, log, model.num_timesteps, train_s, model.num_timesteps - start))
