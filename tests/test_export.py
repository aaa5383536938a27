"""Export of Medusa heads: the files each serving engine loads, read back the way that engine
reads them (names, shapes, config fields from vLLM's and TGI's Medusa loaders), give the heads'
own logits."""

import contextlib
import io
import json

import pytest
import torch
from safetensors.torch import load_file

from core.errors import UserError
from models.export import export_heads
from models.heads import MedusaHeads, load_heads

HIDDEN, VOCAB = 16, 40


def make_heads(kind: str, seed: int = 0) -> tuple[MedusaHeads, torch.nn.Linear]:
    """'subset': one layer on the shared lm_head over a vocabulary subset; 'shared': two layers
    on the shared lm_head; 'own': two layers and a projection per head."""
    g = torch.Generator().manual_seed(seed)
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    lm_head.weight.data = torch.randn(VOCAB, HIDDEN, generator=g)
    subset = torch.tensor([3, 5, 7, 11, 13, 17, 19, 23]) if kind == "subset" else None
    layers = 1 if kind == "subset" else 2
    heads = MedusaHeads(HIDDEN, VOCAB, 3, layers, None if kind == "own" else lm_head, subset)
    for p in heads.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.3
    return heads.eval(), lm_head


def engine_logits(tensors: dict, config: dict, hidden: torch.Tensor, fmt: str, lm_head: torch.Tensor) -> torch.Tensor:
    """(heads, vocab) logits from the exported tensors as vLLM / TGI compute them: x + SiLU(Wx + b)
    per layer, then the projection (vLLM: a shared one is `lm_heads.0`, sliced by `token_map`, the
    rest of the vocabulary never proposed; TGI V2: the backbone's `lm_head`)."""
    if fmt == "vllm":
        n, layers = config["num_heads"], config["num_hidden_layers"]
        block = lambda i, j: tuple(tensors[f"blocks.{i}.layers.{j}.{k}"] for k in ("weight", "bias"))  # noqa: E731
        proj = lambda i: tensors["lm_heads.0.weight" if config["original_lm_head"] else f"lm_heads.{i}.weight"]  # noqa: E731
    else:
        n, layers = config["medusa_num_heads"], config["medusa_num_layers"]
        block = lambda i, j: tuple(tensors[f"{i}.{j}.linear.{k}"] for k in ("weight", "bias"))  # noqa: E731
        proj = lambda i: tensors.get(f"{i}.{layers}.weight", lm_head)  # noqa: E731
    rows = []
    for i in range(n):
        x = hidden.float()
        for j in range(layers):
            w, b = block(i, j)
            x = x + torch.nn.functional.silu(x @ w.float().t() + b.float())
        weight = proj(i).float()
        row = x @ weight.t()
        if fmt == "vllm" and "token_map" in tensors:
            assert config["truncated_vocab_size"] == len(tensors["token_map"]) < config["vocab_size"]
            row = torch.full((config["vocab_size"],), float("-inf"))
            row[tensors["token_map"]] = x @ weight[tensors["token_map"]].t()
        rows.append(row)
    return torch.stack(rows)


def own_logits(heads: MedusaHeads, hidden: torch.Tensor) -> torch.Tensor:
    """The heads' logits over the whole vocabulary (a subset's at its token ids, the rest -inf)."""
    with torch.no_grad():
        logits = heads(hidden).float()
    if heads.token_ids is None:
        return logits
    full = torch.full((heads.num_heads, VOCAB), float("-inf"))
    full[:, heads.token_ids] = logits
    return full


def exported(tmp_path, kind: str, fmt: str, weights: str) -> tuple:
    """Heads of `kind` exported for `fmt` with "base-folder" as the backbone: (heads, lm_head, the
    serve command, the config written, the tensors in `weights`)."""
    heads, lm_head = make_heads(kind)
    command = export_heads(heads, lm_head.weight, tmp_path, fmt, "base-folder")
    config = json.loads((tmp_path / "config.json").read_text())
    return heads, lm_head, command, config, load_file(tmp_path / weights)


