"""The execution contract: static buffers, captured graphs, streams, and capsules.

Mechanism only: this package knows buffers, graphs, streams, copies and capsules, never
models, environments, sessions or rewards.
"""

from flashrt.runtime.buffers import ALIGN, BufferSet, BufferSpec, scratch, shared, slot
from flashrt.runtime.capsule import Capsule, snapshot
from flashrt.runtime.descriptor import CapsuleError, CapsuleFileError, DeploymentMismatchError, LayoutMismatchError
from flashrt.runtime.files import atomic_write
from flashrt.runtime.graphs import Graph, MissingVariantError, collector_paused
from flashrt.runtime.registry import CapsuleRegistry, RegistryStats
from flashrt.runtime.slots import copy_rows, masked_restore
from flashrt.runtime.streams import Event, Stream
from flashrt.runtime.verbs import fork, restore, rollback

__version__ = "0.1.0"

__all__ = [
    "ALIGN",
    "BufferSet",
    "BufferSpec",
    "Capsule",
    "CapsuleError",
    "CapsuleFileError",
    "CapsuleRegistry",
    "DeploymentMismatchError",
    "Event",
    "Graph",
    "LayoutMismatchError",
    "MissingVariantError",
    "RegistryStats",
    "Stream",
    "atomic_write",
    "collector_paused",
    "copy_rows",
    "fork",
    "masked_restore",
    "restore",
    "rollback",
    "scratch",
    "shared",
    "slot",
    "snapshot",
]
