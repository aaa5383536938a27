"""Published EAGLE-3 checkpoints (`LlamaForCausalLMEagle3`: `midlayer.*`, `fc` over three of the
backbone's layers, `d2t`/`t2d`): tiny ones written in that layout load through `--eagle`'s path,
compute what the published code computes, draft target ids in the tree and decode exactly; one
made for another model is one sentence (exit 2 through the CLI).

The backbone is the tiny Llama of `tests.helpers` with 7 layers instead of 2: EAGLE-3 reads the
streams entering layers 2, L // 2 and L − 3, three distinct layers from L = 7 up."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from core.backends import lean as fast
from core.backends.torch import TorchBackend
from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.decode.step import prefill
from core.drafters.eagle3 import Eagle3Draft
from core.drafters.eagle_tree import EagleDrafter
from core.errors import UserError
from models.loader import eagle_for, resolve_eagle
from tests.helpers import FAST_KERNELS, plain_tokens, tiny_model

LAYERS, VOCAB, DRAFT_VOCAB = 7, 96, 40
SHAPE = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inner=96)
SMOL = dict(hidden=576, heads=9, kv_heads=3, head_dim=64, inner=128)  # the embedded model's width
PROMPT = [5, 17, 3, 17, 9, 5, 17, 60, 2]


def backbone(layers: int = LAYERS, vocab: int = VOCAB, hidden: int = 64, seed: int = 0) -> LlamaForCausalLM:
    """`tests.helpers`' tiny Llama, with `layers` decoder layers."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def write_checkpoint(
    folder: Path, vocab: int = VOCAB, draft_vocab: int = DRAFT_VOCAB, shape: dict = SHAPE, seed: int = 3,
    dtype: torch.dtype = torch.float32, **config,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """A random EAGLE-3 checkpoint in the published layout (config.json + model.safetensors, no
    embedding): its draft vocabulary a random subset of the target's, in order."""
    g = torch.Generator().manual_seed(seed)
    h, q, kv, inner = (
        shape["hidden"],
        shape["heads"] * shape["head_dim"],
        shape["kv_heads"] * shape["head_dim"],
        shape["inner"],
    )

    def rand(*size: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(*size, generator=g) * std

    targets = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    tensors = {
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * h), "midlayer.self_attn.k_proj.weight": rand(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * h), "midlayer.self_attn.o_proj.weight": rand(h, q),
        "midlayer.mlp.gate_proj.weight": rand(inner, h), "midlayer.mlp.up_proj.weight": rand(inner, h),
        "midlayer.mlp.down_proj.weight": rand(h, inner),
        "midlayer.input_layernorm.weight": 1 + rand(h, std=0.1), "midlayer.hidden_norm.weight": 1 + rand(h, std=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h, std=0.1), "norm.weight": 1 + rand(h, std=0.1),
        "fc.weight": rand(h, 3 * h, std=0.1), "lm_head.weight": rand(draft_vocab, h, std=1.0),
    }  # fmt: skip
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    tensors |= {"d2t": targets - torch.arange(draft_vocab), "t2d": t2d}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    fields = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": inner, "num_attention_heads": shape["heads"], "num_key_value_heads": shape["kv_heads"],
        "head_dim": shape["head_dim"], "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048, "hidden_act": "silu",
        "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
    } | config  # fmt: skip
    (folder / "config.json").write_text(json.dumps(fields))
    return tensors


def load(folder: Path, model) -> Eagle3Draft:
    """The draft as `--eagle FOLDER` loads it (`models.loader.resolve_eagle`, then `eagle_for`)."""
    return eagle_for(SimpleNamespace(model=model, name="tiny"), resolve_eagle(str(folder)))


