"""Training agents that steer the frozen VLA: what a Hydra config describes, the evaluation
protocol, the run folder, and ``train(cfg)``, the entry behind ``scripts/train.py`` (kept apart
from ``@hydra.main`` so that tests and notebooks call it directly).

Two learners share all of it: :class:`~flashrt_gym.fast_sac.FastSAC` (``agent=fast_sac``, the
default: on the device, thousands of slots, see :mod:`flashrt_gym.fast_training`) and any
stable-baselines3 algorithm (``agent=sac`` for :class:`~flashrt_gym.graph_sac.GraphSAC`,
``agent=sac_sb3``, ``agent=ppo``), through :class:`~flashrt_gym.sb3.SB3VecEnv`.

Evaluation follows :mod:`flashrt_gym.splits`: the steered policy and the unsteered base policy
run one episode per slot from the same starts; hyper-parameters and checkpoints are chosen on
``validation`` starts (every ``eval.every`` env steps) and results are reported on ``test``
starts (at ``eval.test_at`` and at the end), which no choice sees. Config values are read once,
here, into plain objects; nothing in a training loop looks at the config again.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.utils import get_class, get_method
from omegaconf import DictConfig, OmegaConf
from scipy.stats import binomtest
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback, CheckpointCallback
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.vec_env import VecMonitor
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from flashrt.runtime import atomic_write
from flashrt_gym.devices import resolve_device
from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.evaluation import run_episodes
from flashrt_gym.fast_sac import FastSAC, FastSACConfig
from flashrt_gym.sb3 import SB3VecEnv
from flashrt_gym.splits import eval_seed, train_seed

logger = logging.getLogger(__name__)

SB3_AGENT_KEYS = {"_target_", "policy", "utd", "kwargs"}
FAST_AGENT_KEYS = {"_target_", "kwargs"}

AUTO = {  # key: (fast learner on a GPU, SB3 learner on a GPU, any learner on the CPU); used where a key is `auto`
    "env.num_envs": (2048, 64, 16),
    "total_steps": (10_000_000, 200_000, 100_000),
    "time_limit_s": (540, None, 570),
    "time_limit_includes_eval": (False, False, True),
    "eval.every": (500_000, 10_000, 2_000),
    "eval.episodes": (512, 512, 32),
    "eval.test_episodes": (1024, 1024, 256),
    "agent.kwargs.batch_size": (4096, 256, 256),
    "agent.kwargs.buffer_size": (1 << 20, 200_000, 1 << 14),
}


CPU_NOTE = (
    "CPU-only: this run shows the whole pipeline (the base policy, FastSAC training with validation, "
    "base and steered success on 256 test starts with 95 % intervals) in about 11 minutes on 2 cores, "
    "not steering above the base policy. The VLA costs about 40 ms of CPU time an env step "
    "(docs/training/cpu_budget.json), so the two test evaluations take nearly all of that time and leave "
    "almost no training, while FastSAC passes the base policy only after about 1.5 M env "
    "steps (README, Result, on a GPU)."
)
"""The first log line of a run on the CPU: what such a run shows, and why (measured)."""


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def _require(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config key '{key}': {msg}")


def device_of(cfg: DictConfig) -> str:
    """``runtime.device`` with ``auto`` resolved (:func:`flashrt_gym.devices.resolve_device`)."""
    try:
        return resolve_device(cfg.runtime.device).type
    except ValueError as e:
        raise ConfigError(f"config key 'runtime.device': {e}") from e


def agent_class(cfg: DictConfig) -> type:
    try:
        return get_class(cfg.agent._target_)
    except Exception as e:
        raise ConfigError(f"config key 'agent._target_': cannot import {cfg.agent._target_!r} ({e})") from e


def is_fast(cfg: DictConfig) -> bool:
    """Whether ``cfg.agent`` is the device-resident learner (else an SB3 algorithm)."""
    return issubclass(agent_class(cfg), FastSAC)


def resolve_budget(cfg: DictConfig) -> None:
    """Replace ``auto`` values of :data:`AUTO`'s keys by the default for this learner and device, in place."""
    column = 2 if device_of(cfg) == "cpu" else (0 if is_fast(cfg) else 1)
    for key, values in AUTO.items():
        if OmegaConf.select(cfg, key) == "auto":
            OmegaConf.update(cfg, key, values[column])


