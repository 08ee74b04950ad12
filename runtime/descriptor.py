"""What a capsule holds, and the errors of capsules.

A :class:`Descriptor` names every buffer of a capsule, where its bytes sit in the capsule, the
layout and deployment it came from, and the owner's metadata. :meth:`Descriptor.parse` reads
one back from untrusted text and checks it against itself, so that nothing downstream (an
allocation, a copy) ever sees an offset, size or shape that does not add up.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from flashrt.runtime.buffers import ALIGN

STATE_KINDS = ("slot", "shared")

DTYPES = {
    "bool": ("BOOL", 1),
    "uint8": ("U8", 1),
    "int8": ("I8", 1),
    "int16": ("I16", 2),
    "uint16": ("U16", 2),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "int32": ("I32", 4),
    "uint32": ("U32", 4),
    "float32": ("F32", 4),
    "int64": ("I64", 8),
    "uint64": ("U64", 8),
    "float64": ("F64", 8),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
}
"""Buffer dtypes a capsule can hold: torch name -> (safetensors name, item size)."""

MAX_DIMS = 64
FIELDS = ("entries", "layout", "deployment", "slots", "num_rows", "row_bytes", "shared_bytes", "meta")


class CapsuleError(ValueError):
    """A capsule cannot be used as asked; the message names the mismatch and the fix."""


class DeploymentMismatchError(CapsuleError):
    """The capsule was made by another deployment (weights, config, kernels)."""


class LayoutMismatchError(CapsuleError):
    """The capsule's buffers do not match the target set's names, shapes, dtypes or kinds."""


class CapsuleFileError(CapsuleError):
    """A capsule file is missing, truncated, corrupted or not a capsule."""


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Entry:
    """One buffer in a capsule: what it is and where its bytes sit in the capsule."""

    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    offset: int  # within a capsule row (slot buffers) or the shared bytes (shared buffers)
    nbytes: int  # per slot for slot buffers


@dataclass(frozen=True)
class Descriptor:
    """Everything needed to check a capsule against a target before any byte moves."""

    entries: tuple[Entry, ...]
    layout: str  # layout digest of the origin set
    deployment: str  # owner-supplied deployment digest
    slots: tuple[int, ...] | None  # origin slots, in row order; None = the whole set
    num_rows: int  # captured slots (rows)
    row_bytes: int
    shared_bytes: int
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, allow_nan=False)

    @property
    def data_nbytes(self) -> int:
        """Bytes of the buffers' data, without padding (the data section of a capsule file)."""
        return sum(e.nbytes * (self.num_rows if e.kind == "slot" else 1) for e in self.entries)

    @classmethod
    def parse(cls, text: str) -> Descriptor:
        """The descriptor that :meth:`to_json` wrote, checked against itself.

        Raises:
            ValueError: naming the first field that is malformed or inconsistent: a missing or
                unknown key, a wrong type, a negative or unaligned offset, an ``nbytes`` that is
                not the shape's size, entries that overlap or lie outside their rows, a
                ``row_bytes`` / ``shared_bytes`` that is not the entries' aligned total, slots
                that do not match ``num_rows``.
        """
        try:
            d = json.loads(text, parse_constant=_no_constant)
        except RecursionError:
            raise ValueError("the descriptor nests too deeply") from None
        d = _fields(
            d,
            "descriptor",
            ("entries", "layout", "deployment", "slots", "num_rows", "row_bytes", "shared_bytes", "meta"),
        )
        for key in ("layout", "deployment"):
            if not isinstance(d[key], str):
                raise ValueError(f"descriptor.{key} must be a string, got {d[key]!r:.80}")
        if not isinstance(d["meta"], dict):
            raise ValueError(f"descriptor.meta must be an object, got {type(d['meta']).__name__}")
        num_rows = _int(d["num_rows"], "descriptor.num_rows", low=1)
        if not isinstance(d["entries"], list):
            raise ValueError(f"descriptor.entries must be a list, got {type(d['entries']).__name__}")
        entries = tuple(_entry(e, i) for i, e in enumerate(d["entries"]))
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise ValueError(
                f"descriptor.entries name a buffer twice: {sorted({n for n in names if names.count(n) > 1})}"
            )
        sizes = {}
        for kind, key in (("slot", "row_bytes"), ("shared", "shared_bytes")):
            sizes[kind] = _int(d[key], f"descriptor.{key}", low=0)
            mine = sorted((e for e in entries if e.kind == kind), key=lambda e: (e.offset, e.nbytes))
            total = sum(align(e.nbytes) for e in mine)
            if sizes[kind] != total:
                raise ValueError(f"descriptor.{key} is {sizes[kind]} but its {kind} entries take {total} aligned bytes")
            for a, b in itertools.pairwise(mine):
                if a.offset + a.nbytes > b.offset:
                    raise ValueError(f"entries {a.name!r} and {b.name!r} overlap")
            for e in mine:
                if e.offset + e.nbytes > total:
                    raise ValueError(f"entry {e.name!r} ends at byte {e.offset + e.nbytes}, past its {key} ({total})")
        slots = d["slots"]
        if slots is not None:
            if not isinstance(slots, list) or len(slots) != num_rows:
                raise ValueError(f"descriptor.slots must be null or a list of num_rows ({num_rows}) slot indices")
            slots = tuple(_int(s, "descriptor.slots[]", low=0) for s in slots)
            if len(set(slots)) != len(slots):
                raise ValueError("descriptor.slots holds a slot twice")
        return cls(entries, d["layout"], d["deployment"], slots, num_rows, sizes["slot"], sizes["shared"], d["meta"])


