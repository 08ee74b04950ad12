"""The capsule file: a checksum over everything it says, and a reader that refuses what does not
add up before allocating anything (runtime/capsule_file.py)."""

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from flashrt.runtime import BufferSet, Capsule, CapsuleError, CapsuleFileError, restore, snapshot
from tests.runtime import toy
from tests.runtime.filebytes import edited, join, split


@pytest.fixture
def saved(tmp_path):
    b = toy.make(3)
    for _ in range(2):
        toy.step(b)
    return b, snapshot(b, meta={"step": 2}).save(tmp_path / "c.safetensors")


def test_the_checksum_covers_the_descriptor_and_its_metadata(saved, tmp_path):
    _, path = saved
    raw = path.read_bytes()
    for edit in (
        lambda d: d["meta"].update(step=3),
        lambda d: d.update(layout="0" * 16),
        lambda d: d.update(deployment="toy-v2"),
    ):
        p = tmp_path / "edited.safetensors"
        p.write_bytes(edited(raw, edit, sign=False))
        with pytest.raises(CapsuleFileError, match="checksum mismatch"):
            Capsule.load(p)
    p.write_bytes(edited(raw, lambda d: None, sign=False))  # re-encoded, same content: still whole
    assert Capsule.load(p).meta == {"step": 2}


ISSUE_REPROS = {
    "negative offset": (lambda d: d["entries"][0].update(offset=-64), "offset must be an integer >= 0"),
    "unaligned offset": (lambda d: d["entries"][1].update(offset=d["entries"][1]["offset"] + 4), "multiple of 64"),
    "huge row_bytes": (lambda d: d.update(row_bytes=500_000_000), "row_bytes is 500000000"),
    "zero rows": (lambda d: d.update(num_rows=0), "num_rows must be an integer >= 1"),
    "wrong nbytes": (lambda d: d["entries"][0].update(nbytes=4), "nbytes is 4"),
    "offset past the row": (lambda d: d["entries"][0].update(offset=1 << 20), "past its row_bytes"),
    "overlap": (lambda d: d["entries"][1].update(offset=d["entries"][0]["offset"]), "overlap"),
    "more rows than data": (lambda d: d.update(num_rows=1000), "bytes of data where the descriptor needs"),
    "slots of the wrong length": (lambda d: d.update(slots=[0]), "list of num_rows"),
    "unknown dtype": (lambda d: d["entries"][0].update(dtype="complex64"), "dtype must be one of"),
    "scratch kind": (lambda d: d["entries"][0].update(kind="scratch"), "kind must be one of"),
    "missing key": (lambda d: d.pop("meta"), r"missing \['meta'\]"),
    "bool as int": (lambda d: d.update(num_rows=True), "num_rows must be an integer"),
}


@pytest.mark.parametrize("name", list(ISSUE_REPROS))
def test_an_inconsistent_descriptor_is_refused_before_anything_big_is_allocated(saved, tmp_path, monkeypatch, name):
    """Re-signed, so only the descriptor's own checks stand between the file and the allocator."""
    _, path = saved
    edit, match = ISSUE_REPROS[name]
    p = tmp_path / "forged.safetensors"
    p.write_bytes(edited(path.read_bytes(), edit, sign=True))
    for fn in ("empty", "zeros"):
        real = getattr(torch, fn)

        def bounded(*size, _real=real, **kw):
            shape = size[0] if len(size) == 1 and isinstance(size[0], tuple | list) else size
            assert torch.Size(shape).numel() <= 1 << 20, f"allocated {shape} for a {p.stat().st_size}-byte file"
            return _real(*size, **kw)

        monkeypatch.setattr(torch, fn, bounded)
    with pytest.raises(CapsuleFileError, match=match):
        Capsule.load(p)


def test_a_table_that_disagrees_with_the_descriptor_is_refused(saved, tmp_path):
    _, path = saved
    head, data = split(path.read_bytes())
    head["pos"]["dtype"] = "I32"  # same size: a safetensors reader would read wrong values
    p = tmp_path / "table.safetensors"
    p.write_bytes(join(head, data))
    with pytest.raises(CapsuleFileError, match="tensor table does not match"):
        Capsule.load(p)


