"""FlashRT-Gym: a VLA flow policy and a simulator as captured steps over one set of buffers.

Importing the package registers ``FlashRT-VLA`` (the shipped ``tiny`` policy on the built-in
tabletop) with Gymnasium:

    env = gymnasium.make("FlashRT-VLA")                                   # FlashRTEnv, one slot
    envs = gymnasium.make_vec("FlashRT-VLA", num_envs=64, vectorization_mode="vector_entry_point")

:func:`register_simulator` wraps a simulator of one's own (in-graph or external) the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import gymnasium

from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.external import ExternalSimulator
from flashrt_gym.simulator import Simulator
from flashrt_gym.single import FlashRTEnv


def register_simulator(env_id: str, simulator: Callable[[], Simulator | ExternalSimulator], **defaults: Any) -> None:
    """Register ``env_id`` with Gymnasium: a VLA (``weights=``, default the shipped ``tiny``)
    steering the simulator ``simulator(num_envs)`` makes (a fresh one per env), with the capsule verbs.
    ``gymnasium.make(env_id)`` gives the one-slot :class:`FlashRTEnv`, ``gymnasium.make_vec(env_id,
    num_envs=N)`` the :class:`FlashRTVectorEnv`; ``defaults`` are env arguments either may override."""
    if not callable(simulator):
        raise TypeError(
            f"simulator must be a callable that takes num_envs and returns a fresh simulator, got {simulator!r}"
        )
    gymnasium.register(
        id=env_id,
        entry_point=functools.partial(FlashRTEnv, simulator=simulator, **defaults),
        vector_entry_point=functools.partial(FlashRTVectorEnv, simulator=simulator, **defaults),
    )


gymnasium.register(
    id="FlashRT-VLA",
    entry_point="flashrt_gym.single:FlashRTEnv",
    vector_entry_point="flashrt_gym.env:FlashRTVectorEnv",
)

__all__ = ["ExternalSimulator", "FlashRTEnv", "FlashRTVectorEnv", "Simulator", "register_simulator"]
