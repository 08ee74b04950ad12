"""What a training config describes, read once: checks that name the failing key, the ``auto``
budgets filled in, and the envs a config builds (the training env, the evaluation env, the base
policy's evaluation). Nothing in a training loop looks at the config again after this.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from hydra.utils import get_class, get_method
from omegaconf import DictConfig, OmegaConf

from flashrt.runtime import atomic_write
from flashrt_gym.devices import resolve_device
from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.evaluation import EvalResult, evaluate
from flashrt_gym.splits import eval_seed, train_seed

logger = logging.getLogger(__name__)

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


def require(cond: bool, key: str, msg: str) -> None:
    """Refuse a config value.

    Args:
        cond: whether the value can work. key: its dotted config key. msg: what is wrong and the fix.

    Raises:
        ConfigError: ``cond`` is false; the message names ``key``.
    """
    if not cond:
        raise ConfigError(f"config key '{key}': {msg}")


def device_of(cfg: DictConfig) -> str:
    """``runtime.device`` with ``auto`` resolved (:func:`flashrt_gym.devices.resolve_device`).

    Args:
        cfg: a composed training config.

    Returns:
        ``"cpu"`` or ``"cuda"``.

    Raises:
        ConfigError: the device cannot be used here.
    """
    try:
        return resolve_device(cfg.runtime.device).type
    except ValueError as e:
        raise ConfigError(f"config key 'runtime.device': {e}") from e


def agent_class(cfg: DictConfig) -> type:
    """The class ``agent._target_`` names.

    Args:
        cfg: a composed training config.

    Returns:
        The class, imported.

    Raises:
        ConfigError: it cannot be imported.
    """
    try:
        return get_class(cfg.agent._target_)
    except Exception as e:
        raise ConfigError(f"config key 'agent._target_': cannot import {cfg.agent._target_!r} ({e})") from e


def resolve_budget(cfg: DictConfig, budget: Mapping[str, Any]) -> None:
    """Replace ``auto`` values of ``budget``'s keys by its values, in place.

    Args:
        cfg: a composed training config.
        budget: dotted config keys to values (the learner's budget for the run's device).
    """
    for key, value in budget.items():
        if OmegaConf.select(cfg, key) == "auto":
            OmegaConf.update(cfg, key, value)


def check_run(cfg: DictConfig) -> None:
    """Fail early, naming the key, on run values (budgets, time limit, evaluation, seed) that
    cannot work; the agent's own values are its loop's to check.

    Args:
        cfg: a composed training config whose budgets are resolved.

    Raises:
        ConfigError: a value that cannot work (or an ``auto`` no budget filled), naming its key.
    """
    for key in ("env.num_envs", "total_steps", "eval.every", "eval.episodes", "eval.test_episodes"):
        value = OmegaConf.select(cfg, key)
        require(isinstance(value, int) and value > 0, key, f"must be an int > 0 or auto, got {value!r}")
    limit = cfg.time_limit_s
    require(limit is None or (isinstance(limit, (int, float)) and limit > 0), "time_limit_s", "must be > 0 or null")
    require(isinstance(cfg.time_limit_includes_eval, bool), "time_limit_includes_eval", "must be true, false or auto")
    base = cfg.get("base_eval")
    require(base is None or isinstance(base, str), "base_eval", f"must be a file path or null, got {base!r}")
    require(
        cfg.eval.test_episodes % cfg.eval.episodes == 0,
        "eval.test_episodes",
        f"must be a multiple of eval.episodes ({cfg.eval.episodes}: the evaluation env's slots)",
    )
    require(all(isinstance(s, int) and s > 0 for s in cfg.eval.test_at), "eval.test_at", "must list env steps > 0")
    for split, key in (("validation", "eval.episodes"), ("test", "eval.test_episodes")):
        try:
            eval_seed(split, OmegaConf.select(cfg, key))
        except ValueError as e:
            raise ConfigError(f"config key '{key}': {e}") from e
    try:
        train_seed(cfg.seed, cfg.env.num_envs)
    except ValueError as e:
        raise ConfigError(f"config key 'seed' / 'env.num_envs': {e}") from e


def task_kwargs(task: dict[str, Any]) -> dict[str, Any]:
    """The env's keyword for a ``task`` config group.

    Args:
        task: the group as a plain dict.

    Returns:
        ``{"simulator": factory}`` (its factory, given the rest of the group) for a task with a
        simulator of its own (``task=mujoco_push``), else ``{"task": fields}`` (the built-in
        tabletop's fields).
    """
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
    """The env of ``cfg`` (``env``, ``task``, ``policy`` and ``runtime`` groups).

    Args:
        cfg: a composed training config.
        num_envs: its slots.
        autoreset: as :class:`~flashrt_gym.FlashRTVectorEnv`'s (False for evaluation).
        action_mode: overrides ``env.action_mode`` (``"residual"``: the base policy).
        device: overrides ``runtime.device``.
        render_mode: as the env's.

    Returns:
        The env.
    """
    env_cfg = OmegaConf.to_container(cfg.env, resolve=True)
    env_cfg.pop("num_envs")
    if action_mode is not None:
        env_cfg["action_mode"] = action_mode
    env_cfg |= task_kwargs(OmegaConf.to_container(cfg.task, resolve=True))
    return FlashRTVectorEnv(
        num_envs,
        weights=cfg.policy.weights,
        precision=cfg.policy.precision,
        device=device or device_of(cfg),
        graphs=cfg.runtime.graphs,
        autoreset=autoreset,
        render_mode=render_mode,
        **env_cfg,
    )


def evaluate_base(
    cfg: DictConfig, splits: dict[str, int], device: str | None = None, env: FlashRTVectorEnv | None = None
) -> dict[str, EvalResult]:
    """The unsteered VLA (its own per-slot noise, no correction) on each split's episodes.

    Args:
        cfg: a composed training config.
        splits: split name to its episodes.
        device: overrides ``runtime.device``.
        env: an env of ``make_env(cfg, cfg.eval.episodes, autoreset=False, action_mode="residual")``
            to evaluate in (left open); None: one is made and closed.

    Returns:
        Split name to its result.
    """
    logger.info("base policy: evaluating on %s", ", ".join(f"{n} {split} starts" for split, n in splits.items()))
    own = env is None
    if env is None:
        env = make_env(cfg, cfg.eval.episodes, autoreset=False, action_mode="residual", device=device)
    zeros = np.zeros((env.num_envs, *env.single_action_space.shape), np.float32)
    out = {split: evaluate(env, lambda _: zeros, split, episodes) for split, episodes in splits.items()}
    if own:
        env.close()
    return out


BASE_FILE_VERSION = 1
"""The layout of a ``base_eval`` file; another is refused."""


def base_identity(cfg: DictConfig, splits: dict[str, int], deployment: str, device: str | None = None) -> dict:
    """Everything the base policy's evaluation depends on, as a ``base_eval`` file records it.

    The env, task and policy groups as configured, less what gives the same bytes whatever its
    value (``task.processes`` and ``task.threads``: tested so) or what the base evaluation
    overrides (``env.num_envs``, ``env.action_mode``: it runs ``cfg.eval.episodes`` slots in residual
    mode with no correction), so the runs of one job that differ only in seed or action mode share
    one evaluation; the env's deployment digest (weights checksum, simulator identity, episode
    length); the graphs switch, the device type and each split's episodes.

    Args:
        cfg: a composed training config.
        splits: split name to its episodes.
        deployment: the deployment digest of an env of ``cfg`` (its ``engine.bufs.deployment``).
        device: overrides ``runtime.device``.

    Returns:
        A JSON-able dict.
    """
    env = OmegaConf.to_container(cfg.env, resolve=True)
    task = OmegaConf.to_container(cfg.task, resolve=True)
    for part, keys in ((env, ("num_envs", "action_mode")), (task, ("processes", "threads"))):
        for key in keys:
            part.pop(key, None)
    return {
        "version": BASE_FILE_VERSION,
        "deployment": deployment,
        "env": env,
        "task": task,
        "policy": OmegaConf.to_container(cfg.policy, resolve=True),
        "graphs": cfg.runtime.graphs,
        "device": resolve_device(device or cfg.runtime.device).type,
        "eval_slots": cfg.eval.episodes,
        "splits": dict(splits),
    }


def _read_base(path: Path, identity: dict) -> tuple[dict[str, EvalResult], float]:
    """A ``base_eval`` file's results and seconds, if it holds the evaluation ``identity`` names."""
    try:
        record = json.loads(path.read_text())
        held = record["identity"]
        if not isinstance(held, dict):
            raise TypeError(f"its identity is a {type(held).__name__}, not a mapping")
        results = {
            split: EvalResult(
                r["success"], r["mean_return"], r["episodes"], {k: (v[0], v[1]) for k, v in r["by_instruction"].items()}
            )
            for split, r in record["results"].items()
        }
        seconds = float(record["seconds"])
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ConfigError(
            f"config key 'base_eval': {path} is not a base evaluation file ({type(e).__name__}: {e}); "
            "delete it to evaluate the base policy again"
        ) from e
    if held != identity or set(results) != set(identity["splits"]):
        differs = sorted(k for k in identity.keys() | held.keys() if held.get(k) != identity.get(k)) or ["splits"]
        raise ConfigError(
            f"config key 'base_eval': {path} holds the base policy's evaluation under another "
            f"configuration (it differs in: {', '.join(differs)}); delete it to evaluate again, or name "
            "the file written for this one"
        )
    return results, seconds


