"""The conversation's cache kept between replies (`core.backends.cache.Kept`): the next request reads only
what its prompt does not share with the last one, and no reply changes by a token.

The reference for every reply is the same request on an engine that keeps nothing (its kept
cache cleared before each request): the whole prompt read again, as before the cache was kept.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from core.backends import cache as kv
from core.backends.base import Backend
from core.backends.cache import Kept
from core.decode.generate import Finished, collect, stream
from core.decode.settings import DecodeSettings
from core.decode.tree import AUTO, load_preset
from core.drafters.eagle import EagleDraft, init_from_backbone
from core.drafters.eagle_tree import EagleDrafter
from core.drafters.fixed import MedusaDrafter
from core.drafters.lookup import NgramIndex
from tests.helpers import FAST_KERNELS, tiny_backend
from tests.test_devices import corpus, random_heads

ARCHS = ("llama", *(f"llama+{k}" for k in FAST_KERNELS))
GREEDY = DecodeSettings(max_new_tokens=24)
SAMPLING = DecodeSettings(temperature=0.9, top_p=0.95, max_new_tokens=24)
# (mode, tree, drafter) of a ReplyRequest: the plain loop, a fixed tree of the heads, and the
# policy's trees (hybrid with an EAGLE layer: it and the heads' policy take turns), EAGLE's own
MODES = {
    "plain": ("baseline", AUTO, ""),
    "medusa": ("medusa", "cpu-8", "medusa"),
    "hybrid": ("medusa", AUTO, "hybrid"),
    "eagle": ("medusa", AUTO, "eagle"),
}


# a chat template in the characters the tokenizer knows: "u>message|a>reply|u>…|a>"
TEMPLATE = (
    "{% for m in messages %}{{ m.role[0] }}>{{ m.content }}|{% endfor %}{% if add_generation_prompt %}a>{% endif %}"
)


# ---- an engine on a tiny model with a character tokenizer (text and tokens round-trip) ----


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import decoders
    from transformers import AutoTokenizer

    from tests.tiny_folder import save_tiny_model

    folder = tmp_path_factory.mktemp("tiny-chat")
    save_tiny_model(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.backend_tokenizer.decoder = decoders.Fuse()  # characters joined as they are, not by spaces
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module", params=ARCHS)
def loaded(request, tokenizer):
    from app.engine import Loaded
    from models.loader import Backbone

    backend = tiny_backend(request.param)
    backbone = Backbone("tiny", backend.model, tokenizer, (tokenizer.eos_token_id,), backend=backend)
    costs = SimpleNamespace(
        curve=lambda: None, needed=False, rates=lambda kind: None
    )  # the policy's prior curve, nothing to measure
    return Loaded(backbone, random_heads(backend.model), True, "cpu-8", costs, corpus(), eagle_layer(backend))


def eagle_layer(backend: Backend) -> EagleDraft:
    """An EAGLE layer for `backend`'s model: its own last layer where it has transformers' layers, else random."""
    model = backend.model
    draft = EagleDraft(model, torch.arange(model.config.vocab_size))
    if backend.layer_kernel is None:
        init_from_backbone(draft, model)
    return draft.eval()


def engines(loaded):
    from app.engine import Engine

    pair = Engine("tiny"), Engine("tiny")
    for engine in pair:
        engine.loaded = loaded
    return pair


def ask(engine, messages: list[dict], mode: str, settings: DecodeSettings = GREEDY, seed: int = 0) -> Finished:
    from app.engine import ReplyRequest

    decoding, tree, drafter = MODES[mode]
    request = ReplyRequest(messages, settings, mode=decoding, tree=tree, drafter=drafter, seed=seed)
    events = list(engine.reply(request).events)
    assert isinstance(events[-1], Finished)
    return events[-1]


def fresh(engine, messages: list[dict], mode: str, settings: DecodeSettings = GREEDY, seed: int = 0) -> Finished:
    """The reply of an engine that keeps nothing between replies."""
    engine.kept.clear()
    done = ask(engine, messages, mode, settings, seed)
    assert done.prompt_reused == 0
    return done


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def scripted_chat(reply) -> list[tuple[str, list[dict]]]:
    """Ten turns: a chat that goes on, a regenerated reply, an earlier message edited (as an API
    client sends it: the whole messages list), another chat opened, the first one resumed and then
    trimmed. `reply(messages)` answers a turn; each turn's (name, messages) in order."""
    turns: list[tuple[str, list[dict]]] = []

    def turn(name: str, messages: list[dict]) -> str:
        turns.append((name, messages))
        return reply(messages)

    a = [user("the cat sat on the mat")]
    a += [assistant(turn("first", a)), user("and then?")]
    turn("next", a)
    a += [assistant(turn("regenerate", a)), user("tell me more about the cat")]
    a += [assistant(turn("goes on", a))]
    turn("an earlier message edited", [user("the dog sat on the mat"), *a[1:], user("why?")])
    b = [user("count: 1 2 3 4")]
    b += [assistant(turn("another chat", b)), user("again")]
    turn("that chat goes on", b)
    a += [user("why?")]
    turn("history trimmed", a[2:])
    a += [assistant(turn("back to the first chat", a)), user("ok")]
    turn("the first chat goes on", a)
    return turns


