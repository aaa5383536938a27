"""Sliding-window layers under a tree's mask (transformers' forward): tiny random Gemma-3 and
Mistral models whose window (6) is far shorter than the context, so most steps attend beyond it.
Each tree node's logits equal a plain forward over its path; greedy tree decoding equals the plain
loop, and the plain loop equals transformers' own `generate`."""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

from core.backends.torch import TorchBackend, layered, windows
from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.decode.step import prefill, verify
from core.decode.tree import build_tree, load_tree
from core.drafters.base import Draft
from tests.helpers import OracleDrafter, plain_tokens

WINDOW = 6
VOCAB = 96
PROMPT = [1, 17, 33, 5, 60, 2, 41, 9, 77, 12, 50, 3, 64, 28]  # 14 tokens: already past the window
ARCHS = ("gemma3", "mistral")


def tiny(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, initializer_range=0.1, sliding_window=WINDOW,
    )  # fmt: skip
    if arch == "gemma3":  # two sliding layers, then a full one, as Gemma 3 interleaves them (5:1 there)
        layers = ["sliding_attention", "sliding_attention", "full_attention"]
        config = Gemma3TextConfig(**common, head_dim=16, num_hidden_layers=3, layer_types=layers)
        model = Gemma3ForCausalLM(config)
    else:  # every layer slides, and the config has no layer types
        model = MistralForCausalLM(MistralConfig(**common, num_hidden_layers=2))
    model.config._attn_implementation = "sdpa"
    return model.eval()


def test_the_windows_a_config_declares():
    assert windows(tiny("gemma3").config) == {"full_attention": 0, "sliding_attention": WINDOW}
    assert windows(tiny("mistral").config) == {"": WINDOW}
    assert windows(MistralConfig(sliding_window=None)) is None
    qwen2 = pytest.importorskip("transformers").Qwen2Config
    assert windows(qwen2()) is None  # its window is off unless use_sliding_window
    assert windows(qwen2(use_sliding_window=True, max_window_layers=1, num_hidden_layers=2)) == {
        "full_attention": 0,
        "sliding_attention": 4096,
    }


def test_the_window_hides_keys_by_position_not_by_cache_index():
    """Two committed keys, then a chain of three nodes at positions 2, 3, 4 under a window of 2."""
    mask = torch.zeros(1, 1, 3, 5)
    mask[0, 0, 0, 3:] = mask[0, 0, 1, 4] = torch.finfo(torch.float32).min  # causal within the chain
    masks = layered(mask, torch.tensor([2, 3, 4]), {"full_attention": 0, "sliding_attention": 2})
    assert masks["full_attention"] is mask
    visible = masks["sliding_attention"][0, 0] == 0
    assert visible.tolist() == [
        [False, True, True, False, False],
        [False, False, True, True, False],
        [False, False, False, True, True],
    ]
    assert layered(mask, torch.tensor([2, 3, 4]), None) is mask and layered(None, torch.tensor([2]), {"": 2}) is None


@pytest.mark.parametrize("arch", ARCHS)
def test_each_tree_node_beyond_the_window_has_the_logits_of_a_plain_forward_over_its_path(arch):
    model = tiny(arch)
    backend = TorchBackend(model)
    tree = load_tree("cpu-8")[1]
    tokens = torch.randint(0, VOCAB, (tree.size,), generator=torch.Generator().manual_seed(0))
    cache = backend.new_cache()
    prefill(backend, cache, torch.tensor(PROMPT))
    with torch.inference_mode():
        fwd = verify(backend, cache, Draft(tokens, tree))
        for node in range(tree.size):
            path = tokens[tree.path_to(node)].tolist()
            plain = model(torch.tensor([PROMPT + path])).logits[0, -1]
            torch.testing.assert_close(fwd.logits.full()[node], plain, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tree_decoding_beyond_the_window_equals_the_plain_loop_and_transformers_generate(arch):
    model = tiny(arch)
    backend = TorchBackend(model)
    n = 30  # the reply ends 44 positions in: seven windows
    reference = plain_tokens(backend, PROMPT, n + 8)
    with torch.inference_mode():
        theirs = model.generate(
            torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert reference[:n] == theirs[0, len(PROMPT) :].tolist()
    deep = build_tree([[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]])
    for tree in (load_tree("cpu-8")[1], deep):
        drafter = OracleDrafter(PROMPT + reference, tree, VOCAB, seed=1)
        events, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=n), drafter))
        assert list(done.token_ids) == reference[:n]
        assert max(e.accepted for e in events) >= 2  # deep paths were accepted
