"""The speculation policy: its choices on stub cost curves, exactness while it switches trees,
and the stored step-cost curve."""

import itertools
import json
from collections import Counter
from dataclasses import replace

import pytest
import torch

from app.worker import ComputeThread
from core.backends import q4build
from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.decode.tree import load_preset
from core.drafters.auto import AutoDrafter
from core.drafters.build import auto_drafter
from core.drafters.policy import (
    CONTEXT_DEPTH,
    CONTEXT_KEY,
    CONTEXT_PRIOR,
    EXPLORE_BACKOFF,
    EXPLORE_EVERY,
    RANKS,
    CostCurve,
    Policy,
    prior_accuracy,
    prior_reliability,
)
from core.measure import costs
from tests.helpers import FAST_KERNELS, plain_tokens, three_token_p_value, tiny_backend, tiny_model
from tests.test_engine import PROMPT, random_heads

CHEAP = CostCurve({1: 10.0, 8: 10.5, 16: 11.0, 32: 12.0, 64: 14.0}, 0.1)
EXPENSIVE = CostCurve({1: 10.0, 2: 25.0, 8: 80.0, 32: 300.0}, 2.0)
MODERATE = CostCurve({1: 10.0, 2: 11.0, 4: 12.0, 8: 14.0, 16: 20.0, 32: 40.0}, 0.2)
ONE_BRANCH = (1, 2, 3, 4)  # a lookup continuation of 4 tokens: its nodes cut to 1, 2, 3, 4 tokens
GOOD_HEADS = prior_accuracy(4, [0.7, 0.5, 0.4, 0.3], [0.95, 0.85, 0.75, 0.65])


def policy(curve, accuracy=GOOD_HEADS, **kw) -> Policy:
    return Policy(lambda: curve, accuracy, **kw)


def test_expensive_trees_decode_plain():
    choice = policy(EXPENSIVE).choose()
    assert choice.plain and choice.budget == 0 and "plain" in choice.reason


def test_cheap_trees_grow_the_tree():
    cheap, moderate = policy(CHEAP).choose(), policy(MODERATE).choose()
    assert cheap.budget > moderate.budget >= 1
    assert cheap.budget >= 16
    assert cheap.expected_tokens > moderate.expected_tokens > 1


def test_a_run_of_rejections_shrinks_the_tree_down_to_plain():
    p = policy(MODERATE)
    budgets = [p.choose().budget]
    wrong = torch.full((4, RANKS), 5)  # the heads' candidates: never the emitted token
    for _ in range(80):
        choice = p.choose()
        p.observe(choice, wrong if choice.budget else None, [7], [], choice.expected_ms / 1000)  # one token a step
        budgets.append(choice.budget)
    assert budgets[0] >= 4
    assert budgets[-20:].count(0) >= 18  # plain, but for the odd exploring step
    assert all(b <= a for a, b in itertools.pairwise(budgets[:10]))  # shrinking on the way


def test_it_explores_back_and_grows_when_the_heads_turn_right():
    p = policy(MODERATE, accuracy=prior_accuracy(4, [0.01] * 4, [0.02] * 4))
    choices = [p.choose() for _ in range(3)]
    assert all(c.plain for c in choices)
    right = torch.tensor([[7] * RANKS] * 4)  # every candidate is the emitted token
    explored = []
    for _ in range(6 * EXPLORE_EVERY):
        c = p.choose()
        explored.append(c.reason.startswith("explore"))
        p.observe(c, right if c.budget else None, [7, 7, 7, 7, 7], [], 0.01)
        if c.budget >= 4:
            break
    assert any(explored)  # it tried the heads while plain looked best
    assert p.choose().budget >= 4  # and, finding them right, grew the tree


def test_heads_that_keep_missing_are_explored_ever_more_rarely_but_never_dropped():
    """Each exploring step in a row whose heads do not pay doubles the wait before the next (up to
    2**EXPLORE_BACKOFF times), so a text the heads cannot guess costs little; one that pays, or the
    heads drafting on their own, starts over."""
    p = policy(MODERATE)
    wrong, right = torch.full((4, RANKS), 5), torch.full((4, RANKS), 7)
    explored = []
    for step in range(2000):
        c = p.choose()
        p.observe(c, wrong if c.budget else None, [7], [], c.expected_ms / 1000)
        if c.reason.startswith("explore"):
            explored.append(step)
    gaps = [b - a for a, b in itertools.pairwise(explored)]
    assert len(explored) >= 4 and all(b >= a for a, b in itertools.pairwise(gaps))  # never dropped, ever rarer
    assert gaps[-1] >= EXPLORE_EVERY * 2**EXPLORE_BACKOFF and gaps[0] < gaps[-1] / 4
    assert len(explored) <= 4 + 2000 // (EXPLORE_EVERY * 2**EXPLORE_BACKOFF)  # ~16 times fewer than without
    for _ in range(gaps[-1] + 1):  # the text turns easy: the next exploration pays, and the heads draft again
        c = p.choose()
        p.observe(c, right if c.budget else None, [7, 7, 7, 7, 7], [], 0.01)
        if c.drafted and not c.reason.startswith("explore"):
            break
    assert p.choose().drafted


