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
changes the leader brings it back to `EVERY`. Whatever those rules say, a trial whose losing
turns cost more than `SHARE` of the steps until the next one is followed by a longer gap.
Every drafter that reads the backbone's features is fed all of them, whichever ran, so the one
switched to drafts from the whole context.

With a `reference` (plain decoding, whose steps always give one token, so its rate is known
best), another drafter runs only once it is measured faster with confidence: its rate over
the reference's by `CONFIDENCE` standard errors of the difference (from the steps' tokens and
seconds; a step of a tree gives 1 to 6 tokens, so 16 steps leave a rate uncertain by about
10 %). Rates within the noise of each other, as with AVX2 kernels, where the heads' tree is
within 5 % of plain decoding, would otherwise crown whichever had the luckier steps; plain
then runs, which loses nothing against a drafter that is not measurably faster. Of two drafters
that are, the later named runs only once it beats the earlier by `CONFIDENCE` standard errors
too (the heads' tree before EAGLE's, whose drafting costs more): the first trials fall on the
first reply's kind of text, and a drafter that wins them by less than the noise can hold the
lead for hundreds of steps on text where it is slower (a better-trained EAGLE layer won them on
two writing prompts and then ran at 361 tok/s where the heads' tree made 423). When a
drafter that is not running comes to have the best rate, the next trial follows `FIRST_GAP`
steps later, so the evidence that decides comes soon (such trials are cheap: the drafters are
close), and the gaps double from there while it stays so.

With a `memory` (`core.measure.rates`), every trial's end is remembered for the next launch on
this machine, and a new session whose memory holds `EVIDENCE` trials of each drafter starts as
after that last trial (`_resume`): the leader they name runs, its own first trial follows
`FIRST_GAP` steps in (or later, by the `SHARE` rule) and a clear loser sits it out. Without it a
new session's first reply ran mostly the reference while the contenders were measured.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from torch import Tensor

from core.drafters.base import Draft, Drafter
from core.drafters.policy import Choice
from core.measure.rates import RateMemory

TURNS = 8  # steps each drafter takes in one trial
EVERY = 160  # steps between trials at first, and after a trial that changed the leader
MAX_GAP = 4 * EVERY  # the gap a run of trials won by the same drafter grows to
MEMORY = 6  # trials a drafter's rate is measured over
EVIDENCE = 2  # trials every drafter must have run in before rates pick the one that runs
FIRST_GAP = 32  # steps between the first trials, and while the best rate is not yet trusted
SHARE = 0.03  # the most of the time the turns of a trial may lose against the leader: a trial
# whose losing turns cost more is followed by a gap long enough (up to MAX_GAP) to keep it so
SIT_OUT = 8  # the most trials in a row a clearly losing drafter sits out
CONFIDENCE = 2.0  # standard errors by which a drafter must beat the reference to replace it (at
# 1.0, with AVX2 kernels, the heads' tree, 3 % slower than plain when it ran, won early trials)


class Fastest(Drafter):
    def __init__(
        self, drafters: dict[str, Drafter], reference: str | None = None, memory: RateMemory | None = None
    ) -> None:
        """`reference`: the drafter that runs unless another is measured faster with confidence
        (None: the first named runs until rates decide, then the fastest); `memory`: the trials of
        earlier sessions, read now and written at each trial's end."""
        self.drafters = drafters
        self.reference = reference
        self.trials: dict[str, deque[list[tuple[int, float]]]] = {n: deque(maxlen=MEMORY) for n in drafters}
        self.active = reference or next(iter(drafters))
        self.trial_steps = TURNS * len(drafters)  # the steps of a trial every drafter takes
        self._trial = self.trial_steps  # steps left in the running trial (0: none runs)
        self._since = 0  # steps since the last trial ended
        self._gap = EVERY  # steps from the last trial to the next
        self._leader: str | None = None  # the fastest before the running trial
        self._runs = self.active  # what runs between trials (the leader as of the last trial)
        self._doubt = False  # a drafter that does not run has the best rate
        self._names = list(drafters)
        self._taking = list(drafters)  # the drafters taking the running (or the next) trial
        self._out = dict.fromkeys(drafters, 0)  # trials each sits out from the next one on
        self._losses = dict.fromkeys(drafters, 0)  # clear losses in a row (2^(n−1) trials out)
        self._turn = 0
        self._open = False  # each drafter's tally for the running trial is open
        self.memory = memory
        for name, kept in (memory.load(self._names) if memory is not None else {}).items():
            self.trials[name].extend(kept)
        if all(len(self.trials[n]) >= EVIDENCE for n in self._names):  # remembered: no opening trial
            self._resume()

    def _resume(self) -> None:
        """Start from remembered trials as from the end of the last one: their leader runs, the
        first trial follows `FIRST_GAP` steps in (later where the losers' turns would cost more
        than `SHARE`), and a clear loser sits it out (EAGLE's turns with AVX2 kernels)."""
        leader = self.active = self._runs = self.leader()
        self._trial, self._gap = 0, FIRST_GAP
        self._settle(leader, self._names)

    def _steps(self, name: str) -> list[tuple[int, float]]:
        return [step for trial in self.trials[name] for step in trial]

    def rate(self, name: str) -> float | None:
        """Tokens per second of step time over `name`'s last trials (None before one)."""
        steps = self._steps(name)
        seconds = sum(s for _, s in steps)
        return sum(t for t, _ in steps) / seconds if seconds > 0 else None

    def spread(self, name: str) -> float:
        """The standard error of `rate(name)` (a ratio of means: the spread of tokens − rate ×
        seconds over the steps, ÷ the mean step time); infinite before two steps."""
        steps, rate = self._steps(name), self.rate(name)
        if len(steps) < 2 or rate is None:
            return math.inf
        mean_s = sum(s for _, s in steps) / len(steps)
        residual = sum((t - rate * s) ** 2 for t, s in steps) / (len(steps) - 1)
        return math.sqrt(residual / len(steps)) / mean_s

    def _fastest(self) -> str:
        return max(self._names, key=lambda n: self.rate(n) or 0.0)

    def leader(self) -> str:
        if any(len(self.trials[n]) < EVIDENCE for n in self._names):
            return self.reference or self._names[0]
        if self.reference is None:
            return self._fastest()
        beats = [n for n in self._names if n != self.reference and self._beats(n, self.reference)]
        champion = beats[0] if beats else self.reference
        for name in beats[1:]:  # a later-named drafter must beat an earlier one with confidence too
            if self._beats(name, champion):
                champion = name
        return champion

    def _beats(self, name: str, other: str) -> bool:
        """Whether `name`'s rate exceeds `other`'s by `CONFIDENCE` standard errors of the difference."""
        gap = (self.rate(name) or 0.0) - (self.rate(other) or 0.0)
        return gap > CONFIDENCE * math.hypot(self.spread(name), self.spread(other))

    def _pick(self) -> str:
        if self._trial == 0 and self._since >= self._gap:
            self._since = 0
            self._taking = [n for n in self._names if self._out[n] == 0]
            self._out = {n: max(0, k - 1) for n, k in self._out.items()}
            if len(self._taking) > 1:  # else no trial: only the leader would take its turns
                self._trial = TURNS * len(self._taking)
        if self._trial > 0:
            if not self._open:
                self._leader = self.leader() if any(self.trials[n] for n in self._names) else None
                for name in self._taking:
                    self.trials[name].append([])
                self._open = True
            self._turn = (self._turn + 1) % len(self._taking)
            return self._taking[self._turn]
        self._since += 1
        return self._runs

    @property
    def taps(self) -> tuple[int, ...]:
        """The layers a contender reads the backbone's streams at (EAGLE-3's; one such contender)."""
        return next((d.taps for d in self.drafters.values() if d.taps), ())

    @property
    def reads_features(self) -> bool:
        return any(d.reads_features for d in self.drafters.values())

    def feed(self, features: Tensor, next_ids: Tensor, position: int) -> None:
        for drafter in self.drafters.values():
            if drafter.reads_features:
                drafter.feed(features, next_ids, position)

    def rewind(self, prompt_ids: Sequence[int], reused: int) -> int:
        """A new reply, told to every contender: each keeps what the one keeping least keeps (see
        `core.decode.generate.resume`; one without state of the prompt keeps all it is told); the
        second pass cuts back those asked before it answered."""
        for _ in range(2):
            for drafter in self.drafters.values():
                reused = min(reused, drafter.rewind(prompt_ids, reused))
        return reused

    def propose(self, hidden: Tensor, root: Tensor, history: Sequence[int] = ()) -> Draft:
        self.active = self._pick()
        return self.drafters[self.active].propose(hidden, root, history)

    def observe(self, draft: Draft, emitted: Sequence[int], seconds: float) -> None:
        if self._trial > 0:
            self.trials[self.active][-1].append((len(emitted), seconds))
            self._trial -= 1
            self._open = self._trial > 0
            if not self._open:  # the trial is over
                leader = self._runs = self.leader()
                kept = self._leader is not None and leader == self._leader
                doubt, self._doubt = self._doubt, self._fastest() != leader
                if len(self.trials[self.active]) < EVIDENCE or (self._doubt and not doubt):
                    self._gap = FIRST_GAP
                elif len(self.trials[self.active]) == EVIDENCE:  # the first comparison
                    self._gap = FIRST_GAP if self._doubt else EVERY
                else:
                    self._gap = min(2 * self._gap, MAX_GAP) if kept else EVERY
                self._settle(leader, self._taking)
                if self.memory is not None:
                    self.memory.save(self.trials)
        self.drafters[self.active].observe(draft, emitted, seconds)

    def _settle(self, leader: str, taking: list[str]) -> None:
        """After a trial that `taking` took (or remembered ones): the gap to the next lengthened where
        the losers' turns would cost more than `SHARE`, and which of them sit out."""
        lost = {name: self._lost(name, leader) for name in taking if name != leader}
        self._gap = max(self._gap, self._costly_gap(leader, lost))
        self._sit_out(leader, lost)

    def _sit_out(self, leader: str, lost: dict[str, float]) -> None:
        """After a trial (`lost`: each other drafter's `_lost` seconds in it): which of its losers
        sit out the next ones. The reference (else the first named) and the leader take every
        trial; where those are one, so does the loser that lost least, so a trial always compares two."""
        anchor = self.reference or self._names[0]
        clear = [n for n, s in lost.items() if n != anchor and s > 0 and len(self.trials[n]) >= EVIDENCE]
        losers = sorted((n for n in clear if self._beats(leader, n)), key=lost.get)
        for name in set(self._taking) - set(losers):
            self._losses[name] = 0
        for name in losers[1:] if leader == anchor else losers:
            self._losses[name] += 1
            self._out[name] = min(SIT_OUT, 2 ** (self._losses[name] - 1))

    def _costly_gap(self, leader: str, lost: dict[str, float]) -> int:
        """The steps after a trial that keep what its losing turns cost within `SHARE` of the time:
        `lost`, the seconds each other drafter's turns took beyond what the leader's rate in the same
        trial would have made their tokens in (none where they gained), over SHARE × the leader's
        step time; at most MAX_GAP. Where no tree pays (AVX2 kernels: EAGLE's turns took 2-4× a
        plain step for 1-2 tokens), trials 32 steps apart cost the default ~10 % of its speed."""
        turns = self.trials[leader][-1]  # the leader's tally of the trial that just ended
        seconds = sum(s for _, s in turns)
        if seconds <= 0:
            return 0
        return min(MAX_GAP, math.ceil(sum(lost.values()) / (SHARE * seconds / len(turns))))

    def _lost(self, name: str, leader: str) -> float:
        """The seconds `name`'s turns in the trial that just ended took beyond what the leader's
        rate in it would have made their tokens in (0 where they gained, or the leader made none)."""
        turns = self.trials[leader][-1]
        tokens, seconds = sum(t for t, _ in turns), sum(s for _, s in turns)
        if tokens <= 0 or seconds <= 0:
            return 0.0
        return max(0.0, sum(s - t * seconds / tokens for t, s in self.trials[name][-1]))

    @property
    def last_choice(self) -> Choice | None:
        choice = self.drafters[self.active].last_choice
        return None if choice is None else replace(choice, reason=f"{self.active}: {choice.reason}")
