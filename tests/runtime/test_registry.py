import copy
import gc
import os
import subprocess
import sys
import tempfile
from collections import OrderedDict

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from flashrt.runtime import (
    BufferSet,
    Capsule,
    CapsuleError,
    CapsuleFileError,
    CapsuleRegistry,
    capsule_file,
    restore,
    slot,
    snapshot,
)
from flashrt.runtime.files import HOST

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


def owners(root) -> list[str]:
    """The entry name of every file in a registry root (its files are ``<name>.flashrt-...``)."""
    return sorted(p.split(".flashrt-")[0] for p in os.listdir(root))


def test_lru_demotion_cascades_down_the_tiers(tmp_path):
    reg = CapsuleRegistry(tmp_path, gpu_bytes=2 * ROW, host_bytes=2 * ROW, disk_bytes=None)
    for i in range(5):
        reg.put(f"c{i}", capsule_of(1, i))
    assert [reg.tier_of(f"c{i}") for i in range(5)] == ["disk", "host", "host", "gpu", "gpu"]
    assert owners(tmp_path) == ["c0"]
    s = reg.stats
    assert s.bytes == {"gpu": 2 * ROW, "host": 2 * ROW, "disk": ROW} and s.demotions == 4
    assert reg.get("c0").tier == "gpu" and content(reg.get("c0")) == 0  # promoted on use
    assert reg.stats.promotions == 1 and owners(tmp_path) == ["c1"]  # c0's file went with its tier
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
    reg = CapsuleRegistry(tmp_path, gpu_bytes=ROW, host_bytes=4 * ROW, disk_bytes=None)
    reg.put("small", capsule_of(1, 1))
    reg.put("big", capsule_of(3, 2))
    assert reg.tier_of("big") == "host" and reg.tier_of("small") == "gpu"
    reg.get("big")  # cannot be promoted into a 1-row gpu budget
    assert reg.tier_of("big") == "host" and reg.tier_of("small") == "gpu"
    with pytest.raises(CapsuleError, match="larger than the free budget of every tier"):
        CapsuleRegistry(None, gpu_bytes=ROW, host_bytes=ROW).put("huge", capsule_of(2, 3))


def test_a_capsule_put_from_disk_keeps_its_file(tmp_path):
    cap = capsule_of(1, 5).to("disk", path=tmp_path / "mine.safetensors")
    reg = CapsuleRegistry(tmp_path / "reg", gpu_bytes=ROW, host_bytes=None, disk_bytes=None)
    reg.put("mine", cap)
    assert reg.tier_of("mine") == "disk" and content(reg.get("mine")) == 5 and reg.tier_of("mine") == "gpu"
    reg.evict("mine")
    assert (tmp_path / "mine.safetensors").exists()


def test_misses_hits_replace_and_bad_names():
    reg = CapsuleRegistry(gpu_bytes=None, host_bytes=None)
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
    reg.evict("a")
    assert len(reg) == 0 and reg.stats.evictions == 1


def test_every_budget_is_the_callers_choice(tmp_path):
    with pytest.raises(TypeError, match="gpu_bytes"):
        CapsuleRegistry(host_bytes=ROW)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="gpu_bytes must be an int >= 0, or None for no bound"):
        CapsuleRegistry(gpu_bytes=-1, host_bytes=0)
    with pytest.raises(ValueError, match="host_bytes must be an int"):
        CapsuleRegistry(gpu_bytes=0, host_bytes=1.5e9)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="give it a budget, disk_bytes="):
        CapsuleRegistry(tmp_path, gpu_bytes=0, host_bytes=0)
    with pytest.raises(ValueError, match="needs a disk tier: pass root="):
        CapsuleRegistry(gpu_bytes=0, host_bytes=0, disk_bytes=ROW)
    b = BufferSet([slot("x", (0,))], 2, deployment="reg")
    with pytest.raises(CapsuleError, match="holds no state bytes"):
        CapsuleRegistry(gpu_bytes=None, host_bytes=None).put("empty", snapshot(b))


def state_of(reg: CapsuleRegistry) -> tuple:
    s = reg.stats
    return reg.names(), [reg.tier_of(n) for n in reg.names()], s.bytes, s.demotions, s.promotions, s.evictions