def probabilities(top: list[float]) -> torch.Tensor:
    """(4, RANKS) head probabilities: `top[k]` for head k's first candidate, the rest spread thin."""
    probs = torch.full((4, RANKS), 0.004)
    probs[:, 0] = torch.tensor(top)
    return probs


HONEST = [[(b + 0.5) / 10 for b in range(10)]] * 4  # heads whose probabilities are right as often as they say


def test_confident_heads_draft_deep_and_unsure_heads_not_at_all():
    p = policy(MODERATE, reliability=HONEST)
    choice = p.choose()
    assert choice.drafted  # good heads on a moderate curve: worth running
    sure = p.refine(choice, probabilities([0.97, 0.95, 0.95, 0.95]))
    assert sure.drafted and sure.budget >= 4 and (0, 0, 0, 0) in sure.paths
    assert sure.expected_tokens > 4
    unsure = p.refine(choice, probabilities([0.05, 0.05, 0.05, 0.05]))
    assert unsure.drafted and unsure.plain and unsure.paths == () and "unsure" in unsure.reason


def test_the_calibration_learns_that_confident_heads_were_wrong():
    p = policy(MODERATE, reliability=HONEST)
    sure, wrong = probabilities([0.97, 0.95, 0.95, 0.95]), torch.full((4, RANKS), 5)
    assert p.refine(p.choose(), sure).budget >= 4
    for _ in range(200):
        choice = p.choose()
        if choice.drafted:
            choice = p.refine(choice, sure)
        p.observe(choice, wrong if choice.drafted else None, [7, 7, 7, 7, 7], [], 0.01, sure)
    assert p.calibration[0, 9] < 0.2  # the bin of 0.97 now says "rarely right"
    assert p.refine(replace(p.choose(), drafted=True), sure).plain


def test_heads_that_looked_good_but_ran_slower_than_plain_stop_until_they_pay_again():
    p = policy(MODERATE)  # good heads on paper: their steps are expected to beat plain ones
    right = torch.full((4, RANKS), 7)
    ran = []
    for _ in range(60):  # and head 0 keeps guessing right, but each step that runs them returns one
        c = p.choose()  # token and costs more than a plain one
        p.observe(c, right if c.drafted else None, [7], [], 0.012 if c.drafted else 0.010)
        ran.append(c.drafted)
    assert all(ran[:8]) and sum(ran[-30:]) <= 3  # stopped after a few, but for rare exploring steps
    for _ in range(20 * EXPLORE_EVERY):  # the text turns easy: the explored steps return 4 tokens
        c = p.choose()
        p.observe(c, right if c.drafted else None, [7, 7, 7, 7], [], 0.012 if c.drafted else 0.010)
        if c.drafted and not c.reason.startswith("explore"):
            break
    assert p.choose().drafted and not p.choose().reason.startswith("explore")


def test_lookup_is_taken_when_it_matches_and_dropped_when_it_does_not():
    p = policy(MODERATE, accuracy=prior_accuracy(4, [0.0] * 4, [0.0] * 4))
    for _ in range(10):
        c = p.choose(lookup_nodes=ONE_BRANCH)
        p.observe(c, None, [1, 2, 3, 4, 5], [[1, 2, 3, 4]], c.expected_ms / 1000)  # steps cost what the curve says
    assert p.choose(lookup_nodes=ONE_BRANCH).lookup
    wasted = 0.0  # ms spent over plain steps while the lookup no longer matches
    for _ in range(60):
        c = p.choose(lookup_nodes=ONE_BRANCH)
        p.observe(c, None, [9], [[1, 2, 3, 4]], c.expected_ms / 1000)  # the lookup's first token is wrong
        wasted += c.expected_ms - p.plain_ms()
    assert not p.choose(lookup_nodes=ONE_BRANCH).lookup
    assert wasted < 5 * p.plain_ms()  # the failing lookup is cut to its cheapest, then dropped


