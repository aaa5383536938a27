"""The stock transformers copies of a loaded backbone that the benchmark compares against."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from core.decode import precision
from models import gguf_files
from models.loader import Backbone, device_map
from models.quantization import estimate_gb


def stock_peers(backbone: Backbone, dtypes: dict[str, torch.dtype]) -> tuple[dict[str, PreTrainedModel], list[str]]:
    """The stock copies the benchmark's transformers modes run on (mode → dtype asked for), one
    per dtype, and a sentence for each one left out. On a GPU a quantized backbone's peers load in
    its own 4- or 8-bit setting (a full-precision copy beside it is another model's memory, and
    another model's arithmetic), and a copy that would not fit in the free memory is skipped."""
    quantized = precision.quantization(backbone.model) is not None and backbone.model.device.type == "cuda"
    copies: dict[torch.dtype, PreTrainedModel] = {}
    peers, skipped = {}, []
    for mode, dtype in dtypes.items():
        dtype = backbone.model.dtype if quantized else dtype
        if dtype not in copies:
            if short := _short_of_memory(backbone, dtype, quantized):
                skipped.append(f"The {mode} mode is skipped: {short}")
                continue
            copies[dtype] = load_stock(backbone, dtype, same_quantization=quantized)
        peers[mode] = copies[dtype]
    return peers, skipped


def _short_of_memory(backbone: Backbone, dtype: torch.dtype, quantized: bool) -> str | None:
    """Why a stock copy would not fit beside the backbone on its GPU (None: it fits, or no GPU)."""
    device = backbone.model.device
    if device.type != "cuda":
        return None
    config = AutoConfig.from_pretrained(backbone.folder)
    quant = precision.quantization(backbone.model) if quantized else "none"
    need = 1.2 * estimate_gb(config, dtype, quant) + 1.0  # and room to decode in
    free = torch.cuda.mem_get_info(device)[0] / 2**30
    if free >= need:
        return None
    return f"its copy of the model needs about {need:.1f} GB of GPU memory and {free:.1f} GB is free."


def load_stock(backbone: Backbone, dtype: torch.dtype, same_quantization: bool = False) -> PreTrainedModel:
    """The backbone's model as stock transformers loads it, with none of our speed-ups: the
    reference the benchmark compares against. `same_quantization`: in the backbone's own
    bitsandbytes setting (its dtype and 4- or 8-bit weights) where it has one, on its device."""
    device = backbone.model.device
    quant = getattr(backbone.model.config, "quantization_config", None)
    if same_quantization and quant is not None:
        options = {"quantization_config": quant} if not isinstance(quant, dict) else {}  # a dict: the repo's own
        model = AutoModelForCausalLM.from_pretrained(
            backbone.folder, dtype=backbone.model.dtype, device_map=device_map(device), **options
        )
        return model.eval()
    model = AutoModelForCausalLM.from_pretrained(gguf_files.with_weights(backbone.folder, backbone.gguf), dtype=dtype)
    return model.to(device).eval()
