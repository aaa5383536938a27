"""Calibration: greedy trees from accuracies, and a replay that predicts real decoding exactly."""

import torch

from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.decode.tree import build_tree, load_tree
from core.drafters.fixed import LookupDrafter, MedusaDrafter
from core.train import calibrate as cal
from tests.helpers import plain_tokens, tiny_backend
from tests.test_engine import PROMPT, random_heads


def test_greedy_tree_adds_the_node_with_the_highest_path_accuracy():
    acc = torch.tensor([[0.6, 0.2, 0.08], [0.5, 0.1, 0.05]])
    assert cal.greedy_tree(acc, 1) == [[0]]
    assert cal.greedy_tree(acc, 3) == [[0], [0, 0], [1]]  # 0.6, 0.6·0.5 = 0.3, then 0.2
    assert cal.greedy_tree(acc, 5) == [[0], [0, 0], [1], [1, 0], [2]]  # then 0.2·0.5 = 0.1 before 0.08
    tree = cal.greedy_tree(acc, 12)
    assert len(tree) == 12 and all(len(p) == 1 or p[:-1] in tree for p in tree)
    build_tree(tree)  # a valid tree
    assert abs(cal.expected_accept(acc, [[0], [0, 0], [1]]) - (0.6 + 0.3 + 0.2)) < 1e-6


def test_greedy_tree_is_optimal_for_small_budgets():
    """Against brute force over every valid tree of that size (acceptance is monotone on paths)."""
    from itertools import combinations

    acc = torch.tensor([[0.5, 0.3, 0.15], [0.4, 0.25, 0.1], [0.3, 0.2, 0.1]])
    nodes = [(a,) for a in range(3)] + [(a, b) for a in range(3) for b in range(3)]
    nodes += [(a, b, c) for a in range(2) for b in range(2) for c in range(2)]
    for budget in (2, 4, 6):
        best = max(
            cal.expected_accept(acc, [list(p) for p in subset])
            for subset in combinations(nodes, budget)
            if all(len(p) == 1 or p[:-1] in subset for p in subset)
        )
        got = cal.expected_accept(acc, cal.greedy_tree(acc, budget))
        assert abs(got - best) < 1e-9


def test_replay_predicts_the_steps_of_real_greedy_decoding():
    backend = tiny_backend("llama")
    model = backend.model
    n = 48
    reply = plain_tokens(backend, PROMPT, n)
    heads = random_heads(model)
    ids = PROMPT + reply
    r = cal.reply_positions(ids, len(PROMPT), *cal.head_candidates(model, heads, ids, len(PROMPT), 10))
    paths = [list(p) for p in load_tree("cpu-16")[1].paths]
    for branches, length in [(0, 0), (2, 4)]:
        look = cal.lookup_accepts(r, branches, length) if branches else ([0] * n, [0] * n)
        predicted = cal.replay([r], [cal.medusa_accepts(r, paths)], [look], len(paths) + 1)
        medusa = MedusaDrafter(heads, build_tree(paths))
        drafter = LookupDrafter(medusa, branches, length) if branches else medusa
        events, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=n), drafter))
        assert list(done.token_ids) == reply
        assert predicted.tokens_per_step == done.tokens_per_step
        sizes = [e.tree_size for e in events[1:]]
        assert predicted.mean_nodes >= sum(sizes) / len(sizes)  # an upper bound: shared nodes merge
    assert done.tokens_per_step > 1.2  # something was accepted, so the comparison means something


def test_interpolated_latency():
    ms = {1: 10.0, 5: 14.0, 9: 22.0}
    assert cal.interpolate(ms, 1) == 10 and cal.interpolate(ms, 3) == 12 and cal.interpolate(ms, 7) == 18
    assert cal.interpolate(ms, 11) == 25  # extrapolates the mean slope, (22 - 10) / (9 - 1) a node


def test_reliability_is_the_hit_rate_of_each_probability_bin():
    # one head, two ranks: candidates at p 0.95 right 3 times in 4, candidates at p 0.05 never
    probs = torch.tensor([[[0.95, 0.05]]] * 4)
    match = torch.tensor([[[True, False]], [[True, False]], [[True, False]], [[False, False]]])
    reply = cal.Reply([1, 2, 3], 1, match, probs)
    rel = cal.reliability([reply], prior=0.0)
    assert rel.shape == (1, cal.BINS)
    assert rel[0, 9].item() == 0.75 and rel[0, 0].item() == 0.0
    steadied = cal.reliability([reply], prior=4.0)  # 4 pseudo-candidates at the middle of the bin
    assert abs(steadied[0, 9].item() - (3 + 4 * 0.95) / 8) < 1e-6
    assert abs(steadied[0, 5].item() - 0.55) < 1e-6  # an empty bin keeps its middle
