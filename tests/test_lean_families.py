"""The lean forward serves Qwen3, Gemma 3 and Mistral's window: q/k head norms, Gemma's norms (1 + w, the sandwich
around attention and MLP), the GELU-tanh gate, the attention scale, sliding-window layers with
their own rotary table. It agrees with transformers' forward, and greedy tree decoding equals plain
decoding token for token on torch's ops and through the kernel library's whole-layer decoder,
with prompts longer than the window."""

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from core.backends import lean as fast
from core.backends import stepops
from core.backends.lean.layer import window_mask
from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.decode.step import prefill, verify
from core.decode.tree import load_tree
from core.drafters.base import Draft
from tests.helpers import FAST_KERNELS, OracleDrafter, plain_tokens, require_kernel

VOCAB, WINDOW = 96, 8
PROMPT = [1, 17, 33, 5, 60, 2, 41, 9, 70, 12, 3, 88, 45, 6]  # longer than the window
FAMILIES = ("qwen3", "gemma3", "mistral")


def tiny(family: str, seed: int = 0):
    """A random model of `family`: head_dim 32 (not hidden / heads), norms that are not the
    identity; Gemma 3 with sliding layers of window 8 around a full one and a scale of its own."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, num_hidden_layers=2, tie_word_embeddings=False))
    elif family == "mistral":  # a window on every layer, as Mistral-7B v0.1's config sets it
        config = MistralConfig(**common, num_hidden_layers=2, sliding_window=WINDOW, tie_word_embeddings=False)
        model = MistralForCausalLM(config)
    else:
        config = Gemma3TextConfig(
            **common,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
        )
        model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # norms away from their initial identity: the 1 + w of Gemma's is seen
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def lean(family: str, kernel: str, seed: int = 0):
    """The tiny model of `family` behind the lean backend with `kernel` (bf16 for 4-bit kernels)."""
    model = tiny(family, seed)
    four_bit = kernel in fast.QUANTIZED
    if four_bit:
        model = model.to(torch.bfloat16)
    return fast.accelerate(model, kernel, "dense" if four_bit else kernel, by_row=lambda head: False)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_families_are_served_by_the_lean_forward(family):
    model = tiny(family)
    assert fast.servable(model.config)
    backend = lean(family, "dense")
    assert backend.describe().startswith("lean")
    if family == "mistral":
        assert [one.window for one in backend.forward.layers] == [WINDOW, WINDOW]
    if family == "gemma3":
        layers = backend.forward.layers
        assert [one.window for one in layers] == [WINDOW, 0, WINDOW]
        assert len(backend.forward.ropes) == 2 and backend.forward.rope_of == [1, 0, 1]


def test_a_multimodal_or_softcapped_gemma_keeps_transformers():
    config = Gemma3TextConfig(attn_logit_softcapping=50.0)
    assert not fast.servable(config)
    assert not fast.servable(Gemma3TextConfig(hidden_activation="gelu"))


@pytest.mark.skipif(not FAST_KERNELS, reason="no fp32 kernel rounds alike at every row count on this CPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_lean_forward_matches_transformers(family):
    """fp32: the prompt's logits and every node of a tree verify give transformers' own logits,
    past the window (positions 14 to 20 against a window of 8)."""
    reference = tiny(family)
    backend = lean(family, FAST_KERNELS[0])
    tree = load_tree("cpu-8")[1]
    tokens = torch.randint(0, VOCAB, (tree.size,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = reference(torch.tensor([PROMPT])).logits[0]
        cache = backend.new_cache()
        every = prefill(backend, cache, torch.tensor(PROMPT)).features  # every position's, past the window
        torch.testing.assert_close(backend.logits(every).full(), expected, atol=1e-4, rtol=1e-4)
        fwd = verify(backend, cache, Draft(tokens, tree))
        for node in range(tree.size):
            path = tokens[tree.path_to(node)].tolist()
            plain = reference(torch.tensor([PROMPT + path])).logits[0, -1]
            torch.testing.assert_close(fwd.logits[node], plain, atol=1e-4, rtol=1e-4)


def _tree_equals_plain(backend, steps: int = 40) -> None:
    reference = plain_tokens(backend, PROMPT, steps)
    drafter = OracleDrafter(PROMPT + reference, load_tree("mc_sim_7b_63")[1], VOCAB, seed=1)
    events, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=steps - 8), drafter))
    assert list(done.token_ids) == reference[: steps - 8]
    assert max(e.accepted for e in events) >= 2


@pytest.mark.skipif(not FAST_KERNELS, reason="no fp32 kernel rounds alike at every row count on this CPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tree_decoding_equals_plain_in_float32(family):
    _tree_equals_plain(lean(family, FAST_KERNELS[0]))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernel", ["q4", "int4"])
def test_greedy_tree_decoding_equals_plain_in_4_bits(family, kernel):
    """q4: every layer of a step in the library's decoder (sliding windows, Gemma's norms and gate
    in C); int4: torch's int4 matmul with the library's row-by-row attention and norms."""
    require_kernel(kernel, torch.bfloat16)
    backend = lean(family, kernel)
    assert (backend.forward.native is not None) == (kernel == "q4")
    _tree_equals_plain(backend)


@pytest.mark.parametrize("attention", list(stepops.NAMES))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tree_decoding_equals_plain_with_attention_on_amx(family, attention, monkeypatch):
    """The library's decoder with attention on AMX, or AMX's in AVX-512 bf16 and VNNI products (its
    scores, and its weighted values in layers without a sliding window: Gemma 3 has both kinds,
    Mistral only windowed ones): a tree's nodes get the bits of one-token steps, and a prompt's
    blocks those of its steps."""
    require_kernel("q4", torch.bfloat16)
    if not stepops.can_attend_with(attention):
        pytest.skip(f"this CPU (or its Linux) does not run the {attention} attention kernel")
    monkeypatch.setitem(stepops._chosen, "attention", attention)
    backend = lean(family, "q4")
    assert backend.forward.native is not None and stepops.NAMES[attention] in backend.describe()
    _tree_equals_plain(backend)
    _blocks_equal_steps(backend)


@pytest.mark.parametrize("attention", ["vectors", *stepops.NAMES])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tree_decoding_equals_plain_with_8_bit_keys_and_values(family, attention, monkeypatch):
    """The library's decoder on an 8-bit cache (each row's int8 values and scale), its attention in
    vectors or on AMX: a tree's nodes get the bits of one-token steps, a prompt's blocks those of
    its steps, and the first logits stay within bf16 noise of a bf16 cache's."""
    require_kernel("q4", torch.bfloat16)
    if not stepops.can_attend_with(attention):
        pytest.skip(f"this CPU (or its Linux) does not run the {attention} attention kernel")
    monkeypatch.setitem(stepops._chosen, "attention", attention)
    monkeypatch.setitem(stepops._chosen, "kv bits", 8)
    backend = lean(family, "q4")
    assert backend.forward.native is not None and "8-bit KV" in backend.describe()
    assert backend.new_cache().keys.dtype == torch.uint8
    _tree_equals_plain(backend)
    _blocks_equal_steps(backend)
    with torch.inference_mode():  # a causal block longer than the decoder takes, in one run: as the prefill's blocks
        ids = torch.randint(0, VOCAB, (150,), generator=torch.Generator().manual_seed(4))
        caches = [backend.new_cache(), backend.new_cache()]
        whole = backend.forward.run(ids, torch.arange(150), None, caches[0])[0]
        assert torch.equal(whole, prefill(backend, caches[1], ids).features)
        assert caches[0].keys[:, :, :150].equal(caches[1].keys[:, :, :150])
    logits = []
    with torch.inference_mode():
        for bits in (8, 16):
            backend.forward.kv_bits = bits
            logits.append(backend.logits(prefill(backend, backend.new_cache(), torch.tensor(PROMPT)).features).full())
    eight, sixteen = (x.float() for x in logits)
    assert (eight - sixteen).abs().mean() < 0.02 * sixteen.abs().max()


