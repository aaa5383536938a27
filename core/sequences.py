"""Token sequences: what two of them share (the kept cache and the lookups both ask)."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share (compared in blocks at C speed, then one by one)."""
    n, end, block = 0, min(len(a), len(b)), 256
    while n + block <= end and list(a[n : n + block]) == list(b[n : n + block]):
        n += block
    while n < end and a[n] == b[n]:
        n += 1
    return n
