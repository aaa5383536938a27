"""Context lookup: draft continuations copied from the conversation itself.

Chat replies reuse the user's names, numbers and identifiers and their own earlier phrases.
`NgramIndex` maps every n-gram (n = 1…N) of the token history to the positions where it
ends, and is extended as tokens are committed: the work per step is proportional to the new
tokens, never to the context length. A query takes the longest suffix of the history that
occurred before and returns the tokens that followed it, most recent occurrence first,
distinct continuations only, falling back to shorter suffixes while it needs more.
"""

from __future__ import annotations

from collections.abc import Sequence

from core.sequences import common_prefix


class NgramIndex:
    def __init__(self, max_ngram: int = 4) -> None:
        if max_ngram < 1:
            raise ValueError("max_ngram must be ≥ 1")
        self.max_ngram = max_ngram
        self.ids: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram → positions of its last token

    def __len__(self) -> int:
        return len(self.ids)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens and index the n-grams that end at each of them."""
        ids, ends = self.ids, self._ends
        for t in tokens:
            ids.append(int(t))
            end = len(ids) - 1
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                ends.setdefault(tuple(ids[end - n + 1 : end + 1]), []).append(end)

    def sync(self, history: Sequence[int]) -> None:
        """Catch up with `history`; indexes only the new tokens. Where history was rewritten (the
        next turn of a chat, a regenerated reply, another chat) the index is first cut back to the
        part it shares, so a long conversation is not indexed again each turn."""
        n = len(self.ids)
        if len(history) < n or list(history[:n]) != self.ids:  # a C-speed compare, microseconds
            n = common_prefix(self.ids, history)
            self.truncate(n)
        self.extend(history[n:])

    def truncate(self, size: int) -> None:
        """Forget every token from position `size` on (the same index as built from the first `size`)."""
        ids, ends = self.ids, self._ends
        for end in range(len(ids) - 1, size - 1, -1):  # the latest first: each is the last in its lists
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                key = tuple(ids[end - n + 1 : end + 1])
                ends[key].pop()
                if not ends[key]:
                    del ends[key]
        del ids[size:]

    def continuations(self, max_count: int, length: int) -> list[list[int]]:
        """Up to `max_count` distinct continuations (≤ `length` tokens) of the history's suffix."""
        ids, found, seen = self.ids, [], set()
        last = len(ids) - 1
        for n in range(min(self.max_ngram, len(ids) - 1), 0, -1):
            for end in reversed(self._ends.get(tuple(ids[last - n + 1 :]), ())):
                if end >= last:
                    continue  # the suffix itself: nothing follows it yet
                cont = tuple(ids[end + 1 : end + 1 + length])
                if cont and cont not in seen:
                    seen.add(cont)
                    found.append(list(cont))
                    if len(found) == max_count:
                        return found
        return found


def node_count(continuations: list[list[int]]) -> int:
    """Tree nodes the continuations add under the root once shared prefixes are merged."""
    return len({tuple(c[:d]) for c in continuations for d in range(1, len(c) + 1)})
