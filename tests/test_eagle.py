"""The EAGLE drafter: training passes that see what drafting sees, and exact decoding (its files and
published checkpoints: test_eagle_files.py)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from core.backends.torch import TorchBackend
from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.decode.tree import build_tree
from core.drafters.base import Draft
from core.drafters.eagle import EagleDraft
from core.drafters.eagle_tree import EagleDrafter, LeanDraft, _closed
from core.train import eagle as eagle_train
from tests.helpers import ARCHS, plain_tokens, three_token_p_value, tiny_backend, tiny_model
from tests.helpers import tiny_eagle_draft as _draft


def _sequence(model, n: int = 14, seed: int = 0) -> eagle_train.Sequence:
    ids = torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        features = model.base_model(input_ids=ids.view(1, -1)).last_hidden_state[0]
    return eagle_train.Sequence(ids, features.to(torch.bfloat16), 3)  # stored as training stores them


def test_cached_features_are_remade_when_the_transcripts_changed(tmp_path):
    model = tiny_model("llama")
    records = [{"prompt_ids": [1, 5, 9], "answer_ids": [20, 21]}, {"prompt_ids": [1, 4], "answer_ids": [30]}]
    first = eagle_train.features(model, records, tmp_path)
    longer = [dict(r, answer_ids=r["answer_ids"] + [40, 41]) for r in records]  # continued replies
    again = eagle_train.features(model, longer, tmp_path)
    for seq, record in zip(again, longer, strict=True):
        assert seq.ids.tolist() == record["prompt_ids"] + record["answer_ids"]
    with torch.inference_mode():
        expected = model.base_model(input_ids=torch.tensor([longer[0]["prompt_ids"] + longer[0]["answer_ids"]]))
    torch.testing.assert_close(again[0].features, expected.last_hidden_state[0].to(torch.bfloat16))
    assert len(first[0].ids) == 5


def test_a_sampled_replys_positions_learn_the_models_argmax(tmp_path):
    model = tiny_model("llama")
    records = [
        {"prompt_ids": [1, 5, 9], "answer_ids": [20, 21, 22, 23]},
        {"prompt_ids": [1, 4], "answer_ids": [30, 31]},
    ]
    greedy = eagle_train.features(model, records, tmp_path / "greedy")
    sampled = eagle_train.features(model, records, tmp_path / "sampled", targets=True)
    assert greedy[0].targets is None
    for seq, record in zip(sampled, records, strict=True):
        ids = torch.tensor([record["prompt_ids"] + record["answer_ids"]])
        with torch.inference_mode():
            argmax = model(input_ids=ids).logits[0].argmax(-1)
        assert seq.targets.tolist() == argmax.tolist()
    again = eagle_train.features(model, records, tmp_path / "sampled", targets=True)  # from the cache
    assert again[0].targets.tolist() == sampled[0].targets.tolist()
    to_draft = torch.arange(model.config.vocab_size)
    plain = eagle_train.make_batch(greedy[:1], to_draft, model.config.hidden_size)
    chosen = eagle_train.make_batch(sampled[:1], to_draft, model.config.hidden_size)
    # row t learns token t + 2: the reply's own token, or the model's argmax after position t + 1
    assert plain.token_targets[0, 1:5].tolist() == [20, 21, 22, 23]
    assert chosen.token_targets[0, 1:5].tolist() == sampled[0].targets[2:6].tolist()
    assert plain.token_targets[0, 0] == chosen.token_targets[0, 0] == -100  # the prompt is not learned


def test_pass_masks_show_each_row_the_true_rows_and_its_own_drafted_ancestors():
    masks = eagle_train.pass_mask([5], 5, 3, torch.float32)
    seen = [m[0, 0] == 0 for m in masks]
    assert seen[0].equal(torch.ones(5, 5, dtype=torch.bool).tril())
    # pass 3, row 4: true rows 0..2, pass 2's row 3, its own row 4
    row = seen[2][4]
    assert row[:5].tolist() == [True, True, True, False, False]
    assert row[5:10].tolist() == [False, False, False, True, False]
    assert row[10:].tolist() == [False, False, False, False, True]


def test_training_passes_compute_what_drafting_computes():
    """Pass k at row s + k − 1 is the draft k tokens ahead after true row s: the same number the
    drafter's own cache and tree mask give (so held-out acceptance measures real drafting)."""
    model = tiny_model("llama")
    draft = _draft(model)
    seq = _sequence(model)
    to_draft = eagle_train.to_draft_index(draft.vocab, draft.vocab_size)
    batch = eagle_train.make_batch([seq], to_draft, 64)
    with torch.inference_mode():
        outs = eagle_train.passes_forward(draft, batch, 3)
        lean = LeanDraft(copy.deepcopy(draft), torch.float32)
        cache = lean.new_cache()
        s = 6
        out = lean(seq.features[: s + 1], seq.ids[1 : s + 2], torch.arange(s + 1), None, cache)
        cache.length = s + 1
        torch.testing.assert_close(out[-1], outs[0][0, s], rtol=1e-4, atol=1e-4)
        feature = out[-1]
        for depth in (1, 2):  # the true tokens as drafted nodes, each seeing its ancestors
            mask = torch.zeros(1, 1, 1, cache.length + 1)
            feature = lean(feature.view(1, -1), seq.ids[s + depth + 1].view(1), torch.tensor([s + depth]), mask, cache)[
                0
            ]
            cache.length += 1
            torch.testing.assert_close(feature, outs[depth][0, s + depth], rtol=1e-4, atol=1e-4)