def test_a_failing_disk_changes_nothing_and_names_the_path(tmp_path):
    root = tmp_path / "root"
    reg = CapsuleRegistry(root, gpu_bytes=ROW, host_bytes=ROW, disk_bytes=None)
    reg.put("a", capsule_of(1, 1))
    reg.put("b", capsule_of(1, 2))  # a -> host
    before = state_of(reg)
    root.rmdir()
    root.write_bytes(b"not a folder any more")  # every write into the root now fails
    with pytest.raises(CapsuleError, match=f"could not move capsule 'a' to the disk tier at {root}"):
        reg.put("c", capsule_of(1, 3))  # b -> host, a -> disk
    assert state_of(reg) == before and "c" not in reg
    assert content(reg.get("a")) == 1 and content(reg.get("b")) == 2  # in-memory entries still serve
    root.unlink()
    root.mkdir()
    reg.put("c", capsule_of(1, 3))
    assert [reg.tier_of(n) for n in "abc"] == ["disk", "host", "gpu"] and owners(root) == ["a"]


def test_a_root_that_cannot_be_a_folder_is_refused_at_open(tmp_path):
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(CapsuleError, match="cannot be made a folder.*root=None for no disk tier"):
        CapsuleRegistry(tmp_path / "file", gpu_bytes=0, host_bytes=0, disk_bytes=None)


def test_a_file_gone_bad_on_disk_fails_get_and_changes_nothing(tmp_path):
    reg = CapsuleRegistry(tmp_path, gpu_bytes=ROW, host_bytes=0, disk_bytes=None)
    reg.put("a", capsule_of(1, 1))
    reg.put("b", capsule_of(1, 2))  # a -> disk
    (path,) = tmp_path.iterdir()
    path.write_bytes(path.read_bytes()[:-1])
    before = state_of(reg)
    with pytest.raises(CapsuleFileError, match=str(path)):
        reg.get("a")
    assert state_of(reg) == before and content(reg.get("b")) == 2


def test_a_users_files_in_the_root_are_never_written(tmp_path):
    mine = capsule_of(1, 7).save(tmp_path / "a.safetensors")
    also_mine = tmp_path / "a.flashrt-notes.txt"
    also_mine.write_text("keep")
    reg = CapsuleRegistry(tmp_path, gpu_bytes=ROW, host_bytes=0, disk_bytes=None)
    for i in range(4):
        reg.put("a", capsule_of(1, i))
        reg.put(f"x{i}", capsule_of(1, 10 + i))  # "a" -> disk, under a name of the registry's own
    assert content(Capsule.load(mine)) == 7 and also_mine.read_text() == "keep"
    assert content(reg.get("a")) == 3


def test_one_capsule_under_two_names_and_the_callers_object_are_independent(tmp_path):
    cap = capsule_of(1, 5)
    reg = CapsuleRegistry(tmp_path, gpu_bytes=2 * ROW, host_bytes=0, disk_bytes=None)
    reg.put("x", cap)
    reg.put("y", cap)
    reg.put("z", capsule_of(1, 6))  # x -> disk; y and the caller's object stay where they are
    assert (reg.tier_of("x"), reg.tier_of("y")) == ("disk", "gpu")
    assert cap.tier == "gpu" and cap.rows is not None and content(cap) == 5
    got = reg.get("y")
    assert got.rows is not None and content(got) == 5
    assert content(reg.get("x")) == 5
    got.to("disk", path=tmp_path / "elsewhere.safetensors")  # moving what get returned moves no entry
    assert reg.tier_of("y") != "disk" and content(reg.get("y")) == 5
    assert reg.get("y").rows.data_ptr() == cap.rows.data_ptr()  # shared bytes, not copies


def test_files_of_dead_registries_and_temps_go_when_a_registry_opens_the_root(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = tmp_path / f"a.flashrt-{HOST}-{gone.pid}-{'0' * 12}.safetensors"
    temp = tmp_path / f".b.safetensors.flashrt-{HOST}-{gone.pid}-{'0' * 16}.tmp"
    live = tmp_path / f"c.flashrt-{HOST}-{os.getpid()}-{'0' * 12}.safetensors"
    user = tmp_path / "a.safetensors"
    for p in (orphan, temp, live, user):
        p.write_bytes(b"x")
    CapsuleRegistry(tmp_path, gpu_bytes=0, host_bytes=0, disk_bytes=None)
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, user.name])


