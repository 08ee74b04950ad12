"""The runtime's semantics under CUDA graph replay (run on the GPU machine: pytest -m cuda)."""

import gc

import pytest
import torch
from safetensors.torch import save_file

from flashrt.runtime import (
    Capsule,
    CapsuleFileError,
    CapsuleRegistry,
    Graph,
    copy_rows,
    fork,
    masked_restore,
    restore,
    snapshot,
)
from flashrt.runtime.streams import Event, Stream, beside
from tests.runtime import toy
from tests.runtime.filebytes import edited

pytestmark = pytest.mark.cuda


def replayed(num_slots: int, steps: int, backend: str) -> toy.BufferSet:
    b = toy.make(num_slots, "cuda")
    g = Graph("toy", backend=backend).bind(b)
    g.capture(num_slots, lambda: toy.step(b))
    for _ in range(steps):
        g.replay(num_slots)
    torch.cuda.synchronize()
    return b


def test_graph_replay_equals_the_eager_backend_byte_for_byte():
    graph, eager = replayed(16, 12, "cuda"), replayed(16, 12, "eager")
    assert torch.equal(graph.slot_arena, eager.slot_arena) and torch.equal(graph.shared_arena, eager.shared_arena)


def test_cuda_capture_leaves_the_state_untouched():
    b = toy.make(8, "cuda")
    before = toy.state_bytes(b)
    g = Graph("toy").bind(b)
    g.capture(8, lambda: toy.step(b), warmup=3)
    assert g.backend == "cuda"
    assert toy.same_state(b, before)


