"""The backend interface: a model's forward and its KV cache, called the same way whatever runs them.

A decode step needs five things of the model: a fresh cache, a forward of some tokens at given
positions under a mask on top of that cache (`run`; `prefill` for a prompt), the cache cut back to
an accepted path (`keep_path`) or to a prefix (`truncate`), and next-token logits from the final
hidden states (`logits`). Two backends implement them: `core.backends.torch.TorchBackend`
(transformers' model and its DynamicCache: any architecture, any device, bitsandbytes weights)
and `core.backends.lean.LeanBackend` (the lean CPU forward on packed and native kernels, with a
pre-allocated `StaticKV`). The decode step and loop call only this interface, so they never ask
which cache or which logits they hold.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

Taps = tuple[int, ...]  # hidden-state indices, ascending: the residual stream after that many layers
# The attention kernels a step may run with (`core.measure.attention` measures which is faster on a
# GPU): PyTorch's own choice, or every kernel but cuDNN's (which builds a plan per new shape).
ATTENTION: dict[str, tuple[SDPBackend, ...] | None] = {
    "default": None,
    "no-cudnn": (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
}


class Cache(Protocol):
    """A KV cache of committed positions (transformers' DynamicCache, the lean `StaticKV`)."""

    def get_seq_length(self) -> int: ...


class Logits(Protocol):
    """Next-token logits of T positions, read by the acceptance rules. `by_row`: they are computed
    a node at a time as `[node]` asks (a walk down the tree then pays only for its path), so a rule
    that reads every node asks `full()` instead."""

    by_row: bool

    def __getitem__(self, node: int) -> Tensor:
        """(V,) the logits at position `node`."""
        ...

    def full(self) -> Tensor:
        """(T, V) every position's logits."""
        ...


class Backend(Protocol):
    """A model's forward and its KV cache. Every method that takes a cache takes one this backend's
    `new_cache` made; only the cache passed in is mutated."""

    model: nn.Module  # the transformers model: its config, embeddings and the lm_head weight Medusa heads read
    row_head: bool  # a tree's logits are computed a node at a time (the lm_head's cost grows with every row)
    attention: str  # a key of ATTENTION: the attention kernels its steps and drafting run with

    def kernels(self) -> AbstractContextManager:
        """Where a step (its drafting, verify and commit) runs: under the `attention` kernels."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def layer_kernel(self) -> str | None:
        """The decoder layers' packed matmul kernel ("int4", "q4", …), None for transformers' layers."""
        ...

    @property
    def rows_one_by_one(self) -> bool:
        """Whether the decoder layers compute a tree's rows one at a time, each with the bits a
        one-token step gives it, whatever the dtype (the kernel library's whole-layer decoder)."""
        ...

    def tree_room(self, past: int) -> int | None:
        """The most nodes a tree verified after `past` cached positions may have for each node to
        get the bits a one-token step at its position would (None: no bound of the backend's)."""
        ...

    def describe(self) -> str:
        """How the forward runs, for reports and the step-cost key ("transformers", "lean, q4 layers…")."""
        ...

    def new_cache(self) -> Cache: ...

    def length(self, cache: Cache) -> int:
        """Positions the cache holds."""
        ...

    def prefill(self, cache: Cache, ids: Tensor, taps: Taps = ()) -> tuple[Tensor, Tensor | None]:
        """A prompt's (n,) tokens after the cache's prefix, causally → (n, H) final hidden states
        and, with `taps`, (n, taps·H) the streams after that many layers side by side (else None)."""
        ...

    def run(
        self, ids: Tensor, positions: Tensor, mask: Tensor | None, cache: Cache, taps: Taps = ()
    ) -> tuple[Tensor, Tensor | None]:
        """(T,) tokens at (T,) positions after the cache's prefix → (T, H) hidden states after the
        final norm, and the tapped streams as `prefill` gives them. `mask`: (1, 1, T, past + T)
        additive float mask, or None for causal attention. The T keys and values are appended."""
        ...

    def keep_path(self, cache: Cache, prefix_len: int, path: Tensor) -> None:
        """Keep entries [0, prefix_len) and the tree nodes `path` (indices relative to prefix_len,
        ascending), moved down to follow the prefix: the cache of a plain run over those tokens."""
        ...

    def truncate(self, cache: Cache, size: int) -> None:
        """Drop every entry from position `size` on."""
        ...

    def reserve(self, cache: Cache, size: int) -> None:
        """Room for `size` positions made now, where the cache is pre-allocated (else nothing): a
        reply's prompt and longest reply, so that it does not grow in its middle."""
        ...

    def logits(self, hidden: Tensor, tree: bool = False) -> Logits:
        """(T, H) final hidden states → their next-token logits. `tree`: the states of a tree's
        nodes, which the backend may leave to be computed a node at a time (`row_head`)."""
        ...


class OnModel:
    """What a backend reads off its transformers model: the device and dtype it computes in, and
    the attention kernels chosen for it."""

    model: nn.Module
    attention = "default"

    def kernels(self) -> AbstractContextManager:
        allowed = ATTENTION[self.attention]
        return nullcontext() if allowed is None else sdpa_kernel(list(allowed))

    def tree_room(self, past: int) -> int | None:
        return None

    def reserve(self, cache: Cache, size: int) -> None:
        pass  # transformers' caches grow as they fill

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


def project(model: nn.Module, hidden: Tensor) -> Tensor:
    """(T, H) last hidden states → (T, V) next-token logits (the lm_head, soft-capped where the model does)."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


class DenseLogits:
    """Every position's logits, computed at once."""

    by_row = False

    def __init__(self, values: Tensor) -> None:
        self.values = values  # (T, V)

    def __getitem__(self, node: int) -> Tensor:
        return self.values[node]

    def full(self) -> Tensor:
        return self.values


class RowLogits:
    """Next-token logits computed one node at a time, the first time `[node]` asks: where the
    lm_head's cost grows with every row, a walk down the tree pays only for the nodes on its path,
    and each row rounds exactly as a one-token step's does."""

    by_row = True

    def __init__(self, project_rows: Callable[[Tensor], Tensor], hidden: Tensor) -> None:
        self.project_rows, self.hidden = project_rows, hidden  # (rows, H) → (rows, V); (T, H)
        self._rows: dict[int, Tensor] = {}

    def __getitem__(self, node: int) -> Tensor:
        node = int(node)
        if node not in self._rows:
            self._rows[node] = self.project_rows(self.hidden[node : node + 1])[0]  # (V,)
        return self._rows[node]

    def full(self) -> Tensor:
        return torch.stack([self[n] for n in range(self.hidden.shape[0])])
