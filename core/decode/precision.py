"""Whether tree decoding returns the very tokens plain decoding would, for a loaded model.

A verify forward runs a tree's rows together where a plain step runs one row. The two agree
bit for bit only where every kernel gives a row the same result whatever the row count:
- float32 on the CPU (torch's kernels; `core.backends.lean` measures its packed kernels before it uses them);
- the kernel library's whole-layer decoder (`core.backends.q4`), which computes the rows one by one
  (a backend's `rows_one_by_one`).
Everywhere else a tree step and a plain step may round differently, so a near-tie between two
tokens can fall the other way, and the reply is exact only up to rounding:
- bf16 and fp16, on any device;
- bitsandbytes' 4- and 8-bit weights: on CUDA its 4-bit kernel is chosen by the row count (one
  row: a matrix-vector kernel; more: dequantize, then a matmul), and it computes in bf16 or fp16
  (`bnb_4bit_compute_dtype`) even when the model is loaded in float32;
- float32 on a GPU: cuBLAS chooses its kernels, and with them the order of the sums, by shape.
Typical acceptance is approximate by design, whatever the precision.
"""

from __future__ import annotations

import torch

from core.backends.base import Backend
from core.decode.settings import DecodeSettings

EXACT = "exact"
TYPICAL = "approximate (typical acceptance)"


def quantization(model) -> str | None:
    """How the model's weights are quantized by transformers ("nf4", "fp4", "int8", or the method
    of another quantizer); None for plain weights (the CPU's own int4 kernels are not counted:
    `core.backends.lean` computes rows alike with them where the library decoder runs)."""
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is None:
        return None
    if _field(config, "load_in_4bit"):
        return str(_field(config, "bnb_4bit_quant_type") or "fp4")
    if _field(config, "load_in_8bit"):
        return "int8"
    return str(_field(config, "quant_method") or "quantized")


def compute_dtype(model) -> torch.dtype:
    """The dtype the decoder layers really compute in: bitsandbytes' compute dtype for 4-bit
    weights, fp16 for 8-bit ones (it casts activations to fp16), else the model's dtype."""
    quant = quantization(model)
    if quant in ("nf4", "fp4"):
        dtype = _field(model.config.quantization_config, "bnb_4bit_compute_dtype")
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return dtype if isinstance(dtype, torch.dtype) else torch.float32
    if quant == "int8":
        return torch.float16
    return model.dtype


def rows_alike(backend: Backend) -> bool:
    """Whether a tree's verify forward gives every node the bits a one-token step would."""
    model = backend.model
    if quantization(model) is not None:
        return False
    if backend.rows_one_by_one:
        return True
    return model.dtype == torch.float32 and torch.device(model.device).type == "cpu"


def exactness(backend: Backend, settings: DecodeSettings | None = None, tree: bool = True) -> str:
    """What a reply decoded with these settings promises against plain decoding: "exact", "exact
    up to bfloat16 rounding" (and the like), or approximate under typical acceptance. `tree`
    False: plain decoding, the reference itself."""
    if not tree:
        return EXACT
    if settings is not None and settings.acceptance == "typical":
        return TYPICAL
    if rows_alike(backend):
        return EXACT
    return f"exact up to {str(compute_dtype(backend.model)).removeprefix('torch.')} rounding"


def _field(config, name: str):
    """A field of a quantization config, an object or (read from a config.json) a dict."""
    return config.get(name) if isinstance(config, dict) else getattr(config, name, None)