def check(cfg: DictConfig) -> None:
    """Fail early, naming the key, on values that cannot work (resolves the ``auto`` budgets)."""
    _require(cfg.runtime.device in ("auto", "cpu", "cuda"), "runtime.device", "must be auto, cpu or cuda")
    cls = agent_class(cfg)
    resolve_budget(cfg)
    for key in ("env.num_envs", "total_steps", "eval.every", "eval.episodes", "eval.test_episodes"):
        value = OmegaConf.select(cfg, key)
        _require(isinstance(value, int) and value > 0, key, f"must be an int > 0 or auto, got {value!r}")
    limit = cfg.time_limit_s
    _require(limit is None or (isinstance(limit, (int, float)) and limit > 0), "time_limit_s", "must be > 0 or null")
    _require(isinstance(cfg.time_limit_includes_eval, bool), "time_limit_includes_eval", "must be true, false or auto")
    _require(
        cfg.eval.test_episodes % cfg.eval.episodes == 0,
        "eval.test_episodes",
        f"must be a multiple of eval.episodes ({cfg.eval.episodes}: the evaluation env's slots)",
    )
    _require(all(isinstance(s, int) and s > 0 for s in cfg.eval.test_at), "eval.test_at", "must list env steps > 0")
    for split, key in (("validation", "eval.episodes"), ("test", "eval.test_episodes")):
        try:
            eval_seed(split, OmegaConf.select(cfg, key))
        except ValueError as e:
            raise ConfigError(f"config key '{key}': {e}") from e
    try:
        train_seed(cfg.seed, cfg.env.num_envs)
    except ValueError as e:
        raise ConfigError(f"config key 'seed' / 'env.num_envs': {e}") from e
    if issubclass(cls, FastSAC):
        extra = set(cfg.agent) - FAST_AGENT_KEYS
        _require(not extra, "agent", f"unknown keys {sorted(extra)}; FastSAC's arguments go under agent.kwargs")
        names = {f.name for f in fields(FastSACConfig)}
        unknown = set(cfg.agent.kwargs) - names
        _require(not unknown, "agent.kwargs", f"unknown keys {sorted(unknown)}; FastSAC takes {sorted(names)}")
        try:
            FastSACConfig(**OmegaConf.to_container(cfg.agent.kwargs, resolve=True))
        except ValueError as e:
            raise ConfigError(f"config key 'agent.kwargs': {e}") from e
        _require(cfg.env.obs_mode in ("state", "features"), "env.obs_mode", "FastSAC needs a flat observation")
    else:
        extra = set(cfg.agent) - SB3_AGENT_KEYS
        _require(not extra, "agent", f"unknown keys {sorted(extra)}; put algorithm arguments under agent.kwargs")
        _require(issubclass(cls, BaseAlgorithm), "agent._target_", f"{cfg.agent._target_} is not an SB3 algorithm")
        _require(cfg.agent.utd > 0, "agent.utd", f"must be > 0, got {cfg.agent.utd}")
        if "." in cfg.agent.policy:
            try:
                get_class(cfg.agent.policy)
            except Exception as e:
                raise ConfigError(f"config key 'agent.policy': cannot import {cfg.agent.policy!r} ({e})") from e
    if cfg.resume:
        _require(Path(cfg.resume).is_file(), "resume", f"no checkpoint file at {cfg.resume}")


def task_kwargs(task: dict[str, Any]) -> dict[str, Any]:
    """The env's keyword for a ``task`` config group: ``simulator=`` (its factory, given the rest of
    the group) for a task with a simulator of its own (``task=mujoco_push``), else ``task=`` (the
    built-in tabletop's fields)."""
    task = dict(task)
    if "simulator" in task:
        factory = get_method(task.pop("simulator"))
        return {"simulator": functools.partial(factory, **task)}
    return {"task": task}


def make_env(
    cfg: DictConfig,
    num_envs: int,
    *,
    autoreset: bool = True,
    action_mode: str | None = None,
    device: str | None = None,
    render_mode: str | None = None,
) -> FlashRTVectorEnv:
    """The env of ``cfg`` (``env``, ``task``, ``policy`` and ``runtime`` groups) with ``num_envs`` slots."""
    env_cfg = OmegaConf.to_container(cfg.env, resolve=True)
    env_cfg.pop("num_envs")
    if action_mode is not None:
        env_cfg["action_mode"] = action_mode
    env_cfg |= task_kwargs(OmegaConf.to_container(cfg.task, resolve=True))
    return FlashRTVectorEnv(
        num_envs,
        weights=cfg.policy.weights,
        device=device or device_of(cfg),
        graphs=cfg.runtime.graphs,
        autoreset=autoreset,
        render_mode=render_mode,
        **env_cfg,
    )