def _no_constant(name: str) -> None:
    raise ValueError(f"the descriptor holds {name}, which JSON does not allow")


def _fields(d: object, what: str, keys: tuple[str, ...]) -> dict:
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be an object, got {type(d).__name__}")
    if set(d) != set(keys):
        missing, unknown = sorted(set(keys) - set(d)), sorted(set(d) - set(keys))
        raise ValueError(f"{what} must have exactly the keys {sorted(keys)}; missing {missing}, unknown {unknown}")
    return d


def _int(x: object, what: str, *, low: int) -> int:
    if type(x) is not int or x < low:
        raise ValueError(f"{what} must be an integer >= {low}, got {x!r:.80}")
    return x


def _entry(e: object, i: int) -> Entry:
    what = f"descriptor.entries[{i}]"
    e = _fields(e, what, ("name", "kind", "shape", "dtype", "offset", "nbytes"))
    if not isinstance(e["name"], str) or not e["name"] or e["name"] == "__metadata__":
        raise ValueError(f"{what}.name must be a non-empty string other than '__metadata__', got {e['name']!r:.80}")
    if e["kind"] not in STATE_KINDS:
        raise ValueError(f"{what}.kind must be one of {STATE_KINDS}, got {e['kind']!r:.80}")
    if not isinstance(e["dtype"], str) or e["dtype"] not in DTYPES:
        raise ValueError(f"{what}.dtype must be one of {sorted(DTYPES)}, got {e['dtype']!r:.80}")
    if not isinstance(e["shape"], list) or len(e["shape"]) > MAX_DIMS:
        raise ValueError(f"{what}.shape must be a list of at most {MAX_DIMS} sizes, got {e['shape']!r:.80}")
    shape = tuple(_int(s, f"{what}.shape[]", low=0) for s in e["shape"])
    offset = _int(e["offset"], f"{what}.offset", low=0)
    if offset % ALIGN:
        raise ValueError(f"{what}.offset must be a multiple of {ALIGN}, got {offset}")
    nbytes = _int(e["nbytes"], f"{what}.nbytes", low=0)
    size = math.prod(shape) * DTYPES[e["dtype"]][1]
    if size != nbytes:
        raise ValueError(f"{what}.nbytes is {nbytes}, but a {e['dtype']} tensor of shape {list(shape)} takes {size}")
    return Entry(e["name"], e["kind"], shape, e["dtype"], offset, nbytes)