@pytest.mark.parametrize("kind", ["subset", "shared", "own"])
def test_vllm_export_reads_back_as_the_heads(tmp_path, kind):
    heads, lm_head, command, config, tensors = exported(tmp_path, kind, "vllm", "model.safetensors")
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["num_heads"], config["num_hidden_layers"]) == (3, heads.num_layers)
    assert (config["hidden_size"], config["vocab_size"]) == (HIDDEN, VOCAB)
    assert config["medusa_fc_bias"] is True and config["original_lm_head"] is (kind != "own")
    names = {
        f"blocks.{i}.layers.{j}.{k}" for i in range(3) for j in range(heads.num_layers) for k in ("weight", "bias")
    }
    names |= {"lm_heads.0.weight"} if kind != "own" else {f"lm_heads.{i}.weight" for i in range(3)}
    names |= {"token_map"} if kind == "subset" else set()
    assert set(tensors) == names
    assert tensors["blocks.0.layers.0.weight"].shape == (HIDDEN, HIDDEN)
    assert all(t.shape == (VOCAB, HIDDEN) for k, t in tensors.items() if k.startswith("lm_heads"))
    hidden = torch.randn(HIDDEN)
    got, want = engine_logits(tensors, config, hidden, "vllm", lm_head.weight), own_logits(heads, hidden)
    assert torch.equal(got.isinf(), want.isinf())
    finite = ~want.isinf()
    assert torch.allclose(got[finite], want[finite], rtol=0.05, atol=0.15)  # bf16 on disk
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 2 / 3
    spec = json.loads(command.split("--speculative-config ")[1].strip("'"))
    assert command.startswith("vllm serve base-folder ") and spec["method"] == "medusa"
    assert spec["model"] == str(tmp_path) and spec["num_speculative_tokens"] == 3


@pytest.mark.parametrize("kind", ["subset", "shared", "own"])
def test_tgi_export_reads_back_as_the_heads(tmp_path, kind):
    heads, lm_head, command, config, tensors = exported(tmp_path, kind, "tgi", "medusa_lm_head.safetensors")
    assert "architectures" not in config  # TGI would take the folder for another speculator
    assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, heads.num_layers)
    assert config["base_model_name_or_path"] == "base-folder"
    names = {f"{i}.{j}.linear.{k}" for i in range(3) for j in range(heads.num_layers) for k in ("weight", "bias")}
    v1 = kind != "subset"  # one shared layer loads as V2 (the backbone's lm_head); else V1 projections
    names |= {f"{i}.{heads.num_layers}.weight" for i in range(3)} if v1 else set()
    assert set(tensors) == names
    hidden = torch.randn(HIDDEN)
    got, want = engine_logits(tensors, config, hidden, "tgi", lm_head.weight), own_logits(heads, hidden)
    finite = ~want.isinf()  # TGI reads a subset's heads out over the whole vocabulary
    assert torch.allclose(got[finite], want[finite], rtol=0.05, atol=0.15)
    assert command == f"text-generation-launcher --model-id {tmp_path} --speculate 3"
    again = load_heads(tmp_path, lm_head)  # the canonical layout: medusa-chat reads it back too
    assert (again.num_heads, again.num_layers, again.shared) == (3, heads.num_layers, not v1)  # V1: own projections


def test_sglang_and_unknown_formats_are_refused(tmp_path):
    heads, lm_head = make_heads("subset")
    with pytest.raises(UserError, match="EAGLE"):
        export_heads(heads, lm_head.weight, tmp_path / "s", "sglang", "base")
    with pytest.raises(UserError, match="vllm, tgi, sglang"):
        export_heads(heads, lm_head.weight, tmp_path / "x", "onnx", "base")
    assert not (tmp_path / "s").exists() and not (tmp_path / "x").exists()


@pytest.mark.embedded
def test_export_cli_writes_the_embedded_models_heads(tmp_path):
    from app.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["export", str(tmp_path / "tgi"), "--format", "tgi"]) == 0
    assert out.getvalue().startswith("text-generation-launcher --model-id ")
    config = json.loads((tmp_path / "tgi" / "config.json").read_text())
    assert config["medusa_num_heads"] == 4 and config["vocab_size"] == 49152
