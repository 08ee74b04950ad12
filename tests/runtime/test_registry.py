import os
import tempfile
from collections import OrderedDict

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flashrt.runtime import BufferSet, CapsuleError, CapsuleRegistry, restore, slot, snapshot

ROW = 64  # every test capsule is k rows of 64 bytes


def capsule_of(rows: int, fill: int):
    b = BufferSet([slot("x", (ROW,), torch.uint8)], rows, deployment="reg")
    b["x"].fill_(fill)
    return snapshot(b, meta={"fill": fill})


def content(cap) -> int:
    b = BufferSet([slot("x", (ROW,), torch.uint8)], cap.descriptor.num_rows, deployment="reg")
    restore(b, cap)
    values = b["x"].unique().tolist()
    assert len(values) == 1
    return values[0]


def test_lru_demotion_cascades_down_the_tiers(tmp_path):
    reg = CapsuleRegistry(tmp_path, gpu_bytes=2 * ROW, host_bytes=2 * ROW)
    for i in range(5):
        reg.put(f"c{i}", capsule_of(1, i))
    assert [reg.tier_of(f"c{i}") for i in range(5)] == ["disk", "host", "host", "gpu", "gpu"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c0.safetensors"]
    s = reg.stats
    assert s.bytes == {"gpu": 2 * ROW, "host": 2 * ROW, "disk": ROW} and s.demotions == 4
    assert reg.get("c0").tier == "gpu" and content(reg.get("c0")) == 0  # promoted on use
    assert reg.stats.promotions == 1 and not (tmp_path / "c0.safetensors").exists()
    assert [reg.tier_of(f"c{i}") for i in range(5)] == ["gpu", "disk", "host", "host", "gpu"]


def test_pinned_capsules_never_move_and_cannot_overfill_a_tier():
    reg = CapsuleRegistry(None, gpu_bytes=2 * ROW, host_bytes=2 * ROW)
    reg.put("start", capsule_of(1, 1), pin=True)
    for i in range(4):
        reg.put(f"c{i}", capsule_of(1, 10 + i))
    assert reg.tier_of("start") == "gpu" and reg.is_pinned("start")
    assert reg.names() == ["start", "c1", "c2", "c3"]  # no disk tier: pushed past host means evicted
    assert reg.stats.evictions == 1
    with pytest.raises(CapsuleError, match="cannot pin 'big'.*raise gpu_bytes"):
        reg.put("big", capsule_of(2, 2), pin=True)
    assert "big" not in reg
    reg.unpin("start")  # now the least recently used capsule of all: demoted, then evicted
    reg.put("c4", capsule_of(1, 14))
    assert reg.names() == ["c1", "c2", "c3", "c4"] and reg.stats.evictions == 2


def test_a_capsule_too_big_for_a_tier_enters_below_it_and_flushes_nothing(tmp_path):
    reg = CapsuleRegistry(tmp_path, gpu_bytes=ROW, host_bytes=4 * ROW)
    reg.put("small", capsule_of(1, 1))
    reg.put("big", capsule_of(3, 2))
    assert reg.tier_of("big") == "host" and reg.tier_of("small") == "gpu"
    reg.get("big")  # cannot be promoted into a 1-row gpu budget
    assert reg.tier_of("big") == "host" and reg.tier_of("small") == "gpu"
    with pytest.raises(CapsuleError, match="larger than the free budget of every tier"):
        CapsuleRegistry(None, gpu_bytes=ROW, host_bytes=ROW).put("huge", capsule_of(2, 3))


def test_a_capsule_put_from_disk_keeps_its_file(tmp_path):
    cap = capsule_of(1, 5).to("disk", path=tmp_path / "mine.safetensors")
    reg = CapsuleRegistry(tmp_path / "reg", gpu_bytes=ROW)
    reg.put("mine", cap)
    assert reg.tier_of("mine") == "disk" and content(reg.get("mine")) == 5 and reg.tier_of("mine") == "gpu"
    reg.evict("mine")
    assert (tmp_path / "mine.safetensors").exists()


def test_misses_hits_replace_and_bad_names():
    reg = CapsuleRegistry()
    reg.put("a", capsule_of(1, 1))
    reg.put("a", capsule_of(1, 2))
    assert content(reg.get("a")) == 2 and len(reg) == 1
    with pytest.raises(KeyError, match=r"no capsule named 'b'; the registry holds \['a'\]"):
        reg.get("b")
    s = reg.stats
    assert (s.hits, s.misses, s.evictions) == (1, 1, 0)
    with pytest.raises(ValueError, match="must match"):
        reg.put("../escape", capsule_of(1, 1))
    with pytest.raises(TypeError, match="takes a Capsule"):
        reg.put("x", "not a capsule")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gpu_bytes must be"):
        CapsuleRegistry(gpu_bytes=-1)
    reg.evict("a")
    assert len(reg) == 0 and reg.stats.evictions == 1


class Model:
    """The registry's rules on plain dicts: what the real registry must agree with."""

    TIERS = ("gpu", "host", "disk")

    def __init__(self, budgets):
        self.budgets = budgets
        self.items = OrderedDict()  # name -> [tier, size, pinned, fill]

    def used(self, tier, pinned_only=False):
        return sum(v[1] for v in self.items.values() if v[0] == tier and (v[2] or not pinned_only))

    def settle(self):
        for rank, tier in enumerate(self.TIERS):
            while self.used(tier) > self.budgets[tier]:
                victim = next(n for n, v in self.items.items() if v[0] == tier and not v[2])
                if rank == 2:
                    del self.items[victim]
                else:
                    self.items[victim][0] = self.TIERS[rank + 1]

    def room(self, tier):
        return self.budgets[tier] - self.used(tier, pinned_only=True)

    def can_pin(self, tier, size, replacing=None):
        old = self.items.get(replacing)
        freed = old[1] if old and old[2] and old[0] == tier else 0
        return self.room(tier) + freed >= size

    def enter(self, name, size, pin, fill):
        if not pin and not any(self.room(t) + self.freed(name, t) >= size for t in self.TIERS):
            return False
        self.items.pop(name, None)
        tier = "gpu" if pin else next(t for t in self.TIERS if self.room(t) >= size)
        self.items[name] = [tier, size, pin, fill]
        self.settle()
        return True

    def freed(self, name, tier):
        old = self.items.get(name)
        return old[1] if old and old[2] and old[0] == tier else 0


class RegistryMachine(RuleBasedStateMachine):
    @initialize(gpu=st.integers(0, 4), host=st.integers(0, 4), disk=st.integers(0, 6))
    def setup(self, gpu, host, disk):

        self.root = tempfile.mkdtemp()
        budgets = {"gpu": gpu * ROW, "host": host * ROW, "disk": disk * ROW}
        self.reg = CapsuleRegistry(
            self.root, gpu_bytes=budgets["gpu"], host_bytes=budgets["host"], disk_bytes=budgets["disk"]
        )
        self.model = Model(budgets)
        self.fill = 0

    names = st.sampled_from([f"c{i}" for i in range(6)])

    @rule(name=names, rows=st.integers(1, 3), pin=st.booleans())
    def put(self, name, rows, pin):
        self.fill += 1
        if pin and not self.model.can_pin("gpu", rows * ROW, replacing=name):
            with pytest.raises(CapsuleError, match="cannot pin"):
                self.reg.put(name, capsule_of(rows, self.fill), pin=True)
            return
        if self.model.enter(name, rows * ROW, pin, self.fill):
            self.reg.put(name, capsule_of(rows, self.fill), pin=pin)
        else:
            with pytest.raises(CapsuleError, match="larger than the free budget"):
                self.reg.put(name, capsule_of(rows, self.fill), pin=pin)

    @precondition(lambda self: len(self.model.items) > 0)
    @rule(data=st.data())
    def get(self, data):
        name = data.draw(st.sampled_from(list(self.model.items)))
        cap = self.reg.get(name)
        m = self.model
        v = m.items[name]
        m.items.move_to_end(name)
        if not v[2]:
            for tier in m.TIERS[: m.TIERS.index(v[0])]:
                if v[1] <= m.room(tier):
                    v[0] = tier
                    m.settle()
                    break
        assert content(cap) == v[3]

    @precondition(lambda self: len(self.model.items) > 0)
    @rule(data=st.data())
    def toggle_pin(self, data):
        name = data.draw(st.sampled_from(list(self.model.items)))
        v = self.model.items[name]
        if v[2]:
            self.reg.unpin(name)
            v[2] = False
            self.model.settle()
        elif self.model.can_pin(v[0], v[1]):
            self.reg.pin(name)
            v[2] = True
        else:
            with pytest.raises(CapsuleError):
                self.reg.pin(name)

    @precondition(lambda self: len(self.model.items) > 0)
    @rule(data=st.data())
    def evict(self, data):
        name = data.draw(st.sampled_from(list(self.model.items)))
        self.reg.evict(name)
        del self.model.items[name]

    @invariant()
    def agrees_with_the_model(self):
        if not hasattr(self, "reg"):
            return
        assert self.reg.names() == list(self.model.items)
        for name, (tier, _, pinned, _) in self.model.items.items():
            assert (self.reg.tier_of(name), self.reg.is_pinned(name)) == (tier, pinned)
        for tier, budget in self.model.budgets.items():
            assert self.reg.used(tier) == self.model.used(tier) <= budget

        on_disk = sorted(os.listdir(self.root))
        assert on_disk == sorted(f"{n}.safetensors" for n, v in self.model.items.items() if v[0] == "disk")


TestRegistryAgainstModel = RegistryMachine.TestCase
TestRegistryAgainstModel.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
