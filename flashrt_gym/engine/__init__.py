"""The env's engine: :mod:`flashrt_gym.engine.engine` (:class:`Engine`, the one buffer set, the
step's programs and the one owner of their capture and replay) and
:mod:`flashrt_gym.engine.host_link` (the hand-off to an external simulator on the host)."""

from flashrt_gym.engine.engine import Engine, EpisodeState, Observations, StepInputs, StepOutputs

__all__ = ["Engine", "EpisodeState", "Observations", "StepInputs", "StepOutputs"]
