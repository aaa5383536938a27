"""The decode loop on tiny random models: exactness against plain decoding, cache, events."""

import contextlib
from itertools import product

import pytest
import torch

from core.backends import cache as kv
from core.backends import lean as fast
from core.backends.torch import TorchBackend
from core.decode.generate import Finished, StepEvent, collect, stream
from core.decode.settings import DecodeSettings
from core.decode.step import accept, commit, prefill, verify
from core.decode.tree import AUTO, build_tree, load_tree
from core.drafters.fixed import MedusaDrafter
from models.heads import MedusaHeads
from tests.helpers import (
    ARCHS,
    BASE_ARCHS,
    FAST_KERNELS,
    OracleDrafter,
    plain_tokens,
    three_token_p_value,
    tiny_backend,
    tiny_model,
)

PROMPT = [1, 17, 33, 5, 60, 2, 41]
TREES = ["chain-4", "cpu-8", "cpu-32", "mc_sim_7b_63", "custom"]


def tree_named(name: str):
    if name == "custom":  # deep and narrow with a late branch
        return build_tree([[0], [1], [1, 0], [1, 0, 0], [1, 0, 1], [1, 0, 0, 0]])
    return load_tree(name)[1]


def random_heads(model, num_heads=4, seed=0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(model.config.hidden_size, model.config.vocab_size, num_heads, 1, model.lm_head)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return heads.eval()


@pytest.mark.parametrize(("arch", "tree_name"), list(product(ARCHS, TREES)))
def test_greedy_tree_decoding_equals_plain_greedy(arch, tree_name):
    backend = tiny_backend(arch)
    n = 40
    reference = plain_tokens(backend, PROMPT, n + 8)
    tree = tree_named(tree_name)
    drafter = OracleDrafter(PROMPT + reference, tree, backend.model.config.vocab_size, seed=1)
    events, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=n), drafter))
    assert list(done.token_ids) == reference[:n]
    accepted = [e.accepted for e in events]
    assert max(accepted) >= 2 and len(events) < n  # drafts were really accepted, deep ones too
    if tree.top_k > 1:  # and paths off the first branch
        assert any(e.path != tuple(range(len(e.path))) for e in events)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_real_heads_equals_plain_greedy(arch):
    backend = tiny_backend(arch)
    reference = plain_tokens(backend, PROMPT, 30)
    drafter = MedusaDrafter(random_heads(backend.model), load_tree("mc_sim_7b_63")[1])
    _, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=30), drafter))
    assert list(done.token_ids) == reference


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_forward_matches_sequential_forwards(attn):
    """Each node's logits equal those of a plain run over its path (both attention kernels)."""
    model = tiny_model("llama")
    model.config._attn_implementation = attn
    backend = TorchBackend(model)
    tree = tree_named("cpu-8")
    tokens = torch.randint(0, 96, (tree.size,), generator=torch.Generator().manual_seed(0))
    cache = backend.new_cache()
    prefill(backend, cache, torch.tensor(PROMPT))
    from core.drafters.base import Draft

    fwd = verify(backend, cache, Draft(tokens, tree))
    for node in range(tree.size):
        path = tokens[tree.path_to(node)].tolist()
        plain = model(torch.tensor([PROMPT + path])).logits[0, -1]
        torch.testing.assert_close(fwd.logits[node], plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_after_commit_equals_plain_cache(arch):
    backend = tiny_backend(arch)
    model = backend.model
    reference = plain_tokens(backend, PROMPT, 12)
    tree = tree_named("custom")
    drafter = OracleDrafter(PROMPT + reference, tree, model.config.vocab_size, seed=3)
    settings = DecodeSettings()
    cache = backend.new_cache()
    fwd = prefill(backend, cache, torch.tensor(PROMPT))
    root = fwd.logits[-1].argmax()
    committed = list(PROMPT)
    with torch.inference_mode():
        for _ in range(4):
            prefix = backend.length(cache)
            draft = drafter.propose(fwd.hidden[-1], root, committed + [int(root)])
            fwd = verify(backend, cache, draft)
            result = accept(fwd, draft, settings, None)
            commit(backend, cache, prefix, result)
            committed += draft.tokens[result.path].tolist()
            root = result.next_token
    assert backend.length(cache) == len(committed)
    plain = TorchBackend(model).new_cache()  # transformers' own forward and cache over the committed tokens
    model(torch.tensor([committed]), **kv.argument(model, plain), use_cache=True)
    for i, theirs in enumerate(plain.layers):
        if isinstance(cache, fast.StaticKV):
            ours = (cache.keys[i, :, : cache.length][None], cache.values[i, :, : cache.length][None])
        else:
            ours = (cache.layers[i].keys, cache.layers[i].values)
        torch.testing.assert_close(ours[0], theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours[1], theirs.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", *(f"llama+{k}" for k in FAST_KERNELS)])
def test_lossless_sampling_reproduces_plain_sampling_for_the_same_seed(arch):
    """One draw per emitted token, in order: the same generator gives the same reply."""
    backend = tiny_backend(arch)
    settings = DecodeSettings(temperature=0.8, top_p=0.95, max_new_tokens=40)
    plain = plain_tokens(backend, PROMPT, 40, settings, torch.Generator().manual_seed(7))
    drafter = MedusaDrafter(random_heads(backend.model), load_tree("mc_sim_7b_63")[1])
    _events, done = collect(stream(backend, PROMPT, settings, drafter, generator=torch.Generator().manual_seed(7)))
    assert list(done.token_ids) == plain


@pytest.mark.parametrize("arch", ["llama", *(f"llama+{k}" for k in FAST_KERNELS[-1:])])
def test_lossless_sampling_distribution_on_a_model(arch):
    """Chi-square of the first three tokens against the model's exact probabilities."""
    vocab = 6
    backend = tiny_backend(arch, vocab=vocab, seed=2)
    prompt = [1, 4, 2]
    tree = build_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0]])
    heads = random_heads(backend.model, num_heads=2, seed=5)
    drafter = MedusaDrafter(heads, tree)
    accepted: list[int] = []
    p_value = three_token_p_value(
        backend, prompt, vocab, drafter, on_events=lambda ev: accepted.extend(e.accepted for e in ev)
    )
    assert sum(accepted) > 3000 // 3  # the tree was really used
    assert p_value > 1e-3


