"""Take a capsule file apart and put it back together, edited: how the tests corrupt and forge
capsule files (the format as runtime/capsule_file.py defines it, written out independently)."""

import hashlib
import json
import struct

from flashrt.runtime.capsule_file import FORMAT


def split(raw: bytes) -> tuple[dict, bytes]:
    """A capsule file's header (parsed) and data section."""
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(head: dict, data: bytes) -> bytes:
    h = json.dumps(head).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def resign(head: dict, data: bytes) -> None:
    """Recompute the checksum as the format defines it: what a forger (or a bug) would do."""
    meta = head["__metadata__"]
    text = meta["descriptor"].encode()
    meta["sha256"] = hashlib.sha256(FORMAT.encode() + b"\n" + text + b"\n" + data).hexdigest()


def edited(raw: bytes, edit, *, sign: bool) -> bytes:
    """``raw`` with ``edit(descriptor_dict)`` applied to its descriptor, re-signed or not."""
    head, data = split(raw)
    desc = json.loads(head["__metadata__"]["descriptor"])
    edit(desc)
    head["__metadata__"]["descriptor"] = json.dumps(desc)
    if sign:
        resign(head, data)
    return join(head, data)
