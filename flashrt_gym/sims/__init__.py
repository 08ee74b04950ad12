"""Simulators on a MuJoCo scene of the tabletop push task.

- :mod:`flashrt_gym.sims.push`: the task's configuration, the scene's checked layout and the task
  logic (draws, rewards, success, observation, scripted expert) every backend shares.
- :mod:`flashrt_gym.sims.mujoco_cpu`: :class:`MujocoPush`, MuJoCo's C library on the CPU, an
  external simulator (``get_state`` / ``set_state`` of whole slots as bytes).
- :mod:`flashrt_gym.sims.mujoco_warp`: MuJoCo Warp on a CUDA GPU.
- :mod:`flashrt_gym.sims.render`: a batched top-down renderer of the scene's primitive geoms.

``mujoco``, ``warp`` and ``mujoco_warp`` are imported only when a simulator is made.
"""

import importlib
from typing import Any

_LAZY = {
    "MujocoPush": "flashrt_gym.sims.mujoco_cpu",
    "PushConfig": "flashrt_gym.sims.push",
    "PushTask": "flashrt_gym.sims.push",
    "SCENE": "flashrt_gym.sims.push",
    "load_scene": "flashrt_gym.sims.push",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_LAZY)