def test_events_add_up_and_text_deltas_concatenate():
    backend = tiny_backend("llama")
    reference = plain_tokens(backend, PROMPT, 30)
    drafter = OracleDrafter(PROMPT + reference, tree_named("cpu-8"), 96, seed=2)
    decoder = ByteDecoder()
    events, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=30), drafter, decoder))
    assert all(isinstance(e, StepEvent) for e in events) and isinstance(done, Finished)
    assert sum(len(e.token_ids) for e in events) == len(done.token_ids) == 30
    assert [e.step for e in events] == list(range(1, len(events) + 1)) and done.steps == len(events)
    assert "".join(e.text for e in events) == done.text == decoder.decode(list(done.token_ids))
    assert events[0].tree_size == 0 and events[0].accepted == 0
    for e in events[1:-1]:
        assert e.path[0] == 0 and len(e.token_ids) == e.accepted + 1 == len(e.path)
        assert e.tree_size == 9 and len(e.draft) == 9
    assert done.finish_reason == "length" and done.tokens_per_step == 30 / len(events)


def test_finish_reasons():
    backend = tiny_backend("llama")
    reference = plain_tokens(backend, PROMPT, 30)
    drafter = OracleDrafter(PROMPT + reference, tree_named("cpu-8"), 96, seed=2)

    eos = reference[10]
    first = reference.index(eos)
    _, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=30), drafter, eos_ids=[eos]))
    assert done.finish_reason == "eos" and list(done.token_ids) == reference[: first + 1]

    calls = []
    should_stop = lambda: calls.append(1) or len(calls) > 2  # noqa: E731
    events, done = collect(stream(backend, PROMPT, DecodeSettings(), drafter, should_stop=should_stop))
    assert done.finish_reason == "cancelled" and len(events) == 3

    decoder = ByteDecoder()
    stop = decoder.decode(reference[12:14])
    _, done = collect(stream(backend, PROMPT, DecodeSettings(stop=(stop,)), drafter, decoder))
    assert done.finish_reason == "stop" and stop not in done.text
    assert done.text == decoder.decode(reference)[: decoder.decode(reference).index(stop)]


