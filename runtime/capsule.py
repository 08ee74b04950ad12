"""Execution-state capsules: the byte image of a buffer set's live state at a boundary.

:func:`snapshot` copies the state of all or selected slots (and buffers) out into a
:class:`Capsule`, and :func:`check` says whether one can go back into a buffer set;
:mod:`flashrt.runtime.verbs` copies it back. A capsule lives in one tier at a time: ``gpu``
(the origin device), ``host`` (pinned memory, asynchronous copies) or ``disk`` (a safetensors
file written atomically, its descriptor and data under one checksum verified on load:
:mod:`flashrt.runtime.capsule_file`). A capsule's bytes are never written in place once taken:
a move between tiers makes new tensors, so two capsule objects may share bytes safely.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from flashrt.runtime import capsule_file
from flashrt.runtime.buffers import BufferSet, BufferSpec, dtype_from_name, dtype_name
from flashrt.runtime.descriptor import (
    DTYPES,
    CapsuleError,
    CapsuleFileError,
    DeploymentMismatchError,
    Descriptor,
    Entry,
    LayoutMismatchError,
    align,
)
from flashrt.runtime.slots import index_tensor, slot_index
from flashrt.runtime.streams import Event, Stream

Tier = Literal["gpu", "host", "disk"]
TIERS: tuple[Tier, ...] = ("gpu", "host", "disk")
FORMAT = capsule_file.FORMAT


class Capsule:
    """A committed boundary: a descriptor plus the bytes, in one tier.

    Build capsules with :func:`snapshot` or :meth:`load`; move them with :meth:`to`; read one
    buffer with :meth:`tensor`.

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
        self.checked_for: str | None = None  # uid of the last buffer set this capsule was checked against
        self._digest: str | None = None  # checksum of the file at ``path`` as this capsule wrote or read it

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
        """Says where the bytes are: the ``gpu`` tier is the compute device's memory, so a capsule of
        a CPU-only run shows ``tier=device (cpu)``, not ``gpu``; the file of the ``disk`` tier is named."""
        slots = "all" if self.slots is None else list(self.slots)
        where = {
            "gpu": f"{'gpu' if self.device.type == 'cuda' else 'device'} ({self.device})",
            "host": "host",
            "disk": f"disk ({self.path})",
        }[self.tier]
        return f"Capsule({len(self.descriptor.entries)} buffers, slots={slots}, {self.nbytes} B, tier={where})"

    def tensor(self, name: str) -> torch.Tensor:
        """A typed view of one buffer's bytes in the capsule, without a copy: ``(k, *shape)``
        for a slot buffer (row i is the capsule's i-th slot), ``shape`` for a shared one.

        For owners that check what a capsule carries before restoring it. The view is ordered
        after the capsule's own copy (the current stream waits for it; a host-tier capsule is
        waited for on the host). Read it, never write it: capsule bytes may be shared.
        """
        e = next((e for e in self.descriptor.entries if e.name == name), None)
        if e is None:
            names = [e.name for e in self.descriptor.entries]
            raise KeyError(f"the capsule holds no buffer {name!r}; it holds {names}")
        if self.tier == "disk":
            raise CapsuleError(
                f"the capsule is on disk ({self.path}); bring it into memory first, e.g. capsule.to('host'), "
                "or load it with Capsule.load"
            )
        assert self.rows is not None and self.shared is not None
        if self.tier == "host":
            self.ready.synchronize()
        else:
            Stream.current(self.device).wait(self.ready)
        dtype = dtype_from_name(e.dtype)
        shape = (self.rows.shape[0], *e.shape) if e.kind == "slot" else e.shape
        if e.nbytes == 0:  # nothing to view (a dtype view of an empty span is refused)
            return torch.empty(shape, dtype=dtype, device=self.rows.device)
        raw = self.rows[:, e.offset : e.offset + e.nbytes] if e.kind == "slot" else self.shared[e.offset :][: e.nbytes]
        return raw.view(dtype).view(shape)

    # -- tiers -------------------------------------------------------------------------------
    def to(self, tier: Tier, *, path: str | os.PathLike | None = None, stream: Stream | None = None) -> Capsule:
        """Move the capsule to ``tier`` in place and return it.

        ``gpu`` -> ``host`` copies into pinned memory asynchronously (``ready`` completes when
        it has landed); ``host`` -> ``gpu`` likewise; ``disk`` needs ``path`` unless the capsule
        was saved before, and frees the in-memory bytes; leaving ``disk`` reads and verifies the
        file.
        """
        moved = self.moved(tier, path=path, stream=stream)
        self.rows, self.shared, self.tier, self.path, self.ready, self._digest = (
            moved.rows,
            moved.shared,
            moved.tier,
            moved.path,
            moved.ready,
            moved._digest,
        )
        return self

    def moved(self, tier: Tier, *, path: str | os.PathLike | None = None, stream: Stream | None = None) -> Capsule:
        """A new capsule object holding this one's boundary in ``tier``; this one is unchanged
        (its ``path`` too). See :meth:`to` for what each move does. The same tier gives a new
        object over the same bytes: what a holder that must not be disturbed by moves of the
        other object keeps (a registry entry)."""
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        d, out = self.descriptor, None
        if tier == self.tier:
            out = Capsule(d, self.rows, self.shared, tier=tier, device=self.device, path=self.path, ready=self.ready)
        elif tier == "disk":
            target = Path(path) if path is not None else self.path
            if target is None:
                raise ValueError("moving a capsule to the disk tier needs path=... (it has not been saved before)")
            out = Capsule(d, None, None, tier="disk", device=self.device, path=target)
            out._digest = self._write(target)
        elif self.tier == "disk":
            out = _loaded(self, self.device, tier)
            out.path = self.path
        else:
            assert self.rows is not None and self.shared is not None
            target_device = self.device if tier == "gpu" else torch.device("cpu")
            stream = stream or Stream.current(self.device)
            with stream:
                stream.wait(self.ready)
                rows, shared = _to_device(self.rows, target_device), _to_device(self.shared, target_device)
                ready = Event.record_on(stream)
            out = Capsule(d, rows, shared, tier=tier, device=self.device, path=self.path, ready=ready)
        out.origin, out.checked_for = self.origin, self.checked_for
        out._digest = out._digest or self._digest
        return out

    # -- disk --------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> Path:
        """Write the capsule to a safetensors file atomically (one temporary file beside it,
        fsync, rename): one tensor per buffer (slot buffers as ``(k, *shape)``) and the
        descriptor under one SHA-256 (:mod:`flashrt.runtime.capsule_file`). An interrupted
        write leaves no file at ``path`` and the old one, if any, intact.
        """
        path = Path(path)
        if self.tier == "disk":
            if self.path is not None and self.path.resolve() != path.resolve():
                raise ValueError(
                    f"capsule is on disk at {self.path}; promote it (capsule.to('host')) before saving elsewhere"
                )
            return path
        self._digest = self._write(path)
        self.path = path
        return path

    def _write(self, path: Path) -> str:
        d = self.descriptor
        odd = [f"{e.name} ({e.dtype})" for e in d.entries if e.dtype not in DTYPES or e.name == "__metadata__"]
        if odd:
            raise CapsuleError(
                f"a capsule file cannot hold buffers {odd}: it holds the dtypes {sorted(DTYPES)} under any name "
                "but '__metadata__'; keep this capsule in memory or change those buffers"
            )
        assert self.rows is not None and self.shared is not None
        self.ready.synchronize()
        return capsule_file.save(path, d, self.rows.cpu(), self.shared.cpu())

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: torch.device | str = "cpu", tier: Tier = "gpu") -> Capsule:
        """Read and verify a capsule file. ``tier="gpu"`` puts the bytes on ``device``,
        ``"host"`` in (pinned, with CUDA) host memory. Raises :class:`CapsuleFileError` if the
        file is missing, truncated, corrupted, of an older format or not a capsule; nothing is
        allocated beyond the file's size until the file has been verified."""
        if tier not in ("gpu", "host"):
            raise ValueError(f"load into the 'gpu' or 'host' tier, got {tier!r}")
        path, device = Path(path), torch.device(device)
        desc, data, digest = capsule_file.read(path)
        rows, shared = capsule_file.unpack(desc, data, pin_memory=tier == "host" and device.type == "cuda")
        del data
        stream = Stream.current(device)
        with stream:
            if tier == "gpu":
                rows, shared = rows.to(device, non_blocking=True), shared.to(device, non_blocking=True)
            ready = Event.record_on(stream)
        capsule = cls(desc, rows, shared, tier=tier, device=device, path=path, ready=ready)
        capsule._digest = digest
        return capsule


