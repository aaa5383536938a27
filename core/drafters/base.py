"""The drafter contract: every method the decode loop may call on a drafter, declared once with
harmless defaults, and the two things every loop has (a step's `Draft`, and `NoDrafter`).

What the loop (`core.decode.generate.stream`) calls, in order, for one reply:
1) `rewind(prompt_ids, reused)` before every reply's prefill (`reused`: the prompt positions the kept
   cache holds, 0 without one);
2) `feed(...)` after the prefill, then after each step, only where `reads_features` (with the
   streams at `taps` before the last feature);
3) per step: `propose(...)`, then `last_choice` is read; after verify → accept → commit, `observe(...)`.
A drafter writes `propose` and whatever else it needs; the defaults keep no state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from core.decode.tree import HEADS, ROOT, TreeBuffers, build_tree, from_parents

if TYPE_CHECKING:
    from core.drafters.policy import Choice


@dataclass(frozen=True)
class Draft:
    tokens: Tensor  # (T,) token of each tree node; tokens[0] is the root
    tree: TreeBuffers
    sources: tuple[int, ...] = ()  # per node: tree.ROOT, HEADS, CONTEXT or BOTH (empty: the root, then heads)

    def source(self, node: int) -> int:
        return self.sources[node] if self.sources else (ROOT if node == 0 else HEADS)

    def first(self, n: int) -> Draft:
        """The draft of its tree's first `n` ≥ 1 nodes (itself when it has no more): still a tree,
        every node's parent coming before it."""
        if n >= self.tree.size:
            return self
        tree = self.tree
        cut = from_parents(tree.parents[:n], tree.rank[:n].tolist(), tree.paths[: n - 1])
        return Draft(self.tokens[:n], cut.on(tree.depth.device), self.sources[:n])


class Drafter(ABC):
    """Anything that turns the backbone's state into a tree of candidate tokens."""

    taps: tuple[int, ...] = ()  # hidden-state indices whose streams `feed` carries too (EAGLE-3's layers)
    reads_features: bool = False  # the loop feeds it the backbone's features of every committed position
    last_choice: Choice | None = None  # why the last proposed tree (an adaptive drafter's reason; None: fixed)

    @abstractmethod
    def propose(self, hidden: Tensor, root: Tensor, history: Sequence[int]) -> Draft:
        """hidden: (H,) last hidden state at the last committed position; root: () the
        backbone's next token (the tree's root); history: prompt and reply so far, root last."""

    def feed(self, features: Tensor, next_ids: Tensor, position: int) -> None:  # noqa: B027 (a default: nothing)
        """(Called only where `reads_features`.) `features`: the (n, taps·H + H) backbone features of
        the positions committed from `position` on (the prompt after the prefill, the accepted path
        after a step); `next_ids`: (n,) the token after each, the last one the next root."""

    def rewind(self, prompt_ids: Sequence[int], reused: int) -> int:
        """A new reply's prompt, of which the backbone's kept cache holds the first `reused`
        positions: keep own state for as many as it can and say how many (the prefill reads and
        feeds the prompt from there). By default a drafter keeps all it is told, unless it reads
        features: then it keeps nothing and is fed the whole prompt again."""
        return 0 if self.reads_features else reused

    def observe(self, draft: Draft, emitted: Sequence[int], seconds: float) -> None:  # noqa: B027 (a default: nothing)
        """After the step that verified `draft`: the tokens it emitted (accepted drafts, then the
        backbone's own) and its wall time; an adaptive drafter learns from them."""


class NoDrafter(Drafter):
    """Plain decoding: a tree of the root alone, one token per step."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.tree = build_tree([]).to(device)

    def propose(self, hidden: Tensor, root: Tensor, history: Sequence[int] = ()) -> Draft:
        self.tree = self.tree.on(root.device)
        return Draft(root.view(1), self.tree)
