"""Training agents that steer the frozen VLA: ``train(cfg)``, the entry behind ``flashrt-train``
and ``scripts/train.py`` (kept apart from ``@hydra.main`` so that tests and notebooks call it).

The agent config's ``_target_`` picks the training loop from :data:`LOOPS`: a device learner
(:class:`flashrt_gym.learners.Learner`, ``agent=fast_sac``, the default) runs
:mod:`~flashrt_gym.training.device_loop`; a stable-baselines3 algorithm (``agent=sac``,
``agent=sac_sb3``, ``agent=ppo``) runs :mod:`~flashrt_gym.training.sb3_loop`. Both share
:mod:`~flashrt_gym.training.setup` (config checks, ``auto`` budgets, the envs) and
:mod:`~flashrt_gym.training.runlog` (the run folder, the summary).

Evaluation follows :mod:`flashrt_gym.splits`: the steered policy and the unsteered base policy
run one episode per slot from the same starts; hyper-parameters and checkpoints are chosen on
``validation`` starts (every ``eval.every`` env steps) and results are reported on ``test``
starts (at ``eval.test_at`` and at the end), which no choice sees.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.contrib.logging import logging_redirect_tqdm

from flashrt.runtime import atomic_write
from flashrt_gym.deprecated import moved_names
from flashrt_gym.learners import MEMBERS
from flashrt_gym.training import device_loop, sb3_loop
from flashrt_gym.training.setup import (
    CPU_NOTE,
    ConfigError,
    agent_class,
    check_run,
    device_of,
    make_env,
    require,
    resolve_budget,
    task_kwargs,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Loop:
    """A training loop and what it knows of the agents it runs.

    Args:
        accepts: whether it runs an agent class.
        budget: the ``auto`` values of a run of an agent class on a device (``"cpu"``, ``"cuda"``).
        check: fails early, with a :class:`ConfigError`, on an agent config it cannot run.
        run: the loop, ``run(cfg, out, launch) -> summary``.
    """

    accepts: Callable[[type], bool]
    budget: Callable[[type, str], Mapping[str, Any]]
    check: Callable[[DictConfig, type], None]
    run: Callable[[DictConfig, Path, float], dict[str, Any]]


LOOPS: dict[str, Loop] = {
    "device": Loop(device_loop.accepts, device_loop.budget, device_loop.check_agent, device_loop.train),
    "sb3": Loop(sb3_loop.accepts, sb3_loop.budget, sb3_loop.check_agent, sb3_loop.train),
}
"""The training loops by name, asked in order which one runs an agent config's class."""


def loop_of(cfg: DictConfig) -> str:
    """The name of the loop in :data:`LOOPS` that runs ``cfg.agent``.

    Args:
        cfg: a composed training config.

    Returns:
        A key of :data:`LOOPS`.

    Raises:
        ConfigError: ``agent._target_`` cannot be imported, or no loop runs its class.
    """
    cls = agent_class(cfg)
    for name, loop in LOOPS.items():
        if loop.accepts(cls):
            return name
    raise ConfigError(
        f"config key 'agent._target_': {cfg.agent._target_} is neither a stable-baselines3 algorithm nor a "
        f"learner (flashrt_gym.learners.Learner: it defines {', '.join(MEMBERS)})"
    )


def check(cfg: DictConfig) -> None:
    """Fail early, naming the key, on values that cannot work; resolves the ``auto`` budgets in place.

    Args:
        cfg: a composed training config.

    Raises:
        ConfigError: a config value that cannot work, naming its key.
    """
    require(cfg.runtime.device in ("auto", "cpu", "cuda"), "runtime.device", "must be auto, cpu or cuda")
    device = device_of(cfg)
    loop, cls = LOOPS[loop_of(cfg)], agent_class(cfg)
    resolve_budget(cfg, loop.budget(cls, device))
    check_run(cfg)
    loop.check(cfg, cls)
    if cfg.resume:
        require(Path(cfg.resume).is_file(), "resume", f"no checkpoint file at {cfg.resume}")


def train(cfg: DictConfig, out: str | Path = ".", launch: float | None = None) -> dict[str, Any]:
    """Train ``cfg.agent`` on FlashRT-VLA and record the run under ``out``.

    Writes ``config.yaml``, checkpoints, ``tb/``, ``curve.json``, ``curve.png`` and
    ``summary.json``; logs (module loggers: Hydra's ``train.log``) every evaluation and, at
    the end, base against steered success on the test starts with their intervals; shows a
    progress bar while training.

    Args:
        cfg: the composed ``configs/train.yaml`` (its ``auto`` values are resolved in place).
        out: the run folder.
        launch: the job's start (``time.time()``), from which ``time_limit_s`` and every
            ``wall_s`` count; None: now. A process that runs several jobs (a sequential
            multirun) passes each job's own start.

    Returns:
        The run's summary (also ``summary.json``).

    Raises:
        ConfigError: a config value that cannot work, naming its key.
    """
    launch = time.time() if launch is None else launch
    check(cfg)  # also resolves the auto budgets
    if device_of(cfg) == "cpu":
        logger.warning(CPU_NOTE)
    torch.set_float32_matmul_precision("high")  # the agent's float32 GEMMs on tensor cores (TF32)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = OmegaConf.to_yaml(cfg, resolve=True)
    atomic_write(out / "config.yaml", lambda f: f.write(text.encode()))
    logger.info(
        "%s on %s: %d slots, %d env steps at most, time limit %s; run folder %s",
        cfg.agent._target_.rsplit(".", 1)[-1], device_of(cfg), cfg.env.num_envs, cfg.total_steps,
        "none" if cfg.time_limit_s is None else f"{cfg.time_limit_s} s", out.resolve(),
    )  # fmt: skip
    with logging_redirect_tqdm():  # log lines above the progress bar, not through it
        return LOOPS[loop_of(cfg)].run(cfg, out, launch)


__getattr__ = moved_names(
    __name__,
    {
        **dict.fromkeys(("EvalResult", "evaluate", "torch_policy"), "flashrt_gym.evaluation"),
        **dict.fromkeys(("evaluate_base",), "flashrt_gym.training.setup"),
        **dict.fromkeys(
            ("Progress", "RunLog", "deadline", "plot_curve", "success_interval", "summarize"),
            "flashrt_gym.training.runlog",
        ),
        **dict.fromkeys(("Evaluations", "build_agent", "sb3_replay_path"), "flashrt_gym.training.sb3_loop"),
    },
)

__all__ = ["LOOPS", "ConfigError", "Loop", "check", "device_of", "loop_of", "make_env", "task_kwargs", "train"]