class ByteDecoder:
    """Token id i is the letter chr(ord('a') + i % 26): enough to test text handling."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.mark.cuda
@pytest.mark.parametrize("arch", BASE_ARCHS)
def test_greedy_tree_decoding_on_cuda_equals_plain_greedy(arch):
    model = tiny_model(arch).to("cuda")
    backend = TorchBackend(model)
    reference = plain_tokens(backend, PROMPT, 40)
    tree = tree_named("mc_sim_7b_63").to("cuda")
    drafter = MedusaDrafter(random_heads(model).to("cuda"), tree)
    _, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=40), drafter))
    assert list(done.token_ids) == reference


# ---- the app's engine with a draft model (tiny model folders of one tokenizer, no downloads) ----


def draft_folders(root):
    """Tiny model folders: a target, a smaller draft model and another model of its tokenizer, one
    of another vocabulary of the same size, and a path with no model."""
    from types import SimpleNamespace

    from tests.tiny_folder import CHARS, save_tiny_model

    return SimpleNamespace(
        target=save_tiny_model(root / "target").name,
        draft=save_tiny_model(root / "draft", seed=1, shape=(32, 1)).name,
        second=save_tiny_model(root / "second", seed=3).name,
        other=save_tiny_model(root / "other", seed=2, chars=CHARS[::-1]).name,
        missing=str(root / "missing"),
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return draft_folders(tmp_path_factory.mktemp("draft-models"))


@contextlib.contextmanager
def tiny_engine(model: str, draft: str | None = None, **options):
    """The chat's engine on a tiny folder in float32 (its step costs not measured), loaded; closed after."""
    from types import SimpleNamespace

    import app.engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            app.engine,
            "step_costs",
            lambda *_: SimpleNamespace(curve=lambda: None, needed=False, rates=lambda kind: None),
        )
        engine = app.engine.Engine(model, dtype=options.pop("dtype", "float32"), draft_model=draft, **options)
        engine.start().result()
        assert engine.error is None, engine.error
        try:
            yield engine
        finally:
            engine.close()


def reply(engine, mode: str = "medusa", drafter: str = "", tree: str = "auto"):
    from app.engine import ReplyRequest

    request = ReplyRequest([{"role": "user", "content": "the cat sat on the mat"}], DecodeSettings(max_new_tokens=40),
                           mode=mode, tree=tree, drafter=drafter, seed=0)  # fmt: skip
    *steps, done = engine.reply(request).events
    return steps, done


def one_sentence(message: str) -> bool:
    return message.endswith(".") and "\n" not in message and "Traceback" not in message


def test_an_engine_with_a_draft_model_replies_with_the_plain_greedy_tokens(folders):
    with tiny_engine(folders.target, folders.draft) as engine:
        assert engine.draft_model == folders.draft and f"· draft model {folders.draft}" in engine.status()
        _, plain = reply(engine, "baseline")
        for kind, tree in product(("draft", "hybrid"), ("auto", "cpu-8")):
            _, done = reply(engine, "medusa", kind, tree)
            assert done.token_ids == plain.token_ids, (kind, tree)
        engine.set_draft_model("self")  # the target's own weights in 4 bits: most of its drafts are accepted
        steps, done = reply(engine, "medusa", "draft", "cpu-8")
        assert done.token_ids == plain.token_ids and done.prompt_reused > 0  # the kept conversation stood the swap
        assert any("draft" in e.sources for e in steps)  # the draft model drafted
        assert engine.draft_model == "self" and "· draft model self" in engine.status()


