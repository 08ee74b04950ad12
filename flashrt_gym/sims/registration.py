"""Wrap a simulator with the VLA under a Gymnasium id, in one call: :func:`register_simulator`.

A simulator factory is called with the number of slots and returns a fresh simulator, either
in-graph (:class:`flashrt_gym.simulator.Simulator`) or external
(:class:`flashrt_gym.external.ExternalSimulator`)::

    register_simulator("MyLab-Push", "my_lab.sims:PushSim", max_episode_steps=60)
    env = gymnasium.make("MyLab-Push")                       # one slot (FlashRTEnv)
    envs = gymnasium.make_vec("MyLab-Push", num_envs=256, vectorization_mode="vector_entry_point")

The factory may be given as ``"module:attribute"``, imported only when an env is made (a
registration then costs no import of the simulator's packages), or as a callable.
``simulator_kwargs`` given to ``make``/``make_vec`` go to the factory; every other keyword goes
to :class:`~flashrt_gym.env.FlashRTVectorEnv` (``obs_mode``, ``weights``, ``device``, ...).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium

from flashrt_gym.env import FlashRTEnv, FlashRTVectorEnv

SimulatorFactory = Callable[..., Any]
"""``factory(num_slots, **simulator_kwargs)`` -> a fresh in-graph or external simulator."""


def _split(name: str) -> tuple[str, str]:
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"simulator {name!r} must be 'module:attribute', e.g. 'my_lab.sims:PushSim'")
    return module, attr


def resolve_factory(simulator: str | SimulatorFactory) -> SimulatorFactory:
    """The factory named by ``"module:attribute"`` (imported now), or ``simulator`` itself."""
    if isinstance(simulator, str):
        module, attr = _split(simulator)
        try:
            found = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load the simulator factory {simulator!r}: {e}") from e
        simulator = found
    if not callable(simulator):
        raise TypeError(f"simulator must be a factory(num_slots, **kwargs) or 'module:attribute', got {simulator!r}")
    return simulator


def _options(simulator_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    if simulator_kwargs is not None and not isinstance(simulator_kwargs, Mapping):
        raise TypeError(f"simulator_kwargs must be a mapping of the factory's keywords, got {simulator_kwargs!r}")
    return dict(simulator_kwargs or {})


def make_vector_env(
    num_envs: int = 1,
    *,
    simulator: str | SimulatorFactory,
    simulator_kwargs: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> FlashRTVectorEnv:
    """A :class:`FlashRTVectorEnv` of ``num_envs`` slots around ``simulator(num_envs,
    **simulator_kwargs)`` (the vector entry point of :func:`register_simulator`)."""
    factory, options = resolve_factory(simulator), _options(simulator_kwargs)
    return FlashRTVectorEnv(num_envs, simulator=lambda: factory(num_envs, **options), **kwargs)


def make_env(
    *,
    simulator: str | SimulatorFactory,
    simulator_kwargs: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> FlashRTEnv:
    """A one-slot :class:`FlashRTEnv` around ``simulator(1, **simulator_kwargs)`` (the entry
    point of :func:`register_simulator`)."""
    factory, options = resolve_factory(simulator), _options(simulator_kwargs)
    return FlashRTEnv(simulator=lambda: factory(1, **options), **kwargs)


def register_simulator(id: str, simulator: str | SimulatorFactory, **env_defaults: Any) -> None:
    """Register ``id`` with Gymnasium: the shipped VLA (or ``weights=``) steering ``simulator``,
    for ``gymnasium.make`` (one slot, :class:`FlashRTEnv`) and ``gymnasium.make_vec`` with
    ``vectorization_mode="vector_entry_point"`` (:class:`FlashRTVectorEnv`, all slots in one
    step). ``env_defaults`` are keyword defaults of the env (and ``simulator_kwargs``), which
    ``make``/``make_vec`` keywords override."""
    if not isinstance(id, str) or not id:
        raise ValueError(f"id must be a non-empty Gymnasium id such as 'MyLab-Push', got {id!r}")
    if isinstance(simulator, str):
        _split(simulator)
    elif not callable(simulator):
        raise TypeError(f"simulator must be a factory(num_slots, **kwargs) or 'module:attribute', got {simulator!r}")
    for name in ("simulator", "task", "num_envs"):
        if name in env_defaults:
            raise ValueError(f"register_simulator: {name!r} is not an env default here (the simulator is the factory)")
    gymnasium.register(
        id=id,
        entry_point="flashrt_gym.sims.registration:make_env",
        vector_entry_point="flashrt_gym.sims.registration:make_vector_env",
        kwargs={"simulator": simulator, **env_defaults},
    )
