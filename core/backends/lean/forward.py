"""The lean forward: embedding → decoder layers → final norm of a Llama-family (or Qwen3, Gemma 3)
model on a StaticKV.

It runs straight from the model's own modules (nothing is copied). Where every layer runs on the
kernel library, a step's layers go through its whole-layer decoder in one call; a prompt is read
through the same decoder, in causal blocks of the rows it takes, so a position's keys and values
are the same bits whether a prefill or a step computed them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from core.backends import stepops
from core.backends.base import Taps
from core.backends.lean.kv import StaticKV
from core.backends.lean.layer import LeanLayer, causal_mask, norm, window_mask
from core.backends.lean.native import native_decoder, run_native
from core.backends.lean.rope import Rope, takes_kinds


class LeanForward:
    """Embedding → decoder layers → final norm of a Llama-family (or Qwen3, Gemma 3) model, on a
    StaticKV. Gemma 3's sliding and full layers read rotary tables of their own (`ropes`)."""

    def __init__(self, model: nn.Module) -> None:
        base = model.base_model
        config = model.config.get_text_config()
        self.embed = base.embed_tokens
        self.layers = [LeanLayer(layer, config, i) for i, layer in enumerate(base.layers)]
        first = self.layers[0]
        self.kv_heads, self.head_dim = first.kv_heads, first.head_dim
        self.dtype = model.dtype
        kinds = sorted({one.kind for one in self.layers}) if takes_kinds(base.rotary_emb) else [None]
        self.ropes = [Rope(base.rotary_emb, self.head_dim, self.dtype, kind) for kind in kinds]
        self.rope_of = [kinds.index(one.kind) if len(kinds) > 1 else 0 for one in self.layers]  # per layer
        self.rope = self.ropes[0]
        self.final_norm = norm(base.norm, stepops.ops(self.dtype, model.device))
        self.native = native_decoder(base.layers, config, self.layers, self.rope_of)  # every layer in one call, or None
        self.kv_bits = stepops.kv_bits()  # the keys' and values' bits where the library's decoder runs the layers
        library = self.native is not None or (first.ops is not None and stepops.Ops.attends(self.head_dim))
        self.split = stepops.split() if library else None  # where the library's attention cuts keys into parts

    def new_cache(self, bits: int | None = None) -> StaticKV:
        """An empty cache, its keys and values in `bits` (None: the model's `kv_bits`): 8 bits only
        for the library's decoder (torch's layers take bf16)."""
        bits = (bits or self.kv_bits) if self.native is not None else 16
        return StaticKV(len(self.layers), self.kv_heads, self.head_dim, self.dtype, bits=bits)

    def tree_room(self, past: int) -> int | None:
        """The most nodes a tree after `past` positions may have for each node to get a one-token
        step's bits. The library's attention cuts the keys into parts at multiples of
        `stepops.split()` positions and joins the parts in float; a tree's nodes lie at slots past
        their positions, so a tree whose slots reach the next multiple would put some node's keys
        in other parts than its one-token step's (None: torch's attention, no such cut)."""
        split = self.split
        return None if split is None else split - past % split

    def run(
        self, ids: Tensor, positions: Tensor, mask: Tensor | None, cache: StaticKV, taps: Taps = ()
    ) -> tuple[Tensor, Tensor | None]:
        """(T,) tokens at (T,) positions after the cache's prefix → (T, H) final hidden states and,
        with `taps` (hidden-state indices, ascending: the stream after that many layers), (T,
        len(taps)·H) those streams side by side (None without taps).

        `mask`: (1, 1, T, past + T) additive float mask, or None for causal attention. The T new
        keys and values are appended to the cache."""
        t, past = ids.numel(), cache.length
        cache.reserve(past + t)
        causal = mask is None and t > 1
        if causal and (past or self.native is not None):  # after a prefix, or for the library's decoder
            mask, causal = causal_mask(t, past, self.dtype, ids.device), False
        ropes = [rope(positions) for rope in self.ropes]
        x = self.embed(ids).contiguous()
        if self.native is not None and t > stepops.Ops.MAX_ROWS and (mask is None or mask.dtype == self.dtype):
            streams = self._in_blocks(x, ropes, positions, mask, cache, past, taps)
        else:
            streams = run_native(self.native, x, ropes, past, mask, causal, cache, positions=positions, taps=taps)
        if streams is None:  # the layers one by one
            x, tapped = self._layers(x, ropes, positions, cache, past, mask, causal, taps)
            streams = torch.cat(tapped, dim=-1) if taps else None
        cache.length = past + t
        return self.final_norm(x), streams if taps else None

    def prefill(self, cache: StaticKV, ids: Tensor, taps: Taps = ()) -> tuple[Tensor, Tensor | None]:
        """The prompt (n,) after the cache's prefix → (n, H) final hidden states (and the tapped
        streams). Where the library's decoder runs the steps, the prompt goes through it too, in
        causal blocks of as many rows as it takes: a position's keys and values are then the same
        bits whether a prefill or a step computed them, so a reply that reuses a kept cache (steps'
        entries) reads exactly as one that reads its whole prompt."""
        library = self.native is not None
        chunk = stepops.Ops.MAX_ROWS if library else ids.numel()
        every, tapped = [], []
        for start in range(0, ids.numel(), chunk):
            part, past = ids[start : start + chunk], cache.length
            positions = torch.arange(past, past + part.numel(), device=ids.device)
            # an explicit causal mask: a causal block without one is left to torch's attention
            mask = causal_mask(part.numel(), past, self.dtype, ids.device) if library and part.numel() > 1 else None
            hidden, streams = self.run(part, positions, mask, cache, taps)
            every.append(hidden)
            tapped.append(streams)
        return torch.cat(every), torch.cat(tapped) if taps else None

    def _in_blocks(self, x, ropes, positions, mask, cache, past, taps: Taps) -> Tensor:
        """More rows than the library's decoder takes at once (x updated in place) in blocks of
        `Ops.MAX_ROWS`, in order: a block's rows see the keys the blocks before wrote, and each
        row's bits are its own whatever block it is in. The tapped streams, as `run_native`'s."""
        step, tapped = stepops.Ops.MAX_ROWS, []
        for a in range(0, x.shape[0], step):
            b = min(a + step, x.shape[0])
            part = x[a:b]  # contiguous rows: updated in place
            tables = [(cos[a:b], sin[a:b]) for cos, sin in ropes]
            seen = mask[:, :, a:b, : past + b]
            tapped.append(run_native(self.native, part, tables, past + a, seen, False, cache, positions[a:b], taps))
        return torch.cat(tapped)

    def _layers(self, x, ropes, positions, cache, past, mask, causal, taps: Taps) -> tuple[Tensor, list[Tensor]]:
        """The layers one by one on torch's ops (and the library's row-by-row ops), with each
        sliding-window layer's mask; the streams after the `taps`."""
        masks = {0: (mask, causal)}
        tapped = [x.clone()] if 0 in taps else []
        for i, (layer, r) in enumerate(zip(self.layers, self.rope_of, strict=True), 1):
            if layer.window not in masks:
                masks[layer.window] = window_mask(mask, causal, positions, past, layer.window, self.dtype)
            x = layer(x, ropes[r], cache, past, *masks[layer.window])
            tapped += [x.clone()] if i in taps else []
        return x, tapped
