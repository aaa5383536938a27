"""Writing a file atomically: a crash or a kill leaves either the previous or the new version.

A write goes to a temporary file in the same folder, is flushed to disk, then renamed over the
old one, and the folder is flushed too. A kill can leave the temporary file behind: its name
is f".{name}." + random + ".tmp" (`app.store.TEMP_GLOB` finds and removes old ones).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _fsync_dir(folder: Path) -> None:
    """Make a rename in folder durable; skipped where a folder cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a folder; the rename itself has happened
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str | bytes, durable: bool = True) -> None:
    """`durable` False: not flushed to disk (a cache, rebuilt if a power cut damages it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") if isinstance(text, bytes) else os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)
