"""The EAGLE drafter's files: its own draft files round trip and are refused for another model,
published EAGLE-1 checkpoints draft as their own code would (or are refused in one sentence),
`train-drafter eagle` then `generate` with it, the shipped drafter, and a checkpoint fetched from
the (fake) hub."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from core.backends.torch import TorchBackend
from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.drafters.eagle import DrafterCard, load_draft, save_draft
from core.drafters.eagle_tree import EagleDrafter
from core.errors import UserError
from models.eagle_formats import load_published
from tests.helpers import plain_tokens, tiny_model
from tests.helpers import tiny_eagle_draft as _draft


def test_draft_file_round_trip_and_refusals(tmp_path):
    model = tiny_model("llama")
    draft = _draft(model, vocab=torch.tensor([1, 5, 9, 40]))
    file = tmp_path / "draft.safetensors"
    save_draft(file, draft, DrafterCard("tiny", 96, 64, (0.5, 0.3)))
    loaded, card = load_draft(file, model, "tiny")
    assert card.acceptance == (0.5, 0.3) and loaded.vocab.tolist() == [1, 5, 9, 40]
    x = torch.randn(1, 3, 64)
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        torch.testing.assert_close(
            loaded(x, ids, torch.arange(3).view(1, -1), None),
            draft(x, ids, torch.arange(3).view(1, -1), None),
            rtol=1e-2,
            atol=2e-2,
        )  # fmt: skip (bf16 on disk)
    with pytest.raises(UserError, match="made for tiny"):
        load_draft(file, tiny_model("llama", vocab=80))
    with pytest.raises(UserError, match="made for tiny"):
        load_draft(file, model, "another-model")
    file.write_bytes(file.read_bytes()[:100])
    with pytest.raises(UserError, match="cannot be read"):
        load_draft(file, model)


def _eagle1_checkpoint(folder, model, seed: int = 4) -> dict:
    """A tiny checkpoint in the EAGLE-1/2 layout: fc over [embedding; feature] with a bias, one
    decoder layer without an input norm, the embedding beside it; saved as their pickle."""
    config = model.config
    hidden = config.hidden_size
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        layer = LlamaDecoderLayer(config, 0)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.2)
        tensors = {"fc.weight": torch.randn(hidden, 2 * hidden) * 0.2, "fc.bias": torch.randn(hidden) * 0.1}
    tensors |= {f"layers.0.{k}": v for k, v in layer.state_dict().items() if not k.startswith("input_layernorm")}
    tensors["embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(tensors, folder / "pytorch_model.bin")
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "bias": True}))
    return tensors


def test_published_eagle1_checkpoint_drafts_as_its_own_code_would(tmp_path):
    model = tiny_model("llama")
    tensors = _eagle1_checkpoint(tmp_path / "eagle", model)
    draft = load_published(tmp_path / "eagle", model)
    # the reference, written out as the EAGLE code computes it
    layer = LlamaDecoderLayer(model.config, 0)
    layer.input_layernorm = torch.nn.Identity()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in tensors.items() if k.startswith("layers.0.")})
    features, ids = torch.randn(1, 5, 64), torch.tensor([[3, 1, 4, 1, 5]])
    positions = torch.arange(5).view(1, -1)
    with torch.inference_mode():
        x = torch.nn.functional.linear(
            torch.cat([model.get_input_embeddings()(ids), features], -1), tensors["fc.weight"], tensors["fc.bias"]
        )
        out = layer(x, position_embeddings=model.model.rotary_emb(x, positions), position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        reference = model.get_output_embeddings()(out)
        ours = draft.logits(draft(features, ids, positions, None))
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
    prompt = [5, 17, 3, 17, 9, 5, 17]
    drafter = EagleDrafter(draft, model.dtype, lookup=False, budget=10)
    backend = TorchBackend(model)
    _, done = collect(stream(backend, prompt, DecodeSettings(max_new_tokens=30), drafter))
    assert list(done.token_ids) == plain_tokens(backend, prompt, 30)


def test_published_checkpoints_that_do_not_fit_are_refused_in_one_sentence(tmp_path):
    model = tiny_model("llama")
    torch.save({"midlayer.self_attn.q_proj.weight": torch.zeros(64, 128), "d2t": torch.zeros(8)}, tmp_path / "p.bin")
    (tmp_path / "three").mkdir()
    (tmp_path / "p.bin").rename(tmp_path / "three" / "pytorch_model.bin")
    with pytest.raises(UserError, match="EAGLE-3 drafter without a readable config"):
        load_published(tmp_path / "three", model)
    _eagle1_checkpoint(tmp_path / "wide", tiny_model("llama", vocab=96), seed=1)
    narrow = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    with pytest.raises(UserError, match="not an EAGLE drafter for this model"):
        load_published(tmp_path / "wide", narrow)
    (tmp_path / "wide" / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(UserError, match="cannot be read"):
        load_published(tmp_path / "wide", model)
    with pytest.raises(UserError, match="holds no EAGLE checkpoint"):
        load_published(tmp_path, model)


def test_train_drafter_eagle_then_generate_with_it(tmp_path):
    """Train a drafter for the embedded model on a few replies, then decode with it: a card with
    per-depth acceptance, a rerun that resumes, and tokens exactly the plain loop's in float32."""
    from tests.test_cli import cli, generate_json

    prompts = tmp_path / "prompts.jsonl"
    lines = ["Say hi.", "Name a fruit.", "Count to 3.", "Name a color.", "Say bye."]
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in lines))
    out = tmp_path / "eagle.safetensors"
    args = ["--kind", "eagle", "--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "24"]
    args += ["--samples", "1"]  # a sampled reply to each training prompt beside the greedy one
    run = cli("train-drafter", *args, "--held-out", "0.4", "--epochs", "2", "--passes", "2", "--draft-vocab", "300")
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    card = json.loads(out.with_suffix(".json").read_text())
    assert card["replies_held_out"] == 2 and len(card["held_out"]["acceptance"]) == 3 and card["draft_vocab"] <= 300
    assert card["sampled_replies"] == 3 and len((tmp_path / "eagle" / "sampled-1.jsonl").read_text().splitlines()) == 3
    assert "depth" in out.with_suffix(".md").read_text()
    epoch = tmp_path / "eagle" / "eagle" / "epoch-1.safetensors"
    made = epoch.stat().st_mtime_ns
    again = cli("train-drafter", *args, "--held-out", "0.4", "--epochs", "2", "--passes", "2", "--draft-vocab", "300")
    assert again.returncode == 0 and epoch.stat().st_mtime_ns == made  # resumed: nothing trained again
    assert json.loads(out.with_suffix(".json").read_text())["held_out"] == card["held_out"]
    common = ["--prompt", "Name three fruits.", "--dtype", "float32", "--max-new-tokens", "24"]
    ours = generate_json(*common, "--drafter", "eagle", "--eagle", str(out))
    plain = generate_json(*common, "--mode", "baseline")
    assert ours["drafter"] == "eagle" and ours["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    bad = cli("generate", *common, "--drafter", "eagle", "--eagle", str(tmp_path / "missing.safetensors"))
    assert bad.returncode != 0 and "No EAGLE drafter" in bad.stderr and "Traceback" not in bad.stderr


def test_a_bad_eagle_option_is_one_sentence_before_anything_is_answered(tmp_path):
    from tests.test_cli import cli

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Say hi."}))
    out = tmp_path / "eagle.safetensors"
    run = cli("train-drafter", "--kind", "eagle", "--prompts", str(prompts), "--out", str(out), "--samples", "-1")
    assert run.returncode == 2 and "--samples at least 0" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "eagle").exists()  # no work dir, no transcripts: nothing was answered


def test_shipped_drafter_drafts_for_the_embedded_model_exactly_and_is_accepted():
    from importlib import resources
    from pathlib import Path

    from models.loader import eagle_for, load_backbone, resolve

    backbone = load_backbone(dtype="float32")
    file = Path(str(resources.files("assets") / "eagle" / "smollm2-135m-instruct.safetensors"))
    draft, card = load_draft(file, backbone.model, backbone.name)
    assert card.acceptance[0] > 0.3 and len(draft.vocab) == 8192
    assert resolve(backbone.name).eagle == file and eagle_for(backbone, file) is not None  # the model's own
    prompt = backbone.encode_chat("Explain how a refrigerator keeps food cold.")
    reference = plain_tokens(backbone.backend, prompt, 64)
    drafter = EagleDrafter(draft, torch.float32, lookup=False, budget=6)
    events, done = collect(stream(backbone.backend, prompt, DecodeSettings(max_new_tokens=64), drafter))
    assert list(done.token_ids) == reference
    assert sum(s == "eagle" for e in events for s in e.sources) > 10  # the trained layer's drafts are accepted


def test_generate_fetches_a_published_eagle_checkpoint_from_the_hub_and_decodes_exactly(tmp_path):
    """`--eagle org/name`: the checkpoint comes through the hub code (a local server speaking the
    hub's file API), loads for the embedded model, and greedy decoding keeps the plain tokens."""
    import os
    import subprocess
    import sys

    from models.loader import load_backbone
    from tests.fake_hub import FakeHub
    from tests.test_cli import generate_json

    backbone = load_backbone(dtype="float32")
    _eagle1_checkpoint(tmp_path / "ckpt", backbone.model)
    files = {name: (tmp_path / "ckpt" / name).read_bytes() for name in ("config.json", "pytorch_model.bin")}
    common = ["--prompt", "Name three rivers.", "--dtype", "float32", "--max-new-tokens", "24"]
    with FakeHub({"tiny-org/eagle-smol": files}) as fake:
        env = {**os.environ, "HF_ENDPOINT": fake.url, "HF_HUB_CACHE": str(tmp_path / "cache")}
        run = subprocess.run(
            [sys.executable, "-m", "app.main", "generate", "--json", *common, "--drafter", "eagle",
             "--eagle", "tiny-org/eagle-smol"],
            capture_output=True, text=True, env=env, timeout=600,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr
    ours = json.loads(run.stdout)["samples"][0]["token_ids"]
    assert ours == generate_json(*common, "--mode", "baseline")["samples"][0]["token_ids"]
    assert (tmp_path / "cache" / "models--tiny-org--eagle-smol").is_dir()
