"""scripts/benchlib.py's replay breakdown: marginal time per kernel (overlap charged once) and
the GPU's idle time charged to the pair of kernels around it, so a wait before a kernel is not
read as the kernel being slow."""

import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib import replay_time  # noqa: E402


def event(name: str, start: float, end: float) -> SimpleNamespace:
    span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return SimpleNamespace(name=name, time_range=span)


def test_idle_time_is_charged_to_the_kernels_around_it_and_overlap_once():
    # a 0..10, b overlaps it 5..12, then 30 idle before c 42..43, d 43..50, idle 10, c 60..61
    events = [event("c", 42, 43), event("a", 0, 10), event("b", 5, 12), event("d", 43, 50), event("c", 60, 61)]
    out = replay_time(events, top=5)
    assert out["span_us"] == 61 and out["kernels"] == 5
    marginal = {r["kernel"]: (r["marginal_us"], r["busy_us"], r["calls"]) for r in out["top"]}
    assert marginal == {"a": (10, 10, 1), "b": (2, 7, 1), "c": (1 + 30 + 1 + 10, 2, 2), "d": (7, 7, 1)}
    assert sum(m for m, _, _ in marginal.values()) == out["span_us"]
    idle = {(r["after"], r["before"]): (r["idle_us"], r["times"]) for r in out["idle"]}
    assert idle == {("b", "c"): (30, 1), ("d", "c"): (10, 1)}  # after b (the latest end), not a
