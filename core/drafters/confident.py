"""A tree grown by a drafting network's own confidence (EAGLE-2), sized to this machine's step
costs: the common part of the EAGLE drafter (`core.drafters.eagle_tree`) and the draft-model
drafter (`core.drafters.draft_model`), which differ only in what they run a drafted depth on.

Positions: the network's cache holds the committed positions up to `_length()`, and its last
output predicts the token after the root (depth 1). A drafted node at depth d is run at position
`_length() + d − 1` and attends to every cached entry, its ancestors and itself.

The tree: the top `TOP_K` tokens under each expanded node, the `BEAM` most probable nodes of each
depth expanded (one forward a depth), then the most probable nodes kept. How many is chosen each
step where expected tokens per millisecond peak: a node's chance to be accepted is its path's
draft probability times a factor learned from how steps really went, and a tree of N nodes costs
the measured verify time at N + 1 nodes plus the drafting time. Where even the best tree is
expected slower than a plain step, the step is plain (probing every `PROBE_EVERY` steps).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from core.backends import stepops
from core.decode.tree import CONTEXT, RETRIEVAL, ROOT, SOURCES, build_tree, from_parents
from core.drafters.base import Draft, Drafter
from core.drafters.estimates import PRIOR_CURVE, CostCurve
from core.drafters.fixed import continuations, with_branches
from core.drafters.lookup import NgramIndex, node_count
from core.drafters.policy import Choice
from core.drafters.retrieval import RETRIEVAL_LENGTH, Corpus
from core.measure.clock import now

TOP_K = 8  # candidates under each expanded node
BEAM = 4  # nodes expanded per depth
DEPTH = 6  # how far ahead the draft looks
BUDGETS = (2, 4, 6, 8, 12, 16, 24, 32)  # drafted-node counts a step may verify
PROBE_EVERY = 8  # while plain steps win, draft every this many steps to keep measuring
MIN_CHANCE = 0.15  # a node less likely than this to be accepted is not expanded (a depth costs ~0.1 steps)


class ConfidenceTree(Drafter):
    """Drafts with a network that predicts the next tokens (`_start`, `_expand`); with `lookup` the
    context's continuations (and with a `corpus` the model's past replies) are grafted under the
    root as well. `source`: the tree source its own nodes are shown as (`core.decode.tree`)."""

    name = "draft"  # what its nodes are called in the step's reason ("EAGLE", "draft model")

    def __init__(
        self,
        source: int,
        curve: Callable[[], CostCurve | None] = lambda: None,
        lookup: bool = True,
        corpus: Corpus | None = None,
        budget: int | None = None,
        branches: int = 2,
        length: int = 4,
        depth: int = DEPTH,
    ) -> None:
        assert 0 < source < len(SOURCES)
        self.source = source
        self.depth = depth
        self.curve = curve
        self.fixed_budget = budget  # None: chosen each step from the costs
        self.index = NgramIndex(4) if lookup else None
        self.corpus = corpus
        self.branches, self.length = branches, length
        self.calibration = 1.0  # realized accepted drafts ÷ the draft's own expectation (running)
        self.draft_ms = 1.0  # running drafting time of a step
        self.plain_ms: float | None = None  # running time of a plain step (prices trees until the curve is measured)
        self.draft_rate: float | None = None  # running tokens a millisecond of the steps that drafted
        self.expand_ms: float | None = None  # running time of one draft forward (a depth of the tree)
        self._plain_streak = 0
        self._drafted = False  # the last step ran the draft
        self._verified = False  # a tree of its nodes has been verified (learning `calibration`)
        self._expected = 0.0
        self._offered = False  # the lookup's continuations went into the last tree
        self.lookup_value = 0.5  # running tokens accepted from the lookups' continuations when offered
        self.root_only = build_tree([])
        self.last_choice = None

    # -- what the network does (the subclass) ---------------------------------------------------

    @abstractmethod
    def _ready(self, history: Sequence[int]) -> bool:
        """Bring the network's cache up to the committed positions (`history`: prompt and reply,
        the root last); False when it has nothing to draft from."""

    @abstractmethod
    def _start(self) -> tuple[Tensor, Any]:
        """(V,) logits of the token after the root (log-probabilities up to a constant: `top_log_probs`
        reads them), and what its children's rows read besides their tokens (EAGLE: the predicted
        feature; None for a draft model)."""

    @abstractmethod
    def _expand(self, inputs: list[Any], tokens: list[int], position: int, mask: Tensor) -> tuple[Tensor, list[Any]]:
        """Rows of `tokens` (with `inputs` from `_start` or an earlier `_expand`), all at `position`,
        appended to the cache under `mask` ((1, 1, rows, cached + rows)) → (rows, V) logits and
        what each row's children read."""

    @abstractmethod
    def _length(self) -> int:
        """Entries in the network's cache."""

    @abstractmethod
    def _cut(self, size: int) -> None:
        """Cut the network's cache back to `size` entries."""

    def _token_ids(self, indices: Tensor) -> list[int]:
        """The target's token ids of the network's output indices (EAGLE-3 maps its own vocabulary)."""
        return indices.tolist()

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    # -- a step's tree ------------------------------------------------------------------------

    def propose(self, hidden: Tensor, root: Tensor, history: Sequence[int] = ()) -> Draft:
        t0 = now(root.device)
        self.last_choice = None
        self._drafted = False
        curve = self.curve() or self._prior()
        found, source = continuations(self.index, self.corpus, history, self.branches, self.length, RETRIEVAL_LENGTH)
        extra = node_count(found)
        self.root_only = self.root_only.on(root.device)  # a plain step's tree is verified on the model's device
        plain = Draft(root.view(1), self.root_only)
        probe = self._plain_streak % PROBE_EVERY == PROBE_EVERY - 1
        if not self._worth_drafting(curve, probe) or not self._ready(history):
            self._plain_streak += 1
            pays = (1 + self.lookup_value) / curve.at(1 + extra) > 1 / curve.at(1)
            return self._finish(plain, found if pays or self.fixed_budget else [], source, [], curve)
        tokens, parent, scores = self._grow(self._min_chance(curve))
        self._drafted = True
        draft_ms = (now(root.device) - t0) * 1000
        self.draft_ms = 0.8 * self.draft_ms + 0.2 * draft_ms
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        chance = (torch.tensor(scores).exp() * self.calibration).clamp(max=1.0)
        budget, found = (
            (self.fixed_budget, found)
            if self.fixed_budget is not None
            else self._budget(order, chance, curve, found, extra, force=probe or not self._verified)
        )
        if budget == 0:
            self._plain_streak += 1
            return self._finish(plain, found, source, [], curve)
        self._plain_streak = 0
        self._verified = True
        keep = closed(order, parent, budget)
        index = {-1: 0} | {n: i + 1 for i, n in enumerate(keep)}
        parents = [0] + [index[parent[n]] for n in keep]
        tree = from_parents(parents, [-1] * len(parents))
        device = root.device
        ids = torch.cat([root.view(1), torch.tensor([tokens[n] for n in keep], device=device, dtype=root.dtype)])
        draft = Draft(ids, tree.on(device), (ROOT,) + (self.source,) * len(keep))
        return self._finish(draft, found, source, chance[keep].tolist(), curve)

    def _worth_drafting(self, curve: CostCurve, probe: bool) -> bool:
        """Whether to run the draft this step: a fixed budget always does; else where the steps
        that drafted returned more tokens a millisecond (drafting included) than a plain step, or
        before that is known, or on a probe."""
        if self.fixed_budget is not None or probe or self.draft_rate is None:
            return True
        return self.draft_rate * curve.at(1) >= 1.0

    def _finish(
        self, draft: Draft, found: list[list[int]], source: int, chances: list[float], curve: CostCurve
    ) -> Draft:
        """`draft` with the lookup's continuations grafted under the root, and why."""
        self._expected = sum(chances)
        self._offered = bool(found)
        draft = with_branches(draft, found, source)
        nodes, drafted = draft.tree.size, len(chances)
        parts = [f"{self.name} tree of {drafted} nodes" if drafted else f"no {self.name} nodes"]
        if found:
            parts.append(f"{nodes - 1 - drafted} copied")
        expected = 1 + self._expected + (self.lookup_value if found else 0.0)
        ms = curve.at(nodes) + (self.draft_ms if drafted else 0.0)
        self.last_choice = Choice(drafted, 0, nodes, expected, ms, ", ".join(parts))
        return draft

    def _prior(self) -> CostCurve:
        """Before this machine's curve is measured: the prior's shape, in the plain steps' real
        milliseconds as this drafter has seen them (10 ms before it has seen one)."""
        scale = (self.plain_ms or 10.0) / PRIOR_CURVE.at(1)
        return CostCurve({n: ms * scale for n, ms in PRIOR_CURVE.step_ms.items()}, PRIOR_CURVE.heads_ms * scale)

    def _min_chance(self, curve: CostCurve) -> float:
        """How likely to be accepted a node must be to be expanded (one more draft forward)."""
        return MIN_CHANCE

    def _grow(self, min_chance: float = MIN_CHANCE) -> tuple[list[int], list[int], list[float]]:
        """Every drafted node: (token, parent node or −1 for the root, log-probability of its path);
        a node less likely than `min_chance` to be accepted is not expanded.

        A node is expanded only while a child of it could still be kept: a child scores no more
        than its parent and comes after every node already drafted, so once `limit` − 1 other
        nodes score at least as much as its parent, it is never among the `limit` most probable
        (what `closed` keeps); the tree is the same, with fewer draft forwards."""
        base = self._length()
        logits, first_in = self._start()
        k = min(TOP_K, logits.shape[-1])
        limit = self.fixed_budget if self.fixed_budget is not None else BUDGETS[-1]
        values, indices = top_log_probs(logits.view(1, -1), k)
        tokens = self._token_ids(indices[0])
        parent = [-1] * k
        scores = values[0].tolist()
        reads = dict.fromkeys(range(k), first_in)  # what each node's row reads besides its token
        entry: dict[int, int] = {}  # node → its row among the appended entries
        frontier = list(range(k))
        ancestors: list[list[int]] = []  # per appended entry: the entry rows it sees (its own last)
        floor = -math.inf  # a fixed budget is filled; else a path this unlikely is never kept
        if self.fixed_budget is None:
            floor = math.log(min_chance / max(self.calibration, 1e-3))
        hidden = torch.finfo(self.dtype).min
        for depth in range(1, self.depth):
            expand = [
                n
                for n in sorted(frontier, key=lambda n: -scores[n])[:BEAM]
                if scores[n] > floor and sum(s >= scores[n] for s in scores) < limit  # n counts itself
            ]
            if not expand:
                break
            rows = len(entry)
            for r, n in enumerate(expand):
                entry[n] = rows + r
                up = entry.get(parent[n])
                ancestors.append((ancestors[up] if up is not None else []) + [rows + r])
            width = rows + len(expand)
            tail = [[hidden] * width for _ in expand]
            for r in range(len(expand)):
                for a in ancestors[rows + r]:
                    tail[r][a] = 0.0
            mask = torch.zeros(1, 1, len(expand), base + width, dtype=self.dtype, device=self.device)
            mask[0, 0, :, base:] = torch.tensor(tail, dtype=self.dtype)
            self._cut(base + rows)
            t0 = now(self.device)
            logits, outs = self._expand([reads[n] for n in expand], [tokens[n] for n in expand], base + depth - 1, mask)
            ms = (now(self.device) - t0) * 1000
            self.expand_ms = ms if self.expand_ms is None else 0.8 * self.expand_ms + 0.2 * ms
            values, indices = top_log_probs(logits, k)
            values, ids = values.tolist(), [self._token_ids(row) for row in indices]
            frontier = []
            for r, n in enumerate(expand):
                for v, i in zip(values[r], ids[r], strict=True):
                    frontier.append(len(tokens))
                    tokens.append(i)
                    parent.append(n)
                    scores.append(scores[n] + v)
                    reads[len(tokens) - 1] = outs[r]
        self._cut(base)
        return tokens, parent, scores

    def _budget(
        self,
        order: list[int],
        chance: Tensor,
        curve: CostCurve,
        found: list[list[int]],
        extra: int,
        force: bool = False,
    ) -> tuple[int, list[list[int]]]:
        """The drafted node count, and whether the lookup's continuations go in too, with the most
        expected tokens per millisecond (a lookup's worth: its running accepted tokens a step).
        `force`: some nodes are drafted even where a plain step looks faster (a probe: the draft's
        own probabilities may understate how often it is right, which only a verified tree shows)."""
        sorted_chance = chance[order]
        best, best_rate = (0, []), -math.inf if force else 1.0 / curve.at(1)
        for with_lookup in (False, True) if found else (False,):
            bonus, nodes = (self.lookup_value, extra) if with_lookup else (0.0, 0)
            for b in BUDGETS if force else (0, *BUDGETS):
                if b > len(order):
                    break
                cost = curve.at(b + 1 + nodes)  # the drafting is spent whatever is verified
                rate = (1 + bonus + float(sorted_chance[:b].sum())) / cost
                if rate > best_rate:
                    best, best_rate = (b, found if with_lookup else []), rate
        return best

    def observe(self, draft: Draft, emitted: Sequence[int], seconds: float) -> None:
        """Learn how far the draft's own probabilities over- or under-state acceptance, and what
        the lookups' continuations are worth."""
        ms = seconds * 1000
        if draft.tree.size == 1 and not self._drafted:  # a plain step that drafted nothing either
            self.plain_ms = ms if self.plain_ms is None else 0.9 * self.plain_ms + 0.1 * ms
        if self._drafted:
            rate = len(emitted) / max(ms, 1e-3)
            self.draft_rate = rate if self.draft_rate is None else 0.8 * self.draft_rate + 0.2 * rate
        tokens, children = draft.tokens.tolist(), draft.tree.children.tolist()
        node, accepted, copied = 0, 0, 0
        for token in emitted[:-1]:  # follow the accepted path, counting each source's nodes
            node = next((c for c in children[node] if c >= 0 and tokens[c] == token), -1)
            if node < 0:
                break
            accepted += draft.source(node) == self.source
            copied += draft.source(node) in (CONTEXT, RETRIEVAL)
        if self._expected > 0:
            self.calibration = 0.9 * self.calibration + 0.1 * min(accepted / self._expected, 2.0)
        if self._offered:
            self.lookup_value = 0.9 * self.lookup_value + 0.1 * copied


def top_log_probs(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(R, V) logits → each row's k most probable tokens' log-probabilities and ids, (R, k) each: by
    the kernel library's `stepops.top` where it takes them (bf16 rows on the CPU: no float copy of a
    row, ~6× faster on the embedded model's 49k vocabulary), else through torch's log-softmax."""
    fast = stepops.top(logits, k)
    if fast is not None:
        values, indices, norms = fast
        return values - norms[:, None], indices
    top = torch.log_softmax(logits.float(), dim=-1).topk(k)
    return top.values, top.indices


def closed(order: list[int], parent: list[int], budget: int) -> list[int]:
    """The first `budget` nodes of `order` whose parent is already kept, parents first."""
    kept: list[int] = []
    have = {-1}
    for n in order:
        if parent[n] in have:
            kept.append(n)
            have.add(n)
            if len(kept) == budget:
                break
    return kept
