"""The one-slot form of the env (``gym.make("FlashRT-VLA")``), for Gymnasium's single-env API."""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
import torch

from flashrt.runtime import Capsule
from flashrt_gym.env import FlashRTVectorEnv


class FlashRTEnv(gym.Env):
    """The single-env form of :class:`FlashRTVectorEnv` (``gym.make("FlashRT-VLA")``): one slot,
    no autoreset (call ``reset`` after an episode ends). Same arguments except ``num_envs``."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(self, render_mode: str | None = None, **kwargs: Any) -> None:
        if "num_envs" in kwargs or "autoreset" in kwargs:
            raise ValueError("FlashRTEnv is one slot without autoreset; use FlashRTVectorEnv for more")
        self.vec = FlashRTVectorEnv(1, render_mode=render_mode, autoreset=False, **kwargs)
        self.render_mode = render_mode
        self.action_space = self.vec.single_action_space
        self.observation_space = self.vec.single_observation_space
        self._ended = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        if seed is None and not self.vec.started:
            seed = int(self.np_random.integers(0, 2**62))
        obs, info = self.vec.reset(seed=seed, options=options)
        self._ended = False
        return _first(obs), {k: v[0] for k, v in info.items()}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        if self._ended:
            raise gym.error.ResetNeeded("the episode has ended (terminated or truncated): call reset() before step()")
        if not isinstance(action, (np.ndarray, list, tuple, torch.Tensor)):
            raise TypeError(f"action must be an array of shape {self.action_space.shape}, got {type(action).__name__}")
        obs, reward, term, trunc, _ = self.vec.step(np.asarray(action)[None])
        self._ended = bool(term[0] or trunc[0])
        return _first(obs), float(reward[0]), bool(term[0]), bool(trunc[0]), {"is_success": bool(term[0])}

    def render(self) -> np.ndarray | None:
        frames = self.vec.render()
        return None if frames is None else frames[0]

    def close(self) -> None:
        self.vec.close()

    # the capsule verbs of the one slot, as on the vector env
    def snapshot(self) -> Capsule:
        return self.vec.snapshot()

    def restore(self, capsule: Capsule) -> Any:
        self._ended = False
        return _first(self.vec.restore(capsule))

    def rollback(self, capsule: Capsule) -> Any:
        self._ended = False
        return _first(self.vec.rollback(capsule))

    def set_instruction(self, text: str) -> Any:
        return _first(self.vec.set_instruction(text))


def _first(obs: Any) -> Any:
    return {k: v[0] for k, v in obs.items()} if isinstance(obs, dict) else obs[0]
