import math
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from core.decode.acceptance import (
    Acceptance,
    accept_greedy,
    accept_greedy_walk,
    accept_sampling,
    accept_typical,
    check_typical,
)
from core.decode.sampling import apply_top_k, apply_top_p, probabilities
from core.decode.settings import DecodeSettings
from core.decode.tree import TreeBuffers, build_tree
from core.errors import UserError
from tests.stats import chi_square_p_value

V = 8
# root 0; [0]→1, [1]→2, [0,0]→3, [0,1]→4, [1,0]→5
TREE = build_tree([[0], [1], [0, 0], [0, 1], [1, 0]])
TOKENS = torch.tensor([5, 3, 4, 1, 2, 6])


def argmax_logits(argmaxes: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


def prob_logits(rows: list[dict[int, float]]) -> torch.Tensor:
    """Logits whose softmax puts the given mass on the given tokens, the rest spread evenly."""
    out = []
    for row in rows:
        rest = (1 - sum(row.values())) / (V - len(row))
        out.append(torch.tensor([math.log(row.get(t, rest)) for t in range(V)]))
    return torch.stack(out)


# -- greedy ----------------------------------------------------------------------------------


def test_greedy_takes_the_path_matching_the_argmax_chain():
    # root argmax 4 → node 2; node 2 argmax 6 → node 5; node 5 argmax 7 → next token
    logits = argmax_logits([4, 0, 6, 0, 0, 7])
    result = accept_greedy(logits, TOKENS, TREE)
    assert result.path.tolist() == [0, 2, 5] and int(result.next_token) == 7
    assert result.accepted == 2


def test_greedy_with_no_match_emits_the_roots_argmax():
    result = accept_greedy(argmax_logits([7, 1, 1, 1, 1, 1]), TOKENS, TREE)
    assert result.path.tolist() == [0] and int(result.next_token) == 7


def test_greedy_stops_where_the_chain_breaks():
    # root → node 1 (token 3) matches; node 1's argmax 5 matches no child (tokens 1, 2)
    result = accept_greedy(argmax_logits([3, 5, 0, 0, 0, 0]), TOKENS, TREE)
    assert result.path.tolist() == [0, 1] and int(result.next_token) == 5


class CountedRows:
    """Logits that note which rows were read."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits, self.read = logits, []

    def __getitem__(self, node):
        self.read.append(int(node))
        return self.logits[node]


def test_the_greedy_walk_reads_only_the_path_and_agrees_with_greedy():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        logits = torch.randint(0, 8, (6, V), generator=gen).float()  # ties and all: argmax picks the first
        rows = CountedRows(logits)
        walked, whole = accept_greedy_walk(rows, TOKENS, TREE), accept_greedy(logits, TOKENS, TREE)
        assert walked.path.tolist() == whole.path.tolist() and int(walked.next_token) == int(whole.next_token)
        assert rows.read == walked.path.tolist()  # one row per node on the path, nothing else


# -- typical ---------------------------------------------------------------------------------

ROWS = {
    0: {3: 0.5, 4: 0.3},  # root: both children pass ε = 0.09
    1: {1: 0.05, 2: 0.04},  # node 1: its children are too unlikely
    2: {6: 0.6},  # node 2: its child passes
    5: {7: 0.9},
}


def typical(rows: dict, epsilon=0.09, delta=0.3, temperature=1.0) -> Acceptance:
    logits = prob_logits([rows.get(i, {0: 0.9}) for i in range(TREE.size)])
    return accept_typical(logits, TOKENS, TREE, temperature, epsilon, delta)


def test_typical_takes_the_longest_accepted_prefix_not_the_likeliest_first_token():
    result = typical(ROWS)
    assert result.path.tolist() == [0, 2, 5]
    assert int(result.next_token) == 7  # the next token is the backbone's greedy choice


def test_typical_breaks_ties_by_summed_log_probability():
    rows = {**ROWS, 1: {1: 0.5}}  # now [0,0] (0.5·0.5) and [1,0] (0.3·0.6) both pass at depth 2
    assert typical(rows).path.tolist() == [0, 1, 3]
    rows = {**ROWS, 1: {1: 0.3}}  # 0.5·0.3 = 0.15 < 0.18
    assert typical(rows).path.tolist() == [0, 2, 5]


def test_typical_threshold_follows_entropy():
    one = build_tree([[0]])  # a single drafted token 3 under the root

    def accepted(root_row: dict[int, float], epsilon=0.09, delta=0.3) -> bool:
        logits = prob_logits([root_row, {0: 0.9}])
        return accept_typical(logits, torch.tensor([5, 3]), one, 1.0, epsilon, delta).accepted == 1

    # p = 0.06 < ε: rejected under a peaked distribution (threshold min(ε, δe^-H) = ε) ...
    assert not accepted({3: 0.06, 0: 0.9})
    # ... accepted under a flat one (the other 7 tokens share 0.94: H ≈ 2.06, δe^-H ≈ 0.038)
    assert accepted({3: 0.06})
    # ε caps the threshold: δ = 1 on that flat distribution gives δe^-H ≈ 0.13 > 0.06
    assert not accepted({3: 0.06}, epsilon=1.0, delta=1.0)
    assert accepted({3: 0.06}, epsilon=0.05, delta=1.0)


def test_typical_at_temperature_zero_is_greedy():
    gen = torch.Generator().manual_seed(0)
    tree = build_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    for _ in range(200):
        logits = torch.randn(tree.size, 4, generator=gen)
        tokens = torch.randint(0, 4, (tree.size,), generator=gen)
        tokens[1:4] = torch.randperm(4, generator=gen)[:3]  # siblings distinct
        tokens[4:6] = torch.randperm(4, generator=gen)[:2]
        greedy = accept_greedy(logits, tokens, tree)
        typ = accept_typical(logits, tokens, tree, 0.0, 0.09, 0.3)
        assert typ.path.tolist() == greedy.path.tolist()
        assert int(typ.next_token) == int(greedy.next_token)


@pytest.mark.parametrize(("epsilon", "delta"), [(0, 0.3), (1.5, 0.3), (0.09, 0), (0.09, -1), (0.09, 2)])
def test_typical_thresholds_out_of_range_are_refused(epsilon, delta):
    with pytest.raises(UserError, match=r"must be in \(0, 1\]"):
        check_typical(epsilon, delta)
    with pytest.raises(UserError):
        DecodeSettings(acceptance="typical", epsilon=epsilon, delta=delta)


# -- lossless sampling -----------------------------------------------------------------------

# root (token 9, irrelevant) with children tokens 0 ([0]) and 1 ([1]); [0] has child token 2.
SMALL = build_tree([[0], [1], [0, 0]])
SMALL_TOKENS = torch.tensor([3, 0, 1, 2])
P = torch.tensor(
    [
        [0.3, 0.2, 0.1, 0.4],  # at the root
        [0.1, 0.2, 0.5, 0.2],  # after token 0
        [0.25, 0.25, 0.25, 0.25],  # after token 1
        [0.7, 0.1, 0.1, 0.1],  # after tokens 0, 2
    ]
)


def exact_distribution() -> dict[tuple[int, ...], float]:
    """The backbone's probability of each sequence the walk can emit in one step."""
    p0, p1, p2, p3 = P.tolist()
    out = {(y,): p0[y] for y in (2, 3)}
    out |= {(0, y): p0[0] * p1[y] for y in (0, 1, 3)}
    out |= {(0, 2, y): p0[0] * p1[2] * p3[y] for y in range(4)}
    out |= {(1, y): p0[1] * p2[y] for y in range(4)}
    return out


def emitted(result: Acceptance, tokens: torch.Tensor) -> tuple[int, ...]:
    return (*tokens[result.path[1:]].tolist(), int(result.next_token))


def biased_walk(logits, tokens, tree, to_probs, generator) -> Acceptance:
    """A plausible-looking bug: take a drafted child outright when the model likes it enough."""
    node = 0
    while True:
        probs = to_probs(logits[node])
        kids = [int(k) for k in tree.children[node] if k >= 0]
        likely = [k for k in kids if probs[tokens[k]] > 0.25]
        if not likely:
            y = torch.multinomial(probs, 1, generator=generator)[0]
            hit = [k for k in kids if int(tokens[k]) == int(y)]
            if not hit:
                return Acceptance(tree.path_to(node), y)
            node = hit[0]
        else:
            node = likely[0]


def sample_counts(walk, n: int, seed: int) -> Counter:
    gen = torch.Generator().manual_seed(seed)
    logits = P.log()
    to_probs = lambda x: probabilities(x, temperature=1.0)  # noqa: E731
    return Counter(emitted(walk(logits, SMALL_TOKENS, SMALL, to_probs, gen), SMALL_TOKENS) for _ in range(n))


def test_lossless_sampling_matches_the_backbone_distribution():
    n = 20_000
    p_value = chi_square_p_value(sample_counts(accept_sampling, n, seed=1), exact_distribution(), n)
    assert p_value > 1e-3


def test_the_statistical_test_catches_a_biased_walk():
    n = 20_000
    p_value = chi_square_p_value(sample_counts(biased_walk, n, seed=1), exact_distribution(), n)
    assert p_value < 1e-6


# -- sampling warpers ------------------------------------------------------------------------


@pytest.mark.parametrize("top_p", [0.3, 0.8, 0.95])
def test_top_p_matches_transformers(top_p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    ours = apply_top_p(logits, top_p)
    theirs = TopPLogitsWarper(top_p)(None, logits.clone())
    assert torch.equal(ours.isinf(), theirs.isinf())


@pytest.mark.parametrize("scale", [12.0, 4.0, 0.3])  # a peaked, a broader and an almost flat distribution
def test_top_p_over_a_model_sized_vocabulary_matches_transformers(scale):
    """The nucleus found among the most likely tokens first (and, where it is wider, by a sort)."""
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(5)) * scale
    for top_p in (0.5, 0.9, 0.99):
        ours = apply_top_p(logits, top_p)
        theirs = TopPLogitsWarper(top_p)(None, logits.clone())
        assert torch.equal(ours.isinf(), theirs.isinf()), top_p
        assert torch.equal(ours[~ours.isinf()], logits[~ours.isinf()])


def test_top_k_matches_transformers():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(4))
    assert torch.equal(apply_top_k(logits, 5).isinf(), TopKLogitsWarper(5)(None, logits.clone()).isinf())


def test_greedy_tree_type_is_frozen():
    assert isinstance(TREE, TreeBuffers)
    with pytest.raises(AttributeError):
        TREE.top_k = 3
