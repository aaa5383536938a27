"""A GGUF file's tokenizer as its description holds it: written compact (`compact_merges`) and
loaded by the fast tokenizer's constructor (`described_tokenizer`), with as little memory as the
tokenizers library allows (a 262k vocabulary, Gemma 3's, holds ~92 MB loaded)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def compact_merges(file: Path) -> None:
    """`file`'s BPE merges written as "a b" strings, not [a, b] pairs, where no merged token holds
    a space (both are tokenizers' forms). Loading reads the merges through serde's buffered forms of
    each: for Gemma's 515k merges the pairs raised the load's peak by ~190 MB (+356 MB over the
    loaded tokenizer's 96) and left ~150 MB of the heap in pieces. The same tokenizer either way."""
    if not file.is_file():
        return
    tokenizer = json.loads(file.read_text(encoding="utf-8"))
    model = tokenizer.get("model") or {}
    merges = model.get("merges")
    if model.get("type") != "BPE" or not merges or not all(isinstance(m, list) and len(m) == 2 for m in merges):
        return
    if any(" " in part for merge in merges for part in merge):
        return
    model["merges"] = [f"{a} {b}" for a, b in merges]
    tmp = file.with_name(f".{file.name}.{os.getpid()}")
    tmp.write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    tmp.replace(file)


# what a description's tokenizer_config.json may set besides its special tokens
TOKENIZER_SETTINGS = {
    "model_max_length", "add_bos_token", "add_eos_token", "clean_up_tokenization_spaces", "chat_template"
}  # fmt: skip


def described_tokenizer(folder: Path):
    """The tokenizer of a GGUF file's description in `folder`: made from its tokenizer.json by the
    fast tokenizer's constructor with the config's special tokens and settings and the chat
    template saved beside them. Not rebuilt by its family's class from vocabulary and merges in
    Python (~160 MB more held for Gemma's 262k vocabulary), nor loaded through `from_pretrained`,
    whose deep copies of its arguments peak ~220 MB higher. The same ids, text and chat turns
    either way (tested)."""
    from transformers import PreTrainedTokenizerFast

    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    settings = {k: v for k, v in config.items() if k.endswith("_token") or k in TOKENIZER_SETTINGS}
    template = folder / "chat_template.jinja"  # where transformers saves a tokenizer's chat template
    if template.is_file():
        settings["chat_template"] = template.read_text(encoding="utf-8")
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), name_or_path=str(folder), **settings)
