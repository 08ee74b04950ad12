"""The training loop of a device learner (:class:`~flashrt_gym.learners.Learner`, ``agent=fast_sac``
the default): one process, or data-parallel under ``torchrun``.

Each env step the loop acts on device tensors, steps every slot with ``env.step_torch``, hands
the transitions to the learner and runs its update: no NumPy, no host copy of a transition, no
read-back (the env's own guard check aside). Host reads happen only at evaluation points and at
the time-limit checks every :data:`CHECK_EVERY` env steps.

Data parallel (``torchrun --nproc_per_node K scripts/train.py ...``): rank ``r`` owns
``env.num_envs / K`` slots (the next block of the run's seeds, :func:`flashrt_gym.splits.train_seed`),
its replay shard (``buffer_size / K``) and a model replica; each gradient step samples
``batch_size / K`` rows per rank and averages the gradients over the ranks (NCCL on GPUs, gloo on
the CPU), so every replica stays identical. Rank 0 evaluates, logs and saves; every rank saves its
own replay shard when asked. On shared GPU hosts keep NVLink multicast off
(``NCCL_NVLS_ENABLE=0``): a collective that uses it can take the host's GPUs out of service.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from flashrt_gym.evaluation import evaluate, torch_policy
from flashrt_gym.learners import Learner, missing_members
from flashrt_gym.splits import train_seed
from flashrt_gym.training.runlog import Progress, RunLog, deadline, summarize
from flashrt_gym.training.setup import ConfigError, base_evaluation, device_of, make_env, require

AGENT_KEYS = {"_target_", "kwargs"}
"""The keys of a device learner's agent config."""

CHECK_EVERY = 16
"""Env steps between time-limit checks on a GPU (under data parallelism, rank 0 decides and broadcasts)."""


