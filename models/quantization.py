"""How a backbone's weights are quantized as it loads: what `--quantization auto` means on this
device and model, and bitsandbytes' configuration for nf4 and int8 (`models.loader` applies them)."""

from __future__ import annotations

import importlib.util
import sys

import torch

from core.backends import lean, quantize
from core.errors import UserError
from models import light
from models.choices import QUANTIZATIONS


def pick_quantization(name: str, device: torch.device, config: object, dtype: str = "auto") -> str:
    """`auto`: nf4 on a GPU; on a CPU the project's int4 for every model the lean forward serves
    (hub, folder or GGUF) where the int4 kernel runs and no dtype was asked for (`dtype` "auto"),
    else the model's own precision."""
    if name not in QUANTIZATIONS:
        raise UserError(f"Unknown quantization '{name}'; choose one of {', '.join(QUANTIZATIONS)}.")
    if getattr(config, "quantization_config", None):
        return "pre-quantized"  # the repo is already quantized (bitsandbytes and the like)
    if name == "auto":
        if device.type == "cuda":
            return "nf4"
        four_bit = dtype == "auto" and lean.servable(config) and lean.kernel_works("int4", torch.bfloat16)
        return "int4" if four_bit else "none"
    if name == "int4" and device.type != "cpu":
        raise UserError("--quantization int4 is for the CPU; on a GPU use nf4.")
    if name in ("nf4", "int8") and device.type == "cpu":
        print(
            f"warning: {name} on the CPU uses bitsandbytes' approximate kernel: tree and plain decoding may "
            "differ slightly; use --quantization none for exact results.",
            file=sys.stderr,
        )
    return name


def bnb_config(quant: str, dtype: torch.dtype, device: torch.device | None = None) -> object:
    """bitsandbytes' `BitsAndBytesConfig` for "nf4" or "int8" weights, computing in `dtype` (bf16
    for float32); one UserError sentence where bitsandbytes cannot run them on `device`."""
    try:
        import bitsandbytes
        from transformers import BitsAndBytesConfig
    except ImportError as e:
        raise UserError("4-bit and 8-bit loading need bitsandbytes; run `pip install bitsandbytes`.") from e
    if device is not None and device.type == "cpu" and importlib.util.find_spec("bitsandbytes.backends.cpu") is None:
        raise UserError(
            f"bitsandbytes {bitsandbytes.__version__} runs {quant} on CUDA only; on the CPU use --quantization int4 "
            "(Llama-family models) or none, or update bitsandbytes."
        )
    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = dtype if dtype != torch.float32 else torch.bfloat16
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
    )


def estimate_gb(config: object, dtype: torch.dtype, quantization: str, head_kernel: str | None = None) -> float:
    """Memory of the weights once loaded: linear layers at the quantized width, the rest at dtype,
    and on the lean CPU forward the lm_head's packed copy (`head_kernel`, the kernel chosen for it;
    a tied 8-bit one is the embedding too)."""
    meta = light.on_meta(config)
    output = meta.get_output_embeddings()
    linears = [m for m in meta.modules() if isinstance(m, torch.nn.Linear) and m is not output]
    linear = sum(m.weight.numel() for m in linears)
    total = sum(p.numel() for p in meta.parameters())
    full = torch.finfo(dtype).bits / 8
    width = {"nf4": 0.53, "int8": 1.0}.get(quantization, full)
    if quantization == "int4":  # the library's layout, by the layers' widths
        width = sum(m.weight.numel() * quantize.bytes_per_weight(4, m.in_features) for m in linears) / max(linear, 1)
    # the lm_head's packed copy, kept beside its weight (the embedding, or what Medusa heads read); "dense": none
    copy_width = {"q8": quantize.bytes_per_weight(8), "onednn": full}.get(head_kernel, 0.0)
    copy = output.weight.numel() * copy_width if output is not None else 0.0
    if copy and head_kernel == "q8" and getattr(config.get_text_config(), "tie_word_embeddings", False):
        copy -= output.weight.numel() * full  # one packed table, the embedding's too (`lean.share_vocabulary`)
    return (linear * width + (total - linear) * full + copy) / 2**30