def test_a_registry_removes_its_files_when_it_goes(tmp_path):
    reg = CapsuleRegistry(tmp_path, gpu_bytes=0, host_bytes=0, disk_bytes=None)
    for i in range(3):
        reg.put(f"c{i}", capsule_of(1, i))
    assert owners(tmp_path) == ["c0", "c1", "c2"]
    reg.evict("c1")
    assert owners(tmp_path) == ["c0", "c2"]
    del reg
    gc.collect()
    assert os.listdir(tmp_path) == []


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
    """The registry against :class:`Model`, with a disk that can fail: then every step whose
    model transition writes a file must raise CapsuleError and change nothing."""

    @initialize(gpu=st.integers(0, 4), host=st.integers(0, 4), disk=st.integers(1, 6))
    def setup(self, gpu, host, disk):
        self.root = tempfile.mkdtemp()
        budgets = {"gpu": gpu * ROW, "host": host * ROW, "disk": disk * ROW}
        self.reg = CapsuleRegistry(
            self.root, gpu_bytes=budgets["gpu"], host_bytes=budgets["host"], disk_bytes=budgets["disk"]
        )
        self.model = Model(budgets)
        self.fill = 0
        self.broken = False
        self.real_save = capsule_file.save

        def save(*args, **kwargs):
            if self.broken:
                raise OSError(28, "No space left on device")
            return self.real_save(*args, **kwargs)

        capsule_file.save = save

    def teardown(self):
        if hasattr(self, "real_save"):
            capsule_file.save = self.real_save

    def transact(self, after: Model, op):
        """Run ``op`` on the registry; ``after`` is the model once the step is done."""
        old = self.model.items
        writes = any(
            v[0] == "disk" and (n not in old or old[n][0] != "disk" or old[n][3] != v[3])
            for n, v in after.items.items()
        )
        if self.broken and writes:
            with pytest.raises(CapsuleError, match="could not move capsule .* No space left"):
                op()
            return None
        out = op()
        self.model = after
        return out

    names = st.sampled_from([f"c{i}" for i in range(6)])

    @rule(broken=st.booleans())
    def disk(self, broken):
        self.broken = broken

    @rule(name=names, rows=st.integers(1, 3), pin=st.booleans())
    def put(self, name, rows, pin):
        self.fill += 1
        cap = capsule_of(rows, self.fill)
        if pin and not self.model.can_pin("gpu", rows * ROW, replacing=name):
            with pytest.raises(CapsuleError, match="cannot pin"):
                self.reg.put(name, cap, pin=True)
            return
        after = copy.deepcopy(self.model)
        if after.enter(name, rows * ROW, pin, self.fill):
            self.transact(after, lambda: self.reg.put(name, cap, pin=pin))
        else:
            with pytest.raises(CapsuleError, match="larger than the free budget"):
                self.reg.put(name, cap, pin=pin)

    @precondition(lambda self: len(self.model.items) > 0)
    @rule(data=st.data())
    def get(self, data):
        name = data.draw(st.sampled_from(list(self.model.items)))
        m = copy.deepcopy(self.model)
        v = m.items[name]
        m.items.move_to_end(name)
        if not v[2]:
            for tier in m.TIERS[: m.TIERS.index(v[0])]:
                if v[1] <= m.room(tier):
                    v[0] = tier
                    m.settle()
                    break
        cap = self.transact(m, lambda: self.reg.get(name))
        if cap is not None:
            assert content(cap) == v[3]

    @precondition(lambda self: len(self.model.items) > 0)
    @rule(data=st.data())
    def toggle_pin(self, data):
        name = data.draw(st.sampled_from(list(self.model.items)))
        v = self.model.items[name]
        if v[2]:
            m = copy.deepcopy(self.model)
            m.items[name][2] = False
            m.settle()
            self.transact(m, lambda: self.reg.unpin(name))
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

        assert owners(self.root) == sorted(n for n, v in self.model.items.items() if v[0] == "disk")


TestRegistryAgainstModel = RegistryMachine.TestCase
TestRegistryAgainstModel.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