def test_heads_stay_off_where_the_lookup_alone_is_expected_faster():
    middling = prior_accuracy(4, [0.35, 0.2, 0.1, 0.05], [0.6, 0.4, 0.3, 0.2])
    heads_ms = CostCurve(MODERATE.step_ms, 2.0)  # drafting costs a fifth of a plain step
    assert policy(heads_ms, middling).choose().drafted  # with nothing else to draft, the heads pay
    p = policy(heads_ms, middling)
    p.hazard(CONTEXT_KEY).fill_(0.9)  # a lookup that keeps matching, as when copying a document
    choice = p.choose(lookup_nodes=ONE_BRANCH)
    assert choice.lookup and not choice.drafted


# A staircase, as torch's int4 CPU matmul makes: every 4 rows a block, nodes within one nearly free.
STAIRS = CostCurve({n: 10.0 + 4.0 * ((n - 1) // 4) + 0.1 * n for n in range(1, 42)}, 0.2)


def test_a_cost_staircase_cuts_the_lookup_to_fit_a_block():
    p = policy(STAIRS, accuracy=prior_accuracy(4, [0.0] * 4, [0.0] * 4))
    for _ in range(10):  # continuations keep matching their first two tokens, never the third
        c = p.choose(lookup_nodes=ONE_BRANCH)
        p.observe(c, None, [1, 2, 9, 9], [[1, 2, 3, 4]], c.expected_ms / 1000)
    c = p.choose(lookup_nodes=ONE_BRANCH)
    assert c.lookup == 3 and c.nodes == 4  # root + 3 context nodes: one block; the 4th token would start the next
    assert p.reach(CONTEXT_KEY, 2) > 1.5 and p.reach(CONTEXT_KEY, 4) - p.reach(CONTEXT_KEY, 2) < 0.5


def test_a_plain_step_says_nothing_of_later_lookup_tokens():
    p = policy(MODERATE)
    for _ in range(30):  # plain steps emit one token: only the continuation's first token is checked
        p.observe(replace(p.choose(), reason="plain"), None, [1], [[1, 2, 3, 4]], 0.01)
    hazard = p.hazard(CONTEXT_KEY)
    assert hazard[0] > 0.99 and torch.all(hazard[1:] == CONTEXT_PRIOR)
    assert p.reach(CONTEXT_KEY, CONTEXT_DEPTH) == pytest.approx(
        float(hazard[0]) * sum(CONTEXT_PRIOR**k for k in range(len(hazard)))
    )


def test_heads_trees_end_at_a_step_of_the_staircase():
    c = policy(STAIRS).choose()
    assert c.budget >= 3 and c.nodes % 4 == 0  # a node more would pay a whole block


def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve({1: 10.0, 3: 14.0, 5: 20.0}, 0.0)
    assert curve.at(1) == 10.0 and curve.at(0) == 10.0
    assert curve.at(2) == pytest.approx(12.0)
    assert curve.at(7) == pytest.approx(25.0)  # beyond: the mean slope, (20 - 10) / (5 - 1) a node


def test_without_a_measured_curve_the_prior_is_cautious():
    p = Policy(lambda: None, GOOD_HEADS)
    assert p.choose().budget <= 4


class Flipping:
    """A cost curve that swaps between cheap and expensive every call, so the policy switches
    between plain decoding and large trees within one reply."""

    def __init__(self) -> None:
        self.calls = itertools.cycle([CHEAP, CHEAP, EXPENSIVE])

    def __call__(self) -> CostCurve:
        return next(self.calls)


def switching_drafter(model, heads_seed=0, num_heads=4) -> AutoDrafter:
    heads = random_heads(model, num_heads=num_heads, seed=heads_seed)
    return AutoDrafter(heads, Policy(Flipping(), prior_accuracy(num_heads, [0.9] * num_heads)))


@pytest.mark.parametrize("arch", ["llama", "qwen2", *(f"llama+{k}" for k in FAST_KERNELS)])
def test_greedy_is_exact_while_the_policy_switches_trees(arch):
    backend = tiny_backend(arch)
    reference = plain_tokens(backend, PROMPT, 40)
    drafter = switching_drafter(backend.model)
    events, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=40), drafter))
    assert list(done.token_ids) == reference
    sizes = {e.tree_size for e in events[1:]}
    assert 1 in sizes and max(sizes) > 8  # it really switched between plain and big trees
    assert any(e.choice for e in events[1:])


