"""Old import paths kept for one release: each old module is an alias of the module that now
holds its code, and importing it warns (``DeprecationWarning``) with the new path."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any


def alias(old: str, new: str) -> ModuleType:
    """Make the module path ``old`` another name of the module ``new``, with a warning.

    Called from the old module's own body (``alias(__name__, "flashrt_gym.learners.fast_sac")``):
    ``import old`` and ``from old import X`` then give ``new``'s objects themselves (classes keep
    their identity, pickles that name ``old`` still load).

    Args:
        old: the old module's dotted path. new: where its code lives now.

    Returns:
        The module ``new`` (also bound as ``sys.modules[old]``).
    """
    warnings.warn(f"{old} has moved to {new}; import it from there", DeprecationWarning, stacklevel=3)
    module = importlib.import_module(new)
    sys.modules[old] = module
    return module


def moved_names(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that serves names moved out of ``module``, with a warning.

    Args:
        module: the module that held the names. names: each moved name to the module that holds it now.

    Returns:
        The ``__getattr__`` to bind in ``module``.
    """

    def getattr_(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} has moved to {names[name]}.{name}; import it from there", DeprecationWarning, stacklevel=2
        )
        return getattr(importlib.import_module(names[name]), name)

    return getattr_
