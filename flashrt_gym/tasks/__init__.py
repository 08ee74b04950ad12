"""Deprecated path of :mod:`flashrt_gym.sims.tabletop` (kept for one release; import from there)."""

import warnings

from flashrt_gym.sims.tabletop import COLORS, GOALS, SHAPES, Tabletop, TabletopConfig, TabletopState

warnings.warn(
    "flashrt_gym.tasks has moved to flashrt_gym.sims.tabletop; import it from there", DeprecationWarning, stacklevel=2
)

__all__ = ["COLORS", "GOALS", "SHAPES", "Tabletop", "TabletopConfig", "TabletopState"]
