"""The transformers backend: the model's own forward and its DynamicCache.

It serves any architecture on any device, bitsandbytes' 4- and 8-bit weights included: a tree's
verify forward is the model's own attention with a 4D float mask and explicit position ids.
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
            attention_mask=mask,
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


def _tapped(out, taps: Taps) -> Tensor | None:
    """(T, taps·H) a transformers output's hidden states at `taps`, side by side."""
    return torch.cat([out.hidden_states[t][0] for t in taps], dim=-1) if taps else None
