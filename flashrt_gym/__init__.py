"""FlashRT-Gym: a VLA flow policy and a batched task simulator as one captured step.

Importing the package registers ``FlashRT-VLA`` with Gymnasium:

    env = gymnasium.make("FlashRT-VLA")                                   # FlashRTEnv
    envs = gymnasium.make_vec("FlashRT-VLA", num_envs=64, vectorization_mode="vector_entry_point")
"""

import gymnasium

from flashrt_gym.env import FlashRTEnv, FlashRTVectorEnv

gymnasium.register(
    id="FlashRT-VLA",
    entry_point="flashrt_gym.env:FlashRTEnv",
    vector_entry_point="flashrt_gym.env:FlashRTVectorEnv",
)

__all__ = ["FlashRTEnv", "FlashRTVectorEnv"]
