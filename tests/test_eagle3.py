"""EAGLE-3's multi-layer features: the backbone's tapped streams (native, lean and transformers
forwards alike), training passes that see what drafting sees, exact decoding, the file."""

from __future__ import annotations

import copy

import pytest
import torch

from core.decode.step import prefill, verify
from core.decode.tree import load_tree
from core.drafters.base import Draft
from core.drafters.eagle import DrafterCard, EagleDraft, eagle3_taps, load_draft, save_draft
from core.drafters.eagle_tree import EagleDrafter
from core.errors import UserError
from core.train import eagle as eagle_train
from tests.helpers import ARCHS, FAST_KERNELS, require_kernel, tiny_backend, tiny_model
from tests.test_eagle import check_greedy_equals_plain

PROMPT = [1, 17, 33, 5, 60, 2, 41]


def _draft(model, seed: int = 3) -> EagleDraft:
    taps = eagle3_taps(model.config.num_hidden_layers)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        draft = EagleDraft(model, torch.arange(model.get_output_embeddings().weight.shape[0]), taps=taps)
        for p in draft.parameters():
            torch.nn.init.normal_(p, std=0.3)
    return draft.eval()


def test_eagle3_taps_are_the_low_middle_and_high_streams():
    assert eagle3_taps(30) == (2, 15, 27)
    assert eagle3_taps(2) == (0, 1)


@pytest.mark.parametrize("arch", ["llama", f"llama+{FAST_KERNELS[0]}"])
def test_tapped_streams_are_transformers_hidden_states(arch):
    """fp32: the streams at the taps, in prefill and at every node of a tree verify, are the
    hidden states transformers gives after that many layers."""
    reference = tiny_model("llama")
    backend = tiny_backend(arch)
    taps = (0, 1)
    tree = load_tree("cpu-8")[1]
    tokens = torch.randint(0, 96, (tree.size,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = backend.new_cache()
        first = prefill(backend, cache, torch.tensor(PROMPT), taps)
        states = reference(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(first.taps, torch.cat([states[t][0] for t in taps], -1), atol=1e-5, rtol=1e-5)
        fed = first.backbone_features()
        assert fed.shape == (len(PROMPT), 3 * 64) and fed[:, -64:].equal(first.features)
        fwd = verify(backend, cache, Draft(tokens, tree), taps)
        for node in (0, tree.size - 1):
            path = tokens[tree.path_to(node)].tolist()
            states = reference(torch.tensor([PROMPT + path]), output_hidden_states=True).hidden_states
            expected = torch.cat([states[t][0, -1] for t in taps])
            torch.testing.assert_close(fwd.taps[node], expected, atol=1e-5, rtol=1e-5)


def test_native_decoding_with_taps_gives_the_same_bits():
    """The library's decoder asked for taps gives the final states of a call without them, bit
    for bit, and the tapped stream of the per-layer path."""
    require_kernel("q4", torch.bfloat16)
    backend = tiny_backend("llama+q4")
    forward = backend.forward
    assert forward.native is not None
    tree = load_tree("cpu-8")[1]
    tokens = torch.randint(0, 96, (tree.size,), generator=torch.Generator().manual_seed(1))
    results, native = [], forward.native
    with torch.inference_mode():
        for taps, decoder in (((), native), ((1,), native), ((1,), None)):
            forward.native = decoder  # None: layer by layer in torch (the taps' fallback)
            cache = backend.new_cache()
            prefill(backend, cache, torch.tensor(PROMPT))
            results.append(verify(backend, cache, Draft(tokens, tree), taps))
    forward.native = native
    whole, tapped, lean = results
    assert whole.taps is None and tapped.taps.shape == (tree.size, 64)
    assert tapped.hidden.equal(whole.hidden)
    error = (tapped.taps.float() - lean.taps.float()).norm() / lean.taps.float().norm()
    assert error < 0.1  # the same stream but for rounding (the final states differ as much; layers by 4x)


def test_training_passes_with_taps_compute_what_drafting_computes():
    """Pass 1 at row s reads the fused taps of the true rows, as the drafter fed the same
    features does; the drafter's first guesses are that pass's top tokens."""
    model = tiny_model("llama")
    draft = _draft(model)
    ids = torch.randint(0, 96, (14,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = model.base_model(input_ids=ids.view(1, -1), output_hidden_states=True)
        wide = torch.cat([*(out.hidden_states[t][0] for t in draft.taps), out.last_hidden_state[0]], -1)
    seq = eagle_train.Sequence(ids, wide.to(torch.bfloat16), 3)
    to_draft = eagle_train.to_draft_index(draft.vocab, 96)
    batch = eagle_train.make_batch([seq], to_draft, 64)
    assert batch.feature_targets[0, 0].equal(seq.features[1, -64:])  # the last feature is the target
    s = 6
    with torch.inference_mode():
        expected = draft.logits(eagle_train.passes_forward(draft, batch, 1)[0][0, s]).topk(3).indices.tolist()
        drafter = EagleDrafter(copy.deepcopy(draft), torch.float32, lookup=False, budget=3)
        assert drafter.taps == draft.taps
        drafter.feed(seq.features[: s + 1], seq.ids[1 : s + 2], 0)
        proposed = drafter.propose(seq.features[s, -64:], seq.ids[s + 1], seq.ids[: s + 2].tolist())
    assert sorted(proposed.tokens[1:].tolist()) == sorted(expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_an_eagle3_drafter_equals_plain_greedy(arch):
    check_greedy_equals_plain(arch, _draft, (1, 6))


def test_taps_travel_with_the_file_and_must_fit_the_model(tmp_path):
    model = tiny_model("llama")
    draft = _draft(model)
    file = tmp_path / "draft.safetensors"
    save_draft(file, draft, DrafterCard("tiny", 96, 64, (0.5,)))
    loaded, _ = load_draft(file, model, "tiny")
    assert loaded.taps == (0, 1)
    x = torch.randn(3, 3 * 64)
    torch.testing.assert_close(loaded.fused(x), draft.fused(x), rtol=2e-2, atol=2e-2)  # bf16 on disk
    deep = EagleDraft(model, torch.arange(96), taps=(1, 2))
    save_draft(file, deep, DrafterCard("tiny", 96, 64))
    with pytest.raises(UserError, match="reads layers"):
        load_draft(file, model)