def init_distributed() -> tuple[int, int, int, bool]:
    """``(rank, world_size, local_rank, created)`` from torchrun's environment; initialises the
    default process group when there are several ranks and none exists (NCCL on CUDA, gloo
    otherwise; ``created`` says whether it did)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, 0, False
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", "0")), created


def accepts(cls: type) -> bool:
    """Whether this loop runs ``cls``: a class with every :class:`~flashrt_gym.learners.Learner` member."""
    return not missing_members(cls)


def budget(cls: type, device: str) -> Mapping[str, Any]:
    """The ``auto`` values of a run of the learner ``cls`` on ``device``: its own ``budget``."""
    return cls.budget(device)


def check_agent(cfg: DictConfig, cls: type) -> None:
    """Fail early on a device learner's agent config that cannot work.

    Args:
        cfg: the run's config. cls: the learner ``agent._target_`` names.

    Raises:
        ConfigError: an unknown key, a ``kwargs`` value its config refuses, or an observation
            that is not flat.
    """
    name = cls.__name__
    extra = set(cfg.agent) - AGENT_KEYS
    require(not extra, "agent", f"unknown keys {sorted(extra)}; {name}'s arguments go under agent.kwargs")
    names = {f.name for f in fields(cls.config_class)}
    unknown = set(cfg.agent.kwargs) - names
    require(not unknown, "agent.kwargs", f"unknown keys {sorted(unknown)}; {name} takes {sorted(names)}")
    try:
        cls.config_class(**OmegaConf.to_container(cfg.agent.kwargs, resolve=True))
    except ValueError as e:
        raise ConfigError(f"config key 'agent.kwargs': {e}") from e
    require(cfg.env.obs_mode in ("state", "features"), "env.obs_mode", f"{name} needs a flat observation")


def learner_config(cfg: DictConfig, world: int) -> Any:
    """The learner's config (its ``config_class``) from ``agent.kwargs``, with the batch and the
    replay capacity (where it has them) split over ``world`` ranks.

    Args:
        cfg: the run's config. world: data-parallel ranks.

    Returns:
        An instance of the learner's ``config_class``.

    Raises:
        ConfigError: a size or ``env.num_envs`` does not split evenly over the ranks.
    """
    kw = OmegaConf.to_container(cfg.agent.kwargs, resolve=True)
    for key in ("batch_size", "buffer_size"):
        if key not in kw:
            continue
        if kw[key] % world:
            raise ConfigError(f"config key 'agent.kwargs.{key}': {kw[key]} does not split evenly over {world} ranks")
        kw[key] //= world
    if cfg.env.num_envs % world:
        raise ConfigError(f"config key 'env.num_envs': {cfg.env.num_envs} does not split evenly over {world} ranks")
    return get_class(cfg.agent._target_).config_class(**kw)


def load_learner(cfg: DictConfig, checkpoint: str | Path, obs_dim: int, act_dim: int, device: torch.device) -> Learner:
    """The learner of ``cfg`` with the state of ``checkpoint``, for acting only (a replay
    capacity of one transition, no captured update).

    Args:
        cfg: the config the checkpoint was trained under (its ``agent`` group).
        checkpoint: a file the learner's ``save`` wrote.
        obs_dim, act_dim: the env's flat observation and action sizes. device: where it acts.

    Returns:
        The learner.
    """
    learner_cfg = learner_config(cfg, 1)
    if "buffer_size" in {f.name for f in fields(learner_cfg)}:
        learner_cfg = replace(learner_cfg, buffer_size=1)  # acting only: no replay ring
    learner = get_class(cfg.agent._target_)(obs_dim, act_dim, 1, learner_cfg, device, graphs=False)
    learner.load(checkpoint)
    return learner


def replay_file(checkpoint: str | Path, rank: int) -> Path:
    """The replay shard of ``rank`` saved beside ``checkpoint``.

    Args:
        checkpoint: the learner's checkpoint. rank: the data-parallel rank.

    Returns:
        The shard's path.
    """
    return Path(checkpoint).with_name(f"replay_rank{rank}.safetensors")


def train(cfg: DictConfig, out: Path, launch: float) -> dict[str, Any]:
    """Train the device learner of ``cfg`` (see the module docstring).

    Args:
        cfg: the run's checked config. out: the run folder. launch: the job's start.

    Returns:
        Rank 0: the run's summary; the other ranks: ``{}``.
    """
    rank, world, local, created = init_distributed()
    device = device_of(cfg)
    if device == "cuda":
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    lead = rank == 0
    n = cfg.env.num_envs // world
    learner_cfg = learner_config(cfg, world)
    seed = train_seed(cfg.seed, cfg.env.num_envs, rank, world)
    torch.manual_seed(seed)  # exploration noise and replay sampling: a stream per run and rank
    env = make_env(cfg, n, device=device)
    (obs_dim,), (act_dim,) = env.single_observation_space.shape, env.single_action_space.shape
    cls = get_class(cfg.agent._target_)
    learner = cls(obs_dim, act_dim, n, learner_cfg, device, seed=cfg.seed, graphs=cfg.runtime.graphs, world_size=world)
    env_steps = 0
    if cfg.resume:
        env_steps = int(learner.load(cfg.resume)["env_steps"])
        if cfg.resume_replay_buffer:
            learner.load(replay_file(cfg.resume, rank), replay=True)
    log, base_s = None, 0.0
    if lead:
        eval_env = make_env(cfg, cfg.eval.episodes, autoreset=False, device=device)
        splits = {"validation": cfg.eval.episodes, "test": cfg.eval.test_episodes}
        # base_s: what the final evaluation (the same episodes) will take
        base, base_s = base_evaluation(cfg, splits, eval_env.engine.bufs.deployment, device)
    stop_at = deadline(cfg, launch, base_s)
    progress = Progress(cfg.total_steps, env_steps, stop_at, disable=not lead)
    if lead:
        log = RunLog(cfg, out, launch, base, progress)
    ckpt = out / "checkpoints"
    validated_at = -1

    def point(split: str, milestone: int | None = None) -> None:
        """Rank 0: evaluate the deterministic actor on ``split`` and save the learner; every rank:
        its replay shard, if asked."""
        nonlocal validated_at
        if split == "validation":
            validated_at = env_steps
        if lead:
            episodes = cfg.eval.episodes if split == "validation" else cfg.eval.test_episodes
            res = evaluate(
                eval_env, torch_policy(lambda o: learner.act(o, deterministic=True), eval_env.device), split, episodes
            )
            log.point(env_steps, split, res, milestone)
            meta = {"env_steps": env_steps, "seed": cfg.seed, "world_size": world}
            learner.save(ckpt / "last.safetensors", metadata=meta)
        if cfg.save_replay_buffer and split == "validation":
            learner.save(replay_file(ckpt / "last.safetensors", rank), replay=True)

    def agree(stop: bool) -> bool:
        """Rank 0's decision, on every rank."""
        if world == 1:
            return stop
        flag = torch.tensor([float(stop)], device=device)
        dist.broadcast(flag, 0)
        return bool(flag.item())

    check_every = 1 if device == "cpu" else CHECK_EVERY  # a time check costs a CPU run nothing
    every, test_at = cfg.eval.every, sorted(cfg.eval.test_at)
    next_eval = (env_steps // every + 1) * every
    obs = torch.tensor(env.reset(seed=seed)[0], device=device)  # a copy: the reset's array is read-only
    ret = torch.zeros(n, device=device)
    episodes = torch.zeros(3, device=device)  # finished, successes, return sum (since the last log)
    start, t0, rounds = env_steps, time.time(), 0
    while env_steps < cfg.total_steps:
        action = learner.act(obs)
        next_obs, reward, term, trunc, info = env.step_torch(action)
        done = term | trunc
        final = torch.where(done[:, None], info["final_obs"], next_obs)  # the finished episodes' last obs
        learner.store(obs, action, reward, final, ~term)  # a time-limit cut still bootstraps
        obs = next_obs
        ret += reward
        episodes += torch.stack([done.float().sum(), term.float().sum(), (ret * done).sum()])
        ret *= ~done
        learner.update()
        before, env_steps, rounds = env_steps, env_steps + n * world, rounds + 1
        progress.update(env_steps)
        if env_steps >= next_eval:
            next_eval += every
            stats = learner.stats()
            finished, succ, rsum = episodes.tolist()
            episodes.zero_()
            if lead:
                rate = (env_steps - start) / (time.time() - t0)
                log.scalars(env_steps, {f"losses/{k}": v for k, v in stats.items()})
                episode_stats = {
                    "train/episode_success": succ / max(finished, 1),
                    "train/episode_return": rsum / max(finished, 1),
                }
                log.scalars(
                    env_steps, {**episode_stats, "charts/env_steps_per_s": rate, "charts/updates": learner.updates}
                )
            point("validation")
        for m in test_at:
            if before < m <= env_steps:
                point("test", m)
        if rounds % check_every == 0 and agree(stop_at is not None and time.time() >= stop_at):
            break
    train_s = time.time() - t0
    progress.close()
    if validated_at != env_steps:
        point("validation")
    point("test")
    env.close()
    mine = {
        "rank": rank,
        "reset_seed": seed,
        "slots": n,
        "batch_size": getattr(learner_cfg, "batch_size", None),
        "stored": learner.stored,
    }
    ranks = [mine]
    if world > 1:  # what each rank trained on, for the record (and the two-rank test)
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
        if created:
            dist.destroy_process_group()
    if not lead:
        return {}
    eval_env.close()
    extra = {
        "world_size": world,
        "updates": learner.updates,
        "ranks": ranks,
        "time_limit_hit": env_steps < cfg.total_steps,
    }
    return log.finish(summarize(cfg, log, env_steps, train_s, env_steps - start, **extra))
