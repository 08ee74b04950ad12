"""Deprecated path of :mod:`flashrt_gym.learners.graph_sac` (kept for one release; import from there)."""

from flashrt_gym.deprecated import alias

alias(__name__, "flashrt_gym.learners.graph_sac")
