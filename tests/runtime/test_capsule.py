import pytest
import torch
from safetensors.torch import load_file, save_file

from flashrt.runtime import (
    BufferSet,
    Capsule,
    CapsuleError,
    CapsuleFileError,
    DeploymentMismatchError,
    LayoutMismatchError,
    copy_rows,
    fork,
    masked_restore,
    restore,
    rollback,
    slot,
    snapshot,
)
from tests.runtime import toy


def run(b: BufferSet, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    for _ in range(n):
        toy.step(b)
    return toy.state_bytes(b)


def test_restore_is_byte_exact_for_every_dtype():
    b = toy.make(6)
    run(b, 3)
    cap = snapshot(b, meta={"step": 3})
    ref = toy.state_bytes(b)
    toy.scramble(b)
    restore(b, cap)
    assert torch.equal(b.slot_arena, ref[0]) and torch.equal(b.shared_arena, ref[1])
    assert cap.meta == {"step": 3} and cap.nbytes == b.state_nbytes


def test_a_capsule_is_a_copy_that_later_steps_do_not_touch():
    b = toy.make(4)
    for cap in (snapshot(b), snapshot(b, tier="host"), snapshot(b, slots=[0, 1, 2, 3])):
        taken = cap.rows.clone(), cap.shared.clone()
        run(b, 2)
        assert torch.equal(cap.rows, taken[0]) and torch.equal(cap.shared, taken[1])
        assert not torch.equal(cap.rows, b.slot_arena)


def test_state_completeness_continuation_is_exact():
    b = toy.make(8)
    run(b, 5)
    cap = snapshot(b)
    uninterrupted = run(b, 20)
    toy.scramble(b, 7)
    run(b, 3)  # something unrelated overwrites every buffer
    restore(b, cap)
    resumed = run(b, 20)
    assert torch.equal(resumed[0], uninterrupted[0]) and torch.equal(resumed[1], uninterrupted[1])


@pytest.mark.parametrize("missing", ["hist", "counter", "tick"])
def test_restoring_part_of_the_state_diverges(missing):
    b = toy.make(8)
    run(b, 5)
    names = [n for n in b.names("slot", "shared") if n != missing]
    partial = snapshot(b, names=names)
    uninterrupted = run(b, 20)
    toy.seed(b, 99)
    run(b, 4)
    restore(b, partial)
    resumed = run(b, 20)
    assert not torch.equal(resumed[0], uninterrupted[0])


def test_selected_slots_restore_into_their_slots_or_others():
    b = toy.make(6)
    run(b, 2)
    cap = snapshot(b, slots=[4, 1])
    assert cap.slots == (4, 1) and cap.rows.shape == (2, b.row_bytes)
    rows = b.slot_arena[[4, 1]].clone()
    toy.scramble(b)
    untouched = b.slot_arena[[0, 2, 3, 5]].clone()
    restore(b, cap)
    assert torch.equal(b.slot_arena[[4, 1]], rows)
    assert torch.equal(b.slot_arena[[0, 2, 3, 5]], untouched)
    restore(b, cap, slots=[0, 2])
    assert torch.equal(b.slot_arena[[0, 2]], rows)


def test_slot_capsules_move_between_variants_of_one_deployment():
    small, big = toy.make(2), toy.make(16)
    run(small, 3)
    restore(big, snapshot(small, slots=[1]), slots=[9])
    assert torch.equal(big.slot_arena[9], small.slot_arena[1])


def test_fork_of_a_capsule_slot_gives_identical_slots_that_continue_identically():
    b = toy.make(8)
    run(b, 3)
    cap = snapshot(b, slots=[5])
    toy.scramble(b)
    toy.seed(b, 1)
    fork(b, cap, [0, 2, 3, 7])
    for s in (0, 2, 3, 7):
        assert torch.equal(b.slot_arena[s], cap.rows[0])
    run(b, 10)
    assert all(torch.equal(b.slot_arena[s], b.slot_arena[0]) for s in (2, 3, 7))


def test_fork_of_a_live_slot_and_of_a_named_slot_of_a_larger_capsule():
    b = toy.make(5)
    run(b, 2)
    row = b.slot_arena[3].clone()
    fork(b, 3, [0, 1, 3])
    assert all(torch.equal(b.slot_arena[s], row) for s in (0, 1, 3))
    whole = snapshot(b)
    toy.scramble(b)
    fork(b, whole, [4], src_slot=2)
    assert torch.equal(b.slot_arena[4], whole.rows[2])
    with pytest.raises(ValueError, match="name one with src_slot"):
        fork(b, whole, [0])
    with pytest.raises(ValueError, match="not in the capsule's slots"):
        fork(b, snapshot(b, slots=[1]), [0], src_slot=3)


def test_rollback_returns_to_an_earlier_boundary_of_the_same_set_only():
    b = toy.make(4)
    run(b, 2)
    early = snapshot(b)
    at_early = toy.state_bytes(b)
    run(b, 5)
    rollback(b, early)
    assert torch.equal(b.slot_arena, at_early[0]) and torch.equal(b.shared_arena, at_early[1])
    with pytest.raises(CapsuleError, match="use restore"):
        rollback(toy.make(4), early)


def test_deployment_and_layout_mismatches_are_refused_and_nothing_is_written():
    b = toy.make(4)
    run(b, 2)
    cap = snapshot(b)
    other = toy.make(4, deployment="toy-v2")
    before = toy.state_bytes(other)
    with pytest.raises(DeploymentMismatchError, match="'toy-v1'.*'toy-v2'"):
        restore(other, cap)
    assert torch.equal(other.slot_arena, before[0])
    specs = [s if s.name != "vel" else slot("vel", (4,)) for s in toy.SPECS]
    wrong_shape = BufferSet(specs, 4, deployment="toy-v1")
    with pytest.raises(LayoutMismatchError, match=r"'vel'.*\(3,\).*\(4,\)"):
        restore(wrong_shape, cap)
    assert not wrong_shape.slot_arena.any()
    specs = [s if s.name != "hist" else slot("hist", (4, 3), torch.float16) for s in toy.SPECS]
    with pytest.raises(LayoutMismatchError, match="'hist'.*bfloat16.*float16"):
        restore(BufferSet(specs, 4, deployment="toy-v1"), cap)
    missing = BufferSet([s for s in toy.SPECS if s.name != "done"], 4, deployment="toy-v1")
    with pytest.raises(LayoutMismatchError, match="'done' does not exist"):
        restore(missing, cap)


@pytest.mark.parametrize(
    ("slots", "err", "match"),
    [
        ([0, 1, 2], ValueError, "holds 2 slots but 3"),
        ([0, 9], IndexError, "out of range"),
        ([1, 1], ValueError, "dup"),
        ([0, 1.5], TypeError, "integers"),
        (torch.tensor([0.0, 1.0]), TypeError, "integers"),
    ],
)
def test_bad_target_slots_are_refused_before_any_write(slots, err, match):
    b = toy.make(4)
    cap = snapshot(b, slots=[0, 1])
    toy.scramble(b)
    before = toy.state_bytes(b)
    with pytest.raises(err, match=match):
        restore(b, cap, slots=slots)
    assert torch.equal(b.slot_arena, before[0])


def test_snapshot_argument_errors():
    b = toy.make(4)
    with pytest.raises(ValueError, match="scratch buffers"):
        snapshot(b, names=["tmp"])
    with pytest.raises(KeyError, match="nope"):
        snapshot(b, names=["nope"])
    with pytest.raises(ValueError, match="have no slots"):
        snapshot(b, slots=[0], names=["tick"])
    with pytest.raises(TypeError):
        snapshot(b, meta={"bad": object()})
    with pytest.raises(ValueError, match="then move it"):
        snapshot(b, tier="disk")


def test_tier_moves_preserve_bytes(tmp_path):
    b = toy.make(4)
    run(b, 3)
    ref = toy.state_bytes(b)
    cap = snapshot(b, tier="host", meta={"episode": 7})
    assert cap.tier == "host" and cap.rows.device.type == "cpu"
    cap.to("disk", path=tmp_path / "c.safetensors")
    assert cap.tier == "disk" and cap.rows is None and cap.nbytes == b.state_nbytes
    toy.scramble(b)
    restore(b, cap)  # straight from disk: read and verified first
    assert torch.equal(b.slot_arena, ref[0])
    cap.to("gpu")
    assert cap.tier == "gpu" and torch.equal(cap.rows, ref[0])
    with pytest.raises(ValueError, match="needs path"):
        snapshot(b).to("disk")


def test_disk_file_holds_one_typed_tensor_per_buffer_and_round_trips(tmp_path):
    b = toy.make(3)
    run(b, 2)
    cap = snapshot(b, meta={"episode": [1, 2, 3]})
    path = cap.save(tmp_path / "sub" / "cap.safetensors")
    tensors = load_file(path)
    assert set(tensors) == set(b.names("slot", "shared"))
    assert tensors["hist"].dtype == torch.bfloat16 and tensors["hist"].shape == (3, 4, 3)
    assert torch.equal(tensors["pos"], b["pos"]) and torch.equal(tensors["tick"], b["tick"])
    loaded = Capsule.load(path)
    assert loaded.descriptor == cap.descriptor and loaded.meta == {"episode": [1, 2, 3]}
    toy.scramble(b)
    restore(b, loaded)
    assert torch.equal(b.slot_arena, cap.rows)
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["cap.safetensors"]  # no temp files left


def test_corrupted_truncated_foreign_and_missing_files_are_rejected(tmp_path):
    b = toy.make(3)
    path = snapshot(b).save(tmp_path / "c.safetensors")
    data = bytearray(path.read_bytes())
    flipped = tmp_path / "flipped.safetensors"
    data[-5] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with pytest.raises(CapsuleFileError, match="checksum mismatch"):
        Capsule.load(flipped)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(CapsuleFileError, match="truncated or corrupted"):
        Capsule.load(truncated)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CapsuleFileError, match="truncated or corrupted"):
        Capsule.load(garbage)
    foreign = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, foreign)
    with pytest.raises(CapsuleFileError, match="not a flashrt-capsule"):
        Capsule.load(foreign)
    with pytest.raises(CapsuleFileError, match="no capsule file"):
        Capsule.load(tmp_path / "absent.safetensors")