# -- evaluation ---------------------------------------------------------------------------------
@dataclass
class EvalResult:
    success: float
    mean_return: float
    episodes: int


def evaluate(env: FlashRTVectorEnv, act: Callable[[np.ndarray], np.ndarray], split: str, episodes: int) -> EvalResult:
    """``episodes`` episodes of ``split``'s starts, one per slot of ``env`` (built with
    ``autoreset=False``; ``episodes`` a multiple of its slots), in batches of
    :func:`flashrt_gym.evaluation.run_episodes`: success rate and mean return."""
    n = env.num_envs
    if episodes % n:
        raise ValueError(f"episodes ({episodes}) must be a multiple of the evaluation env's slots ({n})")
    first = eval_seed(split, episodes)
    horizon = env.step_config.max_episode_steps
    batches = []
    # env steps (slot-chunks) at most: every slot of a batch steps until the batch's last episode ends
    with tqdm(total=episodes * horizon, desc=f"{split}, {episodes} episodes", unit="env step", leave=False) as bar:

        def counted(obs: np.ndarray) -> np.ndarray:
            bar.update(n)
            return act(obs)

        for i, start in enumerate(range(first, first + episodes, n)):
            batches.append(run_episodes(env, counted, start))
            bar.update((i + 1) * n * horizon - bar.n)  # a batch whose episodes all ended early
    return EvalResult(
        sum(b.success for b in batches) / len(batches), sum(b.mean_return for b in batches) / len(batches), episodes
    )


def torch_policy(
    act: Callable[[torch.Tensor], torch.Tensor], device: torch.device
) -> Callable[[np.ndarray], np.ndarray]:
    """A NumPy policy for :func:`evaluate` from one on device tensors."""
    return lambda obs: act(torch.tensor(obs, device=device)).cpu().numpy()


def evaluate_base(cfg: DictConfig, splits: dict[str, int], device: str | None = None) -> dict[str, EvalResult]:
    """The unsteered VLA (its own per-slot noise, no correction) on each split's episodes."""
    logger.info("base policy: evaluating on %s", ", ".join(f"{n} {split} starts" for split, n in splits.items()))
    env = make_env(cfg, cfg.eval.episodes, autoreset=False, action_mode="residual", device=device)
    zeros = np.zeros((env.num_envs, *env.single_action_space.shape), np.float32)
    out = {split: evaluate(env, lambda _: zeros, split, episodes) for split, episodes in splits.items()}
    env.close()
    return out


def success_interval(success: float, episodes: int) -> tuple[float, float]:
    """The Wilson score 95 % interval of a success rate over independent episodes.

    Args:
        success: the rate observed (successes / episodes).
        episodes: how many episodes it is over.

    Returns:
        ``(low, high)``, the interval's bounds as rates.
    """
    ci = binomtest(round(success * episodes), episodes).proportion_ci(0.95, method="wilson")
    return float(ci.low), float(ci.high)


class Progress:
    """The training loop's tqdm bar over env steps: env steps/s, the ETA and the last validation
    success. Under a time limit the bar's total is the env steps the measured rate reaches by the
    deadline (at most the step budget), so the ETA is the real one."""

    def __init__(self, total: int, initial: int, stop_at: float | None, disable: bool = False) -> None:
        self.total, self.initial, self.stop_at = total, initial, stop_at
        self.t0 = time.time()
        self.bar = tqdm(
            total=total, initial=initial, desc="train", unit="env step", unit_scale=True, disable=disable, smoothing=0.1
        )

    def update(self, env_steps: int) -> None:
        """Move the bar to ``env_steps`` (all ranks together)."""
        now = time.time()
        if self.stop_at is not None and env_steps > self.initial and now > self.t0:
            rate = (env_steps - self.initial) / (now - self.t0)
            self.bar.total = min(self.total, int(env_steps + rate * max(self.stop_at - now, 0.0)))
        self.bar.update(env_steps - self.bar.n)

    def validated(self, success: float) -> None:
        """Show ``success``, the latest validation point's rate, beside the rate and ETA."""
        self.bar.set_postfix(validation=f"{success:.1%}")

    def close(self) -> None:
        """End the bar (before the final evaluation, which shows its own)."""
        self.bar.close()


