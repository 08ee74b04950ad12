"""Named static buffers in contiguous arenas: the only state primitive of the runtime.

A :class:`BufferSet` is allocated once, before any graph is captured, and never reallocated.
Every buffer is a typed view into one of three byte arenas on the set's device:

``slot``    per-slot live state, shape ``(num_slots, *shape)``. The slot arena is *slot-major*:
            ``slot_arena[s]`` is one contiguous byte row holding every slot buffer of slot
            ``s``. Snapshotting, restoring or forking any set of slots is therefore one row
            copy over the whole state, whatever the buffers' dtypes (one capturable op; see
            :func:`flashrt.runtime.slots.masked_restore`). The price: a slot buffer is strided along
            the slot dimension (stride = the row, not the buffer), so ``.view`` across the
            slot dimension is not available; use ``.reshape`` or index per slot.
``shared``  live state without a slot dimension (e.g. a global tick counter).
``scratch`` intermediates that are rewritten before being read inside every step; not part of
            any capsule.

Offsets are aligned to :data:`ALIGN` bytes, so any dtype view is legal and vectorised copies
stay aligned.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

ALIGN = 64
"""Byte alignment of every buffer offset and of the slot row length."""

Kind = Literal["slot", "shared", "scratch"]
KINDS: tuple[Kind, ...] = ("slot", "shared", "scratch")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the name used in descriptors and files)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`; raises ``ValueError`` for an unknown name."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}; use a torch dtype name such as 'float32' or 'bfloat16'")
    return dtype


@dataclass(frozen=True)
class BufferSpec:
    """Declaration of one buffer.

    Args:
        name: unique name within the set (dots allowed, e.g. ``"sim.pos"``).
        shape: shape of one slot's part for ``slot`` buffers, the full shape otherwise.
        dtype: element type.
        kind: ``"slot"`` (per-slot live state), ``"shared"`` (live state, no slot dim) or
            ``"scratch"`` (intermediates, not part of capsules).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    kind: Kind = "slot"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"buffer name must be a non-empty string, got {self.name!r}; name every buffer")
        if self.kind not in KINDS:
            raise ValueError(f"buffer {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"buffer {self.name!r}: negative dimension in shape {self.shape}; sizes are >= 0")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(
                f"buffer {self.name!r}: dtype must be a torch.dtype (e.g. torch.float32), got {self.dtype!r}"
            )

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of one slot's part (slot buffers) or of the whole buffer (others)."""
        return self.numel * self.dtype.itemsize