def test_a_corrupted_file_never_reaches_the_buffers(tmp_path):
    b = toy.make(3)
    cap = snapshot(b).to("disk", path=tmp_path / "c.safetensors")
    data = bytearray(cap.path.read_bytes())
    data[-1] ^= 0x01
    cap.path.write_bytes(bytes(data))
    toy.scramble(b)
    before = toy.state_bytes(b)
    with pytest.raises(CapsuleFileError):
        restore(b, cap)
    assert toy.same_state(b, before)


def test_masked_restore_and_copy_rows_match_per_slot_restore():
    b = toy.make(6)
    start = snapshot(b)
    run(b, 4)
    mask = torch.tensor([True, False, False, True, False, True])
    expected = b.slot_arena.clone()
    expected[mask] = start.rows[mask]
    masked_restore(b.slot_arena, start.rows, mask)
    assert torch.equal(b.slot_arena, expected)
    copy_rows(b.slot_arena, torch.tensor([2, 4]), start.rows[[0, 0]])
    assert torch.equal(b.slot_arena[2], start.rows[0]) and torch.equal(b.slot_arena[4], start.rows[0])


def test_moved_makes_a_new_capsule_and_leaves_the_source_alone(tmp_path):
    b = toy.make(3)
    cap = snapshot(b, meta={"k": 1})
    on_disk = cap.moved("disk", path=tmp_path / "m.safetensors")
    assert (cap.tier, cap.path, on_disk.tier, on_disk.rows) == ("gpu", None, "disk", None)
    back = on_disk.moved("host")
    assert on_disk.tier == "disk" and back.tier == "host" and torch.equal(back.rows, cap.rows)
    same = cap.moved("gpu")
    assert same is not cap and same.rows is cap.rows and same.origin == cap.origin
    rollback(b, same)  # the same boundary of the same set


