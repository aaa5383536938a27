"""Retrieval drafting: the suffix index against brute force, the continuations it drafts, the
corpus file, exactness with it in the tree, the policy's use of its evidence, and train-drafter."""

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.decode.tree import build_tree, load_tree
from core.drafters.auto import AutoDrafter
from core.drafters.fixed import LookupDrafter, MedusaDrafter
from core.drafters.policy import RETRIEVAL_PRIOR, CostCurve, Policy
from core.drafters.retrieval import MAX_MATCH, MIN_MATCH, Corpus, SuffixIndex, evidence, load_corpus, save_corpus
from core.errors import UserError
from tests.helpers import plain_tokens, three_token_p_value, tiny_backend
from tests.test_engine import PROMPT, random_heads

MODERATE = CostCurve({1: 10.0, 2: 10.5, 4: 11.0, 8: 14.0, 16: 20.0, 32: 32.0, 64: 60.0}, 2.0)
FLAT = CostCurve({1: 0.1, 64: 0.1}, 0.01)  # a tiny model's steps cost alike whatever the tree


def brute_longest(docs, history):
    """The longest suffix (MIN_MATCH…MAX_MATCH) of history in docs, and where the token after each
    of its occurrences lies, as (doc, offset)."""
    best, where = 0, set()
    for m in range(MIN_MATCH, min(MAX_MATCH, len(history)) + 1):
        q = list(history[-m:])
        hits = {(d, i + m) for d, doc in enumerate(docs) for i in range(len(doc) - m + 1) if doc[i : i + m] == q}
        if not hits:
            break
        best, where = m, hits
    return best, where


@pytest.mark.parametrize("vocab", [2, 3, 7])
def test_index_finds_the_longest_suffix_and_every_occurrence(vocab):
    rng = random.Random(vocab)
    docs = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(12)]
    index = SuffixIndex(docs)
    starts = [0]
    for doc in docs:
        starts.append(starts[-1] + len(doc) + 1)  # documents lie one after another, a separator after each
    assert len(index) == sum(map(len, docs)) and index.documents == len(docs)
    for _ in range(200):
        history = [rng.randrange(vocab) for _ in range(rng.randrange(1, 25))]
        m, after = index.occurrences(history)
        expected, where = brute_longest(docs, history)
        assert m == expected
        assert sorted(after) == sorted(starts[d] + i for d, i in where)


def test_continuations_follow_the_most_frequent_tokens():
    corpus = Corpus(SuffixIndex([[9, 1, 2, 3, 4], [1, 2, 3, 4, 7], [8, 1, 2, 3, 5], [1, 2, 6]]))
    found, strength = corpus.continuations([5, 1, 2], branches=2, length=8)
    # after "1 2": 3 three times (then 4 twice, 5 once), 6 once; a document's end stops a path
    assert found == [[3, 4, 7], [6]]
    assert strength == evidence(3 / 4, 3) == 4
    assert corpus.continuations([5, 1, 2], branches=1, length=2)[0] == [[3, 4]]
    assert corpus.continuations([4, 4], branches=2, length=8) == ([], 0)  # nothing found: no draft
    assert corpus.continuations([2], branches=2, length=8) == ([], 0)  # one token is not a match
    assert [evidence(s, n) for s, n in [(0.1, 9), (0.3, 9), (0.6, 9), (0.9, 2), (0.9, 3)]] == [0, 1, 2, 3, 4]


def test_added_replies_are_found_and_merged_into_the_base():
    corpus = Corpus(SuffixIndex([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]))
    corpus.add([[20, 21, 22, 23]])
    assert corpus.continuations([20, 21], 1, 4)[0] == [[22, 23]]
    assert len(corpus.base) == 10 and len(corpus.recent) == 4  # the shipped index was not rebuilt
    corpus.add([[30, 31, 32, 33, 34, 35, 36]])  # the user's replies now outweigh the base: one index again
    assert len(corpus.base) == 21 and len(corpus.recent) == 0
    assert corpus.continuations([31, 32], 1, 4)[0] == [[33, 34, 35, 36]]
    assert corpus.continuations([1, 2], 1, 2)[0] == [[3, 4]]