def test_a_capture_holds_the_steps_temporaries_once(monkeypatch):
    """The warm-up's temporaries go back to the driver before the capture allocates the graph's
    pool: a step with a temporary of T bytes grows torch's reserve by about T, not 2 T (torch's
    cache and the pool each holding one). Mutation: the same capture with the cache kept (the
    empty call a no-op) grows it by 2 T, outside the bound."""
    b = toy.make(4, "cuda")
    big = 256 * 2**20
    empty = torch.cuda.empty_cache

    def step() -> None:
        toy.step(b)
        t = torch.full((big // 4,), 0.5, device="cuda")  # a float32 temporary of ``big`` bytes
        b["tmp"].add_(t[: b["tmp"].numel()].view_as(b["tmp"]))

    def grown(name: str) -> tuple[Graph, int]:
        torch.cuda.synchronize()
        empty()
        before = torch.cuda.memory_reserved()
        g = Graph(name).bind(b)
        g.capture(4, step, warmup=2)
        return g, torch.cuda.memory_reserved() - before

    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "empty_cache", lambda: None)
        kept, kept_bytes = grown("kept")
    assert kept_bytes >= 2 * big
    del kept
    g, held = grown("toy")
    assert big <= held < 1.5 * big
    g.replay(4)
    torch.cuda.synchronize()


@pytest.mark.parametrize("guarded", [False, True], ids=["plain", "guarded"])
def test_the_garbage_collector_is_held_off_inside_a_capture(guarded):
    """A cyclic collection inside a capture would run other objects' CUDA frees there
    (``collector_paused``); the warm-up runs, outside the capture, keep the collector, and it
    is back on after the capture."""
    b = toy.make(4, "cuda")
    seen: list[bool] = []

    def step() -> None:
        seen.append(gc.isenabled())
        toy.step(b)

    flag = torch.ones((), dtype=torch.bool, device="cuda")
    g = Graph("toy").bind(b)
    g.capture(4, step, warmup=2, guard=(lambda: flag) if guarded else None)
    assert seen == [True, True, False] and gc.isenabled()


def test_snapshot_restore_fork_between_replays_are_exact():
    b = toy.make(8, "cuda")
    g = Graph("toy").bind(b)
    g.capture(8, lambda: toy.step(b))
    for _ in range(3):
        g.replay(8)
    cap = snapshot(b)
    for _ in range(10):
        g.replay(8)
    uninterrupted = toy.state_bytes(b)
    toy.scramble(b)
    g.replay(8)
    restore(b, cap)
    for _ in range(10):
        g.replay(8)
    assert torch.equal(b.slot_arena, uninterrupted[0]) and torch.equal(b.shared_arena, uninterrupted[1])
    fork(b, 2, range(8))
    for _ in range(5):
        g.replay(8)
    assert all(torch.equal(b.slot_arena[s], b.slot_arena[0]) for s in range(8))


def test_masked_slot_restore_inside_a_captured_graph():
    n = 64
    b = toy.make(n, "cuda")
    start = snapshot(b)  # the episode-start image every finished slot returns to
    start_rows = start.rows.clone()
    mask = torch.zeros(n, dtype=torch.bool, device="cuda")

    def step_and_reset():
        toy.step(b)
        mask.copy_(b["done"])
        masked_restore(b.slot_arena, start_rows, mask)

    g = Graph("autoreset").bind(b)
    g.capture(n, step_and_reset)
    ref = toy.make(n, "cuda")

    def check_next_replay():
        g.replay(n)
        toy.step(ref)
        done = ref["done"].clone()
        ref.slot_arena[done] = start_rows[done]
        assert torch.equal(b.slot_arena, ref.slot_arena) and torch.equal(b.shared_arena, ref.shared_arena)
        return done

    for _ in range(20):
        check_next_replay()
    for bufs in (b, ref):  # push the even slots out of bounds: they reset in the next replay
        bufs["pos"][::2] = 100.0
    done = check_next_replay()
    assert done[::2].all()
    assert torch.equal(b.slot_arena[::2], start_rows[::2])


def test_fork_as_one_captured_row_copy():
    b = toy.make(16, "cuda")
    dst = torch.arange(1, 16, device="cuda")
    g = Graph("fork").bind(b)
    g.capture("fork", lambda: copy_rows(b.slot_arena, dst, b.slot_arena[0:1].expand(15, -1)))
    toy.step(b)
    g.replay("fork")
    assert all(torch.equal(b.slot_arena[s], b.slot_arena[0]) for s in range(16))


def test_host_tier_round_trip_and_registry_promotion(tmp_path):
    b = toy.make(32, "cuda")
    toy.step(b)
    ref = toy.state_bytes(b)
    cap = snapshot(b, tier="host")
    assert cap.rows.is_pinned() and cap.rows.device.type == "cpu"
    reg = CapsuleRegistry(tmp_path, gpu_bytes=b.state_nbytes, host_bytes=4 * b.state_nbytes, disk_bytes=None)
    reg.put("a", cap)
    reg.put("b", snapshot(b))
    assert reg.tier_of("a") == "host"
    toy.scramble(b)
    got = reg.get("a")
    assert got.tier == "gpu" and got.rows.is_cuda and reg.tier_of("b") == "host"
    restore(b, got)
    torch.cuda.synchronize()
    assert torch.equal(b.slot_arena, ref[0]) and torch.equal(b.shared_arena, ref[1])
    disk = snapshot(b).to("disk", path=tmp_path / "d.safetensors")
    toy.scramble(b)
    restore(b, disk)
    assert torch.equal(b.slot_arena, ref[0])


@pytest.mark.parametrize("conditional", [True, False], ids=["conditional-node", "host-read-guard"])
def test_a_guarded_graph_runs_its_body_only_where_the_guard_holds(conditional, monkeypatch):
    from flashrt.kernels import nvcc
    from flashrt.runtime import guarded

    if conditional and nvcc.find() is None:
        pytest.skip("needs the CUDA toolkit's nvcc")
    if not conditional:
        monkeypatch.setattr(guarded, "_library", lambda capability: None)
    b = toy.make(8, "cuda")
    gate, ok = torch.zeros(1, device="cuda"), torch.zeros(1, dtype=torch.bool, device="cuda")
    g = Graph("toy").bind(b)
    g.capture(1, lambda: toy.step(b), guard=lambda: torch.gt(gate, 0, out=ok))
    assert g._variants[1].run.__self__.conditional is conditional
    before = toy.state_bytes(b)
    for _ in range(3):
        g.replay(1)
        assert not g.held(1)
    assert toy.same_state(b, before)
    gate.fill_(1.0)
    for _ in range(5):
        g.replay(1)
        assert g.held(1)
    eager = replayed(8, 5, "eager")
    assert torch.equal(b.slot_arena, eager.slot_arena) and torch.equal(b.shared_arena, eager.shared_arena)


@pytest.mark.parametrize("missing", ["hist", "counter", "tick"])
def test_restoring_part_of_the_state_diverges_under_graph_replay(missing):
    b = toy.make(8, "cuda")
    g = Graph("toy").bind(b)
    g.capture(8, lambda: toy.step(b))
    for _ in range(5):
        g.replay(8)
    full = snapshot(b)
    partial = snapshot(b, names=[n for n in b.names("slot", "shared") if n != missing])
    for _ in range(20):
        g.replay(8)
    uninterrupted = toy.state_bytes(b)
    for cap, equal in ((full, True), (partial, False)):  # the full capsule is the mutation check's control
        toy.scramble(b, 5)
        for _ in range(4):
            g.replay(8)
        restore(b, cap)
        for _ in range(20):
            g.replay(8)
        torch.cuda.synchronize()
        assert toy.same_state(b, uninterrupted) is equal


@pytest.mark.parametrize("tier", ["gpu", "host"])
def test_corrupted_truncated_foreign_and_missing_files_are_refused_onto_the_gpu(tmp_path, tier):
    b = toy.make(3, "cuda")
    toy.step(b)
    path = snapshot(b, meta={"step": 1}).save(tmp_path / "c.safetensors")
    raw = path.read_bytes()
    flipped = bytearray(raw)
    flipped[-5] ^= 0xFF
    foreign = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, foreign)
    cases = {
        "flipped.safetensors": (bytes(flipped), "checksum mismatch"),
        "meta.safetensors": (edited(raw, lambda d: d["meta"].update(step=2), sign=False), "checksum mismatch"),
        "forged.safetensors": (edited(raw, lambda d: d.update(row_bytes=500_000_000), sign=True), "row_bytes is"),
        "truncated.safetensors": (raw[:-40], "truncated or corrupted"),
        "garbage.safetensors": (b"\x05\x00\x00\x00\x00\x00\x00\x00{not json", "truncated or corrupted"),
    }
    for name, (data, match) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(CapsuleFileError, match=match):
            Capsule.load(tmp_path / name, device="cuda", tier=tier)
    with pytest.raises(CapsuleFileError, match="not a flashrt-capsule"):
        Capsule.load(foreign, device="cuda", tier=tier)
    with pytest.raises(CapsuleFileError, match="no capsule file"):
        Capsule.load(tmp_path / "absent.safetensors", device="cuda", tier=tier)
    good = Capsule.load(path, device="cuda", tier=tier)
    assert good.rows.is_cuda if tier == "gpu" else good.rows.is_pinned()
    target = toy.make(3, "cuda")
    toy.scramble(target)
    restore(target, good)
    torch.cuda.synchronize()
    assert toy.same_state(target, b)


