"""Atomic writes: one temporary file, the umask's mode, and no temporary outliving its writer."""

import os
import stat
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from flashrt.runtime import BufferSet, Capsule, atomic_write, restore, slot, snapshot
from flashrt.runtime.files import HOST, TEMP_PATTERN, clean_stale
from tests.runtime import toy


def temps(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if TEMP_PATTERN.fullmatch(p.name))


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_written_files_get_the_umask_mode(tmp_path, umask):
    old = os.umask(umask)
    try:
        cap_path = snapshot(toy.make(2)).save(tmp_path / "c.safetensors")
        text_path = atomic_write(tmp_path / "t.json", lambda f: f.write(b"{}"))
    finally:
        os.umask(old)
    for p in (cap_path, text_path):
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask


def test_an_interrupted_write_leaves_no_partial_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    b = toy.make(3)
    path = snapshot(b, meta={"v": 1}).save(tmp_path / "c.safetensors")
    old = path.read_bytes()

    def half_write(f):
        f.write(b"\x00" * 10)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, half_write)
    assert path.read_bytes() == old
    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "new.safetensors", half_write)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    toy.step(b)
    with pytest.raises(OSError, match="disk full"):
        snapshot(b, meta={"v": 2}).save(path)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_only_stale_temps_of_this_pattern_and_host_are_cleaned(tmp_path):
    me, gone = os.getpid(), dead_pid()
    names = {
        "dead": f".a.safetensors.flashrt-{HOST}-{gone}-{'0' * 16}.tmp",
        "reused_pid": f".b.safetensors.flashrt-{HOST}-{me}-{'1' * 16}.tmp",  # written before this process started
        "live": f".c.safetensors.flashrt-{HOST}-{me}-{'2' * 16}.tmp",
        "other_host": f".d.safetensors.flashrt-{'f' * 8 if HOST != 'f' * 8 else 'e' * 8}-{gone}-{'3' * 16}.tmp",
        "user_tmp": f".e.safetensors.{gone}.tmp",
        "user_file": "f.safetensors",
    }
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    day_ago = time.time() - 86400 * 365
    os.utime(tmp_path / names["reused_pid"], (day_ago, day_ago))
    atomic_write(tmp_path / "g.json", lambda f: f.write(b"{}"))
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {names[k] for k in ("live", "other_host", "user_tmp", "user_file")} | {"g.json"}
    assert clean_stale(tmp_path / "absent") == []


KILLER = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    from flashrt.runtime import BufferSet, atomic_write, slot, snapshot

    torch.set_num_threads(1)  # fork-safe: no thread pool in the children


    def loop(target):
        b = BufferSet([slot("x", (1 << 16,), torch.uint8)], 16, deployment="kill")  # 1 MB a capsule
        i = 0
        while True:
            b["x"].fill_(i % 256)
            snapshot(b, meta={"i": i}).save(target)
            i += 1


    def stuck(target, ready):
        def write(f):
            f.write(b"partial")
            f.flush()
            os.write(ready, b"x")
            time.sleep(600)

        atomic_write(target, write)


    def killed(run, *args, ready=None, delay=0.0):
        pid = os.fork()
        if pid == 0:
            try:
                run(*args)
            finally:
                os._exit(1)
        if ready is not None:
            os.read(ready, 1)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


    folder = sys.argv[1]
    for i, delay in enumerate((0.05, 0.1, 0.2)):
        killed(loop, f"{folder}/loop{i}.safetensors", delay=delay)
    r, w = os.pipe()
    killed(stuck, f"{folder}/stuck.safetensors", w, ready=r)
    """
)


def test_killed_saves_leave_the_target_whole_or_absent_and_the_next_save_cleans_up(tmp_path):
    """SIGKILL lands anywhere in a loop of saves (three forked savers), and once mid-write for sure."""
    subprocess.run([sys.executable, "-c", KILLER, str(tmp_path)], check=True, timeout=120)
    assert temps(tmp_path), "the stuck saver was killed mid-write: its temporary file must be there"
    assert not (tmp_path / "stuck.safetensors").exists()
    for i in range(3):
        target = tmp_path / f"loop{i}.safetensors"
        if target.exists():  # complete: it loads, and holds one save's bytes throughout
            cap = Capsule.load(target)
            b = BufferSet([slot("x", (1 << 16,), torch.uint8)], 16, deployment="kill")
            restore(b, cap)
            assert bool((b["x"] == cap.meta["i"] % 256).all())
    snapshot(toy.make(2)).save(tmp_path / "next.safetensors")
    assert temps(tmp_path) == []
