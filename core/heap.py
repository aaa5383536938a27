"""The process heap as glibc keeps it: freed memory given back to the system, and large blocks
mapped apart while a phase makes and frees many of them (elsewhere than glibc: nothing happens)."""

from __future__ import annotations

import contextlib
import ctypes
import functools

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def give_back() -> None:
    """Return the heap's freed memory to the system (glibc keeps it otherwise)."""
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def large_blocks_apart():
    """Blocks of a MiB or more each mapped apart while weights load and pack, so each goes back to
    the system when freed. glibc otherwise raises that threshold as large blocks are freed and
    carves later ones from the heap, where the packed weights kept between a load's short-lived
    working copies fragment it: the process grew by most of those copies (a quarter of a model's
    float32 size, measured). After it, glibc's ceiling for the raised threshold (32 MiB)."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    try:
        yield
    finally:
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 (glibc's, or not glibc)
    except (OSError, AttributeError):
        return None
    return libc
