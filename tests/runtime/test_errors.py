"""Every refusal names the problem and the fix (a sample across the runtime's verbs)."""

import pytest

from flashrt.runtime import (
    BufferSet,
    Capsule,
    CapsuleFileError,
    CapsuleRegistry,
    Graph,
    fork,
    restore,
    shared,
    slot,
    snapshot,
)
from flashrt.runtime.buffers import dtype_from_name
from tests.runtime import toy


def cases(tmp_path):
    b = toy.make(4)
    guarded = Graph("g").bind(b)
    guarded.capture(1, lambda: None)
    bad_file = tmp_path / "bad.safetensors"
    bad_file.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00[]")
    foreign = tmp_path / "foreign.safetensors"
    foreign.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    only_shared = BufferSet([shared("t", (2,)), slot("x", (1,))], 2, deployment="e")
    reg = CapsuleRegistry(gpu_bytes=None, host_bytes=None)
    return {
        "dtype name": (lambda: dtype_from_name("float33"), ValueError, "use a torch dtype name such as"),
        "duplicate names": (lambda: BufferSet([slot("a", (1,))] * 2, 1), ValueError, "give each buffer its own name"),
        "no slots": (lambda: BufferSet([slot("a", (1,))], 0), ValueError, "one row per slot"),
        "empty slots": (lambda: restore(b, snapshot(b), slots=[]), ValueError, "name at least one slot"),
        "slot range": (lambda: fork(b, 0, [4]), IndexError, r"use 0\.\.3"),
        "slot twice": (lambda: fork(b, 0, [1, 1]), ValueError, "name each slot once"),
        "fork of shared": (
            lambda: fork(only_shared, snapshot(only_shared, names=["t"]), [0]),
            ValueError,
            "use restore",
        ),
        "eager hint": (
            lambda: Graph("c", backend="cuda").bind(b).capture(1, lambda: None),
            ValueError,
            "backend='eager'",
        ),
        "not guarded": (lambda: guarded.held(1), ValueError, "capture it with guard="),
        "bad file": (lambda: Capsule.load(bad_file), CapsuleFileError, "take a new snapshot"),
        "no file": (lambda: Capsule.load(tmp_path / "none"), CapsuleFileError, "check the path"),
        "foreign file": (lambda: Capsule.load(foreign), CapsuleFileError, "pass a file written by Capsule.save"),
        "entry name": (lambda: reg.put("a/b", snapshot(b)), ValueError, "no path separators"),
        "not a capsule": (lambda: reg.put("a", b), TypeError, r"from snapshot\(\) or Capsule.load"),
        "disk without path": (lambda: snapshot(b).to("disk"), ValueError, "needs path="),
    }


@pytest.mark.parametrize(
    "case",
    [
        "dtype name",
        "duplicate names",
        "no slots",
        "empty slots",
        "slot range",
        "slot twice",
        "fork of shared",
        "eager hint",
        "not guarded",
        "bad file",
        "no file",
        "foreign file",
        "entry name",
        "not a capsule",
        "disk without path",
    ],
)
def test_an_error_names_the_fix(tmp_path, case):
    fn, err, fix = cases(tmp_path)[case]
    with pytest.raises(err, match=fix):
        fn()
