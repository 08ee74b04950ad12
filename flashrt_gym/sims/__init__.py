"""Simulators on a MuJoCo scene of the tabletop push task, and the wrapper's registration.

- :mod:`flashrt_gym.sims.push`: the task's configuration, the scene's checked layout and the task
  logic (draws, rewards, success, observation, scripted expert) every backend shares.
- :mod:`flashrt_gym.sims.mujoco_cpu`: :class:`MujocoPush`, MuJoCo's C library on the CPU, an
  external simulator (``get_state`` / ``set_state`` of whole slots as bytes).
- :mod:`flashrt_gym.sims.mujoco_warp`: :class:`WarpPush`, MuJoCo Warp on a GPU, an in-graph
  simulator whose ticks are recorded into the env's step graph.
- :mod:`flashrt_gym.sims.render`: a batched top-down renderer of the scene's primitive geoms.
- :mod:`flashrt_gym.sims.registration`: :func:`register_simulator`, any simulator under a
  Gymnasium id.
- :mod:`flashrt_gym.sims.demos`: scripted-expert demonstrations of the push task.

Importing this package registers ``FlashRT-MuJoCoPush`` (the CPU simulator) and
``FlashRT-MuJoCoWarpPush`` (MuJoCo Warp) with Gymnasium; ``mujoco``, ``warp`` and
``mujoco_warp`` are imported only when a simulator is made.
"""

import importlib
from typing import Any

from flashrt_gym.sims.registration import make_env, make_vector_env, register_simulator

_LAZY = {
    "MujocoPush": "flashrt_gym.sims.mujoco_cpu",
    "WarpPush": "flashrt_gym.sims.mujoco_warp",
    "PushConfig": "flashrt_gym.sims.push",
    "PushTask": "flashrt_gym.sims.push",
    "SCENE": "flashrt_gym.sims.push",
    "load_scene": "flashrt_gym.sims.push",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register_simulator("FlashRT-MuJoCoPush", "flashrt_gym.sims.mujoco_cpu:MujocoPush")
register_simulator("FlashRT-MuJoCoWarpPush", "flashrt_gym.sims.mujoco_warp:WarpPush")

__all__ = ["make_env", "make_vector_env", "register_simulator", *_LAZY]
