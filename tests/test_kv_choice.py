"""8-bit keys and values only for models that keep their answers with them (`models.kv_choice`,
`core.measure.kv_fidelity`): measured once per model, remembered, bf16 chosen past the limit."""

from __future__ import annotations

import math

import pytest
import torch

from core.measure import cpu_attention, kernels, kv_fidelity
from tests.gguf_writer import random_folder
from tests.helpers import require_kernel

SHAPE = dict(
    model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return random_folder(SHAPE, tmp_path_factory.mktemp("kv-choice") / "tiny")


@pytest.fixture
def eight_bits(monkeypatch):
    """The speed measurement's answer: 8-bit keys and values (whatever this machine would say),
    with the layers on the library's kernels, whose decoder reads them (a tiny model's kernels are
    otherwise timed, and torch's int4 may win: the CI once failed so)."""
    monkeypatch.setattr(cpu_attention, "kv_bits", lambda *args: 8)
    monkeypatch.setattr(kernels, "choose", lambda *args: kernels.Choice("bfloat16", "q4", "q8"))


def load(folder, capsys):
    from models.loader import load_backbone

    backbone = load_backbone(str(folder), device="cpu", quantization="int4")
    return backbone, capsys.readouterr().err


def test_a_model_whose_answers_8bit_keys_change_keeps_bf16_ones(folder, eight_bits, monkeypatch, capsys):
    require_kernel("q4", torch.bfloat16)
    asked = []
    monkeypatch.setattr(kv_fidelity, "kv8_divergence", lambda backend, ids: asked.append(len(ids)) or 0.05)
    backbone, said = load(folder, capsys)
    assert backbone.backend.forward.kv_bits == 16 and "8-bit KV" not in backbone.backend.describe()
    assert "Keys and values kept in bf16" in said and asked == [512]
    backbone, said = load(folder, capsys)  # remembered: not measured again
    assert backbone.backend.forward.kv_bits == 16 and asked == [512]


def test_a_model_that_keeps_its_answers_keeps_8bit_keys(folder, eight_bits, monkeypatch, tmp_path, capsys):
    require_kernel("q4", torch.bfloat16)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a record of its own: measured afresh
    monkeypatch.setattr(kv_fidelity, "kv8_divergence", lambda backend, ids: kv_fidelity.KV8_KL / 2)
    backbone, said = load(folder, capsys)
    if backbone.backend.forward.native is None:
        pytest.skip("the library's decoder does not run this model here (8-bit keys are its)")
    assert backbone.backend.forward.kv_bits == 8 and "8-bit KV" in backbone.backend.describe()
    assert "Keys and values kept in bf16" not in said


def test_the_divergence_is_measured_between_the_two_caches(folder, capsys):
    """Zero for the same cache twice; small and positive for 8-bit keys against bf16 ones."""
    require_kernel("q4", torch.bfloat16)
    backbone, _ = load(folder, capsys)
    forward = backbone.backend.forward
    if forward.native is None:
        pytest.skip("the library's decoder does not run this model here")
    ids = torch.tensor(backbone.tokenizer("The quick brown fox jumps over the lazy dog. " * 12)["input_ids"])
    divergence = kv_fidelity.kv8_divergence(backbone.backend, ids)
    assert math.isfinite(divergence) and 0 < divergence < 1
    original = forward.new_cache
    forward.new_cache = lambda bits=None: original(16)  # both caches bf16
    assert kv_fidelity.kv8_divergence(backbone.backend, ids) == 0