@pytest.mark.parametrize("tier", ["gpu", "host", "file"])
def test_tensor_is_a_typed_view_of_the_capsules_bytes(tmp_path, tier):
    b = toy.make(5)
    run(b, 3)
    whole = snapshot(b, tier="gpu" if tier == "file" else tier)
    part = snapshot(b, [4, 1], names=["hist", "done", "key"], tier="gpu" if tier == "file" else tier)
    if tier == "file":
        whole = Capsule.load(whole.save(tmp_path / "w.safetensors"), tier="host")
        part = Capsule.load(part.save(tmp_path / "p.safetensors"))
    live = {n: b[n].clone() for n in b.names("slot", "shared")}
    toy.scramble(b)  # a capsule is the boundary, not a view of the live set
    for name, want in live.items():
        got = whole.tensor(name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
        assert got.untyped_storage().data_ptr() in (whole.rows.data_ptr(), whole.shared.data_ptr())  # no copy
    for name in ("hist", "done", "key"):
        assert torch.equal(part.tensor(name), live[name][[4, 1]])
    assert not torch.equal(part.tensor("key"), live["key"][[1, 4]])  # rows in the capsule's slot order
    with pytest.raises(KeyError, match=r"no buffer 'pos'; it holds \['hist', 'done', 'key'\]"):
        part.tensor("pos")


def test_tensor_of_a_disk_capsule_or_an_empty_buffer(tmp_path):
    b = BufferSet([slot("x", (2,)), slot("none", (0, 4), torch.int64)], 3, deployment="t")
    b["x"].copy_(torch.arange(6.0).view(3, 2))
    cap = snapshot(b)
    assert cap.tensor("none").shape == (3, 0, 4) and cap.tensor("none").dtype == torch.int64
    cap.to("disk", path=tmp_path / "d.safetensors")
    with pytest.raises(CapsuleError, match=r"on disk .*d\.safetensors.*capsule\.to\('host'\)"):
        cap.tensor("x")
    assert torch.equal(cap.to("host").tensor("x"), b["x"])


def test_a_file_replaced_by_another_snapshot_of_the_same_layout_is_refused(tmp_path):
    b = toy.make(3)
    cap = snapshot(b).to("disk", path=tmp_path / "c.safetensors")
    toy.step(b)
    snapshot(b).save(tmp_path / "later.safetensors")  # same descriptor, other bytes
    (tmp_path / "later.safetensors").replace(cap.path)
    toy.scramble(b)
    before = toy.state_bytes(b)
    for use in (lambda: restore(b, cap), lambda: cap.to("host"), lambda: fork(b, cap, [0], src_slot=1)):
        with pytest.raises(CapsuleFileError, match="now holds another capsule"):
            use()
    assert toy.same_state(b, before) and cap.tier == "disk"
