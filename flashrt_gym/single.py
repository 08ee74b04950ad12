"""The one-slot form of the env (``gym.make("FlashRT-VLA")``), for Gymnasium's single-env API."""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
import torch

from flashrt.runtime import Capsule
from flashrt_gym.env import FlashRTVectorEnv


class FlashRTEnv(gym.Env):
    """The single-env form of :class:`FlashRTVectorEnv`: one slot, no autoreset (call ``reset``
    after an episode ends). Same arguments except ``num_envs``, ``autoreset`` and ``autoreset_mode``.

    The capsule verbs (:meth:`snapshot`, :meth:`restore`, :meth:`rollback`) and
    :meth:`set_instruction` / :attr:`instructions` are the env's own methods. Gymnasium 1.x
    wrappers (``gym.make`` adds ``OrderEnforcing``, ``PassiveEnvChecker`` and ``TimeLimit``) do not
    forward them: reach them as ``env.unwrapped.snapshot()`` or ``env.get_wrapper_attr("snapshot")()``.

    Episodes truncate after ``max_episode_steps`` chunks (default 40), the env's own count. The
    registered ids carry the same number in their spec, so ``gym.make``'s ``TimeLimit`` ends an
    episode on the same step, once; ``gym.make(id, max_episode_steps=k)`` sets the ``TimeLimit``
    alone, so it can shorten episodes (k < 40) but not lengthen them: for longer ones construct
    ``FlashRTEnv(max_episode_steps=k)`` (or register an id with that default).
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, render_mode: str | None = None, **kwargs: Any) -> None:
        if {"num_envs", "autoreset", "autoreset_mode"} & set(kwargs):
            raise ValueError("FlashRTEnv is one slot without autoreset; use FlashRTVectorEnv for more")
        self.vec = FlashRTVectorEnv(1, render_mode=render_mode, autoreset=False, **kwargs)
        self.render_mode = render_mode
        self.action_space = self.vec.single_action_space
        self.observation_space = self.vec.single_observation_space
        self._ended = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """Start an episode.

        Args:
            seed: restart the slot's episode stream from this seed (the vector env's slot 0 of
                ``reset(seed=seed)``); None: the next episode of its stream.
            options: as the vector env's (``reset_mask`` of shape (1,)).

        Returns:
            The first observation, and an info holding ``instruction`` (an index into
            :attr:`instructions`).
        """
        super().reset(seed=seed)
        if seed is None and not self.vec.started:
            seed = int(self.np_random.integers(0, 2**62))
        obs, info = self.vec.reset(seed=seed, options=options)
        self._ended = False
        return _first(obs), {k: v[0] for k, v in info.items()}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """One action chunk.

        Args:
            action: an array of :attr:`action_space`'s shape, floats in [-1, 1].

        Returns:
            Observation, reward, terminated (success), truncated (``max_episode_steps`` reached)
            and an info holding ``is_success``.

        Raises:
            gymnasium.error.ResetNeeded: the episode has ended.
            TypeError, ValueError: an action of another type, shape or dtype, or out of bounds.
        """
        if self._ended:
            raise gym.error.ResetNeeded("the episode has ended (terminated or truncated): call reset() before step()")
        if not isinstance(action, (np.ndarray, list, tuple, torch.Tensor)):
            raise TypeError(f"action must be an array of shape {self.action_space.shape}, got {type(action).__name__}")
        a = action.numpy(force=True) if isinstance(action, torch.Tensor) else np.asarray(action)
        if a.shape != self.action_space.shape:
            repeated = self.vec.config.repeat_over_horizon
            what = "action_dim, repeated over the horizon" if repeated else "horizon * action_dim"
            raise ValueError(f"action must have shape {self.action_space.shape} ({what}), got {a.shape}")
        obs, reward, term, trunc, _ = self.vec.step(a[None])
        self._ended = bool(term[0] or trunc[0])
        return _first(obs), float(reward[0]), bool(term[0]), bool(trunc[0]), {"is_success": bool(term[0])}

    def render(self) -> np.ndarray | None:
        """The slot's (H, W, 3) uint8 frame, with ``render_mode="rgb_array"``; else None."""
        frames = self.vec.render()
        return None if frames is None else frames[0]

    def close(self) -> None:
        """Release the buffers; the env refuses every later call."""
        self.vec.close()

    @property
    def instructions(self) -> tuple[str, ...]:
        """The instructions the simulator knows (see :attr:`FlashRTVectorEnv.instructions`)."""
        return self.vec.instructions

    # the capsule verbs of the one slot, as on the vector env
    def snapshot(self) -> Capsule:
        """The slot's state at this step boundary, as a capsule.

        Returns:
            A :class:`~flashrt.runtime.Capsule` for :meth:`restore` or :meth:`rollback`.
        """
        return self.vec.snapshot()

    def restore(self, capsule: Capsule) -> Any:
        """Restore a capsule of this env's configuration; the episode continues from it.

        Args:
            capsule: from :meth:`snapshot` (or ``Capsule.load``) of an env of this configuration.

        Returns:
            The restored observation.

        Raises:
            TypeError, flashrt.runtime.CapsuleError: not a capsule, or one this env cannot run
                from (checked before anything is copied).
        """
        self._ended = False
        return _first(self.vec.restore(capsule))

    def rollback(self, capsule: Capsule) -> Any:
        """Return to an earlier boundary of this env.

        Args:
            capsule: a :meth:`snapshot` of this same env.

        Returns:
            The observation at that boundary.
        """
        self._ended = False
        return _first(self.vec.rollback(capsule))

    def set_instruction(self, text: str) -> Any:
        """Hard interrupt: a new instruction between steps.

        Args:
            text: one of :attr:`instructions`.

        Returns:
            The observation under the new instruction.

        Raises:
            ValueError: ``text`` is not one of :attr:`instructions` (the message lists them).
        """
        return _first(self.vec.set_instruction(text))


def _first(obs: Any) -> Any:
    return {k: v[0] for k, v in obs.items()} if isinstance(obs, dict) else obs[0]