@pytest.mark.parametrize("mode", list(MODES))
def test_a_scripted_chat_replies_token_for_token_as_an_engine_that_keeps_nothing(loaded, mode):
    kept, reference = engines(loaded)
    try:
        seen: list[tuple[Finished, Finished, list[int]]] = []

        def reply(messages: list[dict]) -> str:
            before = list(kept.kept.ids)
            prompt = kept.prepare(messages, "", GREEDY).ids
            mine, theirs = ask(kept, messages, mode), fresh(reference, messages, mode)
            assert mine.token_ids == theirs.token_ids and mine.text == theirs.text
            shared = kv.common_prefix(before, prompt) if before else 0
            seen.append((mine, theirs, [shared, len(prompt)]))
            return mine.text

        turns = scripted_chat(reply)
        assert len(turns) == 10
        eagle = mode in ("hybrid", "eagle")  # EAGLE's entry before a change read the token that changed: one less
        for (name, _), (mine, _, (shared, n)) in zip(turns, seen, strict=True):
            assert mine.prompt_read + mine.prompt_reused == n
            assert mine.prompt_reused in (min(shared, n - 1), min(shared, n - 1) - eagle), name
        reused = {name: mine.prompt_reused for (name, _), (mine, _, _) in zip(turns, seen, strict=True)}
        length = {name: n for (name, _), (_, _, (_, n)) in zip(turns, seen, strict=True)}
        assert reused["regenerate"] == length["regenerate"] - 1  # all but the last token
        assert reused["first"] == 0
        assert reused["another chat"] == reused["back to the first chat"] == len("u>") - eagle  # the template's start
        assert reused["an earlier message edited"] == len("u>the ") - eagle
        assert reused["the first chat goes on"] >= length["back to the first chat"] - 1
    finally:
        kept.close(), reference.close()


@pytest.mark.parametrize("mode", ["plain", "medusa"])
def test_sampled_replies_with_a_seed_are_unchanged(loaded, mode):
    """Lossless sampling with a fixed seed: the same tokens with and without the kept cache
    (the drafters here draft alike whatever the timing, so the random draws line up)."""
    kept, reference = engines(loaded)
    try:

        def reply(messages: list[dict]) -> str:
            mine = ask(kept, messages, mode, SAMPLING, seed=7)
            assert mine.token_ids == fresh(reference, messages, mode, SAMPLING, seed=7).token_ids
            return mine.text

        scripted_chat(reply)
    finally:
        kept.close(), reference.close()


