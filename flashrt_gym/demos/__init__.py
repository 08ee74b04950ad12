"""Demonstrations from scripted experts, one module a task, in one shard format.

A shard (safetensors) holds the ticks of whole episodes, concatenated: ``image`` (T, H, W, 3)
uint8 seen before acting, ``proprio`` (T, P), ``action`` (T, A) executed, ``instruction`` (T,)
int64, ``episode`` (T,) int64 and ``tick`` (T,) int64 (0 at each episode's first tick), plus the
task configuration and instruction texts as metadata (``format``: :data:`FORMAT`).

- :mod:`flashrt_gym.demos.tabletop`: the built-in tabletop, and :class:`~flashrt_gym.demos.tabletop.Windows`,
  the windows behaviour cloning trains on (any task's shards);
- :mod:`flashrt_gym.demos.push`: the MuJoCo push task;
- :mod:`flashrt_gym.demos.metaworld`: Meta-World's tasks.
"""

from flashrt_gym.deprecated import moved_names

FORMAT = "flashrt-demos/1"
"""The shards' format name (their ``format`` metadata)."""

__getattr__ = moved_names(
    __name__, dict.fromkeys(("Windows", "collect", "load_shards", "save_shard"), "flashrt_gym.demos.tabletop")
)

__all__ = ["FORMAT"]
