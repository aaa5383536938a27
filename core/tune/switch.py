"""Whichever drafter decodes fastest here: each is measured as it runs, on this machine.

`Fastest` holds several drafters (the heads' policy-driven tree, the EAGLE layer's, and plain
decoding, which drafts nothing and so costs nothing beyond the forward: where no tree pays, as
with AVX2 kernels, the steps between trials then pay no drafting or policy either) and runs one
at a time. Rates are compared only in *trials*, in which the drafters take turns step by step
(`TURNS` steps each), so each meets the same stretch of text (a repetitive passage favours
every drafter alike; a comparison across different passages would favour whichever happened
to run on the easy one). Between trials the drafter with the most tokens per second of step
time over its last `MEMORY` trials runs, once every drafter has been measured in `EVIDENCE`
trials (before that, the first one named: one trial of 8 steps each at the start of a reply,
where the heads' policy has not learned the text yet, is too little to switch on); the first
trial opens the first reply, the second follows `FIRST_GAP` steps later, and one follows
`EVERY` steps after that, so a drafter that becomes faster (another load on the machine,
another kind of conversation) takes over. A trial that leaves the same drafter ahead doubles
the gap to the next one, up to `MAX_GAP` steps (a losing drafter's turns cost time: on a CPU
where a plain step takes 3 ms, EAGLE's drafting alone takes about as long), and a trial that
changes the leader brings it back to `EVERY`. Every drafter that reads the backbone's features is
fed all of them, whichever ran, so the one switched to drafts from the whole context.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from torch import Tensor

from core.step import Draft

TURNS = 8  # steps each drafter takes in one trial
EVERY = 160  # steps between trials at first, and after a trial that changed the leader
MAX_GAP = 4 * EVERY  # the gap a run of trials won by the same drafter grows to
MEMORY = 4  # trials a drafter's rate is measured over
EVIDENCE = 2  # trials every drafter must have run in before rates pick the one that runs
FIRST_GAP = 32  # steps between the first trials


class Fastest:
    def __init__(self, drafters: dict[str, object]) -> None:
        self.drafters = drafters
        self.trials: dict[str, deque[list[float]]] = {n: deque(maxlen=MEMORY) for n in drafters}
        self.active = next(iter(drafters))
        self.trial_steps = TURNS * len(drafters)
        self._trial = self.trial_steps  # steps left in the running trial (0: none runs)
        self._since = 0  # steps since the last trial ended
        self._gap = EVERY  # steps from the last trial to the next
        self._leader: str | None = None  # the fastest before the running trial
        self._names = list(drafters)
        self._turn = 0
        self._open = False  # each drafter's tally for the running trial is open

    def rate(self, name: str) -> float | None:
        """Tokens per second of step time over `name`'s last trials (None before one)."""
        tokens = sum(t for t, _ in self.trials[name])
        seconds = sum(s for _, s in self.trials[name])
        return tokens / seconds if seconds > 0 else None

    def leader(self) -> str:
        if any(len(self.trials[n]) < EVIDENCE for n in self._names):
            return self._names[0]
        return max(self._names, key=lambda n: self.rate(n) or 0.0)

    def _pick(self) -> str:
        if self._trial == 0 and self._since >= self._gap:
            self._trial, self._since = self.trial_steps, 0
        if self._trial > 0:
            if not self._open:
                self._leader = self.leader() if any(self.trials[n] for n in self._names) else None
                for name in self._names:
                    self.trials[name].append([0.0, 0.0])
                self._open = True
            self._turn = (self._turn + 1) % len(self._names)
            return self._names[self._turn]
        self._since += 1
        return self.leader()

    def feed(self, features: Tensor, next_ids: Tensor, position: int) -> None:
        for drafter in self.drafters.values():
            if (feed := getattr(drafter, "feed", None)) is not None:
                feed(features, next_ids, position)

    def propose(self, hidden: Tensor, root: Tensor, history: Sequence[int] = ()) -> Draft:
        self.active = self._pick()
        return self.drafters[self.active].propose(hidden, root, history)

    def observe(self, draft: Draft, emitted: Sequence[int], seconds: float) -> None:
        if self._trial > 0:
            tally = self.trials[self.active][-1]
            tally[0] += len(emitted)
            tally[1] += seconds
            self._trial -= 1
            self._open = self._trial > 0
            if not self._open:  # the trial is over
                kept = self._leader is not None and self.leader() == self._leader
                if len(self.trials[self.active]) < EVIDENCE:
                    self._gap = FIRST_GAP
                elif len(self.trials[self.active]) == EVIDENCE:  # the first comparison
                    self._gap = EVERY
                else:
                    self._gap = min(2 * self._gap, MAX_GAP) if kept else EVERY
        if (observe := getattr(self.drafters[self.active], "observe", None)) is not None:
            observe(draft, emitted, seconds)

    @property
    def last_choice(self):
        choice = getattr(self.drafters[self.active], "last_choice", None)
        return None if choice is None else replace(choice, reason=f"{self.active}: {choice.reason}")
