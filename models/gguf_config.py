"""A GGUF file's transformers config read from its metadata without its vocabulary.

transformers builds a GGUF file's config in one of two ways: a builder per architecture
(`GGUF_CONFIG_ARCHS`, fed by its fast metadata reader, which counts a string array instead of
reading it) or its legacy reader, the `gguf` package's `GGUFReader`, which makes an array view of
every string of the vocabulary. For Gemma 3's 262k tokens that took ~12 s and ~750 MB a read, and a
GGUF file's first use read it three times (the checks, the config, the tokenizer's config). The
families the lean forward serves get a builder here that does what the legacy reader does with
their keys (equal to its result: `tests/test_gguf_real.py`); transformers' own builders win where
it has them.
"""

from __future__ import annotations

SERVED = ("gemma3", "llama", "mistral", "qwen2", "qwen3")  # the GGUF architectures the lean forward serves
# GGUF architectures transformers' legacy reader calls by another name
RENAMED = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
_TEXT_ONLY = {"gemma3": "gemma3_text"}  # a GGUF file holds the text backbone only


def register() -> None:
    """Builders for the served families in transformers' table (where it has none of its own)."""
    from transformers.integrations.gguf import GGUF_CONFIG_ARCHS

    for architecture in SERVED:
        GGUF_CONFIG_ARCHS.setdefault(architecture, config_of)


def config_of(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """The config dict transformers' legacy reader makes of a file with this metadata (as its fast
    reader gives it: a string array as its length) and these tensors."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture = metadata["general.architecture"]
    updated = "mistral" if "llama" in architecture and metadata.get("general.name") == "mistral" else architecture
    updated = RENAMED.get(updated, updated)
    config = {"tie_word_embeddings": "output.weight" not in tensor_names}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(updated) or GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {}
    for key, value in defaults.items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, rest = key.replace(architecture, updated).partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and architecture in value:
            value = value.replace(architecture, updated)
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if target not in (None, -1):
            config[target] = value
    config["model_type"] = _TEXT_ONLY.get(config["model_type"], config["model_type"])
    if "vocab_size" not in config and isinstance(metadata.get("tokenizer.ggml.tokens"), int):
        config["vocab_size"] = metadata["tokenizer.ggml.tokens"]  # the fast reader's count of the tokens
    return config
