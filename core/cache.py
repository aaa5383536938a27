"""The KV cache contract: transformers' DynamicCache, plus keeping only an accepted path.

After a verify forward the cache holds the committed prefix followed by every tree node. The
accepted nodes are moved down to sit right after the prefix, and the rest is cut off, so the
cache afterwards is exactly the cache of a plain run over the same tokens.
"""

from __future__ import annotations

from torch import Tensor
from transformers import DynamicCache


def new_cache() -> DynamicCache:
    """A cache of full-attention layers (filled lazily by the first forward)."""
    return DynamicCache()


def length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def truncate(cache: DynamicCache, size: int) -> None:
    """Drop every entry from position `size` on."""
    cache.crop(size - length(cache))  # transformers takes the count to remove, as a negative number


def keep_path(cache: DynamicCache, prefix_len: int, path: Tensor) -> None:
    """Keep entries [0, prefix_len) and the tree nodes `path` (indices relative to prefix_len)."""
    keep = path + prefix_len  # (A + 1,) ascending: parents precede children
    end = prefix_len + path.numel()
    for layer in cache.layers:
        # (B, heads, S, head_dim); the gather copies before the write, so overlap is safe
        layer.keys[..., prefix_len:end, :] = layer.keys[..., keep, :]
        layer.values[..., prefix_len:end, :] = layer.values[..., keep, :]
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]
