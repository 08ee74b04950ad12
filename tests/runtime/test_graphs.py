import gc

import pytest
import torch

from flashrt.runtime import BufferSet, Graph, MissingVariantError, collector_paused, slot
from tests.runtime import toy


def test_eager_capture_has_no_side_effect_and_replay_runs_the_callable():
    b = toy.make(4)
    before = b.slot_arena.clone()
    g = Graph("toy").bind(b)
    g.capture(("n", 4), lambda: toy.step(b))
    assert g.backend == "eager"
    assert torch.equal(b.slot_arena, before)  # capture does not advance the state
    g.replay(("n", 4))
    ref = toy.make(4)
    toy.step(ref)
    assert toy.same_state(b, ref)


def test_replay_of_a_missing_key_raises_never_runs_eagerly():
    b = toy.make(2)
    g = Graph("toy").bind(b)
    g.capture(1, lambda: toy.step(b))
    before = b.slot_arena.clone()
    with pytest.raises(MissingVariantError, match=r"no variant 2; captured: \[1\]"):
        g.replay(2)
    assert torch.equal(b.slot_arena, before)


def test_the_variant_table_is_bounded_and_evicts_the_least_recently_used():
    b = toy.make(2)
    g = Graph("toy", max_variants=2).bind(b)
    calls = []
    for key in ("a", "b"):
        g.capture(key, lambda key=key: calls.append(key))
    g.replay("a")  # "b" is now the least recently used
    g.capture("c", lambda: calls.append("c"))
    assert "b" not in g and "a" in g and "c" in g
    with pytest.raises(MissingVariantError, match=r"no variant 'b'; captured: \['a', 'c'\]"):
        g.replay("b")
    g.replay("c")
    g.replay("a")
    g.capture("a", lambda: calls.append("a2"))  # re-capturing a key replaces it, evicting nothing
    g.replay("a")
    assert calls == ["a", "c", "a", "a2"] and "c" in g


def test_keys_must_be_hashable_and_arguments_valid():
    b = toy.make(2)
    g = Graph("toy").bind(b)
    with pytest.raises(TypeError):
        g.capture([1, 2], lambda: None)
    with pytest.raises(ValueError, match="backend must be"):
        Graph(backend="tensorrt")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_variants must be an int >= 1"):
        Graph(max_variants=0)
    with pytest.raises(ValueError, match="bind a BufferSet before capturing"):
        Graph("unbound").capture(1, lambda: None)


def test_rebinding_a_graph_with_live_variants_is_refused():
    g = Graph("toy").bind(toy.make(2))
    g.capture(1, lambda: None)
    with pytest.raises(ValueError, match="cannot be re-bound"):
        g.bind(toy.make(2))


def test_cuda_backend_needs_cuda_buffers():
    g = Graph("toy", backend="cuda").bind(toy.make(2))
    with pytest.raises(ValueError, match="needs CUDA buffers"):
        g.capture(1, lambda: None)


def test_two_graphs_bound_to_one_set_hand_off_without_copies():
    io = BufferSet([slot("plan", (4,)), slot("obs", (4,)), slot("act", (4,))], 3)
    planner = Graph("planner").bind(io)
    actor = Graph("actor").bind(io)
    planner.capture(1, lambda: io["plan"].copy_(io["obs"] * 2))
    actor.capture(1, lambda: io["act"].copy_(io["plan"] + 1))
    ptr = io["plan"].data_ptr()
    io["obs"].copy_(torch.arange(12.0).view(3, 4))
    planner.replay(1)
    actor.replay(1)
    assert torch.equal(io["act"], torch.arange(12.0).view(3, 4) * 2 + 1)
    assert io["plan"].data_ptr() == ptr


def guarded(backend: str, device: str) -> tuple[toy.BufferSet, Graph, torch.Tensor]:
    b = toy.make(4, device)
    gate, ok = torch.zeros(1, device=device), torch.zeros(1, dtype=torch.bool, device=device)
    g = Graph("toy", backend=backend).bind(b)
    g.capture(1, lambda: toy.step(b), guard=lambda: torch.gt(gate, 0, out=ok))
    return b, g, gate


def test_a_guarded_variant_runs_its_body_only_where_the_guard_holds():
    b, g, gate = guarded("eager", "cpu")
    before = toy.state_bytes(b)
    g.replay(1)
    assert not g.held(1)
    assert toy.same_state(b, before)
    gate.fill_(1.0)
    g.replay(1)
    assert g.held(1)
    ref = toy.make(4)
    toy.step(ref)
    assert toy.same_state(b, ref)


def test_held_names_a_variant_without_a_guard():
    b = toy.make(2)
    g = Graph("toy").bind(b)
    g.capture(1, lambda: toy.step(b))
    g.replay(1)
    for key in (1, 2):
        with pytest.raises(ValueError, match="not a captured guarded variant"):
            g.held(key)


def test_the_collector_is_paused_for_a_capture_and_restored_as_it_was():
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"):
        with collector_paused():
            assert not gc.isenabled()
            with collector_paused():  # nested: the inner exit leaves it paused
                pass
            assert not gc.isenabled()
            raise RuntimeError("inside")
    assert gc.isenabled()  # back on after an error too
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # a caller's own choice is kept
    finally:
        gc.enable()
