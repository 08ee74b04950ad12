"""Batched pure-torch task simulators (state in static buffers, capturable steps)."""

from flashrt_gym.tasks.tabletop import COLORS, GOALS, SHAPES, Tabletop, TabletopConfig

__all__ = ["COLORS", "GOALS", "SHAPES", "Tabletop", "TabletopConfig"]