def test_the_second_turn_reads_only_the_new_tokens(loaded, monkeypatch):
    import core.decode.generate

    read: list[int] = []
    prefill = core.decode.generate.prefill
    monkeypatch.setattr(
        core.decode.generate, "prefill", lambda m, c, ids, taps=(): read.append(ids.numel()) or prefill(m, c, ids, taps)
    )
    engine, _ = engines(loaded)
    try:
        first = [user("the cat sat on the mat")]
        one = ask(engine, first, "plain")
        kept_ids = list(engine.kept.ids)
        assert kept_ids == engine.prepare(first, "", GREEDY).ids + list(one.token_ids[:-1])
        second = [*first, assistant(one.text), user("and then?")]
        prompt = engine.prepare(second, "", GREEDY).ids
        two = ask(engine, second, "plain")
        shared = kv.common_prefix(kept_ids, prompt)
        assert shared >= len(kept_ids) - 1  # the reply's text is the reply's tokens again
        assert read == [len(engine.prepare(first, "", GREEDY).ids), len(prompt) - shared]
        assert (two.prompt_read, two.prompt_reused) == (len(prompt) - shared, shared)
        assert two.prompt_read == 1 + len("|u>and then?|a>")  # the reply's last token, then the new turn
    finally:
        engine.close()


def test_one_conversation_is_kept_and_another_model_starts_afresh(loaded):
    engine, _ = engines(loaded)
    try:
        a = [user("the cat sat on the mat")]
        ask(engine, a, "plain")
        b = [user("count: 1 2 3 4")]
        done = ask(engine, b, "hybrid")
        kept, prompt = engine.kept, engine.prepare(b, "", GREEDY).ids
        assert kept.ids[: len(prompt)] == prompt and kept.cache.get_seq_length() == len(kept.ids)
        # the reply's tokens but the last (which no forward has read yet), and drafts accepted past the limit
        assert kept.ids[len(prompt) :][: len(done.token_ids) - 1] == list(done.token_ids[:-1])
        other = tiny_backend("llama", seed=1)
        cache, reused = kept.take(other, kept.ids + [3])
        assert reused == 0 and other.length(cache) == 0 and kept.cache is None and not kept.ids
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_a_failed_reply_keeps_nothing(arch):
    backend = tiny_backend(arch)
    kept = Kept()
    collect(stream(backend, [5, 17, 3, 9], GREEDY, kept=kept))
    assert len(kept) > 4
    events = stream(backend, [5, 17, 3, 9, 30], GREEDY, kept=kept)
    next(events)  # the prefill took the kept cache; the reader leaves
    events.close()
    assert kept.cache is None and not kept.ids
    _, done = collect(stream(backend, [5, 17, 3, 9, 30], GREEDY, kept=kept))
    assert done.prompt_reused == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_eagle_rewound_drafts_as_after_the_whole_prompt(arch):
    """The EAGLE draft layer's cache after a reply that reused the kept cache equals its cache
    after the whole prompt was read: the same entries, the same tree drafted next."""
    backend = tiny_backend(arch)
    model = backend.model
    settings = DecodeSettings(max_new_tokens=16)
    prompt = [5, 17, 3, 9, 22, 40, 41, 7]
    draft = eagle_layer(backend)
    kept, mine = Kept(), EagleDrafter(draft, model.dtype, budget=6)
    _, one = collect(stream(backend, prompt, settings, mine, kept=kept))
    follow = [*prompt, *one.token_ids, 11, 12, 13]
    _, two = collect(stream(backend, follow, settings, mine, kept=kept))
    theirs = EagleDrafter(draft, model.dtype, budget=6)
    _, again = collect(stream(backend, follow, settings, theirs))
    assert two.prompt_reused >= len(prompt) + len(one.token_ids) - 2 and two.token_ids == again.token_ids
    mine._flush(), theirs._flush()
    n = theirs.cache.length
    assert mine.cache.length == n and mine._read == theirs._read
    torch.testing.assert_close(mine.cache.keys[:, :, :n], theirs.cache.keys[:, :, :n], rtol=1e-4, atol=1e-5)
    hidden, root = torch.zeros(model.config.hidden_size), torch.tensor(two.token_ids[-1])
    assert torch.equal(mine.propose(hidden, root).tokens, theirs.propose(hidden, root).tokens)


