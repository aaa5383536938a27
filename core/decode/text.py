"""Incremental detokenization: text deltas that never split a multi-byte character.

A token can end in the middle of a UTF-8 character; decoding it alone gives U+FFFD. The delta
is held back until the character is complete, and a few earlier tokens are kept as context
so that tokenizers that drop or add leading spaces decode the same as the whole reply. A
character still incomplete when the reply ends (cut by its token limit) is left out.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class Detokenizer:
    def __init__(self, tokenizer: Decoder | None) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the context window
        self.read = 0  # tokens whose text was already emitted
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    def push(self, ids: list[int]) -> str:
        """Add tokens; return the newly completed text."""
        self.ids.extend(ids)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is left, less the tokens of a character left incomplete at the
        very end (a reply cut by its token limit mid-character would end in U+FFFD)."""
        end = len(self.ids)
        full = self._decode(self.ids)
        while full.endswith("\ufffd") and end > self.read:  # held back: only push's pending tokens go
            end -= 1
            full = self._decode(self.ids[:end])
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta
