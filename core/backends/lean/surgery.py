"""Model surgery for the lean backend: which models it serves, and their linear layers swapped in
place for `PackedLinear`s (q/k/v and gate/up fused into one matmul each)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from core.backends.lean.backend import LeanBackend, cost_grows_by_row
from core.backends.lean.layer import act_name
from core.backends.lean.packed import PackedLinear

# model_type values whose decoder layers the lean forward reproduces
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
WINDOWED = ("gemma3_text",)  # the families whose sliding-window layers it reproduces


def servable(config) -> bool:
    """Whether the lean forward reproduces the forward of a model with this (transformers) config."""
    text = config.get_text_config()
    if text.model_type not in SUPPORTED or getattr(config, "quantization_config", None):
        return False
    if text.model_type in WINDOWED:  # the text model alone (Gemma3ForCausalLM), causal, no attention softcapping
        return (
            config.model_type == text.model_type
            and act_name(text) == "gelu_tanh"
            and getattr(text, "attn_logit_softcapping", None) is None
            and not getattr(text, "use_bidirectional_attention", False)
        )
    return act_name(text) == "silu" and not any("sliding" in t for t in (getattr(text, "layer_types", None) or []))


class Part(nn.Module):
    """Columns [start, stop) of a fused PackedLinear's output: what the original q/k/v or
    gate/up projection returned, so the transformers forward still works after fusing."""

    def __init__(self, fused: PackedLinear, start: int, stop: int) -> None:
        super().__init__()
        self.fused, self.start, self.stop = fused, start, stop

    def forward(self, x: Tensor) -> Tensor:
        return self.fused(x)[..., self.start : self.stop]


def _fuse(parent: nn.Module, names: tuple[str, ...], kernel: str) -> PackedLinear:
    """One PackedLinear over the concatenated outputs of `parent`'s linear layers `names`,
    which become Parts of it."""
    parts = [getattr(parent, n) for n in names]
    weight = torch.cat([p.weight for p in parts])
    biases = [p.bias for p in parts]
    bias = (
        None
        if all(b is None for b in biases)
        else torch.cat(
            [b if b is not None else weight.new_zeros(p.weight.shape[0]) for p, b in zip(parts, biases, strict=True)]
        )
    )
    fused = PackedLinear(weight, bias, kernel)
    start = 0
    for name, part in zip(names, parts, strict=True):
        stop = start + part.weight.shape[0]
        setattr(parent, name, Part(fused, start, stop))
        start = stop
    return fused


def pack_layer(layer: nn.Module, kernel: str) -> None:
    """Pack one decoder layer's linear layers in place (q/k/v and gate/up fused), for `LeanLayer`."""
    attn, mlp = layer.self_attn, layer.mlp
    attn.qkv = _fuse(attn, ("q_proj", "k_proj", "v_proj"), kernel)
    attn.o_proj = PackedLinear(attn.o_proj.weight, attn.o_proj.bias, kernel)
    mlp.gate_up = _fuse(mlp, ("gate_proj", "up_proj"), kernel)
    mlp.down_proj = PackedLinear(mlp.down_proj.weight, mlp.down_proj.bias, kernel)


def accelerate(
    model: nn.Module, kernel: str, head_kernel: str, by_row: Callable[[PackedLinear], bool] | None = None
) -> LeanBackend:
    """Pack the model's linear layers (in place) and return the lean backend over it, which every
    consumer of the model (the decode loop, the step-cost curve, head training) then runs.

    Decoder layers get `kernel` with q/k/v and gate/up fused into one matmul each; the lm_head
    gets `head_kernel` and keeps its `weight` (tied to the embedding), which Medusa heads read.
    `by_row(head)`: whether a tree's logits go a node at a time (default: timed here, now; the
    loader passes `core.measure.kernels.head_by_row`, which remembers it)."""
    for layer in model.base_model.layers:
        if not any(isinstance(m, PackedLinear) for m in layer.modules()):  # else packed as it loaded
            pack_layer(layer, kernel)
    head = model.get_output_embeddings()
    packed = PackedLinear(head.weight, head.bias, head_kernel)
    packed.weight = head.weight
    model.set_output_embeddings(packed)
    backend = LeanBackend(model)
    backend.row_head = (by_row or cost_grows_by_row)(packed)
    return backend