def test_a_medusa_first_step_drafts_from_the_last_prompt_position():
    """Reading part of the prompt still gives the heads the last position's hidden state."""
    backend = tiny_backend("llama")
    drafter = MedusaDrafter(random_heads(backend.model), load_preset("cpu-8").tree)
    kept, prompt = Kept(), [5, 17, 3, 9, 22, 40]
    _, one = collect(stream(backend, prompt, GREEDY, drafter, kept=kept))
    follow = [*prompt, *one.token_ids, 8, 9]
    mine, _ = collect(stream(backend, follow, GREEDY, drafter, kept=kept))
    theirs, _ = collect(stream(backend, follow, GREEDY, drafter))
    assert mine[1].draft == theirs[1].draft  # the first tree, drafted from the prefill's last hidden state


def test_the_lookup_index_cut_back_equals_one_built_afresh():
    index = NgramIndex(4)
    history = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2]
    index.sync(history)
    rewritten = [*history[:7], 9, 1, 2, 3]
    index.sync(rewritten)
    afresh = NgramIndex(4)
    afresh.sync(rewritten)
    assert index.ids == afresh.ids and index._ends == afresh._ends
    assert index.continuations(3, 3) == afresh.continuations(3, 3)


def test_the_stats_name_the_first_token_and_the_prompt_tokens_read_and_reused(loaded):
    """The chat's stats line says how long the first token took and how much of the prompt was
    read and reused, and a chat saved with those stats reads back (not set aside as corrupt)."""
    import json
    from dataclasses import asdict

    from app.chat import Chat, Turn, chat_from_dict
    from app.engine import figures
    from app.panels import stats_html

    engine, _ = engines(loaded)
    try:
        first = [user("the cat sat on the mat")]
        one = ask(engine, first, "plain")
        two = ask(engine, [*first, assistant(one.text), user("and then?")], "plain")
    finally:
        engine.close()
    stats = figures(two) | {"mode": "baseline", "sources": {}}
    assert stats["prompt_read"] == two.prompt_read and stats["prompt_reused"] == two.prompt_reused > 0
    shown = stats_html(stats, [], [])
    for label, value in (
        ("first token", ""),
        ("prompt tokens read", two.prompt_read),
        ("prompt tokens reused", two.prompt_reused),
    ):
        assert f"<th>{label}</th><td>{value}" in shown
    chat = Chat.new("tiny")
    chat.turns.append(Turn("and then?", two.text, [], stats, True))
    assert chat_from_dict(json.loads(json.dumps(asdict(chat)))).turns[0].stats == stats


def test_a_new_cache_is_made_for_the_prompt_and_the_longest_reply_at_once(monkeypatch):
    """A reply's new cache is reserved before its prefill for the prompt, the reply's most tokens
    and a tree's nodes: it never grows (copying every layer's keys and values: 13-17 ms at 4,096
    positions of the embedded model, more for larger ones) in the middle of the reply."""
    from core.backends.lean.kv import StaticKV

    backend = tiny_backend("llama+dense")  # the lean forward's pre-allocated cache
    grown, reserve = [], StaticKV.reserve

    def spy(cache, size):
        before = cache.keys.shape[2]
        reserve(cache, size)
        if cache.keys.shape[2] != before:
            grown.append((cache.length, cache.keys.shape[2]))

    monkeypatch.setattr(StaticKV, "reserve", spy)
    prompt = [1, 17, 33, 5, 60, 2, 41]
    _, done = collect(stream(backend, prompt, DecodeSettings(max_new_tokens=300)))
    assert len(done.token_ids) == 300
    assert grown == [(0, 512)]  # 7 + 300 + 64 positions, at once (doubling from 256), before the prefill
