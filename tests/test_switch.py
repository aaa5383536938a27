"""`Fastest`: drafters compared in trials where they take turns; the faster one runs between."""

from __future__ import annotations

from collections import Counter

import torch

from core.step import NoDrafter
from core.tune.switch import EVERY, MAX_GAP, TURNS, Fastest

TRIAL = 2 * TURNS  # the steps of a trial between two drafters


class Fake(NoDrafter):
    def __init__(self) -> None:
        super().__init__()
        self.fed, self.observed = 0, 0

    def feed(self, features, next_ids, position) -> None:
        self.fed += 1

    def observe(self, draft, emitted, seconds) -> None:
        self.observed += 1


def run(switch: Fastest, steps: int, speed, seconds=lambda name: 0.01) -> Counter:
    """`speed(name, step)`: the tokens that drafter's step gives; `seconds(name)`: its step's time."""
    ran = Counter()
    for step in range(steps):
        draft = switch.propose(torch.zeros(4), torch.tensor(1), [1])
        ran[switch.active] += 1
        switch.feed(torch.zeros(1, 4), torch.tensor([1]), 0)
        switch.observe(draft, [1] * speed(switch.active, step), seconds(switch.active))
    return ran


def test_the_faster_runs_between_trials_and_every_drafter_sees_every_feature():
    """Trials at the start, then EVERY steps later; each that keeps the leader doubles the gap."""
    slow, fast = Fake(), Fake()
    switch = Fastest({"slow": slow, "fast": fast})
    steps = TRIAL + (EVERY + TRIAL) + (2 * EVERY + TRIAL) + (MAX_GAP + TRIAL) + (MAX_GAP + TRIAL)
    ran = run(switch, steps, lambda name, step: 3 if name == "fast" else 2)
    assert MAX_GAP == 4 * EVERY
    assert ran["slow"] == 5 * TRIAL // 2  # only its turns in the five trials
    assert slow.fed == fast.fed == steps
    assert slow.observed == ran["slow"] and fast.observed == ran["fast"]
    assert switch.rate("fast") == 300 and switch.rate("slow") == 200


def test_trials_compare_like_with_like():
    """A passage where every drafter does well must not crown whichever ran on it: in turns,
    both meet it, and the one that is faster on the same text wins."""
    switch = Fastest({"a": Fake(), "b": Fake()})
    easy = range(0, TRIAL)  # the first trial's passage is easy for both
    ran = run(switch, TRIAL + EVERY, lambda name, step: (8 if step in easy else 1) + (name == "b"))
    assert ran["b"] > EVERY  # b wins by one token a step everywhere


def test_a_drafter_that_becomes_faster_takes_over():
    switch = Fastest({"a": Fake(), "b": Fake()})
    run(switch, TRIAL + 20, lambda name, step: 3 if name == "a" else 2)
    assert switch.active == "a"
    ran = run(switch, 6 * (EVERY + TRIAL), lambda name, step: 1 if name == "a" else 2)  # a slows down
    assert switch.active == "b" and ran["b"] > ran["a"]


def test_plain_decoding_runs_between_trials_where_no_drafter_pays():
    """Drafters whose steps give no more tokens but cost their drafting lose to plain decoding,
    which then runs with nothing drafted; in the trials every contender takes its turns."""
    heads, eagle = Fake(), Fake()
    switch = Fastest({"heads": heads, "eagle": eagle, "plain": NoDrafter()})
    assert switch.trial_steps == 3 * TURNS
    ran = run(switch, switch.trial_steps + EVERY, lambda name, step: 1, lambda name: 0.01 if name == "plain" else 0.012)
    assert ran == Counter(plain=TURNS + EVERY, heads=TURNS, eagle=TURNS)
    assert heads.fed == eagle.fed == 3 * TURNS + EVERY  # fed all along, ready for the next trial