def base_evaluation(
    cfg: DictConfig,
    splits: dict[str, int],
    deployment: str,
    device: str | None = None,
    env: FlashRTVectorEnv | None = None,
) -> tuple[dict[str, EvalResult], float]:
    """The base policy's evaluation (:func:`evaluate_base`), run once for the runs that share it.

    With ``base_eval`` null it runs here. With ``base_eval`` naming a file, it is read from that
    file when the file holds this same evaluation (:func:`base_identity`), else run here and
    written there (atomically). Why: every seed of a job, and both action modes, evaluate the same
    base policy on the same starts, and on Meta-World's CPU physics that is a large part of a short
    run's time limit (README, Meta-World), so ``scripts/metaworld_main.sh`` evaluates it once on
    all the cores and its runs read it.

    Args:
        cfg: a composed training config.
        splits: split name to its episodes.
        deployment: the deployment digest of an env of ``cfg`` (its ``engine.bufs.deployment``).
        device: overrides ``runtime.device``.
        env: as :func:`evaluate_base`'s.

    Returns:
        Split name to its result, and the seconds the evaluation took where it ran (the file's
        record when read: the final evaluation's estimate for ``time_limit_includes_eval``).

    Raises:
        ConfigError: ``base_eval`` names a file of another evaluation, or one that is not a
            base evaluation file.
    """
    path = Path(cfg.base_eval) if cfg.get("base_eval") else None
    identity = base_identity(cfg, splits, deployment, device)
    if path is not None and path.is_file():
        results, seconds = _read_base(path, identity)
        logger.info("base policy: read from %s (evaluated in %.0f s)", path, seconds)
        return results, seconds
    t = time.time()
    results = evaluate_base(cfg, splits, device, env)
    seconds = time.time() - t
    if path is not None:
        record = {
            "identity": identity,
            "seconds": seconds,
            "results": {
                split: {
                    "success": float(r.success),
                    "mean_return": float(r.mean_return),
                    "episodes": int(r.episodes),
                    "by_instruction": {k: list(v) for k, v in r.by_instruction.items()},
                }
                for split, r in results.items()
            },
        }
        atomic_write(path, lambda f: f.write((json.dumps(record, indent=1) + "\n").encode()))
    return results, seconds