def _loaded(capsule: Capsule, device: torch.device, tier: Tier = "gpu") -> Capsule:
    """The bytes of a disk-tier capsule, read and verified, in ``tier`` on ``device``."""
    loaded = Capsule.load(capsule.path, device=device, tier=tier)  # type: ignore[arg-type]
    if loaded.descriptor != capsule.descriptor or capsule._digest not in (None, loaded._digest):
        raise CapsuleFileError(
            f"{capsule.path} now holds another capsule than the one saved there (it was replaced on disk); "
            "take a new snapshot"
        )
    return loaded


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu" and t.device.type == "cuda":
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.to(device, non_blocking=True)


def _copy_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new tensor with ``t``'s bytes on ``device`` (never an alias of ``t``)."""
    out = _to_device(t, device)
    return t.clone() if out.data_ptr() == t.data_ptr() else out


# -- verbs ---------------------------------------------------------------------------------------
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
    meta = _json_meta(meta)
    slot_tuple = None if slots is None else slot_index(bufs, slots, "snapshot")

    # A kind whose buffers are all chosen keeps the arena's own layout (one copy each way);
    # otherwise the chosen buffers are packed.
    whole = {k: set(bufs.names(k)) <= set(chosen) for k in ("slot", "shared")}
    entries, packed = [], {"slot": 0, "shared": 0}
    for n in chosen:
        p = bufs.placements[n]
        s: BufferSpec = p.spec
        off = p.offset if whole[s.kind] else packed[s.kind]
        packed[s.kind] += align(s.nbytes)
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
        meta,
    )
    target = bufs.device if tier == "gpu" else torch.device("cpu")

    stream = stream or Stream.current(bufs.device)
    with stream:
        arena, fresh = bufs.slot_arena, False
        if slot_tuple is not None:
            arena, fresh = arena.index_select(0, index_tensor(bufs, slot_tuple)), True
        rows = _gather(bufs, arena, [e for e in entries if e.kind == "slot"], whole["slot"], fresh, target)
        shared_2d = bufs.shared_arena.view(1, -1)
        shared = _gather(bufs, shared_2d, [e for e in entries if e.kind == "shared"], whole["shared"], False, target)
        ready = Event.record_on(stream)
    return Capsule(desc, rows, shared.view(-1), tier=tier, device=bufs.device, origin=bufs.uid, ready=ready)


