"""`Fastest`: drafters compared in trials where they take turns; the faster one runs between."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from core.drafters.base import NoDrafter
from core.drafters.switch import EVERY, FIRST_GAP, MAX_GAP, SHARE, SIT_OUT, TURNS, Fastest
from core.measure.rates import RateMemory

TRIAL = 2 * TURNS  # the steps of a trial between two drafters


class Fake(NoDrafter):
    reads_features = True

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
    """Two trials at the start (the first named runs between them), then one EVERY steps later;
    each that keeps the leader doubles the gap."""
    slow, fast = Fake(), Fake()
    switch = Fastest({"slow": slow, "fast": fast})
    gaps = (FIRST_GAP, EVERY, 2 * EVERY, MAX_GAP, MAX_GAP)
    steps = TRIAL + sum(gap + TRIAL for gap in gaps)
    ran = run(switch, steps, lambda name, step: 3 if name == "fast" else 2)
    assert MAX_GAP == 4 * EVERY
    assert ran["slow"] == 6 * TRIAL // 2 + FIRST_GAP  # its turns in the six trials, and the first gap
    assert slow.fed == fast.fed == steps
    assert slow.observed == ran["slow"] and fast.observed == ran["fast"]
    assert switch.rate("fast") == pytest.approx(300) and switch.rate("slow") == pytest.approx(200)


def test_one_trial_is_too_little_to_switch_on():
    switch = Fastest({"a": Fake(), "b": Fake()})
    ran = run(switch, TRIAL + FIRST_GAP, lambda name, step: 1 + (name == "b"))
    assert ran == Counter(a=TRIAL // 2 + FIRST_GAP, b=TRIAL // 2)


def test_trials_compare_like_with_like():
    """A passage where every drafter does well must not crown whichever ran on it: in turns,
    both meet it, and the one that is faster on the same text wins."""
    switch = Fastest({"a": Fake(), "b": Fake()})
    easy = range(0, TRIAL)  # the first trial's passage is easy for both
    ran = run(switch, 2 * TRIAL + FIRST_GAP + EVERY, lambda name, step: (8 if step in easy else 1) + (name == "b"))
    assert ran["b"] == TRIAL + EVERY  # b wins by one token a step everywhere


def test_a_drafter_that_becomes_faster_takes_over():
    switch = Fastest({"b": Fake(), "a": Fake()})
    run(switch, 2 * TRIAL + FIRST_GAP + 20, lambda name, step: 3 if name == "a" else 2)
    assert switch.active == "a"
    ran = run(switch, 6 * (EVERY + TRIAL), lambda name, step: 1 if name == "a" else 2)  # a slows down
    assert switch.active == "b" and ran["b"] > ran["a"]


def test_plain_decoding_runs_between_trials_where_no_drafter_pays():
    """Drafters whose steps give no more tokens but cost their drafting lose to plain decoding,
    which then runs with nothing drafted; in the trials every contender takes its turns."""
    heads, eagle = Fake(), Fake()
    switch = Fastest({"heads": heads, "eagle": eagle, "plain": NoDrafter()})
    assert switch.trial_steps == 3 * TURNS
    steps = 2 * switch.trial_steps + FIRST_GAP + EVERY
    ran = run(switch, steps, lambda name, step: 1, lambda name: 0.01 if name == "plain" else 0.012)
    assert ran == Counter(plain=2 * TURNS + EVERY, heads=2 * TURNS + FIRST_GAP, eagle=2 * TURNS)
    assert heads.fed == eagle.fed == steps  # fed all along, ready for the next trial


def noisy(name: str, step: int) -> int:
    """A drafter's tokens a step: 1 to 4, in a pattern that repeats every 7 steps (mean 2)."""
    return (1, 4, 1, 2, 3, 1, 2)[(step * 3 + len(name)) % 7]


def test_with_a_reference_only_a_measurably_faster_drafter_replaces_it():
    """Plain decoding keeps running against a drafter 5 % slower whose steps' tokens vary (so
    a trial's rate can favour it by luck), and gives way to one faster by more than the noise."""

    def tokens(name, step):
        return 1 if name == "plain" else noisy(name, step)

    close = Fastest({"heads": Fake(), "plain": NoDrafter()}, reference="plain")
    ran = run(close, 2000, tokens, lambda name: 0.01 if name == "plain" else 0.021)
    assert close.leader() == "plain" and ran["plain"] > 10 * ran["heads"]
    clear = Fastest({"heads": Fake(), "plain": NoDrafter()}, reference="plain")
    ran = run(clear, 2000, tokens, lambda name: 0.01 if name == "plain" else 0.013)
    assert clear.leader() == "heads" and ran["heads"] > 10 * ran["plain"]