# -- the run folder -----------------------------------------------------------------------------
class RunLog:
    """One run's record on disk: ``curve.json`` (validation points, and test points marked as
    such), tensorboard scalars under ``tb/``, and at the end ``curve.png`` and ``summary.json``.
    A resumed run continues its curve; ``progress``, when given, shows each validation figure.
    ``launch``: the job's start (``time.time()``), from which every ``wall_s`` counts."""

    def __init__(
        self, cfg: DictConfig, out: Path, launch: float, base: dict[str, EvalResult], progress: Progress | None = None
    ) -> None:
        self.cfg, self.out, self.launch, self.base, self.progress = cfg, out, launch, base, progress
        self.curve: list[dict[str, Any]] = []
        if (out / "curve.json").is_file():
            self.curve = json.loads((out / "curve.json").read_text())
        self.tb = None
        if cfg.logger.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tb"))

    def scalars(self, env_steps: int, values: dict[str, float]) -> None:
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, env_steps)

    def point(self, env_steps: int, split: str, res: EvalResult, milestone: int | None = None) -> dict[str, Any]:
        """Record one evaluation (``split`` is ``validation`` or ``test``; ``milestone``: the
        ``eval.test_at`` entry that this point is the first evaluation past)."""
        base = self.base[split]
        p = {
            "env_steps": int(env_steps),
            "split": split,
            "success": res.success,
            "return": res.mean_return,
            "base_success": base.success,
            "base_return": base.mean_return,
            "episodes": res.episodes,
            "wall_s": time.time() - self.launch,
        }
        if milestone is not None:
            p["milestone"] = int(milestone)
        self.curve.append(p)
        tag = "eval" if split == "validation" else "test"
        self.scalars(env_steps, {f"{tag}/success": res.success, f"{tag}/return": res.mean_return})
        text = json.dumps(self.curve, indent=1)
        atomic_write(self.out / "curve.json", lambda f: f.write(text.encode()))
        if self.progress is not None and split == "validation":
            self.progress.validated(res.success)
        logger.info(
            "[%d env steps, %.0f s] %s success %.1f%% (base %.1f%%) on %d starts",
            env_steps, p["wall_s"], split, 100 * res.success, 100 * base.success, res.episodes,
        )  # fmt: skip
        return p

    def finish(self, summary: dict[str, Any]) -> dict[str, Any]:
        text = json.dumps(summary, indent=2)
        atomic_write(self.out / "summary.json", lambda f: f.write(text.encode()))
        plot_curve(self.curve, self.out / "curve.png", f"{summary['agent'].rsplit('.', 1)[-1]}, seed {summary['seed']}")
        if self.tb is not None:
            self.tb.close()
        (lo, hi), (base_lo, base_hi) = summary["success_ci95"], summary["base_success_ci95"]
        logger.info(
            "base policy success %.1f%% [%.1f, %.1f] -> steered %.1f%% [%.1f, %.1f] on %d test starts "
            "(Wilson 95%% intervals) after %d env steps (%.1f env steps/s), %.0f s",
            100 * summary["base_success"], 100 * base_lo, 100 * base_hi, 100 * summary["success"], 100 * lo,
            100 * hi, summary["test_episodes"], summary["env_steps"], summary["env_steps_per_s"], summary["wall_s"],
        )  # fmt: skip
        return summary


