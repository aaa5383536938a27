"""CLI on local models: a small saved model with heads in every published layout; nf4 on CPU."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from models.catalog import entries
from models.embedded import embedded_dir
from models.heads import MedusaHeads
from tests.test_cli import cli, generate_json

pytestmark = pytest.mark.embedded
VOCAB, HIDDEN = 49152, 64  # the SmolLM2 tokenizer's vocabulary, a tiny model


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A tiny random Llama saved like any transformers model, with SmolLM2's tokenizer."""
    folder = tmp_path_factory.mktemp("small-model")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1, tie_word_embeddings=False,
        eos_token_id=2, bos_token_id=1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    for f in embedded_dir().iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, folder / f.name)
    return folder


def heads_module(num_heads: int, shared: bool, seed: int = 3) -> MedusaHeads:
    torch.manual_seed(seed)
    shared_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False) if shared else None
    heads = MedusaHeads(HIDDEN, VOCAB, num_heads, 1, shared_head)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return heads


def canonical(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    return {k.removeprefix("heads."): v.contiguous() for k, v in heads.state_dict().items()}


def write_layout(layout: str, root, model_dir):
    """Heads in one published layout; returns (model folder, heads folder)."""
    folder = root / layout
    folder.mkdir()
    if layout == "legacy-pt":  # FasterDecoding v1.3: config says 2 heads, file has 5
        torch.save(canonical(heads_module(5, shared=False)), folder / "medusa_lm_head.pt")
        (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    elif layout in ("tgi", "medusa-v2"):  # own projections / shared lm_head
        heads = heads_module(3, shared=layout == "medusa-v2")
        save_file(canonical(heads), folder / "medusa_lm_head.safetensors")
        config = {"medusa_num_heads": 3, "medusa_num_layers": 1, "vocab_size": VOCAB}
        (folder / "config.json").write_text(json.dumps(config))
    elif layout == "full-checkpoint":  # medusa-1.0: heads in the backbone's own shards
        shutil.copytree(model_dir, folder, dirs_exist_ok=True)
        backbone = load_file(folder / "model.safetensors")
        (folder / "model.safetensors").unlink()
        medusa = {f"medusa_head.{k}": v for k, v in canonical(heads_module(4, shared=False)).items()}
        save_file(backbone, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
        save_file(medusa, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
        weight_map = dict.fromkeys(backbone, "model-00001-of-00002.safetensors")
        weight_map |= dict.fromkeys(medusa, "model-00002-of-00002.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return folder, folder
    return model_dir, folder


@pytest.mark.parametrize("layout", ["legacy-pt", "tgi", "medusa-v2", "full-checkpoint"])
def test_generate_with_a_local_model_and_heads_in_each_layout(small_model, tmp_path, layout):
    model_dir, heads_dir = write_layout(layout, tmp_path, small_model)
    common = [
        "--model",
        str(model_dir),
        "--prompt",
        "Hello there",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "16",
    ]
    medusa = generate_json(*common, "--heads", str(heads_dir), "--tree", "cpu-16")
    baseline = generate_json(*common, "--mode", "baseline")
    assert medusa["samples"][0]["token_ids"] == baseline["samples"][0]["token_ids"]
    assert len(medusa["samples"][0]["token_ids"]) == 16


def test_models_lists_the_catalog():
    run = cli("models")
    assert run.returncode == 0, run.stderr
    for entry in entries():
        assert entry.id in run.stdout
    assert "embedded" in run.stdout and "not cached" in run.stdout


def test_nf4_on_cpu_loads_and_generates_the_embedded_model():
    run = cli("generate", "--prompt", "What is the capital of France?", "--quantization", "nf4",
              "--max-new-tokens", "12", "--json")  # fmt: skip
    assert run.returncode == 0, run.stderr
    sample = json.loads(run.stdout)["samples"][0]
    assert sample["text"].strip() and len(sample["token_ids"]) == sum(sample["steps"])
    assert "4-bit nf4" in run.stderr and "approximate" in run.stderr


@pytest.mark.cuda
def test_auto_quantization_on_cuda_is_nf4_and_generates():
    from models.loader import load_backbone

    backbone = load_backbone(device="cuda", quantization="auto")
    layer = backbone.model.model.layers[0].mlp.up_proj
    assert type(layer).__name__ == "Linear4bit"
    run = cli("generate", "--prompt", "Hi!", "--device", "cuda", "--max-new-tokens", "8", "--json")
    assert run.returncode == 0, run.stderr
