"""Drafters: Medusa heads filling a fixed tree, context lookup (and retrieval from the model's
past replies where the context finds nothing), and both in one tree per step.

(Plain decoding is `base.NoDrafter`; `build.make_drafter` builds these by kind.) Every drafter
returns distinct children under each node, fixed before verification, which keeps lossless
sampling exact whatever the source.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from core.decode.tree import CONTEXT, RETRIEVAL, TreeBuffers, build_tree, check_fits, graft
from core.drafters.base import Draft, Drafter
from core.drafters.lookup import NgramIndex
from core.drafters.retrieval import Corpus


class Heads(Protocol):
    num_heads: int

    def candidates(self, hidden: Tensor, count: int, k: int) -> Tensor:
        """(count, k) token ids: the first `count` heads' top-k at `hidden`."""
        ...


class MedusaDrafter(Drafter):
    """Each head's top-k at the last committed position, placed into the tree by (depth, rank)."""

    def __init__(self, heads: Heads, tree: TreeBuffers, top_k: int = 10, tree_name: str = "the tree"):
        check_fits(tree, heads.num_heads, top_k, tree_name)
        self.heads = heads
        self.tree = tree
        self.gather = tree.candidate_index()  # (T - 1,) into the flattened (depth, top_k) table

    def propose(self, hidden: Tensor, root: Tensor, history: Sequence[int] = ()) -> Draft:
        if self.tree.depth.device != root.device:  # the tree's positions and mask go to the model
            self.tree = self.tree.on(root.device)
            self.gather = self.tree.candidate_index()
        if self.tree.size == 1:
            return Draft(root.view(1), self.tree)
        with torch.inference_mode():
            candidates = self.heads.candidates(hidden, self.tree.max_depth, self.tree.top_k).flatten()  # (D·top_k,)
        return Draft(torch.cat([root.view(1), candidates[self.gather]]), self.tree)


class LookupDrafter(Drafter):
    """Continuations of the history's longest earlier-seen suffix (in the context, else in the
    `corpus` of past replies), grafted under the root of `base` (the heads' draft in hybrid mode,
    else the root alone). `context` False: the corpus only."""

    def __init__(
        self,
        base: MedusaDrafter | None = None,
        branches: int = 2,
        length: int = 4,
        max_ngram: int = 4,
        corpus: Corpus | None = None,
        context: bool = True,
    ):
        self.base = base
        self.branches, self.length = branches, length
        self.index = NgramIndex(max_ngram) if context else None
        self.corpus = corpus
        self.root_only = build_tree([])

    def propose(self, hidden: Tensor, root: Tensor, history: Sequence[int] = ()) -> Draft:
        self.root_only = self.root_only.on(root.device)  # a lone root too is verified on the model's device
        draft = self.base.propose(hidden, root, history) if self.base else Draft(root.view(1), self.root_only)
        found, source = continuations(self.index, self.corpus, history, self.branches, self.length, self.length)
        return with_branches(draft, found, source)


def continuations(
    index: NgramIndex | None,
    corpus: Corpus | None,
    history: Sequence[int],
    branches: int,
    length: int,
    corpus_length: int,
) -> tuple[list[list[int]], int]:
    """Continuations of the history's longest earlier-seen suffix in the context (`index`), else
    in the past replies (`corpus`, `corpus_length` tokens long), and which (CONTEXT or RETRIEVAL)."""
    if len(history) < 2:
        return [], CONTEXT
    found: list[list[int]] = []
    if index is not None:
        index.sync(history)
        found = index.continuations(branches, length)
    if not found and corpus is not None:
        return corpus.continuations(history, branches, corpus_length)[0], RETRIEVAL
    return found, CONTEXT


def with_branches(draft: Draft, found: list[list[int]], source: int) -> Draft:
    """`draft` with the continuations `found` grafted under its root (see `tree.graft`), on the
    draft's device."""
    if not found:
        return draft
    base = list(draft.sources) if draft.sources else None
    tokens, tree, sources = graft(draft.tree, draft.tokens.tolist(), found, source, base)
    device = draft.tokens.device
    return Draft(torch.tensor(tokens, device=device), tree.on(device), tuple(sources))
