"""The lean backend's KV cache: every layer's keys and values in two pre-allocated tensors.

Layers write their new keys and values by index, and keeping an accepted path is one gather over
all layers at once (transformers' DynamicCache concatenates and gathers layer by layer).
"""

from __future__ import annotations

import torch
from torch import Tensor

KV8_EXTRA = 4  # an 8-bit row's bytes after its head_dim int8 values: its float32 scale (common.h's KV8_ROW)


class StaticKV:
    """Keys and values of every layer in two pre-allocated tensors, (layers, kv heads, capacity,
    head dim); the first `length` positions are the committed prefix. With `bits=8` (read and
    written by the kernel library's decoder only) a row is head dim int8 values then its float32
    scale, as bytes: (layers, kv heads, capacity, head dim + 4) uint8, half the memory of bf16."""

    def __init__(
        self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, capacity: int = 256, device=None,
        bits: int = 16,
    ) -> None:  # fmt: skip
        if bits not in (8, 16):
            raise ValueError(f"a KV cache holds 8- or 16-bit keys and values, not {bits}-bit ones")
        row, dtype = (head_dim + KV8_EXTRA, torch.uint8) if bits == 8 else (head_dim, dtype)
        # left as the allocator gives them, as `reserve` leaves its new rows (untouched pages take
        # no memory: zeros made Gemma 3 270M's 256 first positions 4.6 MB of it at once)
        self.keys = torch.empty(layers, heads, capacity, row, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)
        self.length = 0

    @property
    def bits(self) -> int:
        return 8 if self.keys.dtype == torch.uint8 else 16

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, size: int) -> None:
        """Room for `size` positions (doubling, so appends stay amortised O(1)). The new rows are
        left as the allocator gives them (no kernel reads past `length`): zeroing them cost a reply
        ~35 ms at 4,096 tokens of the embedded model (100 MB), four times its step."""
        capacity = self.keys.shape[2]
        if size <= capacity:
            return
        new = max(size, 2 * capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_empty(old.shape[0], old.shape[1], new, old.shape[3])
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


def from_kv8(rows: Tensor) -> Tensor:
    """8-bit cache rows (…, head dim + 4) uint8 → their values (…, head dim) float32."""
    d = rows.shape[-1] - KV8_EXTRA
    scale = rows[..., d:].contiguous().view(torch.float32)
    return rows[..., :d].contiguous().view(torch.int8).float() * scale


def to_kv8(x: Tensor) -> Tensor:
    """Rows (…, head dim) → 8-bit cache rows (…, head dim + 4) uint8, as the library's decoder
    writes them (q4_kv8_store): scale = the largest magnitude / 127, values rounded to multiples."""
    x = x.float()
    top = x.abs().amax(dim=-1, keepdim=True)
    scale = top / 127.0
    q = torch.where(top > 0, torch.round(x / scale), torch.zeros_like(x)).to(torch.int8)
    return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=-1)
