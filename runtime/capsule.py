"""Execution-state capsules: the byte image of a buffer set's live state at a boundary.

Verbs (all byte copies; nothing is recomputed or recaptured):

- :func:`snapshot` copies the state of all or selected slots (and buffers) out;
- :func:`restore` copies a capsule back, all-or-nothing: every check runs before any byte moves;
- :func:`fork` copies one boundary (a capsule's slot or a live slot) into N slots;
- :func:`rollback` restores an earlier boundary of the same buffer set.

A capsule lives in one tier at a time: ``gpu`` (the origin device), ``host`` (pinned memory,
asynchronous copies) or ``disk`` (a safetensors file written atomically: one tensor per buffer
plus the descriptor and a SHA-256 of the data as metadata, verified on load).
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import safe_open, save

from flashrt.runtime.buffers import ALIGN, BufferSet, BufferSpec, dtype_from_name, dtype_name
from flashrt.runtime.files import atomic_write
from flashrt.runtime.slots import copy_rows
from flashrt.runtime.streams import Event, Stream

Tier = Literal["gpu", "host", "disk"]
TIERS: tuple[Tier, ...] = ("gpu", "host", "disk")
FORMAT = "flashrt-capsule/1"


class CapsuleError(ValueError):
    """A capsule cannot be used as asked; the message names the mismatch and the fix."""


class DeploymentMismatchError(CapsuleError):
    """The capsule was made by another deployment (weights, config, kernels)."""


class LayoutMismatchError(CapsuleError):
    """The capsule's buffers do not match the target set's names, shapes, dtypes or kinds."""


class CapsuleFileError(CapsuleError):
    """A capsule file is missing, truncated, corrupted or not a capsule."""


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
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Descriptor:
        d = json.loads(text)
        d["entries"] = tuple(Entry(**{**e, "shape": tuple(e["shape"])}) for e in d["entries"])
        d["slots"] = None if d["slots"] is None else tuple(d["slots"])
        d["meta"] = d.get("meta") or {}
        return cls(**d)

    @property
    def digest(self) -> str:
        """Deployment + layout: what a restore target must match."""
        return hashlib.sha256(f"{self.deployment}|{self.layout}".encode()).hexdigest()[:16]


class Capsule:
    """A committed boundary: a descriptor plus the bytes, in one tier.

    Build capsules with :func:`snapshot` or :meth:`load`; move them with :meth:`to`.

    Attributes:
        descriptor: names, shapes, dtypes, slots, owner metadata and digests.
        tier: ``"gpu"``, ``"host"`` or ``"disk"``.
        rows: ``(k, row_bytes)`` uint8 slot bytes, one row per captured slot (None on disk).
        shared: ``(shared_bytes,)`` uint8 bytes of shared buffers (None on disk).
        path: the file of a capsule that has been saved.
        origin: ``uid`` of the buffer set it was taken from (None once loaded from a file).
    """

    def __init__(
        self,
        descriptor: Descriptor,
        rows: torch.Tensor | None,
        shared: torch.Tensor | None,
        *,
        tier: Tier,
        device: torch.device,
        origin: str | None = None,
        path: Path | None = None,
        ready: Event | None = None,
    ) -> None:
        self.descriptor = descriptor
        self.rows = rows
        self.shared = shared
        self.tier: Tier = tier
        self.device = device  # the gpu tier's device
        self.origin = origin
        self.path = path
        self.ready = ready or Event()
        self.checked_for: set[str] = set()  # uids of the buffer sets this capsule was checked against

    @property
    def meta(self) -> dict[str, Any]:
        return self.descriptor.meta

    @property
    def slots(self) -> tuple[int, ...] | None:
        return self.descriptor.slots

    @property
    def nbytes(self) -> int:
        """Bytes of state the capsule holds (what a tier budget is charged)."""
        d = self.descriptor
        return d.num_rows * d.row_bytes + d.shared_bytes

    def __repr__(self) -> str:
        slots = "all" if self.slots is None else list(self.slots)
        return f"Capsule({len(self.descriptor.entries)} buffers, slots={slots}, {self.nbytes} B, tier={self.tier})"

    # -- tiers -------------------------------------------------------------------------------
    def to(self, tier: Tier, *, path: str | os.PathLike | None = None, stream: Stream | None = None) -> Capsule:
        """Move the capsule to ``tier`` in place and return it.

        ``gpu`` -> ``host`` copies into pinned memory asynchronously (``ready`` completes when
        it has landed); ``host`` -> ``gpu`` likewise; ``disk`` needs ``path`` unless the capsule
        was saved before, and frees the in-memory bytes; leaving ``disk`` reads and verifies the
        file.
        """
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        if tier == self.tier:
            return self
        if tier == "disk":
            target = Path(path) if path is not None else self.path
            if target is None:
                raise ValueError("moving a capsule to the disk tier needs path=...")
            self.save(target)
            self.rows = self.shared = None
            self.tier = "disk"
            return self
        if self.tier == "disk":
            loaded = Capsule.load(self.path, device=self.device, tier=tier)  # type: ignore[arg-type]
            if loaded.descriptor != self.descriptor:
                raise CapsuleFileError(f"{self.path} now holds another capsule; it was replaced on disk")
            self.rows, self.shared, self.ready = loaded.rows, loaded.shared, loaded.ready
            self.tier = tier
            return self
        assert self.rows is not None and self.shared is not None
        target_device = self.device if tier == "gpu" else torch.device("cpu")
        stream = stream or Stream.current(self.device)
        with stream:
            stream.wait(self.ready)
            self.rows = _to_device(self.rows, target_device)
            self.shared = _to_device(self.shared, target_device)
            self.ready = Event.record_on(stream)
        self.tier = tier
        return self

    # -- disk --------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the capsule to a safetensors file atomically (one temporary file beside it,
        fsync, rename; see :func:`flashrt.runtime.atomic_write`).

        One tensor per buffer (slot buffers as ``(k, *shape)``), the descriptor and a SHA-256
        of the tensors' bytes as metadata. An interrupted write leaves no file at ``path``.
        """
        path = Path(path)
        if self.tier == "disk":
            if self.path is not None and self.path.resolve() != path.resolve():
                raise ValueError(f"capsule is on disk at {self.path}; promote it before saving elsewhere")
            return path
        self.ready.synchronize()
        tensors = self._typed_tensors()
        meta = {
            "format": FORMAT,
            "descriptor": self.descriptor.to_json(),
            "sha256": _checksum(tensors, self.descriptor),
        }
        data = save(tensors, metadata=meta)  # in memory: safetensors' save_file makes a temporary file of its own
        atomic_write(path, lambda f: f.write(data))
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: torch.device | str = "cpu", tier: Tier = "gpu") -> Capsule:
        """Read and verify a capsule file. ``tier="gpu"`` puts the bytes on ``device``,
        ``"host"`` in (pinned) host memory. Raises :class:`CapsuleFileError` if the file is
        missing, truncated, corrupted or not a capsule."""
        path, device = Path(path), torch.device(device)
        if not path.is_file():
            raise CapsuleFileError(f"no capsule file at {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != FORMAT:
                    raise CapsuleFileError(
                        f"{path} is a safetensors file but not a {FORMAT} capsule (format={meta.get('format')!r})"
                    )
                desc = Descriptor.from_json(meta["descriptor"])
                tensors = {e.name: f.get_tensor(e.name) for e in desc.entries}
        except (SafetensorError, OSError, KeyError, json.JSONDecodeError, TypeError) as e:
            raise CapsuleFileError(f"{path} is not a readable capsule (truncated or corrupted?): {e}") from e
        if _checksum(tensors, desc) != meta.get("sha256"):
            raise CapsuleFileError(f"{path}: checksum mismatch, the file is corrupted; take a new snapshot")
        k = desc.num_rows
        rows = torch.zeros((k, desc.row_bytes), dtype=torch.uint8)
        shared = torch.zeros((desc.shared_bytes,), dtype=torch.uint8)
        for e in desc.entries:
            t = tensors[e.name]
            if tuple(t.shape[1:] if e.kind == "slot" else t.shape) != e.shape or dtype_name(t.dtype) != e.dtype:
                raise CapsuleFileError(f"{path}: tensor {e.name!r} does not match its descriptor")
            raw = t.contiguous().reshape(-1).view(torch.uint8)
            if e.kind == "slot":
                rows[:, e.offset : e.offset + e.nbytes] = raw.reshape(k, e.nbytes)
            else:
                shared[e.offset : e.offset + e.nbytes] = raw.reshape(-1)
        target = device if tier == "gpu" else torch.device("cpu")
        stream = Stream.current(device)
        with stream:
            rows, shared = _to_device(rows, target), _to_device(shared, target)
            ready = Event.record_on(stream)
        return cls(desc, rows, shared, tier=tier, device=device, path=path, ready=ready)

    def _typed_tensors(self) -> dict[str, torch.Tensor]:
        assert self.rows is not None and self.shared is not None
        rows, shared = self.rows.cpu(), self.shared.cpu()
        out = {}
        for e in self.descriptor.entries:
            dt = dtype_from_name(e.dtype)
            if e.kind == "slot":
                raw = rows[:, e.offset : e.offset + e.nbytes].contiguous()
                out[e.name] = raw.view(dt).reshape(rows.shape[0], *e.shape)
            else:
                out[e.name] = shared[e.offset : e.offset + e.nbytes].view(dt).reshape(e.shape).clone()
        return out


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu" and t.device.type == "cuda":
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.to(device, non_blocking=True)


def _copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor with ``t``'s bytes on ``device`` (never an alias of ``t``)."""
    out = _to_device(t, device)
    return t.clone() if out.data_ptr() == t.data_ptr() else out


def _checksum(tensors: dict[str, torch.Tensor], desc: Descriptor) -> str:
    h = hashlib.sha256()
    for e in desc.entries:
        h.update(tensors[e.name].contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


# -- verbs ---------------------------------------------------------------------------------------
def _slot_index(bufs: BufferSet, slots: Sequence[int] | torch.Tensor, what: str) -> tuple[int, ...]:
    # Host cost matters here (a fork of 1024 slots is ~80 us on the GPU): builtins over the
    # whole list, no per-element Python loop.
    if isinstance(slots, torch.Tensor):
        slots = slots.tolist()
    try:
        out = tuple(map(operator.index, slots))
    except TypeError:
        raise TypeError(f"{what}: slots must be integers, got {slots!r:.80}") from None
    if not out:
        raise ValueError(f"{what}: empty slot list")
    if min(out) < 0 or max(out) >= bufs.num_slots:
        bad = [s for s in out if not 0 <= s < bufs.num_slots]
        raise IndexError(f"{what}: slots {bad} out of range for a set of {bufs.num_slots} slots")
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: duplicate slots in {list(out)}")
    return out


def _index_tensor(bufs: BufferSet, slots: tuple[int, ...]) -> torch.Tensor:
    # array('q') packs the ints in C; torch.tensor(tuple) costs ~90 us at 1024 slots.
    return torch.frombuffer(array("q", slots), dtype=torch.int64).to(bufs.device, non_blocking=True)


def snapshot(
    bufs: BufferSet,
    slots: Sequence[int] | torch.Tensor | None = None,
    *,
    names: Sequence[str] | None = None,
    meta: dict[str, Any] | None = None,
    tier: Tier = "gpu",
    stream: Stream | None = None,
) -> Capsule:
    """Copy the live state of ``bufs`` out into a new capsule.

    Args:
        bufs: the set to copy from.
        slots: which slots (rows in this order); None for the whole set, shared buffers
            included.
        names: which state buffers (default all); a capsule of a subset restores only those.
        meta: owner metadata stored in the descriptor (JSON-serialisable: step counters,
            episode ids...).
        tier: ``"gpu"`` (a device copy) or ``"host"`` (pinned, asynchronous).
        stream: stream to copy on (default the current one).
    """
    if tier == "disk":
        raise ValueError("snapshot to 'gpu' or 'host', then move it with capsule.to('disk', path=...)")
    state = bufs.names("slot", "shared")
    if names is None:
        chosen = state if slots is None else bufs.names("slot")
    else:
        chosen = tuple(names)
        unknown = [n for n in chosen if n not in bufs]
        if unknown:
            raise KeyError(f"snapshot: no buffers {unknown} in this set; it has {list(state)}")
        scratch = [n for n in chosen if n not in state]
        if scratch:
            raise ValueError(f"snapshot: {scratch} are scratch buffers, not state; leave them out")
        if slots is not None:
            sh = [n for n in chosen if bufs.placements[n].spec.kind == "shared"]
            if sh:
                raise ValueError(f"snapshot: shared buffers {sh} have no slots; snapshot them with slots=None")
    json.dumps(meta or {})  # fail now, not at save time, if the metadata cannot be stored
    slot_tuple = None if slots is None else _slot_index(bufs, slots, "snapshot")

    # A kind whose buffers are all chosen keeps the arena's own layout (one copy each way);
    # otherwise the chosen buffers are packed.
    whole = {k: set(bufs.names(k)) <= set(chosen) for k in ("slot", "shared")}
    entries, packed = [], {"slot": 0, "shared": 0}
    for n in chosen:
        p = bufs.placements[n]
        s: BufferSpec = p.spec
        off = p.offset if whole[s.kind] else packed[s.kind]
        packed[s.kind] += -(-s.nbytes // ALIGN) * ALIGN
        entries.append(Entry(n, s.kind, s.shape, dtype_name(s.dtype), off, s.nbytes))
    row_bytes = bufs.row_bytes if whole["slot"] else packed["slot"]
    shared_bytes = bufs.shared_arena.numel() if whole["shared"] else packed["shared"]
    num_rows = bufs.num_slots if slot_tuple is None else len(slot_tuple)
    desc = Descriptor(
        tuple(entries),
        bufs.layout_digest,
        bufs.deployment,
        slot_tuple,
        num_rows,
        row_bytes,
        shared_bytes,
        dict(meta or {}),
    )
    target = bufs.device if tier == "gpu" else torch.device("cpu")

    stream = stream or Stream.current(bufs.device)
    with stream:
        arena, fresh = bufs.slot_arena, False
        if slot_tuple is not None:
            arena, fresh = arena.index_select(0, _index_tensor(bufs, slot_tuple)), True
        rows = _gather(bufs, arena, [e for e in entries if e.kind == "slot"], whole["slot"], fresh, target)
        shared_2d = bufs.shared_arena.view(1, -1)
        shared = _gather(bufs, shared_2d, [e for e in entries if e.kind == "shared"], whole["shared"], False, target)
        ready = Event.record_on(stream)
    return Capsule(desc, rows, shared.view(-1), tier=tier, device=bufs.device, origin=bufs.uid, ready=ready)


def _gather(
    bufs: BufferSet, src: torch.Tensor, entries: list[Entry], whole: bool, fresh: bool, target: torch.device
) -> torch.Tensor:
    """Capsule bytes of ``entries`` from a 2-D arena (rows x bytes), on ``target``."""
    if whole:
        return _to_device(src, target) if fresh else _copy_to(src, target)
    out = torch.zeros(
        (src.shape[0], sum(-(-e.nbytes // ALIGN) * ALIGN for e in entries)), dtype=torch.uint8, device=src.device
    )
    for e in entries:
        off = bufs.placements[e.name].offset
        out[:, e.offset : e.offset + e.nbytes] = src[:, off : off + e.nbytes]
    return _to_device(out, target)


def check(bufs: BufferSet, capsule: Capsule) -> None:
    """Raise if ``capsule`` cannot be restored into ``bufs`` (deployment or layout mismatch)."""
    if bufs.uid in capsule.checked_for:
        return
    d = capsule.descriptor
    if d.deployment != bufs.deployment:
        raise DeploymentMismatchError(
            f"capsule was made by deployment {d.deployment!r}, this buffer set is {bufs.deployment!r} "
            "(different model config, weights or kernel version); restore it where it was made"
        )
    for e in d.entries:
        if e.name not in bufs:
            raise LayoutMismatchError(f"capsule buffer {e.name!r} does not exist in the target set")
        s = bufs.placements[e.name].spec
        got = (e.kind, e.shape, e.dtype)
        want = (s.kind, s.shape, dtype_name(s.dtype))
        if got != want:
            raise LayoutMismatchError(f"buffer {e.name!r}: capsule has (kind, shape, dtype) {got}, target has {want}")
    capsule.checked_for.add(bufs.uid)  # a set never changes layout: check each pair once


def restore(
    bufs: BufferSet,
    capsule: Capsule,
    slots: Sequence[int] | torch.Tensor | None = None,
    *,
    stream: Stream | None = None,
) -> None:
    """Copy a capsule's bytes back into ``bufs``; all-or-nothing.

    Args:
        bufs: the target set (same deployment; the capsule's buffers must exist there with the
            same kind, shape and dtype).
        capsule: from :func:`snapshot` or :meth:`Capsule.load`, in any tier (a disk capsule is
            read and verified first).
        slots: target slots, one per captured slot, in row order. Default: the slots the
            capsule was taken from (every slot for a whole-set capsule).
        stream: stream to copy on.

    Raises:
        DeploymentMismatchError, LayoutMismatchError, CapsuleFileError, IndexError, ValueError:
            before any byte is written.
    """
    check(bufs, capsule)
    d = capsule.descriptor
    if capsule.tier == "disk":
        src = Capsule.load(capsule.path, device=bufs.device)  # type: ignore[arg-type]
        check(bufs, src)
        rows, shared = src.rows, src.shared
    else:
        rows, shared = capsule.rows, capsule.shared
    assert rows is not None and shared is not None
    k = rows.shape[0]
    if slots is None and d.slots is None:
        dst = tuple(range(bufs.num_slots))
    else:
        dst = _slot_index(bufs, d.slots if slots is None else slots, "restore")
    if len(dst) != k:
        raise ValueError(f"restore: capsule holds {k} slots but {len(dst)} target slots were given")

    stream = stream or Stream.current(bufs.device)
    with stream:
        stream.wait(capsule.ready)
        _write(bufs, d, rows, shared, dst)


def _write(bufs: BufferSet, d: Descriptor, rows: torch.Tensor, shared: torch.Tensor, dst: tuple[int, ...]) -> None:
    same_layout = d.layout == bufs.layout_digest
    by_kind = {k: [e for e in d.entries if e.kind == k] for k in ("slot", "shared")}
    idx = None if dst == tuple(range(bufs.num_slots)) else _index_tensor(bufs, dst)
    whole_rows = same_layout and d.row_bytes == bufs.row_bytes
    whole_rows &= {e.name for e in by_kind["slot"]} == set(bufs.names("slot"))
    if by_kind["slot"]:
        _scatter(bufs, bufs.slot_arena, idx, rows, by_kind["slot"], whole_rows)
    whole_shared = same_layout and d.shared_bytes == bufs.shared_arena.numel()
    whole_shared &= {e.name for e in by_kind["shared"]} == set(bufs.names("shared"))
    if by_kind["shared"]:
        _scatter(bufs, bufs.shared_arena.view(1, -1), None, shared.view(1, -1), by_kind["shared"], whole_shared)


def _scatter(
    bufs: BufferSet, dst: torch.Tensor, idx: torch.Tensor | None, src: torch.Tensor, entries: list[Entry], whole: bool
) -> None:
    """Inverse of :func:`_gather`: write capsule bytes into a 2-D arena, at rows ``idx`` (all if None)."""
    if whole and idx is None:
        dst.copy_(src, non_blocking=True)  # straight from a host tier too: one copy
        return
    src = src.to(dst.device, non_blocking=True)
    if whole:
        copy_rows(dst, idx, src)
    else:
        for e in entries:
            off = bufs.placements[e.name].offset
            part = src[:, e.offset : e.offset + e.nbytes]
            if idx is None:
                dst[:, off : off + e.nbytes].copy_(part)
            else:
                dst[:, off : off + e.nbytes].index_put_((idx,), part)


def fork(
    bufs: BufferSet,
    src: Capsule | int,
    dst_slots: Sequence[int] | torch.Tensor,
    *,
    src_slot: int | None = None,
    stream: Stream | None = None,
) -> None:
    """Copy one boundary into every slot of ``dst_slots`` (one row copy).

    Args:
        bufs: the target set.
        src: a live slot index of ``bufs``, or a capsule holding that boundary.
        dst_slots: target slots (may include the live source slot).
        src_slot: for a capsule of several slots, which of its origin slots to fork.
        stream: stream to copy on.
    """
    dst = _slot_index(bufs, dst_slots, "fork")
    stream = stream or Stream.current(bufs.device)
    if isinstance(src, Capsule):
        check(bufs, src)
        d = src.descriptor
        if not any(e.kind == "slot" for e in d.entries):
            raise ValueError("fork: the capsule holds no slot buffers")
        origin = d.slots if d.slots is not None else tuple(range(d.num_rows))
        if src_slot is None:
            if len(origin) != 1:
                raise ValueError(f"fork: the capsule holds slots {list(origin)}; name one with src_slot=")
            src_slot = origin[0]
        if src_slot not in origin:
            raise ValueError(f"fork: src_slot {src_slot} is not in the capsule's slots {list(origin)}")
        if src.tier == "disk":
            src = Capsule.load(src.path, device=bufs.device)  # type: ignore[arg-type]
        assert src.rows is not None and src.shared is not None
        i = origin.index(src_slot)
        with stream:
            stream.wait(src.ready)
            row = src.rows[i : i + 1]
            _write(bufs, _slots_only(d), row, src.shared, dst)  # one row, broadcast
        return
    (s,) = _slot_index(bufs, [src], "fork source")
    with stream:
        copy_rows(bufs.slot_arena, _index_tensor(bufs, dst), bufs.slot_arena[s : s + 1])


def _slots_only(d: Descriptor) -> Descriptor:
    return Descriptor(
        tuple(e for e in d.entries if e.kind == "slot"),
        d.layout,
        d.deployment,
        d.slots,
        d.num_rows,
        d.row_bytes,
        0,
        d.meta,
    )


def rollback(bufs: BufferSet, capsule: Capsule, *, stream: Stream | None = None) -> None:
    """Restore an earlier boundary of this same buffer set (the slots it was taken from).

    Refuses a capsule taken from another set or loaded from a file: moving state between
    sets is :func:`restore`.
    """
    if capsule.origin != bufs.uid:
        raise CapsuleError(
            "rollback takes a capsule taken from this same buffer set; this one came from another "
            "set or a file: use restore() to move state between sets"
        )
    restore(bufs, capsule, stream=stream)
