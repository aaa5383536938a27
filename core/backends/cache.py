"""The KV cache contract: keeping only an accepted path, whichever cache a model decodes with.

A model served by `core.backends.lean` decodes with its pre-allocated `StaticKV`; any other with
transformers' DynamicCache. After a verify forward the cache holds the committed prefix
followed by every tree node. The accepted nodes are moved down to sit right after the prefix,
and the rest is cut off, so the cache afterwards is exactly the cache of a plain run over the
same tokens.

`Kept` is one conversation's cache kept between replies, with the token ids it holds: the next
reply reads only what its prompt does not share with them.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Sequence

from torch import Tensor, nn
from transformers import DynamicCache

from core.backends import lean as fast
from core.drafters.lookup import common_prefix

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


class Kept:
    """The last reply's cache, kept for the next one: at most one conversation (a new one replaces
    it), of the model it was computed by. `take` hands it over and leaves nothing kept until the
    reply that took it ends and `keep`s its own, so a reply that fails or is abandoned half-way
    leaves nothing behind that could be stale."""

    def __init__(self) -> None:
        self.cache: Cache | None = None
        self.ids: list[int] = []  # the tokens whose keys and values `cache` holds, position by position
        self._model: weakref.ref | None = None  # the model that computed it (another cannot reuse it)

    def take(self, model: nn.Module, prompt_ids: Sequence[int]) -> tuple[Cache, int]:
        """A cache for `prompt_ids` and how many of its leading tokens it holds already: the kept
        cache cut back to the longest prefix it shares with them, but never all of them (the
        prefill must read the last prompt token, whose logits give the first token); a new cache
        holding nothing where none is kept for `model`."""
        cache, ids, owner = self.cache, self.ids, self._model
        self.clear()
        same = cache is not None and owner is not None and owner() is model
        reuse = min(common_prefix(ids, prompt_ids), len(prompt_ids) - 1) if same else 0
        if reuse <= 0:
            return new_cache(model), 0
        truncate(cache, reuse)
        return cache, reuse

    def keep(self, model: nn.Module, cache: Cache, ids: Sequence[int]) -> None:
        """Keep `cache`, which holds the keys and values of `ids`, for the next reply."""
        if length(cache) != len(ids):
            raise ValueError(f"the cache holds {length(cache)} positions, not the {len(ids)} tokens given")
        self.cache, self.ids, self._model = cache, list(ids), weakref.ref(model)

    def clear(self) -> None:
        self.cache, self.ids, self._model = None, [], None

    def __len__(self) -> int:
        return len(self.ids)