def slot(name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> BufferSpec:
    """Spec of a per-slot state buffer; ``shape`` excludes the slot dimension."""
    return BufferSpec(name, tuple(shape), dtype, "slot")


def shared(name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> BufferSpec:
    """Spec of a state buffer without a slot dimension."""
    return BufferSpec(name, tuple(shape), dtype, "shared")


def scratch(name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> BufferSpec:
    """Spec of an intermediate buffer (not part of capsules)."""
    return BufferSpec(name, tuple(shape), dtype, "scratch")


@dataclass(frozen=True)
class Placement:
    """Where a buffer lives: its spec and byte offset in its arena (within the row for slots)."""

    spec: BufferSpec
    offset: int


class BufferSet(Mapping[str, torch.Tensor]):
    """A closed, named set of statically allocated tensors.

    Read-only mapping from name to tensor: the tensors themselves are written in place
    (``bufs["x"].copy_(...)``), never replaced.

    Args:
        specs: the buffers (see :class:`BufferSpec` and the :func:`slot` / :func:`shared` /
            :func:`scratch` helpers).
        num_slots: size of the leading slot dimension of ``slot`` buffers (>= 1).
        device: where the arenas live.
        pin_memory: allocate host arenas in page-locked memory (needed for asynchronous
            host<->device copies). Ignored without CUDA.
        deployment: the owner's deployment digest (model config, weights checksum, kernel
            version...). Capsules carry it and refuse to restore into another deployment.

    Example:
        >>> bufs = BufferSet([slot("pos", (2,)), shared("tick", (), torch.int64)], num_slots=4)
        >>> bufs["pos"].shape
        torch.Size([4, 2])
    """

    def __init__(
        self,
        specs: Sequence[BufferSpec],
        num_slots: int,
        device: torch.device | str = "cpu",
        *,
        pin_memory: bool = False,
        deployment: str = "",
    ) -> None:
        if int(num_slots) < 1:
            raise ValueError(f"num_slots must be >= 1 (slot buffers have one row per slot), got {num_slots}")
        names = [s.name for s in specs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate buffer names: {dupes}; give each buffer its own name")
        self.num_slots = int(num_slots)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # one canonical name per device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.deployment = str(deployment)
        self.uid = uuid.uuid4().hex  # session identity: rollback only accepts this set's capsules
        self.pinned = bool(pin_memory and self.device.type == "cpu" and torch.cuda.is_available())

        sizes = dict.fromkeys(KINDS, 0)
        self.placements: dict[str, Placement] = {}
        for spec in specs:
            self.placements[spec.name] = Placement(spec, sizes[spec.kind])
            sizes[spec.kind] += _align(spec.nbytes)
        self.row_bytes = sizes["slot"]

        def arena(shape: tuple[int, ...]) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.uint8, device=self.device, pin_memory=self.pinned)

        self.slot_arena = arena((self.num_slots, self.row_bytes))
        self.shared_arena = arena((sizes["shared"],))
        self.scratch_arena = arena((sizes["scratch"],))
        self._tensors = {n: self._view(p) for n, p in self.placements.items()}
        self._names_by_kind = {k: tuple(n for n, p in self.placements.items() if p.spec.kind == k) for k in KINDS}
        state = [
            (n, p.spec.kind, list(p.spec.shape), dtype_name(p.spec.dtype), p.offset)
            for n, p in self.placements.items()
            if p.spec.kind != "scratch"
        ]
        self._layout_digest = hashlib.sha256(json.dumps([self.row_bytes, state]).encode()).hexdigest()[:16]

    def _view(self, p: Placement) -> torch.Tensor:
        s = p.spec
        if s.nbytes == 0:  # no bytes to view (a dtype view of an empty span is refused)
            lead = (self.num_slots,) if s.kind == "slot" else ()
            return torch.empty((*lead, *s.shape), dtype=s.dtype, device=self.device)
        if s.kind == "slot":
            raw = self.slot_arena[:, p.offset : p.offset + s.nbytes]
            return raw.view(s.dtype).view(self.num_slots, *s.shape)
        raw = (self.shared_arena if s.kind == "shared" else self.scratch_arena)[p.offset : p.offset + s.nbytes]
        return raw.view(s.dtype).view(s.shape)

    # -- mapping -----------------------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"no buffer named {name!r}; this set has {sorted(self._tensors)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return (
            f"BufferSet({len(self)} buffers, num_slots={self.num_slots}, device={self.device}, "
            f"state={self.state_nbytes} B)"
        )

    # -- layout ------------------------------------------------------------------------------
    @property
    def specs(self) -> tuple[BufferSpec, ...]:
        return tuple(p.spec for p in self.placements.values())

    def names(self, *kinds: Kind) -> tuple[str, ...]:
        """Buffer names of the given kinds (all kinds if none given), in declaration order."""
        if len(kinds) == 1:
            return self._names_by_kind[kinds[0]]
        want = kinds or KINDS
        return tuple(n for n, p in self.placements.items() if p.spec.kind in want)

    @property
    def state_nbytes(self) -> int:
        """Bytes of live state (slot + shared arenas): the size of a whole-set capsule."""
        return self.slot_arena.numel() + self.shared_arena.numel()

    @property
    def layout_digest(self) -> str:
        """Hash of the state layout (names, kinds, shapes, dtypes, offsets); independent of
        ``num_slots`` so that slot capsules move between variants of one deployment."""
        return self._layout_digest

    def clone(self, names: Sequence[str], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Copies of the named ``shared`` or ``scratch`` buffers (of one arena), made by one copy
        of the arena's byte span that holds them all (on ``device``, default the set's): declare
        buffers that are read out together next to each other, so that the span is tight. The
        copies share one fresh storage."""
        missing = [n for n in names if n not in self.placements]
        if missing:
            raise KeyError(f"no buffers named {missing}; this set has {sorted(self.placements)}")
        places = [self.placements[n] for n in names]
        kinds = sorted({p.spec.kind for p in places})
        if not places or kinds not in (["shared"], ["scratch"]):
            raise ValueError(
                f"clone takes one or more buffers of one arena, shared or scratch (slot buffers are strided "
                f"along the slot dimension: clone them one by one); got kinds {kinds} for {list(names)}"
            )
        arena = self.shared_arena if kinds == ["shared"] else self.scratch_arena
        lo = min(p.offset for p in places)
        span = arena[lo : max(p.offset + p.spec.nbytes for p in places)].to(device or self.device, copy=True)
        return {
            n: span[p.offset - lo : p.offset - lo + p.spec.nbytes].view(p.spec.dtype).view(p.spec.shape)
            for n, p in zip(names, places, strict=True)
        }
