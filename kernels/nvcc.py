"""Build a CUDA C++ source with the toolkit's ``nvcc`` into a shared library, once, and load it.

The few pieces Triton cannot express (thread-block clusters, CUDA graph conditional nodes) are
CUDA C++ files built on first use and loaded through ``ctypes``. A build is keyed by the
source's bytes, the flags and the compiler's version, cached on disk (``$FLASHRT_CACHE``, else
``~/.cache/flashrt_gym``) and written atomically, so concurrent processes never load a
half-written library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path


def find() -> str | None:
    """The ``nvcc`` of ``$CUDA_HOME``, ``$CUDA_PATH``, ``/usr/local/cuda`` or the ``PATH``."""
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and (Path(candidate) / "bin" / "nvcc").is_file():
            return str(Path(candidate) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cache_dir() -> Path:
    """Where built libraries are kept."""
    root = (
        os.environ.get("FLASHRT_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flashrt_gym"
    )
    return Path(root)


def build(source: Path, flags: Sequence[str], who: str) -> ctypes.CDLL | None:
    """``source`` built as a shared library with ``nvcc -O3 -std=c++17 <flags>`` and loaded, or
    None where no ``nvcc`` is found or the build fails (a warning naming ``who`` and carrying
    the compiler's message says what falls back)."""
    compiler = find()
    if compiler is None:
        return None
    text = source.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(text + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}_{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [compiler, "-O3", "-std=c++17", *flags, "-Xcompiler", "-fPIC", "-shared", "-o", str(out), str(source)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                warnings.warn(f"{who}: {compiler} failed to build {source.name}:\n{done.stderr[-2000:]}", stacklevel=3)
                return None
            os.replace(out, target)  # atomic: a concurrent build sees the whole file or none
    return ctypes.CDLL(str(target))
