"""The draft-model drafter (`core.drafters.draft_model`): a smaller model of the target's tokenizer,
on its own backend and cache, drafts and the target verifies. Greedy decoding equals the plain
loop token for token, sampling keeps the target's distribution, the kept cache changes neither
a token nor what the draft drafts, and loading a draft model (`models.draft_model`) and the
command line refuse what cannot draft in one sentence."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from core.backends import lean as fast
from core.backends.base import Backend
from core.backends.cache import Kept
from core.backends.torch import TorchBackend
from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.drafters.draft_model import MISSING, DraftModelDrafter
from core.drafters.estimates import CostCurve
from core.errors import UserError
from tests.helpers import FAST_KERNELS, plain_tokens, require_kernel, three_token_p_value, tiny_backend
from tests.tiny_folder import CHARS, save_tiny_model

TARGETS = ("llama", *(f"llama+{k}" for k in FAST_KERNELS))  # transformers' forward, the lean one (float32)
DRAFTS = ("torch", *FAST_KERNELS, "int4")  # the draft on transformers', the lean float32 and 4-bit forwards
PROMPT = [5, 17, 3, 17, 9, 5, 17]
CHEAP = CostCurve({1: 1000.0, 64: 1000.0}, 0.0)  # a machine where a tree costs what a plain step does


def draft_backend(kind: str, vocab: int = 96, seed: int = 7, hidden: int = 32, layers: int = 1) -> Backend:
    """A random Llama of another shape than `tiny_backend`'s (hidden size, layers, heads), of the
    same vocabulary: on transformers' forward ("torch") or the lean one with `kind`'s kernel."""
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.1,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    if kind == "torch":
        return TorchBackend(model)
    four_bit = kind in ("int4", "q4")
    require_kernel(kind, torch.bfloat16 if four_bit else torch.float32)
    if four_bit:
        return fast.accelerate(model.to(torch.bfloat16), kind, "dense")
    return fast.accelerate(model, kind, kind)


def drafted(events) -> list[int]:
    """The draft model's nodes in each step's verified tree (the prefill's event has none)."""
    return [e.node_sources.count("draft") for e in events[1:]]


def accepted(events) -> int:
    """The draft model's tokens accepted in the reply."""
    return sum(e.sources.count("draft") for e in events)


# ---- greedy decoding with a draft model is the plain loop ----


@pytest.mark.parametrize("draft_kind", DRAFTS)
@pytest.mark.parametrize("arch", TARGETS)
def test_greedy_with_a_draft_model_equals_plain_greedy(arch, draft_kind):
    """A draft of another shape (on any forward) drafts every step of a fixed budget, or the
    policy's trees, and the reply is the plain loop's, token for token."""
    target = tiny_backend(arch)
    reference = plain_tokens(target, PROMPT, 40)
    settings = DecodeSettings(max_new_tokens=40)
    for budget in (1, 3, 8):
        drafter = DraftModelDrafter(draft_backend(draft_kind), 96, budget=budget)
        events, done = collect(stream(target, PROMPT, settings, drafter))
        assert list(done.token_ids) == reference, budget
        assert set(drafted(events)) == {budget}, budget  # every step verified the draft's `budget` nodes
    for curve in (CHEAP, None):  # the policy on a machine where trees are cheap, and on its prior
        drafter = DraftModelDrafter(draft_backend(draft_kind), 96, curve=lambda c=curve: c)
        events, done = collect(stream(target, PROMPT, settings, drafter))
        assert list(done.token_ids) == reference, curve
        counts = drafted(events)
        assert counts[0] >= 2, curve  # its first tree drafts some nodes, to learn how often they are right
        if curve is CHEAP:
            assert sum(n > 0 for n in counts) >= len(counts) // 2 and max(counts) >= 8


@pytest.mark.parametrize("arch", TARGETS)
def test_a_draft_of_the_targets_own_weights_is_accepted(arch):
    """The target's own weights drafting (in float32 on transformers', and in 4 bits as `self`
    loads them): its most probable continuation is the target's greedy one, so drafts are
    accepted at (nearly) every step. (The tiny random model's next-token probabilities are
    flat, so the most probable nodes are siblings more than a deep chain: two tokens a step.)"""
    target = tiny_backend(arch)
    reference = plain_tokens(target, PROMPT, 40)
    for own in ("llama", "llama+int4"):
        if own.endswith("int4"):
            require_kernel("int4", torch.bfloat16)
        drafter = DraftModelDrafter(tiny_backend(own), 96, budget=32)
        events, done = collect(stream(target, PROMPT, DecodeSettings(max_new_tokens=40), drafter))
        assert list(done.token_ids) == reference, own
        missed = sum(e.accepted == 0 for e in events[1:])
        assert done.steps * 2 <= len(reference) and accepted(events) >= len(reference) // 2, (own, done.steps)
        assert missed == 0 if own == "llama" else missed <= 2, (own, missed)  # the same weights: every step


@pytest.mark.parametrize("draft_kind", ["torch", *FAST_KERNELS])
@pytest.mark.parametrize("arch", TARGETS)
def test_the_kept_cache_changes_no_token_nor_what_the_draft_drafts(arch, draft_kind):
    """Three replies, one drafter, the target's cache kept: a prompt that goes on from the last
    reply, then one that shares only the first tokens of the first prompt (the draft's cache is
    cut back to them). Each reply is the plain loop's, and each step's tree is the one a new
    drafter without a kept cache drafts: the draft's cache held what a fresh one would."""
    target = tiny_backend(arch)
    settings = DecodeSettings(max_new_tokens=16)
    mine, kept = DraftModelDrafter(draft_backend(draft_kind), 96, budget=6), Kept()
    prompt = [5, 17, 3, 9, 22, 40, 41, 7]
    _, first = collect(stream(target, prompt, settings, mine, kept=kept))
    prompts = [prompt, [*prompt, *first.token_ids, 11, 12, 13], [*prompt[:3], 60, 61, 62]]
    for n, ids in enumerate(prompts):
        events, done = collect(stream(target, ids, settings, mine, kept=kept))
        assert list(done.token_ids) == plain_tokens(target, ids, 16), n
        fresh = DraftModelDrafter(draft_backend(draft_kind), 96, budget=6)
        theirs, _ = collect(stream(target, ids, settings, fresh))
        assert [e.draft for e in events] == [e.draft for e in theirs], n
        assert mine.backend.length(mine.cache) == len(mine.ids) == len(fresh.ids), n
        assert mine.ids == fresh.ids and mine.ids[: len(ids)] == ids, n
    assert done.prompt_reused == 3  # the last prompt shared its first tokens with the kept conversation


def path_log_probs(backend: Backend, history: list[int], tokens: list[int], parent: list[int]) -> list[float]:
    """Each drafted node's path log-probability after `history`, from one causal forward of the
    whole path on a new cache of `backend` (no tree mask, no cache reused)."""
    found = []
    for n in range(len(tokens)):
        path = []
        while n >= 0:
            path.insert(0, tokens[n])
            n = parent[n]
        cache = backend.new_cache()
        with torch.inference_mode():
            hidden, _ = backend.prefill(cache, torch.tensor(history + path))
            logp = torch.log_softmax(backend.logits(hidden).full().float(), dim=-1)
        rows = range(len(history) - 1, len(history) - 1 + len(path))
        found.append(sum(float(logp[r, t]) for r, t in zip(rows, path, strict=True)))
    return found


@pytest.mark.parametrize("draft_kind", ["torch", *FAST_KERNELS])
def test_each_drafted_path_scores_what_the_draft_model_gives_it(draft_kind):
    """The tree's nodes are run at the right positions under the right mask on a cache cut back
    to the conversation: each node's score is the draft model's own probability of its path, as a
    plain forward over the conversation and the path gives it. The drafter has drafted for a
    longer conversation first, which shares only the start of this one."""
    backend = draft_backend(draft_kind)
    drafter = DraftModelDrafter(backend, 96, lookup=False, budget=32, depth=4)
    earlier, history = [5, 17, 3, 9, 22, 40, 41, 7, 8, 30], [5, 17, 3, 9, 60, 61]
    for ids in (earlier, history):
        with torch.inference_mode():  # as the loop calls the drafter
            assert drafter._ready(ids)
            tokens, parent, scores = drafter._grow()
        assert backend.length(drafter.cache) == len(ids) and drafter.ids == ids  # the tree's rows cut back
    assert max(parent) >= 8 and len(tokens) > 16  # drafted three deep and more
    torch.testing.assert_close(
        torch.tensor(scores), torch.tensor(path_log_probs(backend, history, tokens, parent)), rtol=1e-4, atol=1e-4
    )


# ---- sampling ----


def test_lossless_sampling_with_a_draft_model_keeps_the_targets_distribution():
    """The EAGLE drafter's test (tests/test_eagle.py) with a draft model of another shape: its
    trees two deep (one draft forward a step), which can hold a whole three-token reply."""
    vocab = 6
    target = tiny_backend("llama", vocab=vocab, seed=2)
    drafter = DraftModelDrafter(draft_backend("torch", vocab=vocab, seed=4), vocab, lookup=False, budget=6, depth=2)
    kinds = Counter()
    p_value = three_token_p_value(
        target, [1, 4, 2, 1, 4], vocab, drafter, n=2000,
        on_events=lambda ev: kinds.update(s for e in ev for s in e.sources),
    )  # fmt: skip
    assert kinds["draft"] > 100  # drafts were accepted (and, sampled, others were not)
    assert p_value > 1e-3


def test_a_draft_with_more_output_rows_never_drafts_past_the_targets_vocabulary():
    """A draft whose lm_head has rows past the target's vocabulary (padding) drafts only ids of it."""
    target = tiny_backend("llama", vocab=64)
    reference = plain_tokens(target, [5, 17, 3], 24)
    drafter = DraftModelDrafter(draft_backend("torch", vocab=96), 64, lookup=False, budget=8)
    events, done = collect(stream(target, [5, 17, 3], DecodeSettings(max_new_tokens=24), drafter))
    assert list(done.token_ids) == reference
    assert all(t < 64 for e in events for t in e.draft) and max(drafted(events)) == 8


# ---- loading a draft model, and the command line ----


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A target, a draft of another shape and the same tokenizer, and drafts of other vocabularies
    (the same characters in another order; one character fewer); the kernel choices and step
    costs measured here are kept in a folder of their own."""
    root = tmp_path_factory.mktemp("draft-model")
    folders = {
        "target": root / "target",
        "draft": root / "draft",
        "reordered": root / "reordered",
        "fewer": root / "fewer",
    }
    save_tiny_model(folders["target"])
    save_tiny_model(folders["draft"], seed=3, shape=(32, 1))
    save_tiny_model(folders["reordered"], seed=3, shape=(32, 1), chars=CHARS[::-1])
    save_tiny_model(folders["fewer"], seed=3, shape=(32, 1), chars=CHARS.replace("\n", ""))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        yield folders


def load(folder: Path, quantization: str = "none"):
    from models.loader import load_backbone

    return load_backbone(str(folder), "float32" if quantization == "none" else "auto", "cpu", quantization)


def test_a_draft_of_the_targets_tokenizer_loads_and_decodes_exactly(folders):
    from models.draft_model import load_draft_model

    target = load(folders["target"])
    draft = load_draft_model(target, str(folders["draft"]))
    assert draft.name == str(folders["draft"]) and draft.vocab_size == len(target.tokenizer) == 96
    assert draft.backend.model.config.hidden_size == 32 and draft.backend is not target.backend
    prompt = target.encode_chat("the cat sat on the mat")
    reference = plain_tokens(target.backend, prompt, 32)
    drafter = DraftModelDrafter(draft.backend, draft.vocab_size, budget=4)
    events, done = collect(stream(target.backend, prompt, DecodeSettings(max_new_tokens=32), drafter))
    assert list(done.token_ids) == reference and set(drafted(events)) == {4}


@pytest.mark.parametrize("other", ["reordered", "fewer"])
def test_a_draft_of_another_vocabulary_is_one_sentence_naming_both_models(folders, other):
    from models.draft_model import load_draft_model

    target = load(folders["target"])
    with pytest.raises(UserError) as refused:
        load_draft_model(target, str(folders[other]))
    message = str(refused.value)
    assert str(folders[other]) in message and str(folders["target"]) in message
    assert "another vocabulary" in message and "tokenizer" in message
    assert "\n" not in message and message.endswith(".") and message.count(". ") == 0


def test_self_for_a_target_in_4_bits_is_one_sentence(folders, monkeypatch):
    require_kernel("int4", torch.bfloat16)
    from models import draft_model

    target = load(folders["target"], "int4")
    assert target.backend.layer_kernel in ("int4", "q4")
    monkeypatch.setattr(draft_model, "load_backbone", lambda *a, **k: pytest.fail("self was loaded"))
    with pytest.raises(UserError) as refused:
        draft_model.load_draft_model(target, draft_model.SELF)
    message = str(refused.value)
    assert (
        str(folders["target"]) in message and "already runs in 4 bits" in message and "--quantization none" in message
    )
    assert "\n" not in message and message.endswith(".")


def test_self_for_a_full_precision_target_drafts_in_4_bits_exactly(folders):
    require_kernel("int4", torch.bfloat16)
    from models.draft_model import SELF, load_draft_model

    target = load(folders["target"])
    kernel, weights = target.backend.layer_kernel, copy.deepcopy(target.model.state_dict())
    draft = load_draft_model(target, SELF)
    assert (
        draft.name == SELF and draft.backend.layer_kernel in ("int4", "q4") and draft.backend.model is not target.model
    )
    assert target.backend.layer_kernel == kernel  # the target is left in full precision
    assert all(torch.equal(weights[k], v) for k, v in target.model.state_dict().items())
    prompt = target.encode_chat("the cat sat on the mat")
    reference = plain_tokens(target.backend, prompt, 40)
    drafter = DraftModelDrafter(draft.backend, draft.vocab_size, budget=32)
    events, done = collect(stream(target.backend, prompt, DecodeSettings(max_new_tokens=40), drafter))
    assert list(done.token_ids) == reference
    assert done.steps * 2 <= len(reference) and accepted(events) >= len(reference) // 2  # its own weights guess well


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """`medusa-chat ARGS` run in this process: its exit status, stdout and stderr."""
    from app.main import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def refused(code: int, out: str, err: str) -> str:
    """The one error sentence of a refused command (exit 2, nothing on stdout, no traceback)."""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and out == "" and len(errors) == 1 and "Traceback" not in err, (code, out, err)
    assert err.rstrip("\n").splitlines()[-1] == errors[0]  # the last thing said
    return errors[0].removeprefix("error: ")


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_the_draft_drafter_without_a_draft_model_is_refused_before_loading(folders, capsys, monkeypatch, command):
    from models import loader

    monkeypatch.setattr(loader, "load_backbone", lambda *a, **k: pytest.fail("the model was loaded"))
    prompts = folders["target"].parent / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    asked = ["--prompt", "hi"] if command == "generate" else ["--prompts", str(prompts)]
    code, out, err = cli(capsys, command, "--model", str(folders["target"]), "--drafter", "draft", *asked)
    assert refused(code, out, err) == MISSING
    assert err == f"error: {MISSING}\n"  # nothing loaded, nothing else said


def test_a_draft_of_another_vocabulary_is_refused_by_the_command_line(folders, capsys):
    code, out, err = cli(
        capsys, "generate", "--model", str(folders["target"]), "--draft-model", str(folders["reordered"]),
        "--drafter", "draft", "--prompt", "hi", "--max-new-tokens", "4",
    )  # fmt: skip
    sentence = refused(code, out, err)
    assert str(folders["reordered"]) in sentence and str(folders["target"]) in sentence


def test_self_for_a_target_in_4_bits_is_refused_by_the_command_line(folders, capsys):
    require_kernel("int4", torch.bfloat16)
    code, out, err = cli(
        capsys, "generate", "--model", str(folders["target"]), "--quantization", "int4", "--draft-model", "self",
        "--drafter", "draft", "--prompt", "hi", "--max-new-tokens", "4",
    )  # fmt: skip
    assert "already runs in 4 bits" in refused(code, out, err)


@pytest.fixture
def no_measuring(monkeypatch):
    """The step-cost curve is not measured after a reply (the policy drafts on its prior curve)."""
    from core.measure import costs

    monkeypatch.setattr(costs.StepCosts, "measure", lambda self: None)


def generate(capsys, folders, *args: str) -> dict:
    common = ["--model", str(folders["target"]), "--prompt", "the cat sat on the mat", "--dtype", "float32"]
    code, out, err = cli(capsys, "generate", "--json", *common, "--max-new-tokens", "24", *args)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize(
    "args",
    [
        ("--drafter", "draft", "--draft-model", "DRAFT"),
        ("--drafter", "draft", "--draft-model", "self"),
        ("--drafter", "hybrid", "--draft-model", "DRAFT"),
        ("--drafter", "draft", "--draft-model", "DRAFT", "--tree", "cpu-8"),
    ],
    ids=["draft", "self", "hybrid", "draft-on-a-fixed-tree"],
)
def test_generate_with_a_draft_model_prints_the_plain_loops_reply(folders, capsys, no_measuring, args):
    if "self" in args:
        require_kernel("int4", torch.bfloat16)
    plain = generate(capsys, folders, "--mode", "baseline")["samples"][0]
    args = tuple(str(folders["draft"]) if a == "DRAFT" else a for a in args)
    ours = generate(capsys, folders, *args)
    (sample,) = ours["samples"]
    assert sample["token_ids"] == plain["token_ids"] and sample["text"] == plain["text"] and plain["token_ids"]
    assert ours["drafter"] == args[1] and ours["exactness"] == "exact"
    assert sum(sample["steps"]) == len(sample["token_ids"])
    if "self" in args:
        assert len(sample["steps"]) < len(sample["token_ids"])  # its own weights' drafts were accepted


def test_generate_with_a_draft_model_and_the_default_drafter_prints_the_plain_loops_reply(
    folders, capsys, no_measuring
):
    plain = generate(capsys, folders, "--mode", "baseline")["samples"][0]
    ours = generate(capsys, folders, "--draft-model", str(folders["draft"]))
    assert ours["samples"][0]["token_ids"] == plain["token_ids"] and ours["tree"] == "auto"


def test_a_draft_model_given_without_a_drafter_is_used(folders, capsys, no_measuring):
    ours = generate(capsys, folders, "--draft-model", "self")
    assert ours["drafter"] in ("draft", "hybrid")
