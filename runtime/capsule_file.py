"""The capsule file: a safetensors file whose checksum covers everything it says.

Layout (readable by any safetensors reader: one typed tensor per buffer, slot buffers as
``(num_rows, *shape)``, in descriptor order, no gaps)::

    u64 little-endian N | N bytes of JSON header | data
    header = {"__metadata__": {"format": FORMAT, "descriptor": <JSON>, "sha256": <hex>},
              <buffer name>: {"dtype", "shape", "data_offsets"}, ...}

``sha256`` is the SHA-256 of ``FORMAT``, the descriptor's text and the data, so an edited
descriptor (its metadata included) fails like an edited byte. The tensor table is not hashed:
it is derived from the descriptor and must equal that derivation exactly. A reader checks, in
this order and before allocating more than the file's own size: the header length against
the file, the header's shape, the descriptor against itself (:meth:`Descriptor.parse`), the
data length against the descriptor, the table against the descriptor, then the checksum.

The checksum detects corruption; it does not authenticate. Capsule files are trusted input,
like model weights: load only files you or your own jobs wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import BinaryIO

import torch

from flashrt.runtime.descriptor import DTYPES, CapsuleFileError, Descriptor, Entry
from flashrt.runtime.files import atomic_write

FORMAT = "flashrt-capsule/2"
OLD_FORMATS = ("flashrt-capsule/1",)
MAX_HEADER = 100 << 20  # safetensors' own bound on a header
CHUNK = 64 << 20  # bytes staged at a time when writing one buffer


def _table(desc: Descriptor) -> dict[str, dict]:
    """The safetensors tensor table the descriptor implies."""
    table, at = {}, 0
    for e in desc.entries:
        shape = [desc.num_rows, *e.shape] if e.kind == "slot" else list(e.shape)
        size = e.nbytes * desc.num_rows if e.kind == "slot" else e.nbytes
        table[e.name] = {"dtype": DTYPES[e.dtype][0], "shape": shape, "data_offsets": [at, at + size]}
        at += size
    return table


def _header(desc: Descriptor, text: str, digest: str) -> bytes:
    head = {"__metadata__": {"format": FORMAT, "descriptor": text, "sha256": digest}, **_table(desc)}
    raw = json.dumps(head, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes


def _hasher(text: str) -> hashlib._Hash:
    h = hashlib.sha256()
    h.update(FORMAT.encode() + b"\n" + text.encode() + b"\n")
    return h


def _parts(desc: Descriptor, rows: torch.Tensor, shared: torch.Tensor, e: Entry):
    """The bytes of one buffer in file order, in pieces of about :data:`CHUNK` bytes."""
    if e.kind == "shared":
        yield shared[e.offset : e.offset + e.nbytes]
        return
    step = max(1, CHUNK // max(1, e.nbytes))
    for r in range(0, desc.num_rows, step):
        yield rows[r : r + step, e.offset : e.offset + e.nbytes].contiguous().reshape(-1)


def write(f: BinaryIO, desc: Descriptor, rows: torch.Tensor, shared: torch.Tensor) -> str:
    """Write a capsule to the seekable binary file ``f`` (host tensors ``rows``, ``shared``);
    return its checksum.

    One pass over the data: the header goes first with a placeholder checksum of the same
    length, and is rewritten once the data has been hashed."""
    text = desc.to_json()
    placeholder = _header(desc, text, "0" * 64)
    f.write(struct.pack("<Q", len(placeholder)))
    f.write(placeholder)
    h = _hasher(text)
    for e in desc.entries:
        for part in _parts(desc, rows, shared, e):
            view = part.numpy()
            h.update(view)
            f.write(view)
    digest = h.hexdigest()
    header = _header(desc, text, digest)
    assert len(header) == len(placeholder)
    f.seek(8)
    f.write(header)
    return digest


def read(path: Path) -> tuple[Descriptor, torch.Tensor, str]:
    """The checked descriptor, data section (uint8, on the host) and checksum of the capsule
    file at ``path``. Raises :class:`CapsuleFileError` for anything that is not an intact
    capsule."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            desc, text, digest = _read_header(f, path, size)
            data = torch.empty(size - f.tell(), dtype=torch.uint8)
            view, got = memoryview(data.numpy()), 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise CapsuleFileError(
                        f"{path}: the file shrank while it was read; do not write capsules being read"
                    )
                got += n
    except FileNotFoundError:
        raise CapsuleFileError(
            f"no capsule file at {path}; check the path (was it saved, or evicted from a registry?)"
        ) from None
    except OSError as e:
        raise CapsuleFileError(
            f"{path} cannot be read as a capsule file: {e}; check the path and its permissions"
        ) from None
    h = _hasher(text)
    h.update(data.numpy())
    if h.hexdigest() != digest:
        raise CapsuleFileError(f"{path}: checksum mismatch, the file is corrupted; take a new snapshot")
    return desc, data, digest


