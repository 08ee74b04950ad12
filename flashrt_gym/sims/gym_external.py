"""Deprecated path of :mod:`flashrt_gym.sims.gymnasium_mujoco` (kept for one release; import from there)."""

from flashrt_gym.deprecated import alias

alias(__name__, "flashrt_gym.sims.gymnasium_mujoco")
