"""The verbs that copy capsules back into a buffer set (all byte copies; nothing is recomputed
or recaptured):

- :func:`restore` copies a capsule back, all-or-nothing: every check runs before any byte moves;
- :func:`fork` copies one boundary (a capsule's slot or a live slot) into N slots;
- :func:`rollback` restores an earlier boundary of the same buffer set.

A disk-tier capsule is read back and verified first (its file must still hold it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flashrt.runtime.buffers import BufferSet
from flashrt.runtime.capsule import Capsule, check, whole_kinds
from flashrt.runtime.descriptor import (
    CapsuleError,
    Descriptor,
    Entry,
)
from flashrt.runtime.slots import copy_rows, index_tensor, slot_index
from flashrt.runtime.streams import Stream


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
    if slots is None and d.slots is None:
        dst = tuple(range(bufs.num_slots))
    else:
        dst = slot_index(bufs, d.slots if slots is None else slots, "restore")
    if len(dst) != d.num_rows:
        raise ValueError(
            f"restore: the capsule holds {d.num_rows} slots but {len(dst)} target slots were given; "
            "pass one target slot per captured slot"
        )
    src = capsule.moved("gpu") if capsule.tier == "disk" else capsule  # read back and verified
    assert src.rows is not None and src.shared is not None
    stream = stream or Stream.current(bufs.device)
    with stream:
        stream.wait(src.ready)
        _write(bufs, d, src.rows, src.shared, dst)


def _write(bufs: BufferSet, d: Descriptor, rows: torch.Tensor, shared: torch.Tensor, dst: tuple[int, ...]) -> None:
    by_kind = {k: [e for e in d.entries if e.kind == k] for k in ("slot", "shared")}
    whole = whole_kinds(bufs, d)
    idx = None if dst == tuple(range(bufs.num_slots)) else index_tensor(bufs, dst)
    if by_kind["slot"]:
        _scatter(bufs, bufs.slot_arena, idx, rows, by_kind["slot"], whole["slot"])
    if by_kind["shared"]:
        _scatter(bufs, bufs.shared_arena.view(1, -1), None, shared.view(1, -1), by_kind["shared"], whole["shared"])


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
    dst = slot_index(bufs, dst_slots, "fork")
    stream = stream or Stream.current(bufs.device)
    if isinstance(src, Capsule):
        check(bufs, src)
        d = src.descriptor
        if not any(e.kind == "slot" for e in d.entries):
            raise ValueError("fork: the capsule holds no slot buffers, and fork copies slot rows; use restore() for it")
        origin = d.slots if d.slots is not None else tuple(range(d.num_rows))
        if src_slot is None:
            if len(origin) != 1:
                raise ValueError(f"fork: the capsule holds slots {list(origin)}; name one with src_slot=")
            src_slot = origin[0]
        if src_slot not in origin:
            raise ValueError(
                f"fork: src_slot {src_slot} is not in the capsule's slots {list(origin)}; pick one of those"
            )
        if src.tier == "disk":
            src = src.moved("gpu")  # read back and verified
        assert src.rows is not None and src.shared is not None
        i = origin.index(src_slot)
        with stream:
            stream.wait(src.ready)
            row = src.rows[i : i + 1]
            _write(bufs, _slots_only(d), row, src.shared, dst)  # one row, broadcast
        return
    (s,) = slot_index(bufs, [src], "fork source")
    with stream:
        copy_rows(bufs.slot_arena, index_tensor(bufs, dst), bufs.slot_arena[s : s + 1])


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
