"""Atomic file writes: a crash leaves the old file or the new one, never half of one.

Every write goes through exactly one temporary file beside its target, named
``.<target>.flashrt-<host>-<pid>-<random>.tmp`` (``<host>`` a short hash of the host name). A
write killed before its rename (``SIGKILL``, power loss) leaves that file behind; the next
write into the same folder (and a :class:`~flashrt.runtime.CapsuleRegistry` opening its root)
removes the temporaries of this host whose writer is gone: its process has exited, or its pid
now belongs to a process that started after the file was last written. Nothing else in the
folder is ever touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
"""Tag of this host in temporary names: pids of other hosts (or containers) mean nothing here."""

TEMP_PATTERN = re.compile(r"\..+\.flashrt-(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)-[0-9a-f]{16}\.tmp")
"""Names of the temporary files :func:`atomic_write` makes (and only those are ever cleaned)."""


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> Path:
    """Write ``path`` atomically: call ``write(f)`` on a new temporary file beside ``path``
    (opened ``"wb"``, seekable), fsync it, rename it over ``path`` and fsync the folder.

    The file gets the mode any new file gets under the process umask. On any error (or
    interrupt) the temporary file is removed and ``path`` is untouched. Stale temporaries of
    dead writers in the folder are removed first (see the module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path.parent)
    tmp = path.parent / f".{path.name[:128]}.flashrt-{HOST}-{os.getpid()}-{secrets.token_hex(8)}.tmp"
    try:
        with open(tmp, "xb") as f:  # O_EXCL; mode 0o666 less the umask
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def clean_stale(folder: str | os.PathLike, pattern: re.Pattern[str] = TEMP_PATTERN) -> list[Path]:
    """Remove the files in ``folder`` whose names match ``pattern`` (with groups ``host`` and
    ``pid``: by default :func:`atomic_write`'s temporary files) and whose writer on this host
    is gone; return the paths removed. Files of other hosts, of live writers, and every file
    that does not match stay."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:  # not a folder (yet): nothing to clean; the write that follows says why it fails
        return removed
    for entry in entries:
        m = pattern.fullmatch(entry.name)
        if m is None or m["host"] != HOST:
            continue
        with contextlib.suppress(OSError):  # raced with another cleaner, or not ours to remove
            if _stale(int(m["pid"]), entry.stat(follow_symlinks=False).st_mtime):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _stale(pid: int, mtime: float) -> bool:
    """Whether a temporary file last written at ``mtime`` by ``pid`` has no live writer."""
    started = _process_start(pid)
    if started is not None:  # the pid's process started after the file's last write: pid reused
        return mtime < started
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _process_start(pid: int) -> float | None:
    """Wall-clock start time of a live process (Linux ``/proc``; rounded down, so never after the
    true start); ``inf`` for a dead or zombie one (every file it wrote is older); None where
    ``/proc`` cannot tell."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return float("inf") if Path("/proc/self/stat").exists() else None
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
    if fields[0] in ("Z", "X"):
        return float("inf")  # exited, not yet reaped: every file of it is stale
    return _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise OSError("/proc/stat has no btime line")
