import pytest
import torch

from flashrt.runtime import ALIGN, BufferSet, BufferSpec, scratch, shared, slot
from tests.runtime import toy


def test_views_share_one_slot_major_arena():
    b = toy.make(num_slots=5)
    assert b["pos"].shape == (5, 3) and b["hist"].dtype == torch.bfloat16 and b["tick"].shape == ()
    assert b.slot_arena.shape == (5, b.row_bytes) and b.row_bytes % ALIGN == 0
    for name in b.names("slot"):
        assert b.placements[name].offset % ALIGN == 0
        assert b[name].stride(0) * b[name].element_size() == b.row_bytes  # one row per slot
    # a write through a view lands in that slot's row and nowhere else
    before = b.slot_arena.clone()
    b["vel"][2] = 7.0
    changed = (b.slot_arena != before).any(dim=1)
    assert changed.tolist() == [False, False, True, False, False]


def test_names_by_kind_and_state_size():
    b = toy.make(num_slots=2)
    assert b.names("shared") == ("tick",)
    assert b.names("scratch") == ("tmp",)
    assert set(b.names("slot")) == {"pos", "vel", "hist", "key", "counter", "done"}
    assert b.state_nbytes == 2 * b.row_bytes + b.shared_arena.numel()
    assert len(b) == len(toy.SPECS) and set(b) == {s.name for s in toy.SPECS}


def test_layout_digest_ignores_slot_count_but_not_layout():
    assert toy.make(4).layout_digest == toy.make(16).layout_digest
    other = BufferSet([slot("pos", (3,), torch.float64)], 4)
    assert other.layout_digest != BufferSet([slot("pos", (3,))], 4).layout_digest


@pytest.mark.parametrize(
    ("specs", "num_slots", "match"),
    [
        ([slot("a", (1,)), slot("a", (2,))], 2, "duplicate buffer names"),
        ([slot("a", (1,))], 0, "num_slots must be >= 1"),
    ],
)
def test_bad_declarations_are_refused(specs, num_slots, match):
    with pytest.raises(ValueError, match=match):
        BufferSet(specs, num_slots)


def test_bad_specs_and_unknown_names():
    with pytest.raises(ValueError, match="kind must be one of"):
        BufferSpec("a", (1,), torch.float32, "weights")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="negative dimension"):
        slot("a", (-1,))
    with pytest.raises(TypeError, match="must be a torch.dtype"):
        slot("a", (1,), "float32")  # type: ignore[arg-type]
    b = toy.make(2)
    with pytest.raises(KeyError, match="no buffer named 'nope'"):
        b["nope"]


def test_mapping_is_read_only():
    b = toy.make(2)
    with pytest.raises(TypeError):
        b["pos"] = torch.zeros(2, 3)  # type: ignore[index]


def test_zero_size_buffers_are_empty_views():
    b = BufferSet([slot("none", (0, 3)), slot("x", (2,)), shared("empty", (0,), torch.int64)], num_slots=3)
    assert b["none"].shape == (3, 0, 3) and b["empty"].shape == (0,) and b["x"].shape == (3, 2)


def test_clone_copies_buffers_of_one_arena_in_one_span():
    specs = [
        scratch("a", (3,)),
        scratch("flag", (3,), torch.bool),
        scratch("img", (2, 2), torch.uint8),
        shared("tick", (), torch.int64),
        slot("pos", (2,)),
    ]
    b = BufferSet(specs, num_slots=2)
    b["a"].copy_(torch.tensor([1.0, 2.0, 3.0]))
    b["flag"].copy_(torch.tensor([True, False, True]))
    b["img"].copy_(torch.arange(4, dtype=torch.uint8).view(2, 2))
    out = b.clone(["img", "a"])
    assert list(out) == ["img", "a"]
    assert torch.equal(out["a"], b["a"]) and torch.equal(out["img"], b["img"]) and out["img"].dtype == torch.uint8
    assert out["a"].untyped_storage().data_ptr() == out["img"].untyped_storage().data_ptr()  # one copy
    assert out["a"].untyped_storage().data_ptr() != b.scratch_arena.data_ptr()
    b["a"].zero_()  # copies, not views of the buffers
    assert out["a"].tolist() == [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="one arena, shared or scratch"):
        b.clone(["a", "tick"])
    with pytest.raises(ValueError, match="slot buffers are strided"):
        b.clone(["pos"])
    with pytest.raises(ValueError, match="one or more buffers"):
        b.clone([])
    with pytest.raises(KeyError, match=r"no buffers named \['nope'\]"):
        b.clone(["a", "nope"])
