"""The tabletop push task on a MuJoCo scene, and its backends.

- :mod:`flashrt_gym.sims.push.task`: the task's configuration, the scene's checked layout and the
  task logic (draws, rewards, success, observation, scripted expert) every backend shares;
- :mod:`flashrt_gym.sims.push.mujoco_cpu`: :class:`~flashrt_gym.sims.push.mujoco_cpu.MujocoPush`,
  MuJoCo's C library on the CPU, an external simulator;
- :mod:`flashrt_gym.sims.push.mujoco_warp`: :class:`~flashrt_gym.sims.push.mujoco_warp.WarpPush`,
  MuJoCo Warp on a GPU, an in-graph simulator (:mod:`flashrt_gym.sims.push.warp_api`: the Warp
  calls it makes);
- :mod:`flashrt_gym.sims.push.render`: a batched top-down renderer of the scene's primitive geoms.

The task's names are re-exported here (importing this package imports ``mujoco``).
"""

from flashrt_gym.sims.push.task import (
    SCENE,
    Footprint,
    PushConfig,
    PushTask,
    SceneLayout,
    as_push_config,
    body_name,
    load_scene,
    model_digest,
    yaw_of,
)

__all__ = [
    "SCENE",
    "Footprint",
    "PushConfig",
    "PushTask",
    "SceneLayout",
    "as_push_config",
    "body_name",
    "load_scene",
    "model_digest",
    "yaw_of",
]
