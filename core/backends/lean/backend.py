"""`LeanBackend`: the backend interface (`core.backends.base.Backend`) over the lean forward.

It is what `accelerate` returns: the model (its linear layers packed in place), the lean forward
over it, and whether a tree's logits go a node at a time (`row_head`: the lm_head's cost grows
with every row, as with bf16 emulated without native bf16 arithmetic).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from core.backends import q4, stepops
from core.backends.base import DenseLogits, Logits, OnModel, RowLogits, Taps, project
from core.backends.lean.forward import LeanForward
from core.backends.lean.kv import StaticKV
from core.backends.lean.packed import QUANTIZED, PackedLinear
from core.measure import clock


class LeanBackend(OnModel):
    """The lean forward on packed and native kernels, with a pre-allocated `StaticKV`."""

    def __init__(self, model: nn.Module, row_head: bool = False) -> None:
        self.model = model
        self.forward = LeanForward(model)
        self.row_head = row_head  # a tree's logits a node at a time (measured by `accelerate`)

    @property
    def layer_kernel(self) -> str | None:
        layers = self.forward.layers
        return layers[0].qkv.kernel if layers else None

    @property
    def rows_one_by_one(self) -> bool:
        return self.forward.native is not None  # the library's decoder computes the rows one by one

    def tree_room(self, past: int) -> int | None:
        return self.forward.tree_room(past)

    def describe(self) -> str:
        """ "lean, int4 layers, onednn lm_head", "lean, q4 layers in one call, q8 lm_head by node"…"""
        kernel = self.layer_kernel
        if kernel is None:
            return "transformers"
        head = getattr(self.model.get_output_embeddings(), "kernel", "dense")
        whole = " in one call" if self.forward.native is not None else ""
        flavors = q4.flavors(self._amx_rows()) if {kernel, head} & {"q4", "q8"} else ""
        ops = self.forward.layers[0].ops if self.forward.layers else None
        attention = ops.attention_kernel(self.forward.layers[0].head_dim) if ops is not None else "vectors"
        scores = f", {stepops.NAMES[attention]}" if attention in stepops.NAMES else ""
        kv = ", 8-bit KV" if self.forward.kv_bits == 8 and self.forward.native is not None else ""
        return f"lean, {kernel} layers{whole}, {head} lm_head{' by node' if self.row_head else ''}{flavors}{scores}{kv}"

    def _amx_rows(self) -> int:
        """From how many rows the library's weights take AMX (0: none): the lm_head's or a layer's."""
        weights = [self.model.get_output_embeddings(), *(layer.qkv for layer in self.forward.layers[:1])]
        return max((w.packed.amx for w in weights if isinstance(getattr(w, "packed", None), q4.Packed)), default=0)

    def new_cache(self) -> StaticKV:
        return self.forward.new_cache()

    def length(self, cache: StaticKV) -> int:
        return cache.length

    def prefill(self, cache: StaticKV, ids: Tensor, taps: Taps = ()) -> tuple[Tensor, Tensor | None]:
        return self.forward.prefill(cache, ids, taps)

    def run(
        self, ids: Tensor, positions: Tensor, mask: Tensor | None, cache: StaticKV, taps: Taps = ()
    ) -> tuple[Tensor, Tensor | None]:
        return self.forward.run(ids, positions, mask, cache, taps)

    def keep_path(self, cache: StaticKV, prefix_len: int, path: Tensor) -> None:
        cache.keep_path(prefix_len, path)

    def truncate(self, cache: StaticKV, size: int) -> None:
        cache.truncate(size)

    def reserve(self, cache: StaticKV, size: int) -> None:
        cache.reserve(size)

    def logits(self, hidden: Tensor, tree: bool = False) -> Logits:
        if tree and self.row_head:
            return RowLogits(self._project, hidden)
        return DenseLogits(self._project(hidden))

    def _project(self, hidden: Tensor) -> Tensor:
        return project(self.model, hidden)


def cost_grows_by_row(head: PackedLinear, rows: int = 8) -> bool:
    """Whether `rows` rows through the lm_head cost more than twice one row (a kernel that
    re-reads the weights per row, such as bf16 emulated without native bf16 arithmetic)."""
    x = torch.zeros(rows, head.in_features, dtype=torch.bfloat16 if head.kernel in QUANTIZED else head.packed.dtype)
    with torch.inference_mode():
        one, many = (clock.time_ms(lambda n=n: head(x[:n]), repeats=3, fastest=True) for n in (1, rows))
    return many > 2 * one
