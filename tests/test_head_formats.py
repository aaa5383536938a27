"""Every published head layout, written by the test from a module, loads back the same heads."""

import json

import pytest
import torch
from safetensors.torch import save_file

from core.errors import UserError
from models.heads import MedusaHeads, load_heads

H, V = 32, 50


def lm_head() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(H, V, bias=False)


def make_heads(num_heads: int, layers: int = 1, shared: bool = False, seed: int = 1) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(H, V, num_heads, layers, lm_head() if shared else None)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return heads


def canonical(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    """FasterDecoding's keys: {head}.{layer}.linear.weight/bias and {head}.{layers}.weight."""
    return {k.removeprefix("heads."): v.clone() for k, v in heads.state_dict().items()}


def assert_same(loaded: MedusaHeads, original: MedusaHeads, num_heads: int, layers: int) -> None:
    assert (loaded.num_heads, loaded.num_layers) == (num_heads, layers)
    h = torch.randn(3, H)
    torch.testing.assert_close(loaded(h), original(h), rtol=0, atol=0)


def test_legacy_pt_counts_heads_from_tensors_not_the_config(tmp_path):
    """FasterDecoding/medusa-vicuna-*-v1.3: config says 2 heads, the .pt holds 5."""
    heads = make_heads(5)
    torch.save(canonical(heads), tmp_path / "medusa_lm_head.pt")
    config = {
        "base_model_name_or_path": "lmsys/vicuna-7b-v1.3",
        "medusa_num_heads": 2,
        "medusa_num_layers": 1,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_same(load_heads(tmp_path, lm_head()), heads, 5, 1)


def test_legacy_pt_with_shared_lm_head(tmp_path):
    """medusa_model_legacy.py version 2: residual blocks only, the backbone's lm_head projects."""
    heads = make_heads(3, shared=True)
    torch.save(canonical(heads), tmp_path / "medusa_lm_head.pt")
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "version": "2", "vocab_size": V}))
    loaded = load_heads(tmp_path, lm_head())
    assert loaded.shared
    assert_same(loaded, heads, 3, 1)


@pytest.mark.parametrize(("shared", "layers"), [(False, 1), (True, 1), (False, 2)])
def test_safetensors_tgi_and_v2_layouts(tmp_path, shared, layers):
    """TGI MedusaHeadV1 (own projections), V2 (shared lm_head), and multi-layer heads."""
    heads = make_heads(3, layers, shared)
    save_file(canonical(heads), tmp_path / "medusa_lm_head.safetensors")
    config = {"base_model_name_or_path": "mistralai/Mistral-7B-Instruct-v0.2", "medusa_num_heads": 3}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = load_heads(tmp_path, lm_head())
    assert loaded.shared == shared
    assert_same(loaded, heads, 3, layers)


def backbone_tensors() -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": torch.randn(V, H), "lm_head.weight": torch.randn(V, H)}


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_full_checkpoint_shards_with_medusa_head_tensors(tmp_path, kind):
    """FasterDecoding medusa-1.0: heads as medusa_head.* next to the fine-tuned backbone."""
    heads = make_heads(5)
    medusa = {f"medusa_head.{k}": v for k, v in canonical(heads).items()}
    shards = {1: backbone_tensors(), 2: medusa}
    names = {}
    for i, tensors in shards.items():
        if kind == "safetensors":
            name = f"model-0000{i}-of-00002.safetensors"
            save_file(tensors, tmp_path / name)
        else:
            name = f"pytorch_model-0000{i}-of-00002.bin"
            torch.save(tensors, tmp_path / name)
        names |= dict.fromkeys(tensors, name)
    index = "model.safetensors.index.json" if kind == "safetensors" else "pytorch_model.bin.index.json"
    (tmp_path / index).write_text(json.dumps({"metadata": {}, "weight_map": names}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": H, "vocab_size": V}))
    assert_same(load_heads(tmp_path, lm_head()), heads, 5, 1)


def test_a_pickle_that_needs_code_is_refused(tmp_path):
    class Sneaky:
        def __reduce__(self):
            return (print, ("this would run",))

    torch.save({"0.0.linear.weight": Sneaky()}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(UserError, match="refuses"):
        load_heads(tmp_path, lm_head())


def test_wrong_model_is_refused_in_every_layout(tmp_path):
    heads = make_heads(2)
    torch.save(canonical(heads), tmp_path / "medusa_lm_head.pt")
    with pytest.raises(UserError, match="hidden size 32 and vocabulary 50"):
        load_heads(tmp_path, torch.nn.Linear(64, V, bias=False))
