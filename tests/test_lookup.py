"""Context lookup and per-step merged trees: index vs brute force, graft vs definitions, exactness."""

import random
from collections import Counter

import pytest
import torch

from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.decode.tree import BOTH, CONTEXT, HEADS, ROOT, build_tree, graft, load_tree
from core.drafters.fixed import LookupDrafter, MedusaDrafter
from core.drafters.lookup import NgramIndex
from tests.helpers import (
    ARCHS,
    brute_force_continuations,
    plain_tokens,
    three_token_p_value,
    tiny_backend,
)
from tests.test_engine import PROMPT, random_heads


@pytest.mark.parametrize("vocab", [3, 8, 50])
def test_incremental_index_agrees_with_brute_force_after_every_step(vocab):
    rng = random.Random(vocab)
    index = NgramIndex(max_ngram=4)
    ids: list[int] = []
    for _ in range(120):
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]  # steps commit 1–5 tokens
        ids += new
        index.sync(ids)
        for count, length in [(1, 4), (3, 2), (5, 6)]:
            assert index.continuations(count, length) == brute_force_continuations(ids, 4, count, length)
    assert len(index) == len(ids)


def test_index_work_is_proportional_to_new_tokens_and_rebuilds_on_a_new_history():
    index = NgramIndex(max_ngram=3)
    index.sync([1, 2, 3, 1, 2])
    assert index.continuations(2, 3) == [[3, 1, 2]]
    entries = sum(map(len, index._ends.values()))
    index.sync([1, 2, 3, 1, 2, 3])
    assert sum(map(len, index._ends.values())) == entries + 3  # one n-gram per n for the new token
    index.sync([7, 7])  # a different conversation: start over
    assert index.ids == [7, 7] and index.continuations(2, 2) == [[7]]


def _node_paths(tokens: list[int], parent: list[int]) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, len(tokens)):
        paths.append((*paths[parent[i]], tokens[i]))
    return paths


@pytest.mark.parametrize("seed", range(6))
def test_merged_tree_buffers_equal_those_defined_by_the_same_paths(seed):
    """Graft lookup branches onto a Medusa tree; compare every buffer with the definitions."""
    rng = random.Random(seed)
    base = load_tree(["cpu-8", "cpu-16", "mc_sim_7b_63"][seed % 3])[1]
    vocab = 6  # small: branches often run into head nodes
    tokens = [rng.randrange(vocab)]
    for d, r in zip(base.depth[1:].tolist(), base.rank[1:].tolist(), strict=True):
        tokens.append((r + 7 * d) % 40)  # siblings distinct, as heads' top-k are
    branches = [[rng.randrange(40) if rng.random() < 0.5 else tokens[1 + i] for i in range(rng.randint(1, 5))]]
    branches += [[rng.randrange(vocab) for _ in range(rng.randint(1, 5))] for _ in range(3)]
    merged, tree, sources = graft(base, tokens, branches)

    paths = _node_paths(merged, tree.parent.tolist())
    t = len(merged)
    assert len(set(paths)) == t  # no duplicate token path: siblings are distinct
    for branch in branches:  # every branch is in the tree
        assert tuple(branch) in paths
    base_paths = set(_node_paths(tokens, base.parent.tolist()))
    for i, p in enumerate(paths):
        from_branch = any(tuple(b[: len(p)]) == p for b in branches) and p != ()
        expected = ROOT if i == 0 else (BOTH if from_branch else HEADS) if p in base_paths else CONTEXT
        assert sources[i] == expected
    assert tree.depth.tolist() == [len(p) for p in paths]
    assert tree.parent.tolist() == [0] + [paths.index(p[:-1]) for p in paths[1:]]
    visible = [[paths[i][: len(paths[j])] == paths[j] for j in range(t)] for i in range(t)]
    assert tree.visible.tolist() == visible
    kids = [[j for j in range(1, t) if paths[j][:-1] == paths[i]] for i in range(t)]
    assert [[c for c in row if c >= 0] for row in tree.children.tolist()] == kids
    assert (tree.size, tree.max_depth) == (t, max(map(len, paths)))
    mask = tree.attention_mask(5, torch.float32)[0, 0]
    assert (mask[:, :5] == 0).all() and torch.equal(mask[:, 5:] == 0, torch.tensor(visible))
    assert graft(base, tokens, [])[1] is base  # nothing to add: the cached base buffers


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["lookup", "hybrid"])
def test_greedy_with_lookup_equals_plain_greedy(arch, mode):
    backend = tiny_backend(arch)
    reference = plain_tokens(backend, PROMPT, 60)
    base = MedusaDrafter(random_heads(backend.model), load_tree("cpu-16")[1]) if mode == "hybrid" else None
    drafter = LookupDrafter(base, branches=3, length=5)
    events, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=60), drafter))
    assert list(done.token_ids) == reference
    from_context = [s for e in events for s in e.sources if s in ("context", "both")]
    assert from_context  # tiny random models repeat themselves: lookups were accepted
    assert all(len(e.sources) == e.accepted for e in events)


def test_lossless_sampling_distribution_with_hybrid():
    """Chi-square of three sampled tokens against exact probabilities, with both sources
    proposing (often the same tokens: a 6-token vocabulary)."""
    vocab = 6
    backend = tiny_backend("llama", vocab=vocab, seed=2)
    prompt = [1, 4, 2, 1, 4]
    heads = random_heads(backend.model, num_heads=2, seed=5)
    drafter = LookupDrafter(MedusaDrafter(heads, build_tree([[0], [1], [0, 0], [1, 0]])), branches=2, length=3)
    kinds = Counter()

    def count(events) -> None:
        kinds.update(s for e in events for s in e.sources)
        kinds.update("proposed-" + s for e in events for s in e.node_sources)

    p_value = three_token_p_value(backend, prompt, vocab, drafter, on_events=count)
    assert kinds["context"] > 100 and kinds["heads"] > 100 and kinds["proposed-both"] > 100
    assert p_value > 1e-3