def test_of_two_drafters_faster_than_the_reference_the_later_named_must_beat_the_earlier_too():
    """The heads' tree and EAGLE's both beat plain decoding; EAGLE (named later) runs only where
    it is faster than the heads' tree by more than the noise, not where it is 5 % faster."""

    def tokens(name, step):
        return 1 if name == "plain" else noisy(name, step)

    def seconds(eagle):
        return lambda name: {"plain": 0.01, "heads": 0.013, "eagle": eagle}[name]

    close = Fastest({"heads": Fake(), "eagle": Fake(), "plain": NoDrafter()}, reference="plain")
    ran = run(close, 4000, tokens, seconds(0.0124))  # long enough for EAGLE's trials to favour it
    assert close.rate("eagle") > close.rate("heads") * 1.01  # the faster on its trials, not by enough
    assert close.leader() == "heads" and ran["heads"] > 10 * ran["eagle"]
    clear = Fastest({"heads": Fake(), "eagle": Fake(), "plain": NoDrafter()}, reference="plain")
    ran = run(clear, 4000, tokens, seconds(0.009))
    assert clear.leader() == "eagle" and ran["eagle"] > 10 * ran["heads"]


def test_trials_come_soon_when_the_best_rate_is_not_yet_trusted():
    """When the drafter with the best rate is not yet measurably faster than the reference, the
    next trial follows FIRST_GAP steps later (not EVERY)."""
    switch = Fastest({"heads": Fake(), "plain": NoDrafter()}, reference="plain")
    steps = TRIAL + FIRST_GAP + TRIAL + FIRST_GAP + TRIAL
    ran = run(switch, steps, lambda name, step: 1 if name == "plain" else noisy(name, step),
              lambda name: 0.01 if name == "plain" else 0.019)  # fmt: skip
    assert switch.rate("heads") > switch.rate("plain") and switch.leader() == "plain"
    assert ran["heads"] == 3 * TRIAL // 2  # three trials in that many steps, plain between them


def test_a_trial_whose_turns_lose_much_is_followed_by_a_longer_gap():
    """A drafter whose steps take 3× a plain step for one token loses 8 × 20 ms in its turns: the
    next trial waits until that is SHARE of the time (534 plain steps), not FIRST_GAP; one that
    loses little keeps FIRST_GAP."""
    dear = Fastest({"eagle": Fake(), "plain": NoDrafter()}, reference="plain")
    wait = math.ceil(TURNS * 0.02 / (SHARE * 0.01))
    assert FIRST_GAP < wait < MAX_GAP
    ran = run(dear, TRIAL + wait, lambda name, step: 1, lambda name: 0.01 if name == "plain" else 0.03)
    assert ran["eagle"] == TURNS  # its turns in the first trial only
    ran = run(dear, TRIAL, lambda name, step: 1, lambda name: 0.01 if name == "plain" else 0.03)
    assert ran["eagle"] == TURNS  # the second trial, right after the gap
    cheap = Fastest({"eagle": Fake(), "plain": NoDrafter()}, reference="plain")
    ran = run(cheap, 2 * TRIAL + FIRST_GAP, lambda name, step: 1, lambda name: 0.01 if name == "plain" else 0.0101)
    assert ran["eagle"] == 2 * TURNS


def trials_taken(switch: Fastest, steps: int, seconds) -> list[tuple[str, ...]]:
    """Who took each trial that opened in `steps` steps of one token each (the first included)."""
    taken = [tuple(switch._taking)] if switch._trial else []
    for _ in range(steps):
        before = switch._trial
        draft = switch.propose(torch.zeros(4), torch.tensor(1), [1])
        if before == 0 and switch._trial > 0:
            taken.append(tuple(switch._taking))
        switch.observe(draft, [1], seconds(switch.active))
    return taken


def test_a_clear_loser_sits_out_ever_more_trials_and_a_trial_still_compares_two():
    """Where plain decoding leads, EAGLE, three times as dear, sits out 1, 2, 4, then SIT_OUT
    trials; the heads' tree, which loses least, takes every trial beside plain decoding."""
    switch = Fastest({"heads": Fake(), "eagle": Fake(), "plain": NoDrafter()}, reference="plain")
    taken = trials_taken(switch, 16000, lambda name: {"plain": 0.01, "heads": 0.012, "eagle": 0.03}[name])
    assert all({"heads", "plain"} <= set(t) for t in taken)
    with_eagle = [i for i, t in enumerate(taken) if "eagle" in t]
    assert with_eagle[:6] == [0, 1, 3, 6, 11, 11 + SIT_OUT + 1]
    assert len(taken) > with_eagle[-1] + 1  # it sits out still