def test_drafter_offers_the_draft_layers_own_top_tokens():
    model = tiny_model("llama")
    draft = _draft(model)
    seq = _sequence(model)
    s = 6
    with torch.inference_mode():
        expected = draft.logits(eagle_train.passes_forward(
            draft, eagle_train.make_batch([seq], eagle_train.to_draft_index(draft.vocab, 96), 64), 1
        )[0][0, s]).topk(3).indices.tolist()  # fmt: skip
        drafter = EagleDrafter(copy.deepcopy(draft), torch.float32, lookup=False, budget=3)
        drafter.feed(seq.features[: s + 1], seq.ids[1 : s + 2], 0)
        proposed = drafter.propose(seq.features[s], seq.ids[s + 1], seq.ids[: s + 2].tolist())
    assert proposed.tree.size == 4 and proposed.tree.depth[1:].tolist() == [1, 1, 1]
    assert sorted(proposed.tokens[1:].tolist()) == sorted(expected)
    assert set(proposed.sources[1:]) == {5}  # core.decode.tree.EAGLE


def check_greedy_equals_plain(arch: str, make_draft, budgets: tuple[int, ...]) -> None:
    """Greedy decoding with an EAGLE drafter (`make_draft(model)`) of each node budget gives plain
    greedy decoding's tokens, its drafts verified along the way."""
    backend = tiny_backend(arch)
    model = backend.model
    prompt = [5, 17, 3, 17, 9, 5, 17]
    reference = plain_tokens(backend, prompt, 40)
    for budget in budgets:
        drafter = EagleDrafter(make_draft(model), model.dtype, budget=budget)
        events, done = collect(stream(backend, prompt, DecodeSettings(max_new_tokens=40), drafter))
        assert list(done.token_ids) == reference
        assert max(e.tree_size for e in events) > budget  # the draft's nodes were verified


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_eagle_equals_plain_greedy(arch):
    check_greedy_equals_plain(arch, _draft, (1, 6, 24))


def test_eagle_drafts_are_accepted_when_the_draft_knows_the_model():
    """A draft that is the backbone's own last layer reading out the backbone's feature would be
    right every time; a draft trained for a few steps on the model's greedy output gets accepted."""
    model = tiny_model("llama", vocab=32, seed=1)
    prompt = [3, 7, 1]
    reply = plain_tokens(TorchBackend(model), prompt, 60)
    ids = torch.tensor(prompt + reply)
    with torch.inference_mode():
        features = model.base_model(input_ids=ids.view(1, -1)).last_hidden_state[0].clone()
    seqs = [eagle_train.Sequence(ids, features, len(prompt))]
    draft = EagleDraft(model, torch.arange(32))
    draft.float()
    to_draft = eagle_train.to_draft_index(draft.vocab, 32)
    optimizer, schedule = eagle_train.optimizer_for(draft, 3e-3, 300)
    for _ in range(300):
        list(eagle_train.train_epoch(draft, optimizer, schedule, seqs, to_draft, [0], 2, 1.0, 0.8))
    result = eagle_train.evaluate(draft, seqs, to_draft, 3)
    assert result["acceptance"][0] > 0.8
    drafter = EagleDrafter(draft.eval(), model.dtype, lookup=False, budget=8)
    events, done = collect(stream(TorchBackend(model), prompt, DecodeSettings(max_new_tokens=60), drafter))
    assert list(done.token_ids) == reply
    accepted = Counter(s for e in events for s in e.sources)
    assert accepted["eagle"] > 30 and done.steps < 30


def test_lossless_sampling_distribution_with_eagle():
    vocab = 6
    model = tiny_model("llama", vocab=vocab, seed=2)
    drafter = EagleDrafter(_draft(model), model.dtype, lookup=False, budget=6, depth=3)  # 3 tokens a reply
    kinds = Counter()
    p_value = three_token_p_value(
        TorchBackend(model),
        [1, 4, 2, 1, 4],
        vocab,
        drafter,
        on_events=lambda ev: kinds.update(s for e in ev for s in e.sources),
    )
    assert kinds["eagle"] > 100
    assert p_value > 1e-3


def test_typical_acceptance_runs_with_eagle():
    model = tiny_model("llama")
    drafter = EagleDrafter(_draft(model), model.dtype, budget=8)
    settings = DecodeSettings(max_new_tokens=30, temperature=0.7, acceptance="typical")
    backend = TorchBackend(model)
    events, done = collect(stream(backend, [5, 17, 3], settings, drafter, generator=torch.Generator().manual_seed(0)))
    assert len(done.token_ids) == 30 and all(e.accepted == len(e.token_ids) - 1 for e in events[1:-1])


