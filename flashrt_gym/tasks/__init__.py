"""Batched pure-torch task simulators (state in static buffers, capturable steps)."""

from flashrt_gym.tasks.tabletop import Tabletop, TabletopState
from flashrt_gym.tasks.tabletop_config import COLORS, GOALS, SHAPES, TabletopConfig

__all__ = ["COLORS", "GOALS", "SHAPES", "Tabletop", "TabletopConfig", "TabletopState"]
