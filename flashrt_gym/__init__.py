"""FlashRT-Gym: a VLA flow policy and a simulator as captured steps over one set of buffers.

Importing the package registers ``FlashRT-VLA`` (the shipped ``tiny`` policy on the built-in
tabletop) with Gymnasium:

    env = gymnasium.make("FlashRT-VLA")                                   # FlashRTEnv, one slot
    envs = gymnasium.make_vec("FlashRT-VLA", num_envs=64, vectorization_mode="vector_entry_point")

:func:`register_simulator` wraps a simulator of one's own (in-graph or external) the same way;
:mod:`flashrt_gym.registration` lists every built-in id.
"""

from __future__ import annotations

from flashrt_gym.env import FlashRTVectorEnv
from flashrt_gym.registration import register_builtins, register_simulator
from flashrt_gym.simulator import ExternalSimulator, Simulator
from flashrt_gym.single import FlashRTEnv

__version__ = "0.1.0"  # the distribution's version too (pyproject reads it from here)

register_builtins()

__all__ = ["ExternalSimulator", "FlashRTEnv", "FlashRTVectorEnv", "Simulator", "__version__", "register_simulator"]
