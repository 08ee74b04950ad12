"""Simulators on MuJoCo: the tabletop push task, Meta-World, and any Gymnasium MuJoCo env.

- :mod:`flashrt_gym.sims.push`: the task's configuration, the scene's checked layout and the task
  logic (draws, rewards, success, observation, scripted expert) every backend shares.
- :mod:`flashrt_gym.sims.mujoco_cpu`: :class:`MujocoPush`, MuJoCo's C library on the CPU, an
  external simulator (``get_state`` / ``set_state`` of whole slots as bytes).
- :mod:`flashrt_gym.sims.mujoco_warp`: :class:`WarpPush`, MuJoCo Warp on a GPU, an in-graph
  simulator whose ticks are recorded into the env's step graph.
- :mod:`flashrt_gym.sims.render`: a batched top-down renderer of the scene's primitive geoms.
- :mod:`flashrt_gym.sims.demos`: scripted-expert demonstrations of the push task.
- :mod:`flashrt_gym.sims.metaworld_cpu`: :class:`MetaWorld`, Meta-World's tasks on MuJoCo's C
  library, an external simulator whose rows :mod:`flashrt_gym.sims.metaworld_state` finds by rule;
  registered as ``FlashRT-MetaWorld-<task>-v0`` (MT1) and ``FlashRT-MetaWorld-MT10-v0``
  (``metaworld`` is imported only when one is made); :mod:`flashrt_gym.sims.metaworld_demos`: its
  scripted-expert demonstrations.
- :mod:`flashrt_gym.sims.gym_external`: :class:`GymnasiumMujocoSim`, any Gymnasium MuJoCo env as a
  batched external simulator (bring your own; not registered here).

The factories below are the simulators of ``FlashRT-MuJoCoPush`` (the CPU simulator),
``FlashRT-MuJoCoWarpPush`` (MuJoCo Warp) and ``FlashRT-MetaWorld-*`` (:mod:`flashrt_gym.registration`
registers them); ``mujoco``, ``warp``, ``mujoco_warp`` and ``metaworld`` are imported only when a
simulator is made.
"""

import importlib
from collections.abc import Sequence
from typing import Any

_LAZY = {
    "MujocoPush": "flashrt_gym.sims.mujoco_cpu",
    "WarpPush": "flashrt_gym.sims.mujoco_warp",
    "MetaWorld": "flashrt_gym.sims.metaworld_cpu",
    "PushConfig": "flashrt_gym.sims.push",
    "PushTask": "flashrt_gym.sims.push",
    "SCENE": "flashrt_gym.sims.push",
    "load_scene": "flashrt_gym.sims.push",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def mujoco_push(num_envs: int, cfg: Any = None, threads: int = 1) -> Any:
    """``FlashRT-MuJoCoPush``'s simulator: :class:`MujocoPush` of ``num_envs`` slots (``cfg``: a
    :class:`PushConfig` or a mapping of its fields) stepped by ``threads`` CPU threads."""
    return __getattr__("MujocoPush")(num_envs, cfg, threads)


def warp_push(num_envs: int, cfg: Any = None, **options: Any) -> Any:
    """``FlashRT-MuJoCoWarpPush``'s simulator: :class:`WarpPush` of ``num_envs`` worlds."""
    return __getattr__("WarpPush")(num_envs, cfg, **options)


def metaworld(
    num_envs: int,
    tasks: str | Sequence[str] = "MT10",
    threads: int = 1,
    image_size: int = 64,
    camera: str = "overview",
    block: int = 1,
) -> Any:
    """``FlashRT-MetaWorld-*``'s simulator: :class:`MetaWorld` of ``num_envs`` slots of Meta-World
    ``tasks`` (``"MT10"`` or task names, in runs of ``block`` slots) stepped by ``threads`` CPU threads."""
    return __getattr__("MetaWorld")(num_envs, tasks, threads, image_size, camera, block)


__all__ = ["metaworld", "mujoco_push", "warp_push", *_LAZY]