def _read_header(f: BinaryIO, path: Path, size: int) -> tuple[Descriptor, str, str]:
    def bad(why: str) -> CapsuleFileError:
        return CapsuleFileError(
            f"{path} is not a readable capsule (truncated or corrupted?): {why}; it cannot be restored: take a new "
            "snapshot (capsule files are only ever written whole, so this one was damaged or made by something else)"
        )

    if size < 8:
        raise bad(f"{size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > min(MAX_HEADER, size - 8):
        raise bad(f"header length {n} exceeds the file ({size} bytes) or {MAX_HEADER} bytes")
    try:
        head = json.loads(f.read(n))
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, an over-long integer, deep nesting
        raise bad(f"the header is not JSON ({e})") from None
    if not isinstance(head, dict):
        raise bad("the header is not a JSON object")
    meta = head.get("__metadata__", {})
    if not isinstance(meta, dict):
        raise bad("the header's __metadata__ is not an object")
    fmt = meta.get("format")
    if fmt in OLD_FORMATS:
        raise CapsuleFileError(
            f"{path} is a {fmt} capsule, written by an older flashrt whose checksum does not cover its "
            f"descriptor, so it cannot be verified; this version reads {FORMAT}: take a new snapshot"
        )
    if fmt != FORMAT:
        raise CapsuleFileError(
            f"{path} is a safetensors file but not a {FORMAT} capsule (format={fmt!r:.80}); pass a file written "
            "by Capsule.save"
        )
    text, digest = meta.get("descriptor"), meta.get("sha256")
    if not isinstance(text, str) or not isinstance(digest, str):
        raise bad("__metadata__ needs string fields 'descriptor' and 'sha256'")
    try:
        desc = Descriptor.parse(text)
    except ValueError as e:
        raise bad(f"invalid descriptor: {e}") from None
    if size - 8 - n != desc.data_nbytes:
        raise bad(f"{size - 8 - n} bytes of data where the descriptor needs {desc.data_nbytes}")
    if {k: v for k, v in head.items() if k != "__metadata__"} != _table(desc):
        raise bad("the tensor table does not match the descriptor")
    return desc, text, digest


def unpack(desc: Descriptor, data: torch.Tensor, *, pin_memory: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Capsule rows ``(num_rows, row_bytes)`` and shared bytes from a file's data section."""
    k = desc.num_rows
    rows = torch.zeros((k, desc.row_bytes), dtype=torch.uint8, pin_memory=pin_memory)
    shared = torch.zeros((desc.shared_bytes,), dtype=torch.uint8, pin_memory=pin_memory)
    for e, spec in zip(desc.entries, _table(desc).values(), strict=True):
        lo, hi = spec["data_offsets"]
        if e.kind == "slot":
            rows[:, e.offset : e.offset + e.nbytes] = data[lo:hi].view(k, e.nbytes)
        else:
            shared[e.offset : e.offset + e.nbytes] = data[lo:hi]
    return rows, shared


def save(path: Path, desc: Descriptor, rows: torch.Tensor, shared: torch.Tensor) -> str:
    """Write atomically (one temporary file beside ``path``); return the file's checksum."""
    digest = []
    atomic_write(path, lambda f: digest.append(write(f, desc, rows, shared)))
    return digest[0]
