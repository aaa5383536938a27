"""The KV cache contract: keeping only an accepted path, whichever cache a model decodes with.

A model served by `core.fast` decodes with its pre-allocated `StaticKV`; any other with
transformers' DynamicCache. After a verify forward the cache holds the committed prefix
followed by every tree node. The accepted nodes are moved down to sit right after the prefix,
and the rest is cut off, so the cache afterwards is exactly the cache of a plain run over the
same tokens.
"""

from __future__ import annotations

import functools
import inspect

from torch import Tensor, nn
from transformers import DynamicCache

from core import fast

Cache = DynamicCache | fast.StaticKV


def argument(module: nn.Module, cache: Cache | None) -> dict[str, Cache | None]:
    """`cache` as the keyword `module`'s forward takes it: `cache` in the transformers installed
    here (`past_key_values`, its older name, is deprecated and goes in 5.40), `past_key_values`
    in releases before the rename."""
    return {_keyword(type(module)): cache}


@functools.cache
def _keyword(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


def new_cache(model: nn.Module | None = None) -> Cache:
    """The model's fast cache when it has a fast forward, else a DynamicCache (filled lazily)."""
    forward = fast.forward_of(model) if model is not None else None
    return forward.new_cache() if forward is not None else DynamicCache()


def length(cache: Cache) -> int:
    return cache.get_seq_length()


def truncate(cache: Cache, size: int) -> None:
    """Drop every entry from position `size` on."""
    if isinstance(cache, fast.StaticKV):
        cache.truncate(size)
    else:
        cache.crop(size - length(cache))  # transformers takes the count to remove, as a negative number


def keep_path(cache: Cache, prefix_len: int, path: Tensor) -> None:
    """Keep entries [0, prefix_len) and the tree nodes `path` (indices relative to prefix_len)."""
    if isinstance(cache, fast.StaticKV):
        cache.keep_path(prefix_len, path)
        return
    keep = path + prefix_len  # (A + 1,) ascending: parents precede children
    end = prefix_len + path.numel()
    for layer in cache.layers:
        # (B, heads, S, head_dim); the gather copies before the write, so overlap is safe
        layer.keys[..., prefix_len:end, :] = layer.keys[..., keep, :]
        layer.values[..., prefix_len:end, :] = layer.values[..., keep, :]
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]
