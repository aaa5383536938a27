"""Drafters: Medusa heads filling a fixed tree. (Plain decoding is `step.NoDrafter`.)"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from core.step import Draft
from core.tree import TreeBuffers, check_fits


class Heads(Protocol):
    num_heads: int

    def __call__(self, hidden: Tensor, count: int | None = None) -> Tensor:
        """(…, H) → (…, count, V) logits of the first `count` heads (all by default)."""
        ...


class MedusaDrafter:
    """Each head's top-k at the last committed position, placed into the tree by (depth, rank)."""

    def __init__(self, heads: Heads, tree: TreeBuffers, top_k: int = 10, tree_name: str = "the tree"):
        check_fits(tree, heads.num_heads, top_k, tree_name)
        self.heads = heads
        self.tree = tree
        self.gather = tree.candidate_index()  # (T - 1,) into the flattened (depth, top_k) table

    def propose(self, hidden: Tensor, root: Tensor, history: Sequence[int] = ()) -> Draft:
        if self.tree.size == 1:
            return Draft(root.view(1), self.tree)
        with torch.inference_mode():
            logits = self.heads(hidden, self.tree.max_depth)  # (D, V)
        candidates = logits.topk(self.tree.top_k, dim=-1).indices.flatten()  # (D * top_k,)
        return Draft(torch.cat([root.view(1), candidates[self.gather]]), self.tree)
