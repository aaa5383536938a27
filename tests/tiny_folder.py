"""A tiny Llama saved like any transformers model, with a character tokenizer: what `load_backbone`
loads from a folder, in seconds and without downloads."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from models.loader import ModelSpec

CHARS = "".join(chr(32 + i) for i in range(95)) + "\n"  # printable ASCII and a newline: 96 tokens
EOS = "~"


def save_tiny_model(folder: Path, seed: int = 0) -> ModelSpec:
    """A random 2-layer Llama of a 96-token vocabulary in `folder`, and its spec."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(CHARS), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
        eos_token_id=CHARS.index(EOS),
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="?", eos_token=EOS).save_pretrained(folder)
    return ModelSpec(str(folder), folder, folder, None, None, "cpu-8")
