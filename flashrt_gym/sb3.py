"""A stable-baselines3 ``VecEnv`` over :class:`~flashrt_gym.env.FlashRTVectorEnv`.

NumPy at the boundary, same-step autoreset as SB3 expects: a finished slot's info carries
``terminal_observation`` (its last observation, before the reset) and
``TimeLimit.truncated`` (truncated and not terminated), and ``is_success`` for SB3's success
logging. Seeds and options set with ``seed()`` / ``set_options()`` apply at the next ``reset()``.
The env is one batched object, so ``get_attr`` / ``env_method`` answer once per requested index
with the same (whole-env) value. Wrap it in SB3's ``VecMonitor`` for episode returns and lengths
(SB3 then logs ``rollout/ep_rew_mean`` and ``ep_len_mean``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium.vector import AutoresetMode
from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn

from flashrt_gym.env import FlashRTVectorEnv


class SB3VecEnv(VecEnv):
    """Wrap a :class:`FlashRTVectorEnv` (or build one from ``kwargs``) for SB3 algorithms.

    Args:
        env: a vector env in ``AutoresetMode.SAME_STEP`` (the default), or None to build one.
        **kwargs: :class:`FlashRTVectorEnv` arguments, when ``env`` is None.

    Raises:
        ValueError: both ``env`` and ``kwargs``, or an env in another autoreset mode.

    Example:
        >>> from stable_baselines3 import SAC
        >>> from stable_baselines3.common.vec_env import VecMonitor
        >>> env = VecMonitor(SB3VecEnv(num_envs=16))  # episode statistics: SB3 logs ep_rew_mean
        >>> SAC("MlpPolicy", env).learn(10_000)
    """

    def __init__(self, env: FlashRTVectorEnv | None = None, **kwargs: Any) -> None:
        if env is None:
            env = FlashRTVectorEnv(**kwargs)
        elif kwargs:
            raise ValueError(f"pass either an env or the arguments to build one, not both (got {sorted(kwargs)})")
        if env.autoreset_mode != AutoresetMode.SAME_STEP:
            raise ValueError(
                "SB3 needs an env that resets finished slots in the same step: build it with autoreset=True and "
                f"autoreset_mode=SAME_STEP (the default), got {env.autoreset_mode.name}"
            )
        self.env = env
        self._actions: np.ndarray | None = None
        super().__init__(env.num_envs, env.single_observation_space, env.single_action_space)

    def reset(self) -> VecEnvObs:
        seed = self._seeds[0]
        options = self._options[0] or None
        obs, info = self.env.reset(seed=seed, options=options)
        self.reset_infos = [{k: v[i] for k, v in info.items()} for i in range(self.num_envs)]
        self._reset_seeds()
        self._reset_options()
        return obs

    def step_async(self, actions: np.ndarray) -> None:
        self._actions = actions

    def step_wait(self) -> VecEnvStepReturn:
        if self._actions is None:
            raise RuntimeError("step_wait() without step_async(actions)")
        obs, reward, term, trunc, info = self.env.step(self._actions)
        self._actions = None
        done = term | trunc
        infos: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        if "final_obs" in info:
            final = info["final_obs"]
            for i in np.flatnonzero(done):
                infos[i] = {
                    "terminal_observation": {k: v[i] for k, v in final.items()}
                    if isinstance(final, dict)
                    else final[i],
                    "TimeLimit.truncated": bool(trunc[i] and not term[i]),
                    "is_success": bool(term[i]),
                }
        return obs, reward.astype(np.float32), done, infos

    def close(self) -> None:
        self.env.close()

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        return [getattr(self.env, attr_name)] * len(self._get_indices(indices))

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        if len(self._get_indices(indices)) != self.num_envs:
            raise ValueError("the slots share one env object: set_attr applies to all of them (indices=None)")
        setattr(self.env, attr_name, value)

    def env_method(self, method_name: str, *args: Any, indices: VecEnvIndices = None, **kwargs: Any) -> list[Any]:
        result = getattr(self.env, method_name)(*args, **kwargs)
        return [result] * len(self._get_indices(indices))

    def env_is_wrapped(self, wrapper_class: type, indices: VecEnvIndices = None) -> list[bool]:
        return [False] * len(self._get_indices(indices))

    def get_images(self) -> Sequence[np.ndarray | None]:
        """The env's own frames (build it with ``render_mode="rgb_array"``), one per slot."""
        frames = self.env.render()
        return [None] * self.num_envs if frames is None else list(frames)
