"""Typed handles to a buffer set: an owner's buffers as the fields of a dataclass.

Each owner of buffers (a simulator, the policy, the env's step outputs) declares its buffers once,
as the fields of a frozen dataclass of tensors, and binds it to the one :class:`BufferSet` that
holds them: field ``x`` of an owner with prefix ``"sim"`` is the buffer ``"sim.x"``. Code then
reads ``state.ee`` rather than ``bufs["sim.ee"]``, and a missing buffer is an error at bind time,
not in the middle of a captured step. The set stays the one arena that capsules copy; a handle
holds views into it, never memory of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from flashrt.runtime.buffers import BufferSet

T = TypeVar("T")


def bind_views(cls: type[T], bufs: BufferSet, prefix: str) -> T:
    """An instance of the dataclass ``cls`` whose field ``x`` is the buffer ``f"{prefix}.{x}"``.

    A field with a default (``None``) is optional: it stays at its default where the set has no
    such buffer (e.g. a history ring that a configuration without history does not declare).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"bind_views takes a dataclass of tensors, got {cls!r}")
    values: dict[str, Any] = {}
    missing = []
    for f in dataclasses.fields(cls):
        name = f"{prefix}.{f.name}"
        if name in bufs:
            values[f.name] = bufs[name]
        elif f.default is dataclasses.MISSING:
            missing.append(name)
    if missing:
        raise KeyError(f"{cls.__name__} needs buffers {missing}; declare them in the buffer set's specs")
    return cls(**values)
