"""The simulators that ship with FlashRT-Gym, each wing in its own folder or module:

- :mod:`flashrt_gym.sims.tabletop`: the built-in tabletop, a pure-torch in-graph simulator;
- :mod:`flashrt_gym.sims.push`: the push task on MuJoCo, on the CPU (:class:`MujocoPush`, external)
  and on a GPU (:class:`WarpPush`, MuJoCo Warp, in-graph);
- :mod:`flashrt_gym.sims.metaworld_cpu`: :class:`MetaWorld`, Meta-World's tasks on MuJoCo's C
  library, an external simulator whose rows :mod:`flashrt_gym.sims.metaworld_state` finds by rule
  (the tasks and their instructions: :mod:`flashrt_gym.sims.metaworld_tasks`);
- :mod:`flashrt_gym.sims.gymnasium_mujoco`: :class:`GymnasiumMujocoSim`, any Gymnasium MuJoCo env as
  a batched external simulator (bring your own; not registered).

The factories below are the simulators of ``FlashRT-MuJoCoPush``, ``FlashRT-MuJoCoWarpPush`` and
``FlashRT-MetaWorld-*`` (:mod:`flashrt_gym.registration` registers them); ``mujoco``, ``warp``,
``mujoco_warp`` and ``metaworld`` are imported only when a simulator is made. Demonstrations of
these tasks are in :mod:`flashrt_gym.demos`.
"""

import functools
import importlib
from collections.abc import Sequence
from typing import Any

_LAZY = {
    "MujocoPush": "flashrt_gym.sims.push.mujoco_cpu",
    "WarpPush": "flashrt_gym.sims.push.mujoco_warp",
    "MetaWorld": "flashrt_gym.sims.metaworld_cpu",
    "Processes": "flashrt_gym.sims.processes",
    "PositionFree": "flashrt_gym.sims.processes",
    "PushConfig": "flashrt_gym.sims.push.task",
    "PushTask": "flashrt_gym.sims.push.task",
    "SCENE": "flashrt_gym.sims.push.task",
    "load_scene": "flashrt_gym.sims.push.task",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def mujoco_push(num_envs: int, cfg: Any = None, threads: int = 1, processes: int = 1) -> Any:
    """``FlashRT-MuJoCoPush``'s simulator: :class:`MujocoPush` of ``num_envs`` slots (``cfg``: a
    :class:`PushConfig` or a mapping of its fields) stepped by ``threads`` CPU threads; with
    ``processes`` > 1 the slots split over that many worker processes of ``threads`` threads each,
    at most one a slot (:class:`~flashrt_gym.sims.processes.Processes`: the step's Python holds the
    GIL). The same bytes for any counts."""
    make = functools.partial(__getattr__("MujocoPush"), cfg=cfg, threads=threads)
    return _sharded(__getattr__("PositionFree")(make), num_envs, processes)


def warp_push(
    num_envs: int, cfg: Any = None, capture: str = "warp", deterministic: bool = False, **options: Any
) -> Any:
    """``FlashRT-MuJoCoWarpPush``'s simulator (and the Hydra task ``mujoco_warp_push``'s):
    :class:`WarpPush` of ``num_envs`` worlds, by default the step split around MuJoCo Warp's own
    graph with its determinism off: several times the deterministic one-graph step's rate, with
    a small fraction of its Warp memory, and with many worlds no mode repeats a run bit for bit
    anyway (measured in ``docs/PERFORMANCE.md``). ``capture="torch",
    deterministic=True`` (:class:`WarpPush`'s own default) is the one-graph step, byte-exact at
    one world. ``options``: :class:`WarpPush`'s other arguments."""
    return __getattr__("WarpPush")(num_envs, cfg, capture=capture, deterministic=deterministic, **options)


def metaworld(
    num_envs: int,
    tasks: str | Sequence[str] = "MT10",
    threads: int = 1,
    image_size: int = 64,
    camera: str = "overview",
    block: int = 1,
    processes: int = 1,
) -> Any:
    """``FlashRT-MetaWorld-*``'s simulator: :class:`MetaWorld` of ``num_envs`` slots of Meta-World
    ``tasks`` (``"MT10"`` or task names, in runs of ``block`` slots) stepped by ``threads`` CPU
    threads; with ``processes`` > 1, the slots split over that many worker processes of
    ``threads`` threads each, at most one a slot (:class:`~flashrt_gym.sims.processes.Processes`:
    Meta-World's Python code holds the GIL, so threads alone do not fill the cores; a run's
    smaller evaluation env takes what it can use). The same bytes for any counts."""
    make = functools.partial(
        __getattr__("MetaWorld"), tasks=tasks, threads=threads, image_size=image_size, camera=camera, block=block
    )
    return _sharded(make, num_envs, processes)


def _sharded(make: Any, num_envs: int, processes: int) -> Any:
    """``make``'s simulator of ``num_envs`` slots in this process, or split over ``processes``
    worker processes (at most one a slot; :class:`~flashrt_gym.sims.processes.Processes`)."""
    processes = min(processes, num_envs)
    if processes == 1:
        return make(num_envs, first_slot=0)
    return __getattr__("Processes")(make, num_envs, processes)


__all__ = ["metaworld", "mujoco_push", "warp_push", *_LAZY]
