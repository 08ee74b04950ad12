"""Learners that steer the VLA on the device: the :class:`Learner` protocol every one follows.

A learner of this kind keeps its state and its replay on the env's device and is driven by
:mod:`flashrt_gym.training.device_loop` with device tensors (``env.step_torch``). A new one is one
module here (a class that satisfies :class:`Learner`) and one YAML under ``configs/agent/`` whose
``_target_`` names it and whose ``kwargs`` are its config dataclass's fields; nothing else
changes. :class:`~flashrt_gym.learners.fast_sac.FastSAC` is the shipped one.

:mod:`flashrt_gym.learners.graph_sac` (:class:`~flashrt_gym.learners.graph_sac.GraphSAC`) is a
stable-baselines3 algorithm instead: it runs SB3's own loop
(:mod:`flashrt_gym.training.sb3_loop`), not this protocol.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch

CPU_BUDGET: Mapping[str, Any] = {
    "env.num_envs": 16,
    "total_steps": 100_000,
    "time_limit_s": 570,
    "time_limit_includes_eval": True,
    "eval.every": 2_000,
    "eval.episodes": 32,
    "eval.test_episodes": 256,
    "agent.kwargs.batch_size": 256,
    "agent.kwargs.buffer_size": 1 << 14,
}
"""Any learner's run on the CPU: the whole pipeline, the final test inside ten minutes on two cores."""


class Learner(Protocol):
    """What :mod:`flashrt_gym.training.device_loop` needs of a learner.

    ``config_class`` is the frozen dataclass of its hyper-parameters (the agent config's
    ``kwargs``, validated in its ``__post_init__``; ``batch_size`` and ``buffer_size``, where it
    has them, are split over data-parallel ranks). ``stored`` and ``updates`` count this rank's
    stored transitions and gradient steps.
    """

    config_class: ClassVar[type]
    stored: int
    updates: int

    def __init__(
        self,
        obs_dim: int,
        act_dim: int,
        num_envs: int,
        cfg: Any,
        device: torch.device | str = "cpu",
        *,
        seed: int = 0,
        graphs: bool = True,
        world_size: int = 1,
    ) -> None:
        """Make the learner for ``num_envs`` slots of flat ``obs_dim`` observations and actions in
        [-1, 1]^``act_dim`` on ``device`` (``world_size`` data-parallel ranks)."""

    @classmethod
    def budget(cls, device: str) -> Mapping[str, Any]:
        """The values of the run's ``auto`` keys (dotted config keys) for this learner on ``device``
        (``"cpu"`` or ``"cuda"``)."""
        ...

    def act(self, obs: torch.Tensor, deterministic: bool = False) -> torch.Tensor:
        """Actions in [-1, 1] for a batch of observations (explored, or the deterministic ones)."""
        ...

    def store(
        self,
        obs: torch.Tensor,
        action: torch.Tensor,
        reward: torch.Tensor,
        next_obs: torch.Tensor,
        not_done: torch.Tensor,
    ) -> None:
        """Keep one env step of every slot (``not_done``: false where the episode terminated)."""

    def update(self) -> None:
        """Learn from what is stored (nothing until enough is)."""

    def stats(self) -> dict[str, float]:
        """Mean training statistics since the last call (logged as ``losses/<name>``)."""
        ...

    def save(self, path: str | Path, *, replay: bool = False, metadata: dict[str, Any] | None = None) -> Path:
        """Write the learner's state (or, with ``replay``, this rank's replay) to ``path``, making
        its folder if need be."""
        ...

    def load(self, path: str | Path, *, replay: bool = False) -> dict[str, Any]:
        """Read a file :meth:`save` wrote; returns the ``metadata`` saved with it."""
        ...


MEMBERS = ("config_class", "budget", "act", "store", "update", "stats", "save", "load")
"""The class members a :class:`Learner` must define (``stored`` and ``updates`` are per instance)."""


def missing_members(cls: type) -> list[str]:
    """The :class:`Learner` members ``cls`` lacks (empty: it is a learner).

    Args:
        cls: a class named by an agent config's ``_target_``.

    Returns:
        The names of :data:`MEMBERS` it does not define, in that order.
    """
    return [name for name in MEMBERS if not hasattr(cls, name)]


__all__ = ["CPU_BUDGET", "MEMBERS", "Learner", "missing_members"]
