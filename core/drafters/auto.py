"""The policy-driven drafter: each step's tree as the speculation policy (`policy`) chooses it,
from the heads' top candidates and the continuations the lookups find (the context's own text,
and with a corpus, the model's past replies)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from core.decode.tree import CONTEXT, RETRIEVAL, TreeBuffers, build_tree, graft
from core.drafters.base import Draft, Drafter
from core.drafters.lookup import NgramIndex, node_count
from core.drafters.policy import CONTEXT_DEPTH, CONTEXT_KEY, RANKS, Choice, Policy
from core.drafters.retrieval import RETRIEVAL_LENGTH, Corpus

TREES = 256  # tree buffers an AutoDrafter keeps built (each step's tree may differ)


class AutoDrafter(Drafter):
    """A drafter whose tree the policy chooses each step, from the heads' top candidates and the
    context's continuations; `observe` feeds each step's outcome back to the policy."""

    def __init__(
        self,
        heads,
        policy: Policy,
        branches: int = 2,
        length: int = 4,
        max_ngram: int = 4,
        corpus: Corpus | None = None,
    ) -> None:
        self.heads, self.policy = heads, policy
        self.ranks = min(RANKS, getattr(heads, "vocab_size", RANKS))  # a tiny vocabulary has fewer candidates
        policy.accuracy[:, self.ranks :] = 0
        self.branches, self.length = branches, length
        self.index = NgramIndex(max_ngram)
        self.corpus = corpus if policy.use_retrieval else None
        self._trees: dict[tuple, TreeBuffers] = {}
        self._length = self._next_length = -1  # the history's length at the last step, and after it
        self._new_reply: bool | None = None  # told by `rewind` (None: never told, the lengths tell)
        self._last: tuple | None = None  # (choice, candidates, probs, found, retrieved, evidence) of the step

    def rewind(self, prompt_ids: Sequence[int], reused: int) -> int:
        """A new reply (its prompt read from position `reused` on): the policy's state needs none of the
        prompt's. The loop says so before every reply (steps another drafter took in between, under
        `switch.Fastest`, are not one)."""
        self._new_reply = True
        return reused

    def propose(self, hidden: Tensor, root: Tensor, history: Sequence[int] = ()) -> Draft:
        new = self._new_reply if self._new_reply is not None else len(history) != self._next_length
        if new:  # not the continuation of the last step: a new reply
            self.policy.new_reply()
        self._new_reply = None if self._new_reply is None else False
        self._length = len(history)
        found: list[list[int]] = []
        if self.policy.use_lookup and len(history) > 1:
            self.index.sync(history)
            found = self.index.continuations(self.branches, self.length)
        retrieved, evidence = [], 0
        if self.corpus is not None and len(history) > 1:
            retrieved, evidence = self.corpus.continuations(history, self.branches, RETRIEVAL_LENGTH)
        lookup, offered = self._offer(found, retrieved, evidence)
        most = max(map(len, offered), default=0)
        lookup_nodes = [node_count([c[:k] for c in offered]) for k in range(1, most + 1)]
        choice = self.policy.choose(lookup_nodes, lookup)
        candidates = probs = None
        tokens, tree = [int(root)], self._tree(())
        if choice.drafted:
            with torch.inference_mode():
                top, p = self.heads.top(hidden, self.policy.accuracy.shape[0], self.ranks)
            candidates = torch.nn.functional.pad(top.cpu(), (0, RANKS - self.ranks), value=-1)
            probs = torch.nn.functional.pad(p.float().cpu(), (0, RANKS - self.ranks), value=-1)
            choice = self.policy.refine(choice, probs, lookup_nodes, lookup)
            tree = self._tree(choice.paths)
            index = (tree.depth[1:] - 1) * RANKS + tree.rank[1:]  # into the flattened (heads, RANKS) table
            tokens += candidates.flatten()[index].tolist()
        sources: tuple[int, ...] = ()
        if choice.lookup and offered:
            cut, merged = choice.lookup, None
            if found and lookup != ("retrieval", evidence):  # the context alone, or both
                tokens, tree, merged = graft(tree, tokens, [c[:cut] for c in found], CONTEXT)
            if retrieved and lookup != CONTEXT_KEY:  # the past replies alone, or both
                tokens, tree, merged = graft(tree, tokens, [c[:cut] for c in retrieved], RETRIEVAL, merged)
            sources = tuple(merged)
        self._last = (choice, candidates, probs, found, retrieved, evidence)
        device = root.device
        return Draft(torch.tensor(tokens, device=device), tree.on(device), sources)

    def _offer(self, found: list[list[int]], retrieved: list[list[int]], evidence: int) -> tuple:
        """The lookup this step offers the policy and its continuations: both lookups when their
        first tokens differ (at most one can be right, so their chances add up), else the one
        expected to match further (the context on a tie: it is this reply's own text)."""
        other = ("retrieval", evidence)
        if not retrieved:
            return CONTEXT_KEY, found
        if not found:
            return other, retrieved
        if not {c[0] for c in found} & {c[0] for c in retrieved}:
            return (CONTEXT_KEY, other), found + retrieved
        reach = self.policy.reach
        return (
            (other, retrieved)
            if reach(other, CONTEXT_DEPTH) > reach(CONTEXT_KEY, CONTEXT_DEPTH)
            else (CONTEXT_KEY, found)
        )

    def _tree(self, paths: tuple[tuple[int, ...], ...]) -> TreeBuffers:
        """The tree of these head paths (built once, kept among the last `TREES` used)."""
        tree = self._trees.pop(paths, None) or build_tree(list(paths))
        self._trees[paths] = tree  # most recently used last
        if len(self._trees) > TREES:
            del self._trees[next(iter(self._trees))]
        return tree

    def observe(self, draft: Draft, emitted: Sequence[int], seconds: float) -> None:
        """`emitted`: the step's new tokens (accepted drafts, then the backbone's own)."""
        self._next_length = self._length + len(emitted)
        if self._last is not None:
            choice, candidates, probs, found, retrieved, evidence = self._last
            self.policy.observe(choice, candidates, emitted, found, seconds, probs, retrieved, evidence)
            self._last = None

    @property
    def last_choice(self) -> Choice | None:
        return self._last[0] if self._last else None