def test_corpus_file_round_trip_and_damage(tmp_path):
    file = tmp_path / "replies.safetensors"
    docs = [[1, 2, 3], [4, 5], [1, 2, 7]]
    save_corpus(file, docs, "tiny", vocab_size=10, hit_rates=[0.1, None, 0.5])
    corpus = load_corpus(file, vocab_size=10)
    assert len(corpus) == 8 and corpus.continuations([1, 2], 2, 4)[0] == [[3], [7]]
    assert corpus.hit_rates == (0.1, None, 0.5)  # the policy starts from these, its own priors elsewhere
    policy = Policy(lambda: MODERATE, None, use_retrieval=True, retrieval_prior=corpus.hit_rates)
    starts = [float(policy.hazard(("retrieval", k))[0]) for k in range(5)]
    assert starts == pytest.approx([0.1, RETRIEVAL_PRIOR[1], 0.5, *RETRIEVAL_PRIOR[3:]])
    with pytest.raises(UserError, match="another model"):
        load_corpus(file, vocab_size=11)
    save_corpus(file, [[1, 2, 30]], "tiny", vocab_size=10)  # a token past the vocabulary
    with pytest.raises(UserError, match="damaged"):
        load_corpus(file, vocab_size=10)
    save_corpus(file, docs, "tiny", vocab_size=10)
    file.write_bytes(file.read_bytes()[:-5])
    with pytest.raises(UserError, match="cannot be read"):
        load_corpus(file, vocab_size=10)


def own_replies(backend, n=60, noise=0.3, seed=0):
    """The model's own greedy reply to PROMPT, and copies of it with tokens changed at random."""
    reply = plain_tokens(backend, PROMPT, n)
    rng = random.Random(seed)
    vocab = backend.model.config.vocab_size
    noisy = [[t if rng.random() > noise else rng.randrange(vocab) for t in reply] for _ in range(3)]
    return reply, Corpus(SuffixIndex([*noisy, reply[: n // 2]]))


@pytest.mark.parametrize("hybrid", [False, True])
def test_greedy_with_retrieval_equals_plain_greedy(hybrid):
    backend = tiny_backend("llama")
    reference, corpus = own_replies(backend)
    base = MedusaDrafter(random_heads(backend.model), load_tree("cpu-8")[1]) if hybrid else None
    drafter = LookupDrafter(base, branches=2, length=6, corpus=corpus, context=hybrid)
    events, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=60), drafter))
    assert list(done.token_ids) == reference
    assert sum(s == "retrieval" for e in events for s in e.sources) > 5  # retrieved drafts were accepted


@pytest.mark.parametrize("context", [False, True])
def test_greedy_is_exact_with_the_policy_drafting_from_retrieval(context):
    backend = tiny_backend("llama")
    reference, corpus = own_replies(backend)
    policy = Policy(lambda: FLAT, None, use_heads=False, use_lookup=context, use_retrieval=True)
    drafter = AutoDrafter(None, policy, branches=1, length=4, corpus=corpus)
    events, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=60), drafter))
    assert list(done.token_ids) == reference
    assert sum(s == "retrieval" for e in events for s in e.sources) > 5
    assert any("retrieval nodes" in e.choice for e in events[1:])
    if context:  # where the two lookups disagree on the next token, one tree carries both
        both = [e for e in events if {"context", "retrieval"} <= set(e.node_sources)]
        assert both and all("context+retrieval nodes" in e.choice for e in both)


def test_two_lookups_that_disagree_add_up_their_chances():
    policy = Policy(lambda: MODERATE, None, use_heads=False, use_lookup=True, use_retrieval=True)
    context, retrieval = ("context", 0), ("retrieval", 2)
    policy.hazard(context)[:] = torch.tensor([0.6, 0.5] + [0.4] * 14)
    policy.hazard(retrieval)[:] = 0.3
    for k in range(1, 5):
        survival = [min(1.0, 0.6 * 0.5 ** min(i, 1) * 0.4 ** max(i - 1, 0) + 0.3 ** (i + 1)) for i in range(k)]
        assert policy.reach((context, retrieval), k) == pytest.approx(sum(survival))
    assert policy.reach((context, retrieval), 4) > max(policy.reach(context, 4), policy.reach(retrieval, 4))