def test_an_old_format_file_is_refused_with_the_fix(saved, tmp_path):
    b, path = saved
    head, _ = split(path.read_bytes())
    old = tmp_path / "old.safetensors"
    meta = {**head["__metadata__"], "format": "flashrt-capsule/1"}
    save_file({"pos": b["pos"].contiguous()}, old, metadata=meta)
    with pytest.raises(CapsuleFileError, match="older flashrt.*cannot be verified.*take a new snapshot"):
        Capsule.load(old)


def test_meta_round_trips_exactly_or_is_refused_at_snapshot():
    b = toy.make(2)
    cap = snapshot(b, meta={"ids": (1, 2), "n": None})
    assert cap.meta == {"ids": [1, 2], "n": None}  # as it will read back from a file
    with pytest.raises(ValueError, match="NaN or infinity"):
        snapshot(b, meta={"x": float("nan")})
    with pytest.raises(TypeError, match="must be a dict"):
        snapshot(b, meta=[1])  # type: ignore[arg-type]


# -- fuzz ------------------------------------------------------------------------------------------
def originals(tmp_path_factory) -> list[bytes]:
    folder = tmp_path_factory.mktemp("fuzz")
    b = toy.make(3)
    toy.step(b)
    whole = snapshot(b, meta={"step": 1, "ids": [4, 5]}).save(folder / "whole.safetensors")
    part = snapshot(b, [2, 0], names=["hist", "key", "done"]).save(folder / "part.safetensors")
    return [whole.read_bytes(), part.read_bytes()]


@pytest.fixture(scope="module")
def fuzz_inputs(tmp_path_factory):
    return originals(tmp_path_factory), tmp_path_factory.mktemp("mutants") / "m.safetensors"


KEYS = ("num_rows", "row_bytes", "shared_bytes", "slots", "meta", "layout", "deployment", "entries")
ENTRY_KEYS = ("name", "kind", "shape", "dtype", "offset", "nbytes")
VALUES = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 4, 8, 63, 64, 128, 192, 500_000_000, 2**63, 2**64]),
    st.sampled_from(["float32", "bfloat16", "int64", "bool", "complex64", "slot", "shared", "scratch", "pos", "tick"]),
    st.text(max_size=6),
    st.none(),
    st.booleans(),
    st.floats(),
    st.lists(st.integers(-2, 200), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
DELTAS = st.integers(-130, 130)
MUTATIONS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 20), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 20)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=9)),
    st.tuples(st.just("length"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("field"), st.sampled_from(KEYS), VALUES, st.booleans()),
    st.tuples(st.just("nudge"), st.sampled_from(KEYS), DELTAS, st.booleans()),
    st.tuples(st.just("entry"), st.integers(0, 6), st.sampled_from(ENTRY_KEYS), VALUES, st.booleans()),
    st.tuples(st.just("entry_nudge"), st.integers(0, 6), st.sampled_from(ENTRY_KEYS), DELTAS, st.just(True)),
    st.tuples(st.just("drop_entry"), st.integers(0, 6), st.booleans()),
    st.tuples(st.just("swap_offsets"), st.integers(0, 6), st.integers(0, 6), st.booleans()),
    st.tuples(st.just("table"), st.integers(0, 6), st.sampled_from(["dtype", "shape", "data_offsets"]), VALUES),
)


def nudged(value, delta):
    if isinstance(value, bool) or not isinstance(value, int | list):
        return value
    if isinstance(value, list):  # a shape or slot list: nudge its first element
        return [v + delta if i == 0 and isinstance(v, int) else v for i, v in enumerate(value)]
    return value + delta