def test_a_drafter_sitting_out_takes_over_once_faster():
    """EAGLE, clearly behind while it sits out trials, leads once it has become the fastest."""
    switch = Fastest({"heads": Fake(), "eagle": Fake(), "plain": NoDrafter()}, reference="plain")
    trials_taken(switch, 3000, lambda name: {"plain": 0.01, "heads": 0.012, "eagle": 0.03}[name])
    assert switch._out["eagle"] > 0 and switch.leader() == "plain"
    trials_taken(switch, 20000, lambda name: {"plain": 0.01, "heads": 0.012, "eagle": 0.004}[name])
    assert switch.leader() == "eagle" and switch._out["eagle"] == 0


def test_the_reference_and_the_leader_take_every_trial():
    """Two drafters: a trial always has both, however clearly one loses."""
    switch = Fastest({"eagle": Fake(), "plain": NoDrafter()}, reference="plain")
    taken = trials_taken(switch, 5000, lambda name: 0.01 if name == "plain" else 0.03)
    assert len(taken) > 3 and all(t == ("eagle", "plain") for t in taken)


def test_a_new_session_starts_on_the_leader_its_last_one_measured(tmp_path):
    """Trials are remembered at each trial's end; a new session with the same memory starts on the
    leader they name, without an opening trial (its first follows FIRST_GAP steps in), where a
    session without memory runs the reference through its first trials."""
    memory = RateMemory(tmp_path, "model|machine|hybrid")
    first = Fastest({"plain": Fake(), "heads": Fake()}, reference="plain", memory=memory)
    run(first, 2 * TRIAL + FIRST_GAP, lambda name, step: 2 if name == "heads" else 1)
    assert first.leader() == "heads" and memory.path.exists()
    again = Fastest({"plain": Fake(), "heads": Fake()}, reference="plain", memory=memory)
    assert again.rate("heads") == pytest.approx(200) and again.rate("plain") == pytest.approx(100)
    gap = again._gap  # FIRST_GAP, or more where plain's turns cost more than SHARE of the time
    assert gap >= FIRST_GAP and run(again, gap, lambda name, step: 2 if name == "heads" else 1) == Counter(heads=gap)
    assert run(again, TRIAL, lambda name, step: 1) == Counter(heads=TRIAL // 2, plain=TRIAL // 2)  # its own trial
    fresh = Fastest({"plain": Fake(), "heads": Fake()}, reference="plain")
    assert run(fresh, FIRST_GAP, lambda name, step: 2 if name == "heads" else 1)["plain"] > TRIAL // 2
    other = Fastest({"plain": Fake(), "heads": Fake()}, reference="plain", memory=RateMemory(tmp_path, "another"))
    assert other.rate("heads") is None  # another model's or machine's rates are not these


def test_a_damaged_memory_is_dropped_with_one_sentence(tmp_path):
    said = []
    memory = RateMemory(tmp_path, "k", said.append)
    for damaged in ("{not json", '{"format": 1, "key": "k", "trials": {"heads": [[[1, -0.5]]]}}'):
        memory.path.write_text(damaged)
        switch = Fastest({"plain": Fake(), "heads": Fake()}, reference="plain", memory=memory)
        assert switch.rate("heads") is None and not memory.path.exists()
    assert len(said) == 2 and all("damaged" in s for s in said)
    memory.path.write_text('{"format": 0, "key": "k", "trials": {}}')  # another version's: dropped quietly
    assert memory.load(["heads"]) == {} and len(said) == 2


def test_a_remembered_clear_loser_sits_out_the_new_sessions_first_trial(tmp_path):
    """Restored trials are taken as a trial's end: a drafter that lost clearly (EAGLE's turns with
    AVX2 kernels) sits out the first trial, which comes no sooner than FIRST_GAP steps in."""
    memory = RateMemory(tmp_path, "k")
    drafters = lambda: {"plain": Fake(), "heads": Fake(), "eagle": Fake()}  # noqa: E731
    seconds = {"plain": 0.010, "heads": 0.011, "eagle": 0.030}.get
    first = Fastest(drafters(), reference="plain", memory=memory)
    ran = run(first, 3000, lambda name, step: 1, seconds)
    assert ran["eagle"] >= 2 * TURNS and first.leader() == "plain"
    again = Fastest(drafters(), reference="plain", memory=memory)
    gap = again._gap
    assert gap >= FIRST_GAP
    ran = run(again, gap + 2 * TURNS, lambda name, step: 1, seconds)
    assert ran == Counter(plain=gap + TURNS, heads=TURNS)  # a trial of two: eagle sat it out
