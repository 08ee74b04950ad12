"""Scripted-expert demonstrations of the MuJoCo push task, in the shards of :mod:`flashrt_gym.demos`.

:func:`collect` (batch by batch, :func:`collect_batch`) runs :class:`~flashrt_gym.sims.MujocoPush`
with its expert (plus Gaussian action noise) and yields its successful episodes in the tabletop's
shard layout (``image`` seen before acting, ``proprio``, ``action`` executed, ``instruction``,
``episode``, ``tick``), so that :func:`flashrt_gym.demos.tabletop.load_shards`,
:class:`flashrt_gym.demos.tabletop.Windows` and ``scripts/pretrain_policy.py`` read them as they are.
:func:`save_shard` writes the same format and metadata (``task``: the tabletop configuration the
push task reads, ``instructions``) plus ``simulator`` and ``push`` (the frame skip and the
compiled scene's digest), which tell MuJoCo demonstrations apart and let :func:`push_config`
rebuild the task they came from.

:func:`evaluate` is the closed-loop success of a policy on the MuJoCo task (the unsteered policy,
one episode per slot from the validation starts), the MuJoCo counterpart of the pipeline's
tabletop evaluation.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save as save_bytes

from flashrt.runtime import atomic_write
from flashrt_gym.demos import FORMAT
from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.evaluation import VALIDATION_SEED, base_policy
from flashrt_gym.sims.push.mujoco_cpu import MujocoPush
from flashrt_gym.sims.push.task import PushConfig, model_digest
from flashrt_gym.sims.tabletop import TabletopConfig
from flashrt_gym.splits import demo_seed

SIMULATOR = "mujoco_push"
"""The ``simulator`` metadata of MuJoCo push shards."""


def collect_batch(
    cfg: PushConfig, batch: int, *, num_slots: int = 256, noise_std: float = 0.3, max_ticks: int = 160, seed: int = 0
) -> dict[str, torch.Tensor]:
    """The successful episodes of batch ``batch``: ``num_slots`` seeded episodes (slot ``i``
    draws from :func:`flashrt_gym.splits.demo_seed` ``(seed, batch * num_slots + i)``, the
    tabletop pipeline's seeds) of the expert plus Gaussian action noise of ``noise_std`` (its own generator per
    batch, so batches can be collected in any order or in parallel), for at most ``max_ticks``
    ticks. An episode's id is ``batch * num_slots + i``."""
    if batch < 0 or num_slots < 1 or max_ticks < 1:
        raise ValueError("batch must be >= 0, num_slots and max_ticks >= 1")
    if noise_std < 0:
        raise ValueError(f"noise_std must be >= 0, got {noise_std}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + batch)
    sim = MujocoPush(num_slots, cfg)
    sim.seed(np.arange(num_slots) + demo_seed(seed, batch * num_slots))
    sim.reset()
    frames = []
    for _ in range(max_ticks):
        alive = torch.from_numpy(~sim.success())
        if not alive.any():
            break
        action = (torch.from_numpy(sim.expert()) + torch.randn(num_slots, 2, generator=g) * noise_std).clamp(-1, 1)
        frames.append((torch.from_numpy(sim.render()[:, 0]), torch.from_numpy(sim.proprio()), action, alive))
        sim.run_ticks(action[:, None].numpy())
    image, proprio, action, alive = (torch.stack(x, 1) for x in zip(*frames, strict=True))
    keep = torch.from_numpy(sim.success()).nonzero().flatten()
    lengths, sel = alive[keep].sum(1), alive[keep]
    ids = keep + batch * num_slots  # the episode's seed is demo_seed(seed, its id)
    return {
        "image": image[keep][sel],
        "proprio": proprio[keep][sel],
        "action": action[keep][sel],
        "instruction": torch.from_numpy(sim.instruction())[keep].repeat_interleave(lengths),
        "episode": ids.repeat_interleave(lengths),
        "tick": torch.cat([torch.arange(n) for n in lengths.tolist()]) if len(keep) else torch.zeros(0).long(),
    }


def first_episodes(shard: dict[str, torch.Tensor], count: int) -> dict[str, torch.Tensor]:
    """The ticks of the first ``count`` episodes of a shard."""
    ids = shard["episode"].unique_consecutive()
    if len(ids) <= count:
        return shard
    keep = torch.isin(shard["episode"], ids[:count])
    return {k: v[keep] for k, v in shard.items()}


def collect(
    cfg: PushConfig,
    num_episodes: int,
    *,
    num_slots: int = 256,
    noise_std: float = 0.3,
    max_ticks: int = 160,
    seed: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """:func:`collect_batch` of batches 0, 1, ... until ``num_episodes`` successful episodes are
    kept; yields each batch's episodes (the last one cut to the count)."""
    if num_episodes < 1:
        raise ValueError(f"num_episodes must be >= 1, got {num_episodes}")
    done, batch = 0, 0
    while done < num_episodes:
        shard = first_episodes(
            collect_batch(cfg, batch, num_slots=num_slots, noise_std=noise_std, max_ticks=max_ticks, seed=seed),
            num_episodes - done,
        )
        done += int(shard["episode"].unique().numel())
        batch += 1
        yield shard


def save_shard(shard: dict[str, torch.Tensor], path: str | os.PathLike, cfg: PushConfig) -> Path:
    """Write a shard of :func:`collect` atomically, in :data:`flashrt_gym.demos.FORMAT`."""
    sim = MujocoPush(1, cfg)
    meta = {
        "format": FORMAT,
        "task": json.dumps(cfg.table.to_dict()),
        "instructions": json.dumps(sim.instructions),
        "simulator": SIMULATOR,
        "push": json.dumps({"frame_skip": cfg.frame_skip, "scene": str(cfg.scene), "model": model_digest(sim.model)}),
    }
    tensors = {k: v.contiguous() for k, v in shard.items()}
    return atomic_write(path, lambda f: f.write(save_bytes(tensors, metadata=meta)))


def push_config(folder: str | os.PathLike) -> PushConfig:
    """The push task that the MuJoCo shards in ``folder`` were collected on (checked against
    the scene as it compiles here)."""
    paths = sorted(Path(folder).glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no demonstration shards (*.safetensors) in {folder}")
    with safe_open(str(paths[0]), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("simulator") != SIMULATOR:
        raise ValueError(f"{paths[0]} holds no MuJoCo push demonstrations (collect them with scripts/mujoco_demos.py)")
    push = json.loads(meta["push"])
    cfg = PushConfig(TabletopConfig(**json.loads(meta["task"])), push["scene"], push["frame_skip"])
    if model_digest(MujocoPush(1, cfg).model) != push["model"]:
        raise ValueError(f"the scene {push['scene']} compiles to another model than the one {folder} was collected on")
    return cfg


def evaluate(
    weights: str | os.PathLike,
    cfg: PushConfig,
    *,
    episodes: int,
    n_action_steps: int,
    max_episode_steps: int,
    device: str = "cpu",
    seed: int = VALIDATION_SEED,
    threads: int = 1,
) -> dict[str, float]:
    """Success rate of the unsteered policy in ``weights`` on the push task, seen (``train``) and
    held-out instructions, one episode per slot from ``seed``'s starts (the physics stepped by
    ``threads`` CPU threads)."""
    out = {}
    for split in ("train", "heldout"):
        split_cfg = dataclasses.replace(cfg, table=dataclasses.replace(cfg.table, split=split))
        env = FlashRTVectorEnv(
            episodes,
            action_mode="residual",
            autoreset=False,
            simulator=functools.partial(MujocoPush, cfg=split_cfg, threads=threads),
            weights=weights,
            device=device,
            n_action_steps=n_action_steps,
            max_episode_steps=max_episode_steps,
        )
        out[split] = base_policy(env, seed).success
        env.close()
    return out
