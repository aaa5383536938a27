"""Fitting a conversation into the model's context: the oldest turns go first.

The system prompt and the newest user message are always kept; whole earlier exchanges
(a user message and its reply) are dropped, oldest first, until the prompt leaves room for
the reply. A message that cannot fit even alone is refused, so it is never stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.errors import ContextExceeded

MIN_REPLY = 32  # tokens of room a turn must leave for its reply to be accepted at all

Encode = Callable[[list[dict], str | None], list[int]]  # (messages, system) -> prompt ids


@dataclass(frozen=True)
class Fitted:
    ids: list[int]  # the prompt sent to the model
    dropped: int  # earlier messages left out (user and assistant messages counted separately)

    @property
    def note(self) -> str:
        """A sentence for the user when something was left out, else ''."""
        if not self.dropped:
            return ""
        return (
            f"The {self.dropped} oldest message{'s' if self.dropped != 1 else ''} of this chat "
            f"{'were' if self.dropped != 1 else 'was'} left out so the conversation fits the model's context."
        )


def fit_history(encode: Encode, messages: list[dict], system: str | None, context: int, reply: int) -> Fitted:
    """The longest recent part of `messages` (ending with the user's turn) whose prompt leaves
    `reply` tokens of room (at least MIN_REPLY) within `context` positions."""
    room = min(reply, context // 2)  # a long reply limit must not squeeze out every earlier turn
    first = 0
    while True:
        ids = encode(messages[first:], system)
        if len(ids) + room <= context or first == len(messages) - 1:
            break
        first = _next_user(messages, first)
    if len(ids) + min(room, MIN_REPLY) > context:
        raise ContextExceeded(
            f"This message is {len(ids)} tokens with the system prompt, but the model reads at most "
            f"{context} including the reply; shorten it."
        )
    return Fitted(ids, first)


def _next_user(messages: list[dict], start: int) -> int:
    """Index of the next user message after `start` (the last message is always one)."""
    i = start + 1
    while messages[i]["role"] != "user":
        i += 1
    return i