def test_a_new_reply_restarts_the_drafts_cache_and_a_gap_stops_drafting():
    model = tiny_model("llama")
    drafter = EagleDrafter(_draft(model), model.dtype, lookup=False, budget=4)
    seq = _sequence(model)
    drafter.feed(seq.features[:5], seq.ids[1:6], 0)
    assert drafter.propose(seq.features[4], seq.ids[5], []).tree.size == 5
    drafter.feed(seq.features[:3], seq.ids[1:4], 0)  # a new reply
    drafter.propose(seq.features[2], seq.ids[3], [])
    assert drafter.cache.length == 3
    drafter.feed(seq.features[7:9], seq.ids[8:10], 7)  # positions it never saw: no draft until a new reply
    assert drafter.propose(seq.features[8], seq.ids[9], []).tree.size == 1


# -- published checkpoints ---------------------------------------------------------------------


def test_a_small_budget_drafts_fewer_depths_and_keeps_the_same_tree(monkeypatch):
    model = tiny_model("llama")
    draft = _draft(model)
    seq = _sequence(model)
    calls = Counter()
    original = LeanDraft.__call__

    def counted(self, *args, **kwargs):
        calls[id(self)] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LeanDraft, "__call__", counted)
    peaky = lambda self, predicted: self.readout(predicted).float() * 16  # noqa: E731
    monkeypatch.setattr(LeanDraft, "logits", peaky)  # deep nodes outrank shallow ones
    kept, forwards = {}, {}
    for budget in (2, 3, 5, 8, 12, 40):
        drafter = EagleDrafter(copy.deepcopy(draft), torch.float32, lookup=False, budget=budget)
        with torch.inference_mode():
            drafter.feed(seq.features[:7], seq.ids[1:8], 0)
            drafter._flush()
            before = calls[id(drafter.lean)]
            tokens, parent, scores = drafter._grow()
        forwards[budget] = calls[id(drafter.lean)] - before
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        depth = [1 if p < 0 else 0 for p in parent]
        for n, p in enumerate(parent):
            depth[n] = depth[n] or depth[p] + 1
        kept[budget] = [(tokens[n], depth[n]) for n in _closed(order, parent, budget)]
    assert len({depth for _, depth in kept[12]}) > 2
    for budget in (2, 3, 5, 8, 12):  # the most probable closed nodes, drafted with pruning or without
        assert kept[budget] == kept[40][:budget]
    assert forwards[2] < forwards[40]


# -- the commands ----------------------------------------------------------------------------


def test_before_the_curve_is_measured_trees_are_priced_in_the_plain_steps_own_time():
    model = tiny_model("llama")
    drafter = EagleDrafter(_draft(model), model.dtype, lookup=False)
    plain = Draft(torch.tensor([1]), build_tree([]))
    for _ in range(50):
        drafter.observe(plain, [1], 0.008)  # 8 ms plain steps
    assert drafter._prior().at(1) == pytest.approx(8.0, rel=1e-3)
    assert drafter._prior().at(16) > drafter._prior().at(1)


def test_the_draft_layer_sees_a_window_of_the_last_positions():
    """Past its window the draft layer runs only the last rows of a long prompt: its first tree is
    the one a draft fed those rows alone (at their positions) makes; a reply drafted through a
    sliding window still equals plain greedy decoding; a rewind before the window restarts it."""
    model = tiny_model("llama")
    seq = _sequence(model, 20)
    with torch.inference_mode():
        windowed = EagleDrafter(_draft(model), torch.float32, lookup=False, budget=4)
        windowed.window = 4
        windowed.rewind(seq.ids[:15].tolist(), 0)  # a new reply to this prompt (token 0 known)
        windowed.feed(seq.features[:14], seq.ids[1:15], 0)
        got = windowed.propose(seq.features[13], seq.ids[14], seq.ids[:15].tolist())
        assert (windowed.offset, windowed.cache.length) == (10, 4)
        alone = EagleDrafter(_draft(model), torch.float32, lookup=False, budget=4)
        alone.offset = 10
        alone.feed(seq.features[10:14], seq.ids[11:15], 10)
        want = alone.propose(seq.features[13], seq.ids[14], seq.ids[:15].tolist())
        assert got.tokens.tolist() == want.tokens.tolist() and got.tree.size == 5
        assert windowed.rewind(seq.ids[:7].tolist() + [999, 999], 6) == 6  # parts at 7, before the window
        assert (windowed.offset, windowed.cache.length) == (6, 0)
        windowed.feed(seq.features[6:9], seq.ids[7:10], 6)
        assert windowed.propose(seq.features[8], seq.ids[9], []).tree.size == 5
    backend = tiny_backend("llama")
    prompt = [5, 17, 3, 17, 9, 5, 17] * 3
    reference = plain_tokens(backend, prompt, 40)
    drafter = EagleDrafter(_draft(backend.model), backend.model.dtype, budget=6)
    drafter.window = 4
    events, done = collect(stream(backend, prompt, DecodeSettings(max_new_tokens=40), drafter))
    assert list(done.token_ids) == reference and max(e.tree_size for e in events) > 1
    assert drafter.offset > 0 and drafter.cache.length <= 2 * drafter.window