def test_a_bad_file_never_reaches_cuda_buffers(tmp_path):
    b = toy.make(4, "cuda")
    toy.step(b)
    whole = snapshot(b).to("disk", path=tmp_path / "whole.safetensors")
    one = snapshot(b, [2]).to("disk", path=tmp_path / "one.safetensors")
    toy.step(b)
    snapshot(b).save(tmp_path / "other.safetensors")
    toy.scramble(b)
    torch.cuda.synchronize()
    before = toy.state_bytes(b)
    data = bytearray(whole.path.read_bytes())
    data[-1] ^= 0x01
    whole.path.write_bytes(bytes(data))
    with pytest.raises(CapsuleFileError, match="checksum mismatch"):
        restore(b, whole)
    one.path.write_bytes(one.path.read_bytes()[:-3])
    with pytest.raises(CapsuleFileError, match="truncated or corrupted"):
        fork(b, one, [0, 1, 3])
    (tmp_path / "other.safetensors").replace(whole.path)  # a valid capsule of this layout, but not this one
    with pytest.raises(CapsuleFileError, match="now holds another capsule"):
        restore(b, whole)
    torch.cuda.synchronize()
    assert toy.same_state(b, before)


@pytest.mark.parametrize(("captured", "forked"), [(False, True), (True, True), (False, False)])
def test_work_beside_the_current_stream_runs_after_what_was_queued_before_it(captured, forked):
    """``beside`` forks: the side stream's copy reads what the current stream wrote before it,
    behind a ~50 ms spin, eagerly and in a captured graph. The mutation (the side stream made
    current without the fork's wait) copies before the write."""
    src, dst = torch.zeros(1 << 20, device="cuda"), torch.full((1 << 20,), -1.0, device="cuda")
    side = Stream("cuda")

    def work() -> None:
        torch.cuda._sleep(100_000_000)
        src.fill_(1.0)
        with beside(side) if forked else side:
            dst.copy_(src)
        Stream.current("cuda").wait(Event.record_on(side))

    if captured:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            work()
        torch.cuda.synchronize()
        g.replay()
    else:
        work()
    torch.cuda.synchronize()
    assert bool((dst == 1.0).all()) == forked
