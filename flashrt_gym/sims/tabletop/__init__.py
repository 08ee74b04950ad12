"""The built-in tabletop: a batched pure-torch (and Triton) in-graph simulator, its state in
static slot buffers and every step capturable.

- :mod:`flashrt_gym.sims.tabletop.config`: :class:`TabletopConfig`, the scene's shapes, colors and goals;
- :mod:`flashrt_gym.sims.tabletop.triton_kernels`: the fused Triton tick, reset and render;
- :mod:`flashrt_gym.sims.tabletop.tabletop`: :class:`Tabletop`, the simulator.
"""

from flashrt_gym.sims.tabletop.config import COLORS, GOALS, SHAPES, TabletopConfig, as_tabletop_config
from flashrt_gym.sims.tabletop.tabletop import Tabletop, TabletopState

__all__ = ["COLORS", "GOALS", "SHAPES", "Tabletop", "TabletopConfig", "TabletopState", "as_tabletop_config"]
