"""`Fastest`: the drafter with the best measured rate runs; the others are tried again now and then."""

from __future__ import annotations

from collections import Counter

import torch

from core.step import NoDrafter
from core.tune.switch import BLOCK, REVISIT, Fastest


class Fake(NoDrafter):
    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens, self.fed, self.observed = tokens, 0, 0

    def feed(self, features, next_ids, position) -> None:
        self.fed += 1

    def observe(self, draft, emitted, seconds) -> None:
        self.observed += 1


def run(switch: Fastest, steps: int, speed: dict[str, int]) -> Counter:
    ran = Counter()
    for _ in range(steps):
        draft = switch.propose(torch.zeros(4), torch.tensor(1), [1])
        ran[switch.active] += 1
        switch.feed(torch.zeros(1, 4), torch.tensor([1]), 0)
        switch.observe(draft, [1] * speed[switch.active], 0.01)
    return ran


def test_the_fastest_runs_and_the_others_are_revisited():
    slow, fast = Fake(2), Fake(3)
    switch = Fastest({"slow": slow, "fast": fast})
    ran = run(switch, 2 * BLOCK + 3 * REVISIT, {"slow": 2, "fast": 3})
    assert ran["slow"] <= BLOCK * 4 and ran["fast"] > 3 * REVISIT - BLOCK * 3
    assert slow.fed == fast.fed == 2 * BLOCK + 3 * REVISIT  # every drafter sees every feature
    assert slow.observed == ran["slow"] and fast.observed == ran["fast"]  # only the one that ran learns
    assert ran["slow"] > BLOCK  # tried again after the first try


def test_a_drafter_that_becomes_faster_takes_over():
    a, b = Fake(3), Fake(2)
    switch = Fastest({"a": a, "b": b})
    run(switch, 2 * BLOCK + 20, {"a": 3, "b": 2})
    assert switch.active == "a"
    ran = run(switch, 4 * REVISIT, {"a": 1, "b": 2})  # a slows down (another kind of reply)
    assert switch.active == "b" and ran["b"] > ran["a"]
