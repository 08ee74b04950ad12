"""Deprecated path (kept for one release): the protocol is :mod:`flashrt_gym.simulator`'s, the
engine's hand-off :mod:`flashrt_gym.engine.host_link`'s."""

from flashrt_gym.deprecated import moved_names

__getattr__ = moved_names(
    __name__,
    {
        **dict.fromkeys(
            ("ExternalSimulator", "check_simulator", "is_external", "missing_members"), "flashrt_gym.simulator"
        ),
        **dict.fromkeys(("Mirror", "MirrorState", "UPLOADED"), "flashrt_gym.engine.host_link"),
    },
)
