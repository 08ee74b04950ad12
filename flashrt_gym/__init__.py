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

from flashrt_gym.env import MAX_EPISODE_STEPS, FlashRTVectorEnv
from flashrt_gym.external import ExternalSimulator
from flashrt_gym.simulator import Simulator
from flashrt_gym.single import FlashRTEnv

__version__ = "0.1.0"  # the distribution's version too (pyproject reads it from here)


def register_simulator(env_id: str, simulator: Callable[[], Simulator | ExternalSimulator], **defaults: Any) -> None:
    """Register ``env_id`` with Gymnasium: a VLA (``weights=``, default the shipped ``tiny``)
    steering the simulator ``simulator(num_envs)`` makes (a fresh one per env), with the capsule verbs.
    ``gymnasium.make(env_id)`` gives the one-slot :class:`FlashRTEnv`, ``gymnasium.make_vec(env_id,
    num_envs=N)`` the :class:`FlashRTVectorEnv`; ``defaults`` are env arguments either may override.

    The protocol is checked as far as it can be now: a class (or a ``functools.partial`` of one)
    must define every method of the protocol it aims at (:func:`flashrt_gym.external.check_simulator`).
    Its data members, and everything of a plain factory function, are checked when an env makes the
    simulator, before anything else reads it.

    Raises:
        TypeError: ``simulator`` is not callable, or is a class that lacks protocol methods (all named).
    """
    if not callable(simulator):
        raise TypeError(
            f"simulator must be a callable that takes num_envs and returns a fresh simulator, got {simulator!r}"
        )
    from flashrt_gym.external import check_simulator

    target = simulator.func if isinstance(simulator, functools.partial) else simulator
    if isinstance(target, type):
        check_simulator(target)
    gymnasium.register(
        id=env_id,
        entry_point=functools.partial(FlashRTEnv, simulator=simulator, **defaults),
        vector_entry_point=functools.partial(FlashRTVectorEnv, simulator=simulator, **defaults),
        max_episode_steps=defaults.get("max_episode_steps", MAX_EPISODE_STEPS),  # the env's own truncation
    )


gymnasium.register(
    id="FlashRT-VLA",
    entry_point="flashrt_gym.single:FlashRTEnv",
    vector_entry_point="flashrt_gym.env:FlashRTVectorEnv",
    max_episode_steps=MAX_EPISODE_STEPS,  # gym.make's TimeLimit then truncates on the env's own step
)

import flashrt_gym.sims  # noqa: E402, F401  registers the MuJoCo push task's ids (imports no mujoco until made)

__all__ = ["ExternalSimulator", "FlashRTEnv", "FlashRTVectorEnv", "Simulator", "__version__", "register_simulator"]