def _blocks_equal_steps(backend) -> None:
    """The prompt read in one block, or a token at a time: the same cache, bit for bit."""
    with torch.inference_mode():
        caches = []
        for block in (len(PROMPT), 1):
            cache = backend.new_cache()
            for start in range(0, len(PROMPT), block):
                prefill(backend, cache, torch.tensor(PROMPT[start : start + block]))
            caches.append(cache)
    n = len(PROMPT)
    assert all(getattr(caches[0], t)[:, :, :n].equal(getattr(caches[1], t)[:, :, :n]) for t in ("keys", "values"))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_library_decoder_computes_what_the_layers_compute(family):
    """The whole-layer decoder against the same packed layers run one by one (torch's ops around
    the same 4-bit matmuls), over a prompt longer than the window, then a tree: the same function
    up to bf16 rounding, and both close to transformers' forward on the bf16 model."""
    require_kernel("q4", torch.bfloat16)
    backend = lean(family, "q4")
    forward = backend.forward
    tree = load_tree("cpu-8")[1]
    tokens = torch.randint(0, VOCAB, (tree.size,), generator=torch.Generator().manual_seed(3))
    results = []
    with torch.inference_mode():
        for native in (forward.native, None):
            forward.native = native
            cache = backend.new_cache()
            every = prefill(backend, cache, torch.tensor(PROMPT)).features
            first = backend.logits(every).full().float()
            results.append((first, verify(backend, cache, Draft(tokens, tree)).logits.full().float()))
        reference = tiny(family).to(torch.bfloat16)(torch.tensor([PROMPT])).logits[0].float()
    (c_first, c_tree), (t_first, t_tree) = results
    # bf16 noise (the library's attention against torch's) is about 1% of the logits' range; a
    # layer computed otherwise (no window, the other rotary table, SiLU, no post-MLP norm) 3-10%
    scale = t_first.abs().max()
    assert (c_first - t_first).abs().mean() < 0.02 * scale
    assert (c_tree - t_tree).abs().mean() < 0.02 * scale
    assert torch.corrcoef(torch.stack([c_first.flatten(), reference.flatten()]))[0, 1] > 0.9  # 4-bit weights


def test_a_sliding_layer_sees_only_its_window():
    """The mask a sliding layer gets: a row at position p sees keys at positions > p - window,
    tree nodes (positions by depth) included; nothing changes where the window hides nothing."""
    positions = torch.tensor([10, 11, 11])
    tree = torch.zeros(1, 1, 3, 13)
    tree[0, 0, :, 10:] = torch.tensor([[0.0, -1e9, -1e9], [0.0, 0.0, -1e9], [0.0, -1e9, 0.0]])  # 1, 2: children of 0
    mask, causal = window_mask(tree, False, positions, 10, 4, torch.float32)
    seen = (mask[0, 0] == 0).int()
    assert not causal
    assert seen[0].tolist() == [0] * 7 + [1] * 4 + [0, 0]  # keys 7..10
    assert seen[1].tolist() == [0] * 8 + [1] * 3 + [1, 0]  # keys 8, 9 and its parent, itself
    assert seen[2].tolist() == [0] * 8 + [1] * 3 + [0, 1]
    assert window_mask(None, False, torch.tensor([3]), 3, 4, torch.float32) == (None, False)