def mutate(raw: bytes, m: tuple) -> tuple[bytes, bool]:
    """The mutant, and whether its checksum was recomputed (a forged, not a corrupted, file)."""
    kind = m[0]
    if kind == "flip":
        out = bytearray(raw)
        out[m[1] % len(raw)] ^= m[2]
        return bytes(out), False
    if kind == "truncate":
        return raw[: m[1] % len(raw)], False
    if kind == "append":
        return raw + m[1], False
    if kind == "length":
        return struct.pack("<Q", m[1]) + raw[8:], False
    if kind == "table":
        head, data = split(raw)
        names = [k for k in head if k != "__metadata__"]
        head[names[m[1] % len(names)]][m[2]] = m[3]
        return join(head, data), False

    def edit(d):
        entries = d["entries"]
        if kind == "field":
            d[m[1]] = m[2]
        elif kind == "nudge":
            d[m[1]] = nudged(d[m[1]], m[2])
        elif kind == "entry":
            entries[m[1] % len(entries)][m[2]] = m[3]
        elif kind == "entry_nudge":
            e = entries[m[1] % len(entries)]
            e[m[2]] = nudged(e[m[2]], m[3])
        elif kind == "drop_entry":
            entries.pop(m[1] % len(entries))
        elif kind == "swap_offsets":
            a, b = entries[m[1] % len(entries)], entries[m[2] % len(entries)]
            a["offset"], b["offset"] = b["offset"], a["offset"]

    return edited(raw, edit, sign=m[-1]), m[-1]


def buffer_bytes(slot_arena: torch.Tensor, shared_arena: torch.Tensor, b: BufferSet) -> dict[str, torch.Tensor]:
    """Every state buffer's bytes (padding between buffers left out): ``(num_slots, nbytes)`` or ``(nbytes,)``."""
    out = {}
    for name in b.names("slot", "shared"):
        p = b.placements[name]
        arena = slot_arena if p.spec.kind == "slot" else shared_arena
        out[name] = arena[..., p.offset : p.offset + p.spec.nbytes]
    return out


def restored_exactly(b: BufferSet, before: tuple[torch.Tensor, torch.Tensor], cap: Capsule) -> bool:
    """Whether ``b`` holds ``before`` with exactly the capsule's bytes written where its
    descriptor says (its buffers, at its slots), and nothing else changed."""
    want = {n: t.clone() for n, t in buffer_bytes(*before, b).items()}
    d = cap.descriptor
    dst = list(d.slots) if d.slots is not None else list(range(d.num_rows))
    for e in d.entries:
        if e.kind == "slot":
            want[e.name][dst] = cap.rows[:, e.offset : e.offset + e.nbytes]
        else:
            want[e.name][:] = cap.shared[e.offset : e.offset + e.nbytes]
    got = buffer_bytes(b.slot_arena, b.shared_arena, b)
    return all(torch.equal(got[n], want[n]) for n in want)


@settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(which=st.integers(0, 1), mutation=MUTATIONS)
def test_every_mutant_is_refused_or_restores_exactly(fuzz_inputs, which, mutation):
    """Corrupted files (checksum left as it was) are refused with CapsuleFileError, or still say
    exactly what the original said. Forged files (checksum recomputed: the threat model's trusted
    input) are refused with CapsuleFileError or load into a capsule whose restore either refuses
    (a CapsuleError, or a bad-slot error) before any write or writes exactly its own bytes.
    Nothing else: no raw RuntimeError / KeyError / IndexError from the reader, no big allocation."""
    raw, path = fuzz_inputs[0][which], fuzz_inputs[1]
    mutant, forged = mutate(raw, mutation)
    path.write_bytes(mutant)
    try:
        cap = Capsule.load(path)
    except CapsuleFileError:
        return
    for e in cap.descriptor.entries:  # every buffer of a capsule that loads has a typed view
        view = cap.tensor(e.name)
        assert view.shape == ((cap.descriptor.num_rows, *e.shape) if e.kind == "slot" else e.shape)
    path.write_bytes(raw)
    original = Capsule.load(path)
    if not forged:
        assert cap.descriptor == original.descriptor
        assert torch.equal(cap.rows, original.rows) and torch.equal(cap.shared, original.shared)
    target = toy.make(3)
    toy.scramble(target)
    before = toy.state_bytes(target)
    try:
        restore(target, cap)
    except (CapsuleError, ValueError, IndexError) as e:
        assert forged, f"an intact capsule was refused: {e}"
        assert toy.same_state(target, before)
        return
    assert restored_exactly(target, before, cap)
    if not forged:  # the original's own bytes, at the original's own slots
        reference = toy.make(3)
        toy.scramble(reference)
        restore(reference, original)
        assert toy.same_state(target, reference)
