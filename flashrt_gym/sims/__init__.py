"""Simulators on a MuJoCo scene of the tabletop push task.

- :mod:`flashrt_gym.sims.push`: the task's configuration, the scene's checked layout and the task
  logic (draws, rewards, success, observation, scripted expert) every backend shares.
- :mod:`flashrt_gym.sims.mujoco_cpu`: :class:`MujocoPush`, MuJoCo's C library on the CPU, an
  external simulator (``get_state`` / ``set_state`` of whole slots as bytes).
- :mod:`flashrt_gym.sims.mujoco_warp`: :class:`WarpPush`, MuJoCo Warp on a GPU, an in-graph
  simulator whose ticks are recorded into the env's step graph.
- :mod:`flashrt_gym.sims.render`: a batched top-down renderer of the scene's primitive geoms.
- :mod:`flashrt_gym.sims.demos`: scripted-expert demonstrations of the push task.

Importing this package registers ``FlashRT-MuJoCoPush`` (the CPU simulator) and
``FlashRT-MuJoCoWarpPush`` (MuJoCo Warp) with Gymnasium (:func:`flashrt_gym.register_simulator`);
``mujoco``, ``warp`` and ``mujoco_warp`` are imported only when a simulator is made.
"""

import importlib
from typing import Any

from flashrt_gym import register_simulator

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


def mujoco_push(num_envs: int, cfg: Any = None, threads: int = 1) -> Any:
    """``FlashRT-MuJoCoPush``'s simulator: :class:`MujocoPush` of ``num_envs`` slots (``cfg``: a
    :class:`PushConfig` or a mapping of its fields) stepped by ``threads`` CPU threads."""
    return __getattr__("MujocoPush")(num_envs, cfg, threads)


def warp_push(num_envs: int, cfg: Any = None, **options: Any) -> Any:
    """``FlashRT-MuJoCoWarpPush``'s simulator: :class:`WarpPush` of ``num_envs`` worlds."""
    return __getattr__("WarpPush")(num_envs, cfg, **options)


register_simulator("FlashRT-MuJoCoPush", mujoco_push)
register_simulator("FlashRT-MuJoCoWarpPush", warp_push)

__all__ = ["mujoco_push", "warp_push", *_LAZY]