def _json_meta(meta: dict[str, Any] | None) -> dict[str, Any]:
    """``meta`` as it reads back from a file (fail now, not at save time, if it cannot be stored)."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise TypeError(f"snapshot: meta must be a dict, got {type(meta).__name__}")
    try:
        return json.loads(json.dumps(meta, allow_nan=False))
    except TypeError as e:
        raise TypeError(
            f"snapshot: meta must hold JSON values only (str, int, float, bool, None, list, dict): {e}"
        ) from None
    except ValueError as e:
        raise ValueError(f"snapshot: meta cannot hold NaN or infinity (JSON has neither): {e}") from None


def _gather(
    bufs: BufferSet, src: torch.Tensor, entries: list[Entry], whole: bool, fresh: bool, target: torch.device
) -> torch.Tensor:
    """Capsule bytes of ``entries`` from a 2-D arena (rows x bytes), on ``target``."""
    if whole:
        return _to_device(src, target) if fresh else _copy_to(src, target)
    out = torch.zeros((src.shape[0], sum(align(e.nbytes) for e in entries)), dtype=torch.uint8, device=src.device)
    for e in entries:
        off = bufs.placements[e.name].offset
        out[:, e.offset : e.offset + e.nbytes] = src[:, off : off + e.nbytes]
    return _to_device(out, target)


def check(bufs: BufferSet, capsule: Capsule) -> None:
    """Raise if ``capsule`` cannot be restored into ``bufs`` (deployment or layout mismatch)."""
    if capsule.checked_for == bufs.uid:
        return
    d = capsule.descriptor
    if d.deployment != bufs.deployment:
        raise DeploymentMismatchError(
            f"capsule was made by deployment {d.deployment!r}, this buffer set is {bufs.deployment!r} "
            "(different model config, weights or kernel version); restore it where it was made"
        )
    whole = whole_kinds(bufs, d)
    for e in d.entries:
        if e.name not in bufs:
            raise LayoutMismatchError(
                f"capsule buffer {e.name!r} does not exist in the target set; restore it into a set of its layout"
            )
        s = bufs.placements[e.name].spec
        got = (e.kind, e.shape, e.dtype)
        want = (s.kind, s.shape, dtype_name(s.dtype))
        if got != want:
            raise LayoutMismatchError(
                f"buffer {e.name!r}: capsule has (kind, shape, dtype) {got}, target has {want}; restore it into a "
                "set that declares the buffer the same way"
            )
        if whole[e.kind] and e.offset != bufs.placements[e.name].offset:
            raise LayoutMismatchError(
                f"buffer {e.name!r}: the capsule claims this set's layout but puts the buffer at byte {e.offset}, not "
                f"{bufs.placements[e.name].offset}; the capsule is inconsistent: take a new snapshot"
            )
    capsule.checked_for = bufs.uid  # a set never changes layout: check each pair once


def whole_kinds(bufs: BufferSet, d: Descriptor) -> dict[str, bool]:
    """Per kind, whether the capsule holds that arena of ``bufs`` byte for byte (this set's layout,
    every buffer, the arena's size): restoring it is then one copy of the arena."""
    same = d.layout == bufs.layout_digest
    names = {k: {e.name for e in d.entries if e.kind == k} for k in ("slot", "shared")}
    return {
        "slot": same and d.row_bytes == bufs.row_bytes and names["slot"] == set(bufs.names("slot")),
        "shared": same and d.shared_bytes == bufs.shared_arena.numel() and names["shared"] == set(bufs.names("shared")),
    }