@pytest.mark.parametrize(("draft", "options", "words"), [
    ("other", {}, "another vocabulary"),
    ("missing", {}, "Unknown model"),
    ("self", {"quantization": "int4"}, "already runs in 4 bits"),
])  # fmt: skip
def test_a_draft_model_that_fails_at_launch_costs_only_the_draft_model(folders, capsys, draft, options, words):
    from app.engine import DRAFT_OFF
    from core.drafters.draft_model import MISSING
    from core.errors import UserError

    name = getattr(folders, draft, draft)
    with tiny_engine(folders.target, name, **options) as engine:
        said = [line for line in capsys.readouterr().err.splitlines() if DRAFT_OFF in line]
        assert len(said) == 1 and words in said[0] and one_sentence(said[0].removesuffix(DRAFT_OFF).strip())
        assert engine.loaded is not None and engine.draft_model is None and "draft model" not in engine.status()
        _, done = reply(engine, "medusa", "hybrid")
        assert done.token_ids
        with pytest.raises(UserError) as refused:
            reply(engine, "medusa", "draft")
        assert str(refused.value) == MISSING


def test_set_draft_model_swaps_unloads_and_keeps_the_previous_on_failure(folders):
    from core.errors import UserError

    with tiny_engine(folders.target) as engine:
        assert engine.draft_model is None
        _, hybrid = engine.drafter(AUTO, "hybrid")
        engine.set_draft_model(f"  {folders.draft} ")
        assert engine.draft_model == folders.draft
        _, raced = engine.drafter(AUTO, "hybrid")  # the cached drafters were dropped: hybrid races it now
        assert raced is not hybrid and raced.drafters["draft"].backend is engine.loaded.draft.backend
        before = engine.loaded.draft
        for bad, words in ((folders.missing, "Unknown model"), (folders.other, "another vocabulary")):
            with pytest.raises(UserError, match=words) as refused:
                engine.set_draft_model(bad)
            assert one_sentence(str(refused.value))
            assert engine.draft_model == folders.draft and engine.loaded.draft is before
        engine.set_draft_model(folders.second)
        _, drafter = engine.drafter("cpu-8", "draft")
        assert engine.draft_model == folders.second and drafter.backend is engine.loaded.draft.backend
        for none in ("none", None):
            engine.set_draft_model(none)
            assert engine.draft_model is None and "draft model" not in engine.status()
    with tiny_engine(folders.target, quantization="int4") as engine:
        with pytest.raises(UserError, match="already runs in 4 bits") as refused:
            engine.set_draft_model("self")
        assert one_sentence(str(refused.value)) and engine.draft_model is None


def test_a_model_switch_drops_the_draft_model_unless_it_is_self(folders):
    with tiny_engine(folders.target, folders.draft) as engine:
        engine.load(folders.second)
        assert engine.model_id == folders.second and engine.draft_model is None
        engine.set_draft_model("self")
        second_self = engine.loaded.draft
        engine.load(folders.target)  # self is the new model's own weights, loaded again
        assert engine.draft_model == "self" and engine.loaded.draft is not second_self
        _, plain = reply(engine, "baseline")
        steps, done = reply(engine, "medusa", "draft", "cpu-8")
        assert done.token_ids == plain.token_ids and any("draft" in e.sources for e in steps)


def test_self_asked_for_where_the_model_runs_in_4_bits_reloads_it_in_full_precision(folders):
    """The chat offers self: where the model loaded in 4 bits by default, it loads again in full
    precision with its own 4-bit copy drafting, and replies as the full-precision model does."""
    with tiny_engine(folders.target, dtype="auto") as engine:
        assert engine.loaded.backbone.backend.layer_kernel in ("int4", "q4")  # 4 bits by default on a CPU
        engine.set_draft_model("self")
        assert engine.draft_model == "self" and engine.options["quantization"] == "none"
        assert engine.loaded.backbone.backend.layer_kernel not in ("int4", "q4")
        steps, done = reply(engine, "medusa", "draft")
        _, plain = reply(engine, "baseline")
        assert done.token_ids == plain.token_ids and any("draft" in s.sources for s in steps[1:])
