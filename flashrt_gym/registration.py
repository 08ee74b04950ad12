"""Gymnasium registration: :func:`register_simulator` and every built-in env id, in one place.

Importing :mod:`flashrt_gym` imports this module once, which registers:

- ``FlashRT-VLA``: the shipped ``tiny`` policy on the built-in tabletop;
- ``FlashRT-MuJoCoPush`` (MuJoCo's C library) and ``FlashRT-MuJoCoWarpPush`` (MuJoCo Warp): the
  push task of :mod:`flashrt_gym.sims`;
- ``FlashRT-MetaWorld-MT10-v0`` and ``FlashRT-MetaWorld-<task>-v0`` (MT1) for each Meta-World task,
  episodes of 50 chunks (:data:`flashrt_gym.sims.metaworld_tasks.EPISODE_STEPS`).

No simulator library (``mujoco``, ``warp``, ``metaworld``) is imported until an env is made.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import gymnasium

from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.env_config import MAX_EPISODE_STEPS
from flashrt_gym.sims import metaworld, mujoco_push, warp_push
from flashrt_gym.sims.metaworld_tasks import EPISODE_STEPS as METAWORLD_EPISODE_STEPS
from flashrt_gym.sims.metaworld_tasks import INSTRUCTIONS as METAWORLD_TASKS
from flashrt_gym.simulator import ExternalSimulator, Simulator, check_simulator
from flashrt_gym.single import FlashRTEnv


def register_simulator(env_id: str, simulator: Callable[[], Simulator | ExternalSimulator], **defaults: Any) -> None:
    """Register ``env_id`` with Gymnasium: a VLA (``weights=``, default the simulator's
    ``pretrained_weights``, else the shipped ``tiny``)
    steering the simulator ``simulator(num_envs)`` makes (a fresh one per env), with the capsule verbs.
    ``gymnasium.make(env_id)`` gives the one-slot :class:`FlashRTEnv`, ``gymnasium.make_vec(env_id,
    num_envs=N)`` the :class:`FlashRTVectorEnv`; ``defaults`` are env arguments either may override.

    The protocol is checked as far as it can be now: a class (or a ``functools.partial`` of one)
    must define every method of the protocol it aims at (:func:`flashrt_gym.simulator.check_simulator`).
    Its data members, and everything of a plain factory function, are checked when an env makes the
    simulator, before anything else reads it.

    Args:
        env_id: the Gymnasium id.
        simulator: a callable that takes ``num_envs`` and returns a fresh simulator.
        **defaults: env arguments (``weights``, ``max_episode_steps``, ...).

    Raises:
        TypeError: ``simulator`` is not callable, or is a class that lacks protocol methods (all named).
    """
    if not callable(simulator):
        raise TypeError(
            f"simulator must be a callable that takes num_envs and returns a fresh simulator, got {simulator!r}"
        )
    target = simulator.func if isinstance(simulator, functools.partial) else simulator
    if isinstance(target, type):
        check_simulator(target)
    gymnasium.register(
        id=env_id,
        entry_point=functools.partial(FlashRTEnv, simulator=simulator, **defaults),
        vector_entry_point=functools.partial(FlashRTVectorEnv, simulator=simulator, **defaults),
        max_episode_steps=defaults.get("max_episode_steps", MAX_EPISODE_STEPS),  # the env's own truncation
    )


def register_builtins() -> None:
    """Register every built-in id (see the module docstring); :mod:`flashrt_gym` calls it once."""
    gymnasium.register(
        id="FlashRT-VLA",
        entry_point="flashrt_gym.single:FlashRTEnv",
        vector_entry_point="flashrt_gym.env:FlashRTVectorEnv",
        max_episode_steps=MAX_EPISODE_STEPS,  # gym.make's TimeLimit then truncates on the env's own step
    )
    register_simulator("FlashRT-MuJoCoPush", mujoco_push)
    register_simulator("FlashRT-MuJoCoWarpPush", warp_push)
    long = {"max_episode_steps": METAWORLD_EPISODE_STEPS}
    register_simulator("FlashRT-MetaWorld-MT10-v0", functools.partial(metaworld, tasks="MT10"), **long)
    for task in METAWORLD_TASKS:  # FlashRT-MetaWorld-reach-v0 runs Meta-World's reach-v3 (MT1)
        name = f"FlashRT-MetaWorld-{task.removesuffix('-v3')}-v0"
        register_simulator(name, functools.partial(metaworld, tasks=task), **long)
