"""A second device learner, written as a user would add one: this file and one YAML
(``configs/agent/cem.yaml`` beside it), nothing else edited.

:class:`CEMLearner` is the cross-entropy method over one Gaussian of actions shared by every
observation: it acts by sampling the Gaussian, and each update moves the Gaussian toward the
actions of the best rewards stored since the last update.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import save

from flashrt.runtime import atomic_write
from flashrt_gym.learners import CPU_BUDGET


@dataclass(frozen=True)
class CEMConfig:
    """Hyper-parameters of :class:`CEMLearner`."""

    elite_fraction: float = 0.25
    """Share of the stored actions, by reward, that the Gaussian moves toward."""
    lr: float = 0.5
    """How far each update moves the Gaussian (1: onto the elites' mean and spread)."""
    init_std: float = 0.5
    """The Gaussian's first standard deviation."""
    batch_size: int = 8
    """Transitions stored before an update."""

    def __post_init__(self) -> None:
        bad = [
            k
            for k, ok in {
                "elite_fraction": 0 < self.elite_fraction <= 1,
                "lr": 0 < self.lr <= 1,
                "init_std": self.init_std > 0,
                "batch_size": self.batch_size > 0,
            }.items()
            if not ok
        ]
        if bad:
            raise ValueError(f"CEMConfig: out of range: {', '.join(f'{k}={getattr(self, k)!r}' for k in bad)}")


class CEMLearner:
    """The cross-entropy method as a :class:`flashrt_gym.learners.Learner` (one rank only)."""

    config_class: ClassVar[type] = CEMConfig

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        num_envs: int,
        cfg: CEMConfig,
        device: torch.device | str = "cpu",
        *,
        seed: int = 0,
        graphs: bool = True,
        world_size: int = 1,
    ) -> None:
        if world_size != 1:
            raise ValueError(f"CEMLearner runs on one rank, got world_size={world_size}")
        self.cfg, self.device = cfg, torch.device(device)
        self.mean = torch.zeros(act_dim, device=self.device)
        self.std = torch.full((act_dim,), cfg.init_std, device=self.device)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        self.actions: list[torch.Tensor] = []
        self.rewards: list[torch.Tensor] = []
        self.stored = self.updates = 0

    @classmethod
    def budget(cls, device: str) -> Mapping[str, Any]:
        """The CPU budget with 8 slots (on any device: a test learner)."""
        return {**CPU_BUDGET, "env.num_envs": 8}

    def act(self, obs: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """The Gaussian's mean, or a draw of it, for every observation, clipped to [-1, 1]."""
        shape = (len(obs), len(self.mean))
        if deterministic:
            return self.mean.clamp(-1, 1).expand(shape)
        noise = torch.randn(shape, generator=self.generator, device=self.device)
        return (self.mean + self.std * noise).clamp(-1, 1)

    def store(
        self,
        obs: torch.Tensor,
        action: torch.Tensor,
        reward: torch.Tensor,
        next_obs: torch.Tensor,
        not_done: torch.Tensor,
    ) -> None:
        """Keep the actions and their rewards (the rest is not used by this method)."""
        self.actions.append(action.detach().clone())
        self.rewards.append(reward.detach().clone())
        self.stored += len(action)

    def update(self) -> None:
        """Move the Gaussian toward the best ``elite_fraction`` of what is stored, once ``batch_size`` is."""
        if sum(len(r) for r in self.rewards) < self.cfg.batch_size:
            return
        actions, rewards = torch.cat(self.actions), torch.cat(self.rewards)
        elites = actions[rewards.topk(max(1, int(self.cfg.elite_fraction * len(rewards)))).indices]
        self.mean.lerp_(elites.mean(0), self.cfg.lr)
        self.std.lerp_(elites.std(0, correction=0).clamp(min=1e-3), self.cfg.lr)
        self.actions.clear()
        self.rewards.clear()
        self.updates += 1

    def stats(self) -> dict[str, float]:
        """The Gaussian's mean spread."""
        return {"std": float(self.std.mean())}

    def save(self, path: str | Path, *, replay: bool = False, metadata: dict[str, Any] | None = None) -> Path:
        """Write the Gaussian (or, with ``replay``, the pending actions and rewards) to safetensors."""
        if replay:
            tensors = {"actions": torch.cat(self.actions).cpu() if self.actions else torch.zeros(0, len(self.mean))}
        else:
            tensors = {"mean": self.mean.cpu(), "std": self.std.cpu()}
        data = save(tensors, metadata={"user": json.dumps(metadata or {}), "updates": str(self.updates)})
        return atomic_write(path, lambda f: f.write(data))

    def load(self, path: str | Path, *, replay: bool = False) -> dict[str, Any]:
        """Read the Gaussian :meth:`save` wrote (``replay`` files are not read back)."""
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            if not replay:
                self.mean.copy_(f.get_tensor("mean"))
                self.std.copy_(f.get_tensor("std"))
                self.updates = int(meta["updates"])
        return json.loads(meta["user"])
