"""The env's one configuration: :class:`EnvConfig`, the step's options that
:class:`~flashrt_gym.FlashRTVectorEnv` takes as arguments, the engine builds its buffers and
programs from, and Hydra's ``env`` config group is typed by (a structured config: the YAML files
under ``configs/env/`` hold no defaults of their own, only a preset's changes).

Importing this module (every ``import flashrt_gym`` does) stores the group's schema as
``env/schema`` in Hydra's ``ConfigStore``: :class:`EnvGroup`, the config plus the run's slot count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore

from flashrt_gym import arguments

OBS_MODES = ("state", "features", "rgb", "dict")
ACTION_MODES = ("noise", "residual")
REWARD_MODES = ("dense", "sparse")
OBS_FORMS = ("state", "features", "rgb")
MAX_EPISODE_STEPS = 40  # chunks of an episode by default (the registered ids' max_episode_steps)


@dataclass
class EnvConfig:
    """The env's step options (they shape its buffers and its captured graph), checked when made.

    Args:
        obs_mode: ``"state"``, ``"features"``, ``"rgb"`` or ``"dict"`` (all three).
        action_mode: ``"noise"`` (the action scaled by ``noise_bound`` is the policy's initial
            noise) or ``"residual"`` (the policy draws its own noise; the action scaled by
            ``residual_scale`` is added to its chunk).
        reward_mode: ``"dense"`` or ``"sparse"``.
        noise_bound, residual_scale: see ``action_mode`` (finite, > 0).
        repeat_over_horizon: the action is one ``action_dim`` vector repeated over the chunk.
        n_action_steps: actions of each chunk the simulator executes per step (>= 1).
        max_episode_steps: steps after which an episode is truncated (>= 1).

    Raises:
        ValueError: a value out of its range, naming the argument and what it accepts.
    """

    obs_mode: str = "state"
    action_mode: str = "noise"
    reward_mode: str = "dense"
    noise_bound: float = 1.5
    residual_scale: float = 0.5
    repeat_over_horizon: bool = False
    n_action_steps: int = 4
    max_episode_steps: int = MAX_EPISODE_STEPS

    def __post_init__(self) -> None:
        self.obs_mode = arguments.choose("obs_mode", self.obs_mode, OBS_MODES)
        self.action_mode = arguments.choose("action_mode", self.action_mode, ACTION_MODES)
        self.reward_mode = arguments.choose("reward_mode", self.reward_mode, REWARD_MODES)
        self.noise_bound = arguments.positive("noise_bound", self.noise_bound)
        self.residual_scale = arguments.positive("residual_scale", self.residual_scale)
        self.repeat_over_horizon = bool(self.repeat_over_horizon)
        self.n_action_steps = arguments.count("n_action_steps", self.n_action_steps)
        self.max_episode_steps = arguments.count("max_episode_steps", self.max_episode_steps)

    @property
    def obs_forms(self) -> tuple[str, ...]:
        """The observation forms a step writes: all of :data:`OBS_FORMS` for ``"dict"``, else the one."""
        return OBS_FORMS if self.obs_mode == "dict" else (self.obs_mode,)


@dataclass
class EnvGroup(EnvConfig):
    """Hydra's ``env`` group: the env's config and ``num_envs``, the run's slots over all ranks
    (``auto``: the learner's budget for the device, :mod:`flashrt_gym.learners`)."""

    num_envs: Any = "auto"


ConfigStore.instance().store(group="env", name="schema", node=EnvGroup)
