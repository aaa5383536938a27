"""The EAGLE draft layer on packed weights (the lean backend's parts), with its own KV cache:
what `core.drafters.eagle_tree.EagleDrafter` runs each drafted depth on."""

from __future__ import annotations

import copy

import torch
from torch import Tensor

from core.backends import lean as fast
from core.drafters.eagle import EagleDraft, scaled_taps


def draft_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The packed kernel a draft layer runs on: q8 where the library takes it (the whole layer in
    one call, `fast.run_native`), else oneDNN's, else torch's dense matmul (a GPU)."""
    return next((k for k in ("q8", "onednn") if device.type == "cpu" and fast.kernel_works(k, dtype)), "dense")


class LeanDraft:
    """The draft model on packed weights: fc → one `fast.LeanLayer` → norm, on a StaticKV."""

    def __init__(self, draft: EagleDraft, dtype: torch.dtype) -> None:
        device = draft.fc.weight.device
        kernel = draft_kernel(device, dtype)
        config = draft.layer.self_attn.config
        layer = copy.deepcopy(draft.layer).to(device=device, dtype=dtype)  # a copy to pack, made where the draft is
        fast.pack_layer(layer, kernel)  # on a GPU "dense", and torch's ops (fast.LeanLayer keys them by device)
        self.fc = fast.PackedLinear(draft.fc.weight.to(dtype), draft.fc.bias.to(dtype), kernel)
        self.taps = draft.taps
        self.fuse = fast.PackedLinear(draft.fuse.weight.to(dtype), None, kernel) if draft.taps else None
        self.layer = fast.LeanLayer(layer, config, 0)
        self.native = fast.native_decoder([layer], config, [self.layer])
        self.rope = fast.Rope(draft.rotary, self.layer.head_dim, dtype)
        self.norm = fast.norm(copy.deepcopy(draft.norm).to(device=device, dtype=dtype))
        self.readout = fast.PackedLinear(draft.readout_weight.to(dtype), None, kernel)
        self.vocab = draft.vocab
        self.embed = draft.embed
        self.dtype, self.device = dtype, device

    def fused(self, features: Tensor) -> Tensor:
        """`EagleDraft.fused` on the packed weights: the committed positions' (n, H) features."""
        if self.fuse is None:
            return features
        return self.fuse(scaled_taps(features, len(self.taps)).to(self.dtype))

    def new_cache(self) -> fast.StaticKV:
        return fast.StaticKV(1, self.layer.kv_heads, self.layer.head_dim, self.dtype, device=self.device)

    def room(self, t: int, mask: Tensor | None, cache: fast.StaticKV) -> tuple[int, Tensor | None, bool]:
        """Room in `cache` for `t` more rows: the cache's length, and the mask and whether attention
        is plainly causal (an explicit causal mask where a block follows cached entries)."""
        past = cache.length
        cache.reserve(past + t)
        causal = mask is None and t > 1
        if causal and past:
            mask, causal = fast.causal_mask(t, past, self.dtype, self.device), False
        return past, mask, causal

    def __call__(self, features: Tensor, ids: Tensor, positions: Tensor, mask, cache: fast.StaticKV) -> Tensor:
        """(T, H) features and (T,) next tokens at (T,) positions → (T, H) predicted features;
        their keys and values are appended after the cache's length (which is not moved)."""
        past, mask, causal = self.room(ids.numel(), mask, cache)
        x = self.fc(torch.cat([features.to(self.dtype), self.embed(ids).to(self.dtype)], dim=-1))
        rope = self.rope(positions)
        if fast.run_native(self.native, x, rope, past, mask, causal, cache) is None:
            x = self.layer(x, rope, cache, past, mask, causal)
        return self.norm(x)

    def logits(self, predicted: Tensor) -> Tensor:
        return self.readout(predicted)
