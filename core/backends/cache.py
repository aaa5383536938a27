"""What a KV cache needs beyond its backend: the keyword transformers takes it under, and the
conversation's cache kept between replies.

`Kept` is one conversation's cache kept between replies, with the token ids it holds: the next
reply reads only what its prompt does not share with them. It cuts the cache back through the
backend that made it (`core.backends.base.Backend.truncate`), whichever cache that is.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Sequence

from torch import nn

from core.backends.base import Backend, Cache
from core.sequences import common_prefix


def argument(module: nn.Module, cache: Cache | None) -> dict[str, Cache | None]:
    """`cache` as the keyword `module`'s forward takes it: `cache` in the transformers installed
    here (`past_key_values`, its older name, is deprecated and goes in 5.40), `past_key_values`
    in releases before the rename."""
    return {_keyword(type(module)): cache}


@functools.cache
def _keyword(cls: type) -> str:
    return "cache" if "cache" in inspect.signature(cls.forward).parameters else "past_key_values"


class Kept:
    """The last reply's cache, kept for the next one: at most one conversation (a new one replaces
    it), of the backend it was computed by. `take` hands it over and leaves nothing kept until the
    reply that took it ends and `keep`s its own, so a reply that fails or is abandoned half-way
    leaves nothing behind that could be stale."""

    def __init__(self) -> None:
        self.cache: Cache | None = None
        self.ids: list[int] = []  # the tokens whose keys and values `cache` holds, position by position
        self._backend: weakref.ref | None = None  # the backend that computed it (another cannot reuse it)

    def take(self, backend: Backend, prompt_ids: Sequence[int]) -> tuple[Cache, int]:
        """A cache for `prompt_ids` and how many of its leading tokens it holds already: the kept
        cache cut back to the longest prefix it shares with them, but never all of them (the
        prefill must read the last prompt token, whose logits give the first token); a new cache
        holding nothing where none is kept for `backend`."""
        cache, ids, owner = self.cache, self.ids, self._backend
        self.clear()
        same = cache is not None and owner is not None and owner() is backend
        reuse = min(common_prefix(ids, prompt_ids), len(prompt_ids) - 1) if same else 0
        if reuse <= 0:
            return backend.new_cache(), 0
        backend.truncate(cache, reuse)
        return cache, reuse

    def keep(self, backend: Backend, cache: Cache, ids: Sequence[int]) -> None:
        """Keep `cache`, which holds the keys and values of `ids`, for the next reply."""
        held = backend.length(cache)
        if held != len(ids):
            raise ValueError(f"the cache holds {held} positions, not the {len(ids)} tokens given")
        self.cache, self.ids, self._backend = cache, list(ids), weakref.ref(backend)

    def clear(self) -> None:
        self.cache, self.ids, self._backend = None, [], None

    def __len__(self) -> int:
        return len(self.ids)
