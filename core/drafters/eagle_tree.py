"""The EAGLE drafter in the decode loop: the draft layer's own KV cache over the committed
positions, a dynamic tree by draft confidence (EAGLE-2), sized to this machine's step costs.

Positions follow the backbone's: after a step the backbone's cache holds tokens 0 … P − 1 and
the root x_P is not yet in it; the draft's cache then holds entries 0 … P − 1, entry j read
from (feature j, token j + 1), so the last entry's output predicts the feature at P and with it
the token after the root. A drafted node at depth d sits at position P + d − 1 and attends to
every committed entry, its ancestors and itself.

The tree: the top `TOP_K` tokens under each expanded node, the `BEAM` most probable nodes of
each depth expanded (one draft forward a depth), then the most probable nodes kept. How many
is chosen each step where expected tokens per millisecond peak: a node's chance to be accepted
is its path's draft probability times a factor learned from how steps really went, and a
tree of N nodes costs the measured verify time at N + 1 nodes plus the drafting time. Where
even the best tree is expected slower than a plain step, the step is plain; the features still
reach the draft's cache (lazily, in one forward when drafting resumes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from core.decode.tree import CONTEXT, EAGLE, RETRIEVAL, ROOT, build_tree, from_parents
from core.drafters.base import Draft, Drafter
from core.drafters.eagle import EagleDraft
from core.drafters.eagle3 import Eagle3Draft, LeanEagle3
from core.drafters.estimates import PRIOR_CURVE, CostCurve
from core.drafters.fixed import continuations, with_branches
from core.drafters.lean_draft import LeanDraft
from core.drafters.lookup import NgramIndex, node_count
from core.drafters.policy import Choice
from core.drafters.retrieval import RETRIEVAL_LENGTH, Corpus
from core.errors import UserError
from core.measure.clock import now
from core.sequences import common_prefix

TOP_K = 8  # candidates under each expanded node
BEAM = 4  # nodes expanded per depth
DEPTH = 6  # how far ahead the draft looks
BUDGETS = (2, 4, 6, 8, 12, 16, 24, 32)  # drafted-node counts a step may verify
PROBE_EVERY = 8  # while plain steps win, draft every this many steps to keep measuring
MIN_CHANCE = 0.15  # a node less likely than this to be accepted is not expanded (a depth costs ~0.1 steps)


class EagleDrafter(Drafter):
    """Drafts with an EAGLE draft layer; with `lookup` the context's continuations (and with a
    `corpus` the model's past replies) are grafted under the root as well."""

    reads_features = True  # its own cache holds the draft layer's entries of every committed position

    def __init__(
        self,
        draft: EagleDraft,
        dtype: torch.dtype,
        curve: Callable[[], CostCurve | None] = lambda: None,
        lookup: bool = True,
        corpus: Corpus | None = None,
        budget: int | None = None,
        branches: int = 2,
        length: int = 4,
        depth: int = DEPTH,
    ) -> None:
        self.lean = LeanEagle3(draft, dtype) if isinstance(draft, Eagle3Draft) else LeanDraft(draft, dtype)
        self.depth = depth
        self.curve = curve
        self.fixed_budget = budget  # None: chosen each step from the costs
        self.index = NgramIndex(4) if lookup else None
        self.corpus = corpus
        self.branches, self.length = branches, length
        self.cache = self.lean.new_cache()
        self._pending: list[tuple[Tensor, Tensor]] = []  # fed rows not yet run through the draft
        self._pending_rows = 0
        self._last_out: Tensor | None = None  # (H,) output of the last committed entry
        self._read: list[int | None] = [None]  # token 0, then the token each entry read (None: not known)
        self.calibration = 1.0  # realized accepted drafts ÷ the draft's own expectation (running)
        self.draft_ms = 1.0  # running drafting time of a step
        self.plain_ms: float | None = None  # running time of a plain step (prices trees until the curve is measured)
        self._plain_streak = 0
        self._drafted = False  # the last step ran the draft layer
        self._expected = 0.0
        self._offered = False  # the lookup's continuations went into the last tree
        self.lookup_value = 0.5  # running tokens accepted from the lookups' continuations when offered
        self.root_only = build_tree([])
        self.last_choice = None

    @property
    def taps(self) -> tuple[int, ...]:
        """The backbone layers whose streams `feed` must carry before the last feature."""
        return self.lean.taps

    # -- the committed positions --------------------------------------------------------------

    def feed(self, features: Tensor, next_ids: Tensor, position: int) -> None:
        """The backbone's features at positions `position` … (with `taps`, the tapped streams
        then the last feature, side by side) and the token after each (the last one the next
        root). Position 0 starts a new reply."""
        if position == 0 or position != self.cache.length + self._pending_rows:
            first = self._read[:1] if position == 0 and len(self._read) == 1 else [None]  # token 0 if `rewind` said
            self.cache.truncate(0)
            self._pending, self._pending_rows, self._last_out, self._read = [], 0, None, first
            if position != 0:  # not where the draft left off: nothing to draft from until a new reply
                return
        self._pending.append((features, next_ids))
        self._pending_rows += len(next_ids)
        self._read += next_ids.tolist()

    def rewind(self, prompt_ids: Sequence[int], reused: int) -> int:
        """A new reply to `prompt_ids`, of which the backbone's cache holds the first `reused`
        positions: keep the entries this prompt shares, up to `reused` (entry j read feature j and
        token j + 1, so it needs the prompt's first j + 2 tokens), and say how many; the prefill
        feeds the rest from there."""
        keep = max(0, min(reused, len(self._read) - 1, common_prefix(self._read, prompt_ids) - 1))
        if keep <= self.cache.length:
            self.cache.truncate(keep)
            self._pending, self._pending_rows = [], 0
        else:  # part of the pending rows stays
            room, pending = keep - self.cache.length, []
            for features, ids in self._pending:
                if room > 0:
                    pending.append((features[:room], ids[:room]))
                    room -= len(ids)
            self._pending, self._pending_rows = pending, keep - self.cache.length
        self._last_out = None  # the prefill's feed brings the rows it is computed from
        self._read = list(prompt_ids[: keep + 1])
        return keep

    def _flush(self) -> bool:
        """Run the pending rows into the draft's cache; False when it has nothing to draft from."""
        if self._pending:
            features = self.lean.fused(torch.cat([f for f, _ in self._pending]))
            ids = torch.cat([i for _, i in self._pending])
            past = self.cache.length
            positions = torch.arange(past, past + len(ids), device=ids.device)
            out = self.lean(features, ids, positions, None, self.cache)
            self.cache.length = past + len(ids)
            self._last_out = out[-1]
            self._pending, self._pending_rows = [], 0
        return self._last_out is not None

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
        if (self.fixed_budget is None and self._plain_streak and not probe) or not self._flush():
            self._plain_streak += 1
            pays = (1 + self.lookup_value) / curve.at(1 + extra) > 1 / curve.at(1)
            return self._finish(plain, found if pays or self.fixed_budget else [], source, [], curve)
        tokens, parent, scores = self._grow()
        self._drafted = True
        draft_ms = (now(root.device) - t0) * 1000
        self.draft_ms = 0.8 * self.draft_ms + 0.2 * draft_ms
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        chance = (torch.tensor(scores).exp() * self.calibration).clamp(max=1.0)
        budget, found = (
            (self.fixed_budget, found)
            if self.fixed_budget is not None
            else self._budget(order, chance, curve, found, extra)
        )
        if budget == 0:
            self._plain_streak += 1
            return self._finish(plain, found, source, [], curve)
        self._plain_streak = 0
        keep = _closed(order, parent, budget)
        index = {-1: 0} | {n: i + 1 for i, n in enumerate(keep)}
        parents = [0] + [index[parent[n]] for n in keep]
        tree = from_parents(parents, [-1] * len(parents))
        device = root.device
        ids = torch.tensor([int(root)] + [tokens[n] for n in keep], device=device)
        draft = Draft(ids, tree.on(device), (ROOT,) + (EAGLE,) * len(keep))
        return self._finish(draft, found, source, chance[keep].tolist(), curve)

    def _finish(
        self, draft: Draft, found: list[list[int]], source: int, chances: list[float], curve: CostCurve
    ) -> Draft:
        """`draft` with the lookup's continuations grafted under the root, and why."""
        self._expected = sum(chances)
        self._offered = bool(found)
        draft = with_branches(draft, found, source)
        nodes, drafted = draft.tree.size, len(chances)
        parts = [f"EAGLE tree of {drafted} nodes" if drafted else "no EAGLE nodes"]
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

    def _grow(self) -> tuple[list[int], list[int], list[float]]:
        """Every drafted node: (token, parent node or −1 for the root, log-probability of its path).

        A node is expanded only while a child of it could still be kept: a child scores no more
        than its parent and comes after every node already drafted, so once `limit` − 1 other
        nodes score at least as much as its parent, it is never among the `limit` most probable
        (what `_closed` keeps); the tree is the same, with fewer draft forwards."""
        lean, cache = self.lean, self.cache
        base = cache.length
        k = min(TOP_K, len(lean.vocab))
        limit = self.fixed_budget if self.fixed_budget is not None else BUDGETS[-1]
        logp = lean.log_probs(self._last_out.view(1, -1))[0]
        top = logp.topk(k)
        tokens = lean.vocab[top.indices].tolist()
        parent = [-1] * k
        scores = top.values.tolist()
        feature_in = {n: self._last_out for n in range(k)}  # the feature each node's entry reads
        entry: dict[int, int] = {}  # node → its row among the appended entries
        frontier = list(range(k))
        ancestors: list[list[int]] = []  # per appended entry: the entry rows it sees (its own last)
        floor = -math.inf  # a fixed budget is filled; else a path this unlikely is never kept
        if self.fixed_budget is None:
            floor = math.log(MIN_CHANCE / max(self.calibration, 1e-3))
        hidden = torch.finfo(lean.dtype).min
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
            mask = torch.zeros(1, 1, len(expand), base + width, dtype=lean.dtype, device=lean.device)
            mask[0, 0, :, base:] = torch.tensor(tail, dtype=lean.dtype)
            cache.length = base + rows
            out = lean(
                torch.stack([feature_in[n] for n in expand]),
                torch.tensor([tokens[n] for n in expand], device=lean.device),
                torch.full((len(expand),), base + depth - 1, device=lean.device),
                mask,
                cache,
            )
            top = lean.log_probs(out).topk(k)
            values, ids = top.values.tolist(), lean.vocab[top.indices].tolist()
            frontier = []
            for r, n in enumerate(expand):
                for v, i in zip(values[r], ids[r], strict=True):
                    frontier.append(len(tokens))
                    tokens.append(i)
                    parent.append(n)
                    scores.append(scores[n] + v)
                    feature_in[len(tokens) - 1] = out[r]
        cache.length = base
        return tokens, parent, scores

    def _budget(
        self, order: list[int], chance: Tensor, curve: CostCurve, found: list[list[int]], extra: int
    ) -> tuple[int, list[list[int]]]:
        """The EAGLE node count, and whether the lookup's continuations go in too, with the most
        expected tokens per millisecond (a lookup's worth: its running accepted tokens a step)."""
        sorted_chance = chance[order]
        best, best_rate = (0, []), 1.0 / curve.at(1)
        for with_lookup in (False, True) if found else (False,):
            bonus, nodes = (self.lookup_value, extra) if with_lookup else (0.0, 0)
            for b in (0, *BUDGETS):
                if b > len(order):
                    break
                cost = curve.at(b + 1 + nodes) + (self.draft_ms if b else 0.0)
                rate = (1 + bonus + float(sorted_chance[:b].sum())) / cost
                if rate > best_rate:
                    best, best_rate = (b, found if with_lookup else []), rate
        return best

    def observe(self, draft: Draft, emitted: Sequence[int], seconds: float) -> None:
        """Learn how far the draft's own probabilities over- or under-state acceptance, and what
        the lookups' continuations are worth."""
        if draft.tree.size == 1 and not self._drafted:  # a plain step that drafted nothing either
            ms = seconds * 1000
            self.plain_ms = ms if self.plain_ms is None else 0.9 * self.plain_ms + 0.1 * ms
        tokens, children = draft.tokens.tolist(), draft.tree.children.tolist()
        node, accepted, copied = 0, 0, 0
        for token in emitted[:-1]:  # follow the accepted path, counting each source's nodes
            node = next((c for c in children[node] if c >= 0 and tokens[c] == token), -1)
            if node < 0:
                break
            accepted += draft.source(node) == EAGLE
            copied += draft.source(node) in (CONTEXT, RETRIEVAL)
        if self._expected > 0:
            self.calibration = 0.9 * self.calibration + 0.1 * min(accepted / self._expected, 2.0)
        if self._offered:
            self.lookup_value = 0.9 * self.lookup_value + 0.1 * copied


def _closed(order: list[int], parent: list[int], budget: int) -> list[int]:
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


def eagle_drafter(
    draft: EagleDraft | None,
    curve: Callable[[], CostCurve | None] = lambda: None,
    corpus: Corpus | None = None,
    budget: int | None = None,
    branches: int = 2,
    length: int = 4,
) -> EagleDrafter:
    """The "eagle" drafter: `draft` with the context's and `corpus`'s continuations; `budget` None:
    each step's node count chosen from the machine's costs (`curve`)."""
    if draft is None:
        raise UserError(
            "No EAGLE drafter for this model; make one with `medusa-chat train-drafter --kind eagle` "
            "and pass it with --eagle FILE, or choose another drafter."
        )
    return EagleDrafter(draft, draft.backbone_dtype, curve, True, corpus, budget, branches, length)
