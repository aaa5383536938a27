"""core.backends.lean: the lean forward agrees with transformers, packed kernels round every row alike,
the static cache keeps paths, int4 reproduces 4-bit blocks, and the kernel choice is remembered."""

import json

import pytest
import torch

from core.backends import lean as fast
from core.backends import q4build, stepops
from core.backends.base import RowLogits
from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.decode.step import prefill, verify
from core.decode.tree import build_tree, load_tree
from core.drafters.base import Draft
from core.drafters.fixed import MedusaDrafter
from core.measure import kernels
from models.quantization import pick_quantization
from tests.helpers import (
    FAST_KERNELS,
    OracleDrafter,
    plain_tokens,
    require_kernel,
    three_token_p_value,
    tiny_backend,
    tiny_model,
)
from tests.test_engine import random_heads

PROMPT = [1, 17, 33, 5, 60, 2, 41]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kernel", FAST_KERNELS)
def test_fast_forward_matches_transformers(arch, kernel):
    """fp32: prefill and every node of a tree verify give transformers' own logits."""
    reference = tiny_model(arch)
    backend = tiny_backend(f"{arch}+{kernel}")
    assert backend.layer_kernel == kernel and backend.describe().startswith("lean")
    tree = load_tree("cpu-8")[1]
    tokens = torch.randint(0, 96, (tree.size,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = backend.new_cache()
        assert isinstance(cache, fast.StaticKV)
        first = prefill(backend, cache, torch.tensor(PROMPT))
        expected = reference(torch.tensor([PROMPT])).logits[0, -1]
        torch.testing.assert_close(first.logits[-1], expected, atol=1e-5, rtol=1e-5)
        fwd = verify(backend, cache, Draft(tokens, tree))
        for node in range(tree.size):
            path = tokens[tree.path_to(node)].tolist()
            plain = reference(torch.tensor([PROMPT + path])).logits[0, -1]
            torch.testing.assert_close(fwd.logits[node], plain, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not FAST_KERNELS, reason="no fp32 kernel rounds alike at every row count on this CPU")
def test_both_backends_serve_the_step_through_one_interface():
    """Prefill, a tree forward, keeping one path, a step after it and a cut back: the same calls on
    transformers' backend and the lean one, the same logits as a plain run over those tokens."""
    reference = tiny_model("llama")
    plain, lean = tiny_backend("llama"), tiny_backend(f"llama+{FAST_KERNELS[0]}")
    assert (plain.describe(), plain.layer_kernel, plain.rows_one_by_one) == ("transformers", None, False)
    assert lean.describe().startswith(f"lean, {FAST_KERNELS[0]} layers")
    tree = load_tree("cpu-8")[1]
    tokens = torch.randint(0, 96, (tree.size,), generator=torch.Generator().manual_seed(2))
    path = tree.path_to(tree.size - 1)
    kept = PROMPT + tokens[path].tolist()
    with torch.inference_mode():
        expected = reference(torch.tensor([kept + [7]])).logits[0, -1]
        for backend in (plain, lean):
            cache = backend.new_cache()
            hidden, taps = backend.prefill(cache, torch.tensor(PROMPT))
            assert hidden.shape == (len(PROMPT), 64) and taps is None and backend.length(cache) == len(PROMPT)
            past = len(PROMPT)
            nodes, _ = backend.run(tokens, tree.depth + past, tree.attention_mask(past, backend.dtype), cache)
            logits = backend.logits(nodes, tree=True)
            assert not logits.by_row and logits.full().shape == (tree.size, 96)
            backend.keep_path(cache, past, path)
            assert backend.length(cache) == len(kept)
            last, _ = backend.run(torch.tensor([7]), torch.tensor([len(kept)]), None, cache)
            torch.testing.assert_close(backend.logits(last)[0], expected, atol=1e-5, rtol=1e-5)
            backend.truncate(cache, 3)
            assert backend.length(cache) == 3


def test_a_prefill_on_top_of_a_cache_is_causal():
    """A second block of several tokens after a prefix attends causally (the mask fast builds)."""
    reference = tiny_model("llama")
    backend = tiny_backend(f"llama+{FAST_KERNELS[0]}")
    with torch.inference_mode():
        cache = backend.new_cache()
        prefill(backend, cache, torch.tensor(PROMPT[:3]))
        out = prefill(backend, cache, torch.tensor(PROMPT[3:]))
        expected = reference(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(out.logits[-1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("kernel", "dtype"),
    [("onednn", torch.float32), ("onednn", torch.bfloat16), ("int4", torch.bfloat16), ("q4", torch.bfloat16)],
)
def test_packed_kernels_give_each_row_the_same_result_at_any_row_count(kernel, dtype):
    """What makes a tree forward round exactly like a one-token forward."""
    require_kernel(kernel, dtype)
    gen = torch.Generator().manual_seed(0)
    layer = fast.PackedLinear((torch.randn(192, 128, generator=gen) * 0.05).to(dtype), None, kernel)
    x = torch.randn(16, 128, generator=gen).to(dtype)
    whole = layer(x)
    for rows in (1, 3, 8):
        assert torch.equal(layer(x[:rows]), whole[:rows])
    assert torch.equal(layer(x[5:6]), whole[5:6])


@pytest.mark.parametrize("kernel", ["int4", "q4"])
def test_4_bit_kernels_reproduce_weights_that_were_4_bit_blocks(kernel):
    """Weights made of Q4_1-style blocks (min + step × q, q in 0..15 per 32 inputs) come back
    up to the rounding of each block's step and zero (and, for q4, of the int8 inputs: an
    identity row quantizes exactly)."""
    require_kernel(kernel, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (64, 128), generator=gen).float()
    q[:, ::32], q[:, 1::32] = 0, 15  # every block spans the whole range, as a quantizer leaves it
    step = torch.rand(64, 4, 1, generator=gen) * 0.01 + 0.001
    low = torch.randn(64, 4, 1, generator=gen) * 0.02
    w = (low + step * q.view(64, 4, 32)).view(64, 128)
    layer = fast.PackedLinear(w.to(torch.bfloat16), None, kernel)
    eye = torch.eye(128, dtype=torch.bfloat16)
    back = layer(eye).float().t()  # column j of W·I is input j's weights
    assert (back - w).abs().max() < 0.02 * w.abs().max()
    dense = torch.nn.functional.linear(eye.float(), w).t()
    assert torch.corrcoef(torch.stack([back.flatten(), dense.flatten()]))[0, 1] > 0.999


@pytest.mark.parametrize("kernel", ["int4", "q4"])
def test_greedy_tree_decoding_equals_plain_greedy_in_4_bits(kernel):
    """Exactness in the same precision: 4-bit weights with bf16 (int4) or int8 (q4) activations,
    tree vs plain."""
    require_kernel(kernel, torch.bfloat16)
    backend = tiny_backend(f"llama+{kernel}")
    reference = plain_tokens(backend, PROMPT, 40)
    drafter = OracleDrafter(PROMPT + reference, load_tree("mc_sim_7b_63")[1], backend.model.config.vocab_size, seed=1)
    events, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=32), drafter))
    assert list(done.token_ids) == reference[:32]
    assert max(e.accepted for e in events) >= 2


def test_a_tree_stops_short_of_the_next_cut_of_the_keys_into_parts(monkeypatch):
    """The library's attention cuts the keys into parts at multiples of `stepops.split()` positions
    (512; 16 here, to meet them in a short reply): no verified tree reaches past the next one, where
    its nodes' keys would fall into other parts than their one-token steps' (the kernels' test of
    the boundary: tests/test_attention_values.py), and the reply is still the plain loop's."""
    require_kernel("q4", torch.bfloat16)
    backend = tiny_backend("llama+q4")
    assert backend.tree_room(0) == stepops.split() == 512 and backend.tree_room(1000) == 24
    monkeypatch.setattr(backend.forward, "split", 16)
    reference = plain_tokens(backend, PROMPT, 60)
    seen, run = [], backend.run

    def spy(ids, positions, mask, cache, taps=()):
        seen.append((backend.length(cache), ids.numel()))
        return run(ids, positions, mask, cache, taps)

    monkeypatch.setattr(backend, "run", spy)
    drafter = OracleDrafter(PROMPT + reference, load_tree("mc_sim_7b_63")[1], backend.model.config.vocab_size, seed=1)
    events, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=52), drafter))
    assert list(done.token_ids) == reference[:52]
    steps = seen[1:]  # after the prefill; each verified the 64-node tree's first nodes up to the cut
    assert [nodes for _, nodes in steps] == [16 - past % 16 for past, _ in steps]
    assert max(e.accepted for e in events) >= 2