def test_lossless_sampling_with_switching_trees_keeps_the_distribution():
    vocab = 6
    backend = tiny_backend("llama", vocab=vocab, seed=2)
    prompt = [1, 4, 2]
    drafter = switching_drafter(backend.model, heads_seed=5, num_heads=2)
    sizes = Counter()
    p_value = three_token_p_value(
        backend, prompt, vocab, drafter, on_events=lambda ev: sizes.update(e.tree_size for e in ev[1:])
    )
    assert sizes[1] > 100 and sum(v for k, v in sizes.items() if k > 1) > 100  # both kinds of step ran
    assert p_value > 1e-3


# -- the stored curve -----------------------------------------------------------------------------


def test_measured_curve_is_stored_and_reused(tmp_path):
    backend = tiny_backend("llama+onednn" if "onednn" in FAST_KERNELS else "llama")
    heads = random_heads(backend.model)
    said = []
    store = costs.CurveStore(tmp_path)
    first = costs.StepCosts(backend, heads, store, "key-1", said.append)
    assert first.needed and first.curve() is None
    curve = first.measure()
    assert set(curve.step_ms) == set(costs.SIZES) and all(v > 0 for v in curve.step_ms.values())
    assert curve.heads_ms > 0 and first.seconds < costs.BUDGET_S
    again = costs.StepCosts(backend, heads, store, "key-1", said.append)
    assert not again.needed and again.curve() == curve
    assert not costs.StepCosts(backend, heads, store, "key-2", said.append).curve()  # another machine or model


def test_a_changed_kernel_library_measures_the_curve_again(monkeypatch):
    backend = tiny_backend("llama")
    key = costs.curve_key(backend, None)
    monkeypatch.setattr(q4build, "_source", lambda: b"a changed kernel library")
    assert costs.curve_key(backend, None) != key


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p.write_bytes(p.read_bytes()[:20]),  # truncated
        lambda p: p.write_text("[1, 2]"),  # not an object
        lambda p: p.write_text(json.dumps(json.loads(p.read_text()) | {"format": 0})),  # an older format
        lambda p: p.write_text(json.dumps(json.loads(p.read_text()) | {"step_ms": {"1": -3}})),  # nonsense
    ],
)
def test_a_damaged_or_stale_curve_is_measured_again(tmp_path, damage):
    store = costs.CurveStore(tmp_path)
    store.save("k", CostCurve({1: 10.0, 8: 20.0}, 1.0))
    damage(store.path("k"))
    said = []
    step_costs = costs.StepCosts(tiny_backend(), None, store, "k", said.append)
    assert step_costs.needed and len(said) == 1 and "measuring this machine again" in said[0]
    assert not store.path("k").exists()
    assert step_costs.measure() is not None and store.load("k") == step_costs.curve()


def test_compute_thread_streams_in_order_and_passes_errors():
    worker = ComputeThread()
    assert list(worker.stream(lambda: iter(range(5)))) == [0, 1, 2, 3, 4]

    def failing():
        yield 1
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        list(worker.stream(failing))
    assert worker.call(lambda: 42) == 42


def test_closing_the_compute_thread_ends_the_job_running_and_drops_the_rest():
    import threading
    from concurrent.futures import CancelledError

    worker, started, release = ComputeThread(), threading.Event(), threading.Event()

    def job() -> str:
        started.set()
        release.wait(10)
        return "done"

    running = worker.submit(job)
    queued = worker.submit(lambda: "never")
    started.wait(10)
    threading.Timer(0.2, release.set).start()
    assert worker.close(timeout=10)  # waited for the running job
    assert running.result() == "done" and queued.cancelled()
    with pytest.raises(CancelledError):
        worker.call(lambda: "never")
    assert list(worker.stream(lambda: iter(range(3)))) == []


def test_the_calibrated_reliability_seeds_the_policy_and_nonsense_is_ignored(tmp_path):
    heads = random_heads(tiny_model("llama"))
    reliability = [[round(0.1 * (i % 3), 1) for i in range(10)] for _ in range(heads.num_heads)]
    data = {"paths": [[0]], "calibration": {"top1": [0.3] * heads.num_heads, "reliability": reliability}}
    file = tmp_path / "preset.json"
    file.write_text(json.dumps(data))
    drafter = auto_drafter("medusa", heads, lambda: MODERATE, load_preset(str(file)), trained=True)
    assert torch.allclose(drafter.policy.calibration, torch.tensor(reliability))
    data["calibration"]["reliability"] = [[2.0] * 10] * heads.num_heads  # not a probability
    file.write_text(json.dumps(data))
    drafter = auto_drafter("medusa", heads, lambda: MODERATE, load_preset(str(file)), trained=True)
    assert torch.equal(drafter.policy.calibration, prior_reliability(heads.num_heads))


