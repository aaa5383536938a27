"""The transformers backend: the model's own forward and its DynamicCache.

It serves any architecture on any device, bitsandbytes' 4- and 8-bit weights included: a tree's
verify forward is the model's own attention with a 4D float mask and explicit position ids. A model
with sliding-window layers (Gemma 2/3, Mistral's window, Qwen2's optional one) gets the tree mask
with the window applied for those layers: transformers takes a given 4D mask as is, for every layer.
`core.backends.lean` serves Llama-family models on the CPU faster; everything else runs here.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from core.backends.base import DenseLogits, OnModel, Taps, project
from core.backends.cache import argument


class TorchBackend(OnModel):
    """`core.backends.base.Backend` over a transformers causal LM."""

    row_head = False  # the lm_head runs once over every node
    layer_kernel = None  # transformers' own layers
    rows_one_by_one = False  # a tree's rows go through each matmul together

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._windows = windows(model.config)

    def describe(self) -> str:
        return "transformers"

    def new_cache(self) -> DynamicCache:
        return DynamicCache()  # filled lazily, layer by layer

    def length(self, cache: DynamicCache) -> int:
        return cache.get_seq_length()

    def prefill(self, cache: DynamicCache, ids: Tensor, taps: Taps = ()) -> tuple[Tensor, Tensor | None]:
        base = self.model.base_model
        out = base(input_ids=ids.view(1, -1), **argument(base, cache), use_cache=True, output_hidden_states=bool(taps))
        return out.last_hidden_state[0], _tapped(out, taps)  # (n, H)

    def run(
        self, ids: Tensor, positions: Tensor, mask: Tensor | None, cache: DynamicCache, taps: Taps = ()
    ) -> tuple[Tensor, Tensor | None]:
        base = self.model.base_model
        out = base(
            input_ids=ids.view(1, -1),
            attention_mask=layered(mask, positions, self._windows),
            position_ids=positions.view(1, -1),
            **argument(base, cache),
            use_cache=True,
            output_hidden_states=bool(taps),
        )
        return out.last_hidden_state[0], _tapped(out, taps)

    def keep_path(self, cache: DynamicCache, prefix_len: int, path: Tensor) -> None:
        keep = path + prefix_len  # (A + 1,) ascending: parents precede children
        end = prefix_len + path.numel()
        for layer in cache.layers:
            # (B, heads, S, head_dim); the gather copies before the write, so overlap is safe
            layer.keys[..., prefix_len:end, :] = layer.keys[..., keep, :]
            layer.values[..., prefix_len:end, :] = layer.values[..., keep, :]
            layer.keys = layer.keys[..., :end, :]
            layer.values = layer.values[..., :end, :]

    def truncate(self, cache: DynamicCache, size: int) -> None:
        cache.crop(size - cache.get_seq_length())  # transformers takes the count to remove, as a negative number

    def logits(self, hidden: Tensor, tree: bool = False) -> DenseLogits:
        return DenseLogits(project(self.model, hidden))


def windows(config) -> dict[str, int] | None:
    """The sliding window of each kind of layer in `config`, by the names transformers' masks are
    keyed by: {layer type: window} for a model with `layer_types` and sliding layers, {"": window}
    for one whose every layer slides (Mistral's config), None where no layer slides."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if not window:
        return None
    if types:
        if "sliding_attention" not in types:
            return None
        return {"full_attention": 0, "sliding_attention": int(window)}
    return {"": int(window)}


def layered(mask: Tensor | None, positions: Tensor, windows: dict[str, int] | None) -> Tensor | dict | None:
    """The tree mask as the model takes it: as is without sliding layers; with the window applied
    (a query at position p sees keys at positions above p - window, as transformers' and llama.cpp's
    sliding layers do) for the sliding ones, keyed by layer type where the model has several kinds.
    Keys before the T queries are the committed prefix, each at its index; the queries' own keys sit
    at their positions."""
    if mask is None or windows is None:
        return mask  # causal: transformers builds each layer type's mask itself
    past = mask.shape[-1] - positions.numel()
    keys = torch.cat([torch.arange(past, device=positions.device), positions.view(-1)])
    by_type = {}
    for kind, window in windows.items():
        if window <= 0:
            by_type[kind] = mask
            continue
        outside = keys.view(1, -1) <= positions.view(-1, 1) - window  # (T, past + T)
        by_type[kind] = mask.masked_fill(outside.to(mask.device), torch.finfo(mask.dtype).min)
    return by_type.get("", by_type)  # one mask where every layer slides


def _tapped(out, taps: Taps) -> Tensor | None:
    """(T, taps·H) a transformers output's hidden states at `taps`, side by side."""
    return torch.cat([out.hidden_states[t][0] for t in taps], dim=-1) if taps else None