def test_static_cache_grows_keeps_paths_and_truncates():
    cache = fast.StaticKV(layers=2, heads=1, head_dim=1, dtype=torch.float32, capacity=4)
    values = torch.arange(10, dtype=torch.float32)
    cache.reserve(10)
    assert cache.keys.shape[2] >= 10
    cache.keys[:, 0, :10, 0] = values
    cache.values[:, 0, :10, 0] = -values
    cache.length = 10
    cache.reserve(40)  # growing keeps what was there
    assert torch.equal(cache.keys[1, 0, :10, 0], values)
    cache.keep_path(4, torch.tensor([0, 2, 5]))  # nodes 4, 6, 9 move down to 4, 5, 6
    assert cache.get_seq_length() == 7
    assert cache.keys[0, 0, :7, 0].tolist() == [0, 1, 2, 3, 4, 6, 9]
    assert cache.values[1, 0, :7, 0].tolist() == [0, -1, -2, -3, -4, -6, -9]
    cache.truncate(5)
    assert cache.get_seq_length() == 5


def test_kernel_choice_is_measured_once_and_a_damaged_record_is_measured_again(tmp_path, monkeypatch):
    record = tmp_path / "cpu-kernels.json"
    timed = []
    real = kernels._seconds
    monkeypatch.setattr(kernels, "_seconds", lambda c, h, i: timed.append(c) or real(c, h, i, repeats=1))
    first = kernels.choose(64, 128, "float32", False, record)
    assert first.dtype == "float32" and first in kernels.candidates("float32", False)
    count = len(timed)
    assert count == len(kernels.candidates("float32", False))
    assert kernels.choose(64, 128, "float32", False, record) == first and len(timed) == count  # remembered
    record.write_text("[not a dict")
    kernels.choose(64, 128, "float32", False, record)
    assert len(timed) == 2 * count
    known = json.loads(record.read_text())
    (key,) = known
    known[key] = {"dtype": "float32", "kernel": "no-such-kernel", "head_kernel": "dense"}
    record.write_text(json.dumps(known))
    assert kernels.choose(64, 128, "float32", False, record) in kernels.candidates("float32", False)
    assert len(timed) == 3 * count
    monkeypatch.setattr(q4build, "_source", lambda: b"a changed kernel library")  # its timings no longer hold
    kernels.choose(64, 128, "float32", False, record)
    assert len(timed) == 4 * count


