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


def save_tiny_model(folder: Path, seed: int = 0, shape: tuple[int, int] = (64, 2), chars: str = CHARS) -> ModelSpec:
    """A random Llama of a 96-token vocabulary in `folder`, and its spec; `shape`: its hidden size
    and layer count (a draft model for another of the same tokenizer); `chars`: the tokenizer's
    characters in id order (another order: another vocabulary of the same size)."""
    torch.manual_seed(seed)
    hidden, layers = shape
    config = LlamaConfig(
        vocab_size=len(chars), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
        eos_token_id=chars.index(EOS),
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="?", eos_token=EOS).save_pretrained(folder)
    return ModelSpec(str(folder), folder, folder, None, None, "cpu-8")
