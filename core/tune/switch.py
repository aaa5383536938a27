"""Whichever drafter decodes fastest here: each is measured as it runs, on this machine.

`Fastest` holds several drafters (the heads' policy-driven tree, the EAGLE layer's) and runs
one at a time. Each first gets `BLOCK` steps; after that the one with the most tokens per second
of step time over its last `WINDOW` steps runs, and every `REVISIT` steps each other one gets
`BLOCK` steps again, so a drafter that would now be faster (another kind of reply, another
load on the machine) is found. Every drafter that reads the backbone's features is fed all
of them, whichever ran, so the one switched to drafts from the whole context.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from torch import Tensor

from core.step import Draft

BLOCK = 8  # steps a drafter runs when it is tried
WINDOW = 48  # steps a drafter's rate is measured over
REVISIT = 96  # steps between tries of the drafters that are not the fastest


class Fastest:
    def __init__(self, drafters: dict[str, object]) -> None:
        self.drafters = drafters
        self.history: dict[str, deque[tuple[int, float]]] = {n: deque(maxlen=WINDOW) for n in drafters}
        self.active = next(iter(drafters))
        self._block = 0  # steps left in the current try (0: the fastest runs)
        self._since = 0  # steps since the last tries
        self._turn = -1  # which of the others is tried next

    def rate(self, name: str) -> float | None:
        """Tokens per second of step time over `name`'s last steps (None before a full try)."""
        steps = self.history[name]
        if len(steps) < BLOCK:
            return None
        seconds = sum(s for _, s in steps)
        return sum(t for t, _ in steps) / seconds if seconds > 0 else None

    def _pick(self) -> str:
        untried = [n for n in self.drafters if self.rate(n) is None]
        if self._block > 0:
            return self.active
        if untried:
            self._block = BLOCK
            return untried[0]
        best = max(self.drafters, key=lambda n: self.rate(n) or 0.0)
        self._since += 1
        if self._since >= REVISIT and len(self.drafters) > 1:
            self._since, self._block = 0, BLOCK
            others = [n for n in self.drafters if n != best]
            self._turn += 1
            return others[self._turn % len(others)]
        return best

    def feed(self, features: Tensor, next_ids: Tensor, position: int) -> None:
        for drafter in self.drafters.values():
            if (feed := getattr(drafter, "feed", None)) is not None:
                feed(features, next_ids, position)

    def propose(self, hidden: Tensor, root: Tensor, history: Sequence[int] = ()) -> Draft:
        self.active = self._pick()
        return self.drafters[self.active].propose(hidden, root, history)

    def observe(self, draft: Draft, emitted: Sequence[int], seconds: float) -> None:
        if self._block > 0:
            self._block -= 1
        self.history[self.active].append((len(emitted), seconds))
        if (observe := getattr(self.drafters[self.active], "observe", None)) is not None:
            observe(draft, emitted, seconds)

    @property
    def last_choice(self):
        choice = getattr(self.drafters[self.active], "last_choice", None)
        return None if choice is None else replace(choice, reason=f"{self.active}: {choice.reason}")