def test_int4_is_refused_where_it_cannot_run():
    from core.errors import UserError

    config = tiny_model("llama").config
    with pytest.raises(UserError, match="for the CPU"):
        pick_quantization("int4", torch.device("cuda"), config)
    config.model_type = "gpt2"
    assert not fast.servable(config)


def test_drafting_kernel_is_the_fastest_that_runs_and_is_remembered(tmp_path, monkeypatch):
    record = tmp_path / "cpu-kernels.json"
    timed = []

    def fake_time(fn, repeats):
        fn()  # it must run: a kernel that fails here is not a candidate
        timed.append(fn)
        return {1: 5.0, 2: 1.0}.get(len(timed), 3.0)  # the second candidate that runs is the fastest

    monkeypatch.setattr(kernels, "time_ms", fake_time)
    choice = kernels.drafting(100, 64, 4, record)
    runs = [(d, k) for d in kernels.DTYPES for k in fast.KERNELS if _runs(k, kernels.DTYPES[d])]
    assert choice == runs[1] and len(timed) >= len(runs)
    assert kernels.drafting(100, 64, 4, record) == choice and len(timed) >= len(runs)  # remembered
    count = len(timed)
    known = json.loads(record.read_text())
    known[next(iter(known))] = ["float32", "no-such-kernel"]
    record.write_text(json.dumps(known))
    kernels.drafting(100, 64, 4, record)
    assert len(timed) == 2 * count  # a damaged entry is measured again


def _runs(kernel: str, dtype: torch.dtype) -> bool:
    try:
        fast.PackedLinear(torch.randn(100, 64, dtype=dtype), None, kernel)(torch.randn(4, 64, dtype=dtype))
    except (RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not FAST_KERNELS, reason="no fp32 kernel rounds alike at every row count on this CPU")
def test_logits_by_node_keep_greedy_exact_and_sampling_lossless():
    """Where the lm_head's cost grows by row, a tree's logits are computed a node at a time (only
    along the path the acceptance walk takes); replies stay exactly the plain loop's."""
    backend = tiny_backend(f"llama+{FAST_KERNELS[0]}")
    backend.row_head = True  # as `accelerate` sets it where 8 rows cost over twice one
    assert "by node" in backend.describe()
    drafter = MedusaDrafter(random_heads(backend.model), build_tree([[0], [1], [0, 0]]))
    cache = backend.new_cache()
    prefill(backend, cache, torch.tensor(PROMPT))
    logits = verify(backend, cache, drafter.propose(torch.zeros(64), torch.tensor(3), PROMPT)).logits
    assert isinstance(logits, RowLogits) and logits.by_row
    reference = plain_tokens(backend, PROMPT, 40)
    _, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=40), drafter))
    assert list(done.token_ids) == reference and done.tokens_per_step > 1

    vocab, prompt = 6, [1, 4, 2]
    small = tiny_backend(f"llama+{FAST_KERNELS[0]}", vocab=vocab, seed=2)
    small.row_head = True
    drafter = MedusaDrafter(random_heads(small.model, num_heads=2, seed=5), build_tree([[0], [1], [0, 0]]))
    assert three_token_p_value(small, prompt, vocab, drafter, seed=3) > 1e-3
