"""How the kernel library of `native/` is built and kept: its sources, the compiler, the file in the
user's cache (named by a digest of the sources, flags and compiler) and the checksum recorded
beside it (`core.backends.q4` loads it)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import platformdirs

NATIVE = Path(__file__).parent / "native"
_FILES = (
    "q4gemm", "layout", "avx2", "amx", "attend", "attend_amx", "attend_amx8", "attend_dot", "step", "top", "decode",
)  # fmt: skip
SOURCES = tuple(NATIVE / f"{name}.c" for name in _FILES)  # compiled together, with the headers
HEADERS = (NATIVE / "common.h", NATIVE / "attend_amx.h")
VERSION = 33  # q4_version() of the source above
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp")


def artifact_dir() -> Path:
    return Path(platformdirs.user_cache_dir("medusa-chat")) / "kernels"


def compiler() -> str:
    """The C compiler: $CC, else cc, gcc or clang (raises OSError when there is none)."""
    named = os.environ.get("CC")
    found = shutil.which(named) if named else shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if found is None:
        raise OSError(
            f"the C compiler {named} was not found" if named else "no C compiler (cc, gcc or clang) was found"
        )
    return found


@functools.cache
def _source() -> bytes:
    return b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS)) + " ".join(FLAGS).encode()


def source_id() -> str:
    """A short digest of the library's source and flags: measurements made with its kernels (step
    costs, kernel choices) are keyed by it, so a changed kernel is measured again."""
    return hashlib.sha256(_source()).hexdigest()[:12]


def artifact(compiler: str) -> Path:
    """Where the library built from this source with this compiler lives."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(_source() + version.encode()).hexdigest()[:16]
    return artifact_dir() / f"q4gemm-{key}.so"


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check(path: Path) -> None:
    """Raise OSError unless `path` is the file its build recorded: a truncated or damaged library
    is never handed to the dynamic loader (which can crash the process on one)."""
    stamp = path.with_suffix(".sha256")
    try:
        version, recorded = stamp.read_text().split()
    except (OSError, ValueError):
        raise OSError("its checksum is missing") from None
    if version != str(VERSION):
        raise OSError(f"it is version {version}, not {VERSION}")
    if digest(path) != recorded:
        raise OSError("it does not match its checksum (truncated or damaged)")


def build(compiler: str, target: Path) -> None:
    """Compile into a temporary file and move it into place with its checksum (two processes
    may build at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", temp], capture_output=True, text=True, timeout=300
        )
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
            raise OSError(f"the compiler failed: {last}")
        stamp = target.with_suffix(".sha256")
        stamp.write_text(f"{VERSION} {digest(Path(temp))}")
        os.replace(temp, target)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp)