def plot_curve(curve: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    val = [p for p in curve if p["split"] == "validation"]
    test = [p for p in curve if p["split"] == "test"]
    ax.plot([p["env_steps"] for p in val], [p["success"] for p in val], marker="o", label="steered (validation)")
    ax.plot([p["env_steps"] for p in val], [p["base_success"] for p in val], linestyle="--", label="base policy")
    if test:
        steps = [p["env_steps"] for p in test]
        ax.plot(steps, [p["success"] for p in test], "k*", ms=10, label="steered (test)")
        ax.plot(steps, [p["base_success"] for p in test], "kx", ms=8, label="base policy (test)")
    ax.set(xlabel="env steps (chunks)", ylabel="success rate", ylim=(0, 1), title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def deadline(cfg: DictConfig, launch: float, final_eval_s: float = 0.0) -> float | None:
    """When training stops at the latest (``time.time()``), or None. With
    ``time_limit_includes_eval`` it stops ``final_eval_s`` earlier (the seconds the base
    policy's evaluation of the same episodes took), so that the final evaluation also ends
    within ``time_limit_s``."""
    if cfg.time_limit_s is None:
        return None
    return launch + cfg.time_limit_s - (final_eval_s if cfg.time_limit_includes_eval else 0.0)


def summarize(
    cfg: DictConfig, log: RunLog, env_steps: int, train_s: float, steps_trained: int, **extra: Any
) -> dict[str, Any]:
    """The summary of a finished run: the last test point is the headline."""
    test = [p for p in log.curve if p["split"] == "test"]
    final = test[-1]
    at = {str(p.get("milestone", p["env_steps"])): p["success"] for p in test}
    val = [p for p in log.curve if p["split"] == "validation"]
    return {
        "agent": cfg.agent._target_,
        "seed": cfg.seed,
        "env_steps": int(env_steps),
        "num_envs": cfg.env.num_envs,
        "base_success": final["base_success"],
        "success": final["success"],
        "base_return": final["base_return"],
        "return": final["return"],
        "test_episodes": final["episodes"],
        "success_ci95": success_interval(final["success"], final["episodes"]),
        "base_success_ci95": success_interval(final["base_success"], final["episodes"]),
        "test_success_at": at,
        "validation_success": val[-1]["success"] if val else None,
        "wall_s": time.time() - log.launch,
        "process_cpu_s": time.process_time(),  # every thread's CPU time: with wall_s, how loaded the machine was
        "train_seconds": train_s,
        "env_steps_per_s": steps_trained / train_s if train_s > 0 else 0.0,  # training, validation included
        "env_steps_per_s_from_launch": steps_trained / max(time.time() - log.launch, 1e-9),
        "first_wall_s_validation_90": next((p["wall_s"] for p in val if p["success"] >= 0.9), None),
        "device": device_of(cfg),
        **extra,
    }


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
        if is_fast(cfg):
            from flashrt_gym.fast_training import train_fast

            return train_fast(cfg, out, launch)
        return train_sb3(cfg, out, launch)


# -- the SB3 path -------------------------------------------------------------------------------
def build_agent(cfg: DictConfig, venv: Any, tensorboard_log: str | None) -> BaseAlgorithm:
    """The SB3 algorithm of ``cfg.agent``: ``_target_`` class, ``policy``, ``kwargs``, and ``utd``
    (gradient updates per collected transition, for off-policy agents)."""
    cls = get_class(cfg.agent._target_)
    policy = get_class(cfg.agent.policy) if "." in cfg.agent.policy else cfg.agent.policy  # a class, or SB3's alias
    kwargs = OmegaConf.to_container(cfg.agent.kwargs, resolve=True)
    if issubclass(cls, OffPolicyAlgorithm):  # one vec step collects num_envs transitions
        kwargs["gradient_steps"] = max(1, round(cfg.agent.utd * venv.num_envs))
    return cls(policy, venv, seed=cfg.seed, device=device_of(cfg), tensorboard_log=tensorboard_log, verbose=0, **kwargs)


def sb3_replay_path(checkpoint: str | Path) -> Path:
    """Where SB3 saved the replay buffer of ``checkpoint`` (``CheckpointCallback``'s naming, or
    ``<stem>_replay_buffer.pkl`` beside ``last.zip``)."""
    checkpoint = Path(checkpoint)
    m = re.fullmatch(r"(.+)_(\d+)_steps", checkpoint.stem)
    name = f"{m[1]}_replay_buffer_{m[2]}_steps.pkl" if m else f"{checkpoint.stem}_replay_buffer.pkl"
    return checkpoint.with_name(name)


class Evaluations(BaseCallback):
    """What SB3's ``EvalCallback`` cannot do here: the same validation starts at every point,
    one episode per slot of a batched env, the base policy's rate beside the steered one, and
    test points at fixed env steps. Also moves the run's :class:`Progress` bar."""

    def __init__(
        self,
        every: int,
        test_at: list[int],
        run: Callable[[int, str], None],
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


def train_sb3(cfg: DictConfig, out: Path, launch: float) -> dict[str, Any]:
    """The SB3 path: ``SB3VecEnv``, SB3's own loop and checkpoint callback, this module's progress bar."""
    venv = VecMonitor(SB3VecEnv(make_env(cfg, cfg.env.num_envs)))
    eval_env = make_env(cfg, cfg.eval.episodes, autoreset=False)
    t = time.time()
    base = evaluate_base(cfg, {"validation": cfg.eval.episodes, "test": cfg.eval.test_episodes})
    stop_at = deadline(cfg, launch, time.time() - t)  # the final evaluation runs the same episodes
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
