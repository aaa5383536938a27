"""The lean backend's KV cache: every layer's keys and values in two pre-allocated tensors.

Layers write their new keys and values by index, and keeping an accepted path is one gather over
all layers at once (transformers' DynamicCache concatenates and gathers layer by layer).
"""

from __future__ import annotations

import torch
from torch import Tensor


class StaticKV:
    """Keys and values of every layer in two pre-allocated tensors, (layers, kv heads, capacity,
    head dim); the first `length` positions are the committed prefix."""

    def __init__(
        self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, capacity: int = 256, device=None
    ) -> None:
        self.keys = torch.zeros(layers, heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, size: int) -> None:
        """Room for `size` positions (doubling, so appends stay amortised O(1))."""
        capacity = self.keys.shape[2]
        if size <= capacity:
            return
        new = max(size, 2 * capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], old.shape[1], new, old.shape[3])
            grown[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, grown)

    def truncate(self, size: int) -> None:
        self.length = min(size, self.length)

    def keep_path(self, prefix_len: int, path: Tensor) -> None:
        """Keep [0, prefix_len) and the nodes `path` (relative to prefix_len), every layer at once."""
        keep = path + prefix_len
        end = prefix_len + path.numel()
        if not torch.equal(keep, torch.arange(prefix_len, end)):
            self.keys[:, :, prefix_len:end] = self.keys[:, :, keep]
            self.values[:, :, prefix_len:end] = self.values[:, :, keep]
        self.length = end

    def drop_front(self, count: int) -> None:
        """Drop the first `count` entries, the rest moved to the front (their keys keep the
        rotations of the positions they were made at)."""
        count = min(count, self.length)
        if count:
            rest = self.length - count
            self.keys[:, :, :rest] = self.keys[:, :, count : self.length].clone()
            self.values[:, :, :rest] = self.values[:, :, count : self.length].clone()
            self.length = rest