def test_lossless_sampling_distribution_with_retrieval():
    vocab = 6
    backend = tiny_backend("llama", vocab=vocab, seed=2)
    rng = random.Random(3)
    corpus = Corpus(SuffixIndex([[rng.randrange(vocab) for _ in range(30)] for _ in range(20)]))
    heads = random_heads(backend.model, num_heads=2, seed=5)
    drafter = LookupDrafter(MedusaDrafter(heads, build_tree([[0], [1]])), 2, 3, corpus=corpus, context=False)
    kinds = Counter()
    p_value = three_token_p_value(
        backend, [1, 4, 2], vocab, drafter, on_events=lambda ev: kinds.update(s for e in ev for s in e.node_sources)
    )
    assert kinds["retrieval"] > 100
    assert p_value > 1e-3


def test_policy_drafts_retrieval_only_where_the_corpus_backs_it():
    policy = Policy(lambda: MODERATE, None, use_heads=False, use_lookup=True, use_retrieval=True)
    four = [1, 2, 3, 4]  # a chain: its nodes when cut to 1…4 tokens
    assert policy.choose(four, ("retrieval", 4)).lookup  # a phrase that always goes on alike
    assert policy.choose(four, ("retrieval", 4)).source == "retrieval"
    assert policy.choose(four, ("retrieval", 0)).plain  # one that goes on many ways
    for _ in range(30):  # strongly backed continuations turn out wrong in this text
        c = policy.choose(four, ("retrieval", 4))
        policy.observe(c, None, [9], [], c.expected_ms / 1000, retrieved=[[1, 2, 3, 4]], evidence=4)
    assert policy.choose(four, ("retrieval", 4)).plain
    assert Policy(lambda: MODERATE, None, use_heads=False).choose(four, ("retrieval", 4)).plain  # not enabled


def test_train_drafter_cli_writes_a_corpus_and_its_card(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = ["Say hi.", "Name a fruit.", "Count to 3.", "Name a color.", "Say bye."]
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in lines))
    out = tmp_path / "replies.safetensors"
    args = ["--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "16", "--held-out", "0.4"]
    run = subprocess.run([sys.executable, "-m", "app.main", "train-drafter", *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""  # progress and the summary go to stderr
    card = json.loads(out.with_suffix(".json").read_text())
    assert card["replies"] == 5 and card["held_out"]["replies"] == 2
    assert set(card["held_out"]["tokens_per_step"]) == {"context", "retrieval", "context+retrieval"}
    assert "lookup" in out.with_suffix(".md").read_text().lower()
    corpus = load_corpus(out, vocab_size=49152)
    assert len(corpus) == card["tokens"] > 0
    bad = subprocess.run(
        [sys.executable, "-m", "app.main", "train-drafter", *args[:3], "x.bin"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "safetensors" in bad.stderr


def test_shipped_corpus_loads_for_the_embedded_model():
    from importlib import resources

    from models.embedded import EMBEDDED_ID

    file = Path(str(resources.files("assets") / "retrieval" / f"{EMBEDDED_ID}.safetensors"))
    corpus = load_corpus(file, vocab_size=49152)
    assert len(corpus) > 100_000 and corpus.base.documents > 1000
    assert torch.tensor(corpus.base.ids).max() < 49152


@pytest.mark.embedded
def test_engine_drafts_from_saved_chats_and_its_own_replies_unless_opted_out():
    from app.engine import Engine, ReplyRequest
    from core.decode.generate import Finished
    from models.embedded import EMBEDDED_ID

    saved = "Zebra lanterns hum quietly over the violet harbour."
    engines = {}
    for learn in (True, False):
        engine = Engine(EMBEDDED_ID, dtype="float32", past_replies=(lambda: [saved, " "]) if learn else None)
        engine.load(EMBEDDED_ID)
        for _ in range(3):  # the saved chats are indexed in jobs at idle moments: let them run
            engine.compute.call(lambda: None)
        engines[learn] = engine
    corpus = engines[True].loaded.corpus
    saved_ids = engines[True].loaded.backbone.tokenizer.encode(saved, add_special_tokens=False)
    assert corpus.own == [saved_ids]  # the blank reply skipped
    assert corpus.continuations(saved_ids[:3], 1, 4)[0] == [saved_ids[3:7]]
    assert not engines[False].loaded.corpus.own
    for learn, engine in engines.items():
        request = ReplyRequest([{"role": "user", "content": "Name three colors."}], DecodeSettings(max_new_tokens=12))
        *_, done = engine.reply(request).events
        assert isinstance(done, Finished)
        own = engine.loaded.corpus.own
        assert (own[-1] == list(done.token_ids)) if learn else not own  # this session's reply joins the index
        engine.close()