def published_forward(t: dict, model, hidden_in: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The published EAGLE-3 layer written out as its code computes it, one causal sequence:
    row i reads the hidden state `hidden_in[i]` and the embedding of `tokens[i]` at position i
    → (T, draft vocabulary) logits and (T, H) outputs before the norm."""
    n, (heads, kv, d) = len(tokens), (4, 2, 16)

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    def proj(x, name):
        return x @ t[f"midlayer.{name}.weight"].float().T

    embeds = rms(model.get_input_embeddings()(tokens), t["midlayer.input_layernorm.weight"])
    x = torch.cat([embeds, rms(hidden_in, t["midlayer.hidden_norm.weight"])], -1)
    q = proj(x, "self_attn.q_proj").view(1, n, heads, d).transpose(1, 2)
    k = proj(x, "self_attn.k_proj").view(1, n, kv, d).transpose(1, 2)
    v = proj(x, "self_attn.v_proj").view(1, n, kv, d).transpose(1, 2)
    config = LlamaConfig(hidden_size=64, num_attention_heads=heads, head_dim=d, rope_theta=10000.0)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(n).view(1, -1))
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    h = hidden_in + proj(a.transpose(1, 2).reshape(n, heads * d), "self_attn.o_proj")
    m = rms(h, t["midlayer.post_attention_layernorm.weight"])
    h = h + proj(torch.nn.functional.silu(proj(m, "mlp.gate_proj")) * proj(m, "mlp.up_proj"), "mlp.down_proj")
    return rms(h, t["norm.weight"]) @ t["lm_head.weight"].T, h


def test_a_published_checkpoint_computes_what_its_code_computes(tmp_path):
    """fc over the streams entering layers 2, 3 and 4 on committed positions; the layer's output
    before the norm read by the next drafted position; its tokens the target's ids."""
    model = backbone()
    tensors = write_checkpoint(tmp_path / "eagle3")
    draft = load(tmp_path / "eagle3", model)
    assert isinstance(draft, Eagle3Draft) and draft.taps == (2, 3, 4)
    targets = torch.nonzero(tensors["t2d"]).flatten()
    assert draft.vocab.equal(targets) and draft.vocab.max() >= DRAFT_VOCAB  # draft ids mapped to the target's
    ids, n = torch.tensor(PROMPT), len(PROMPT) - 1
    with torch.inference_mode():
        states = model(ids[:n].view(1, -1), output_hidden_states=True).hidden_states
        streams = torch.cat([states[t][0] for t in (2, 3, 4)], -1)
        committed = streams @ tensors["fc.weight"].T
        logits, out = published_forward(tensors, model, committed, ids[1:])
        top = int(logits[-1].argmax())
        drafted_logits, _ = published_forward(
            tensors, model, torch.cat([committed, out[-1:]]), torch.cat([ids[1:], targets[top].view(1)])
        )
        fed = prefill(TorchBackend(model), TorchBackend(model).new_cache(), ids[:n], draft.taps).backbone_features()
        assert fed.shape == (n, 4 * 64)
        lean = EagleDrafter(draft, torch.float32, lookup=False, budget=4).lean
        cache = lean.new_cache()
        ours = lean(lean.fused(fed), ids[1:], torch.arange(n), None, cache)
        cache.length = n
        torch.testing.assert_close(lean.logits(ours).log_softmax(-1), logits.log_softmax(-1), rtol=1e-4, atol=1e-4)
        assert lean.vocab[lean.logits(ours[-1:]).argmax()] == targets[top]
        mask = torch.zeros(1, 1, 1, n + 1)
        again = lean(ours[-1:], targets[top].view(1), torch.tensor([n]), mask, cache)
        torch.testing.assert_close(
            lean.logits(again)[0].log_softmax(-1), drafted_logits[-1].log_softmax(-1), rtol=1e-4, atol=1e-4
        )
        reference = draft(draft.fused(fed)[None], ids[None, 1:], torch.arange(n)[None], None)  # the torch forward
        torch.testing.assert_close(draft.logits(reference)[0], logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", ["torch", *FAST_KERNELS[:1]])
def test_greedy_with_a_published_eagle3_drafter_equals_plain_greedy(tmp_path, kernel):
    """Transformers' backbone and the lean one: the drafted nodes (target ids, in the tree) are
    verified, and the tokens are the plain loop's."""
    model = backbone()
    backend = TorchBackend(model) if kernel == "torch" else fast.accelerate(copy.deepcopy(model), kernel, kernel)
    targets = set(torch.nonzero(write_checkpoint(tmp_path / "eagle3")["t2d"]).flatten().tolist())
    draft = load(tmp_path / "eagle3", backend.model)
    reference = plain_tokens(backend, PROMPT, 32)
    for budget in (1, 8):
        drafter = EagleDrafter(draft, torch.float32, lookup=False, budget=budget)
        events, done = collect(stream(backend, PROMPT, DecodeSettings(max_new_tokens=32), drafter))
        assert list(done.token_ids) == reference
        assert max(e.tree_size for e in events) > budget  # the draft's nodes were verified
        drafted = {t for e in events for t, s in zip(e.draft, e.node_sources, strict=True) if s == "eagle"}
        assert drafted and drafted <= targets and max(drafted) >= DRAFT_VOCAB


def test_a_checkpoint_for_another_model_is_one_sentence(tmp_path):
    write_checkpoint(tmp_path / "eagle3")
    cases = {
        "this model has 2": tiny_model("llama"),  # tests.helpers' 2 layers: no layers 2, 3 and 4
        r"vocabulary 96\); this model has width 64 and vocabulary 80": backbone(vocab=80),
        r"\(width 64, vocabulary 96\); this model has width 32": backbone(hidden=32),
    }
    for match, model in cases.items():
        with pytest.raises(UserError, match=match) as e:
            load(tmp_path / "eagle3", model)
        assert len(str(e.value).splitlines()) == 1 and str(e.value).endswith(".")
    write_checkpoint(tmp_path / "deep", eagle_aux_hidden_state_layer_ids=[1, 5, 9])
    with pytest.raises(UserError, match=r"taps layers \[1, 5, 9\]; this model has 7"):
        load(tmp_path / "deep", backbone())
    write_checkpoint(tmp_path / "named", eagle_aux_hidden_state_layer_ids=[4, 0, 6])
    assert load(tmp_path / "named", backbone()).taps == (0, 4, 6)  # the checkpoint's own, in layer order
    (tmp_path / "eagle3" / "config.json").unlink()
    with pytest.raises(UserError, match="without a readable config"):
        load(tmp_path / "eagle3", backbone())


def test_generate_with_a_published_eagle3_checkpoint(tmp_path):
    """`generate --drafter eagle --eagle FOLDER` on the embedded model: a checkpoint of its width
    and vocabulary (bf16, as published) keeps the plain tokens; the tiny model's is exit 2, one line."""
    from tests.test_cli import cli, generate_json

    write_checkpoint(tmp_path / "smol", vocab=49152, draft_vocab=512, shape=SMOL, dtype=torch.bfloat16)
    write_checkpoint(tmp_path / "tiny")
    common = ["--prompt", "Name three rivers.", "--dtype", "float32", "--max-new-tokens", "24"]
    ours = generate_json(*common, "--drafter", "eagle", "--eagle", str(tmp_path / "smol"))
    plain = generate_json(*common, "--mode", "baseline")
    assert ours["drafter"] == "eagle" and ours["samples"][0]["token_ids"] == plain["samples"][0]["token_ids"]
    bad = cli("generate", *common, "--drafter", "eagle", "--eagle", str(tmp_path / "tiny"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    (error,) = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert "EAGLE-3 drafter for another model" in error and error.endswith(".")


def test_norm_before_residual_feeds_the_normed_feature_to_the_residual_stream(tmp_path):
    """Checkpoints with `norm_before_residual` (vLLM's speculators convention) add the attention to
    the normed feature: the packed runtime and the torch forward agree, and differ from the default."""
    model = backbone()
    write_checkpoint(tmp_path / "before", norm_before_residual=True)
    write_checkpoint(tmp_path / "after")
    features, ids, n = torch.randn(6, 4 * 64), torch.tensor(PROMPT[1:7]), 6
    logp = {}
    with torch.inference_mode():
        for name in ("before", "after"):
            draft = load(tmp_path / name, model)
            lean = EagleDrafter(draft, torch.float32, lookup=False, budget=4).lean
            out = lean(lean.fused(features), ids, torch.arange(n), None, lean.new_cache())
            reference = draft(draft.fused(features)[None], ids[None], torch.arange(n)[None], None)
            torch.testing.assert_close(
                lean.logits(out).log_softmax(-1), draft.logits(reference)[0].log_softmax(-1), rtol=1e-4, atol=1e-4
            )
            logp[name] = lean.logits(out).log_softmax(-1)
    assert draft.norm_before_residual is False and not torch.allclose(logp["before"], logp["after"])
