"""Simulators on a MuJoCo scene of the tabletop push task.

- :mod:`flashrt_gym.sims.push`: the task's configuration, the scene's checked layout and the task
  logic (draws, rewards, success, observation, scripted expert) every backend shares.
- :mod:`flashrt_gym.sims.mujoco_cpu`: :class:`MujocoPush`, MuJoCo's C library on the CPU (an
  external simulator: batched ``get_state`` / ``set_state`` of whole slots as bytes).
- :mod:`flashrt_gym.sims.mujoco_warp`: MuJoCo Warp on a CUDA GPU (imports ``warp`` and
  ``mujoco_warp`` only when used).
- :mod:`flashrt_gym.sims.render`: a batched top-down renderer of the scene's primitive geoms.
"""

from flashrt_gym.sims.mujoco_cpu import MujocoPush
from flashrt_gym.sims.push import SCENE, PushConfig, PushTask, load_scene

__all__ = ["SCENE", "MujocoPush", "PushConfig", "PushTask", "load_scene"]