def test_a_new_reply_forgets_what_the_lookup_matched_but_not_the_heads():
    drafter = auto_drafter("lookup", None, lambda: MODERATE, load_preset("cpu-8"), trained=False)
    p = drafter.policy
    history = [1, 2, 3, 4, 1, 2, 3]
    root, hidden = torch.tensor(4), torch.zeros(8)
    draft = drafter.propose(hidden, root, history)
    drafter.observe(draft, [4, 1, 2, 3, 5], 0.01)  # the lookup's continuation matched four tokens
    prior = Policy(lambda: MODERATE, None).reach(CONTEXT_KEY, CONTEXT_DEPTH)
    matched = p.reach(CONTEXT_KEY, CONTEXT_DEPTH)
    assert matched > prior
    drafter.propose(hidden, torch.tensor(5), [*history, 4, 1, 2, 3, 5])  # the same reply goes on
    assert p.reach(CONTEXT_KEY, CONTEXT_DEPTH) == matched
    drafter.propose(hidden, root, [9, 8, 7])  # another prompt: a new reply
    assert p.reach(CONTEXT_KEY, CONTEXT_DEPTH) == prior and CONTEXT_KEY not in p.realized


def test_the_array_search_picks_the_option_every_pair_priced_alone_picks(monkeypatch):
    import numpy as np

    from core.drafters import estimates

    monkeypatch.setattr(estimates, "SMALL_GRID", 0)  # every grid in arrays

    gen = np.random.default_rng(0)
    for trial in range(400):
        gain = np.cumsum(gen.random(gen.integers(0, 33)) * gen.choice([0.1, 1.0])).tolist()
        lookup_nodes = sorted(gen.integers(1, 20, gen.integers(0, 9)).tolist())
        reaches = np.cumsum(gen.random(len(lookup_nodes))).tolist()
        # a staircase with noise: some larger trees measured cheaper than smaller ones
        steps = 1.0 + np.floor(np.arange(80) / gen.integers(1, 9)) * gen.random() + gen.random(80) * 0.05
        table = np.round(steps, int(gen.integers(1, 4)))  # rounded: ties between options
        heads_ms = float(gen.choice([0.0, 0.2, 1.5]))
        for heads_only, sunk in itertools.product((False, True), repeat=2):
            args = (gain, lookup_nodes, reaches, table, heads_ms, heads_only, sunk)
            assert estimates.best_option(*args) == estimates._best_in_turn(*args), (trial, heads_only, sunk)


def _greedy_order_pushing_every_child(accuracy, budget):
    """Medusa §3.3.3's greedy tree as first written: each joined path pushes all its children."""
    import heapq

    k_heads, ranks = accuracy.shape
    acc = accuracy.tolist()
    frontier = [(-acc[0][r], (r,)) for r in range(ranks) if acc[0][r] > 0]
    heapq.heapify(frontier)
    paths, gains = [], []
    while frontier and len(paths) < budget:
        neg, path = heapq.heappop(frontier)
        paths.append(path)
        gains.append((gains[-1] if gains else 0.0) - neg)
        if len(path) < k_heads:
            for r in range(ranks):
                if acc[len(path)][r] > 0:
                    heapq.heappush(frontier, (neg * acc[len(path)][r], (*path, r)))
    return paths, gains


def test_the_greedy_tree_offering_children_in_turn_joins_the_same_paths_in_the_same_order():
    from core.drafters.estimates import greedy_order

    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        heads, ranks = int(torch.randint(1, 6, (1,), generator=gen)), int(torch.randint(1, 11, (1,), generator=gen))
        acc = torch.rand(heads, ranks, generator=gen)
        if trial % 3 == 0:  # coarse values: many ties, some exactly 0 or 1
            acc = (acc * 4).round() / 4
        elif trial % 3 == 1:
            acc = acc * (torch.rand(heads, ranks, generator=gen) > 0.3)
        for budget in (1, 5, 32, 64):
            assert greedy_order(acc, budget) == _greedy_order_pushing_every_child(acc, budget), (trial, budget)
