"""The online speculation policy: each step's tree chosen from this machine's cost curve and
the acceptance seen so far in this reply.

A tree pays only when the tokens it is expected to return outweigh what its verify forward
costs over a one-token step; both sides change with the machine (a step's cost by tree size,
measured by `costs`) and with the text (heads guess fluent prose well, context lookup pays
on extraction and editing, neither on hard reasoning). So before every forward `Policy.choose`
prices each option, plain decoding included, and takes the fastest; after it
`Policy.observe` updates the estimates from what was accepted:

- heads: a running estimate of how often head k's rank-r candidate is the next token
  (k + 1 ahead), seeded from the calibration; the best tree of every budget is the greedy
  tree of §3.3.3 on those estimates, and its expected accepted tokens the sum of its paths'
  probabilities (the independence estimate `calibrate` uses offline);
- lookups: how far a lookup's best continuation matches, as the chance that its k-th token
  is right given the ones before were (a continuation cut to k tokens costs fewer nodes, and a
  step of the cost staircase may take a cut one where it would not take the whole), kept apart
  for the context (this reply's own text) and for retrieval from past replies by how strongly
  the corpus backs the continuation (`core.drafters.retrieval.evidence`: a phrase that always goes on
  alike is right far more often than one that goes on many ways); each step offers the lookup
  expected to match further;
- cost: the curve's step time by node count, scaled by how plain and tree steps actually ran
  (two scales: a curve measured while something else ran is wrong in shape, not only in size).

When the heads are worth running, they run first and the step's own tree comes from their
probabilities (as EAGLE-2 ranks draft nodes by confidence): each candidate's probability, mapped
through a running calibration of how often candidates of that probability per head were right,
makes a path's value the product along it; the greedy tree on those values, cut at the budget
with the most tokens per ms, is this step's tree (plain if none pays). A confident step drafts
deep, an unsure one not at all.

Plain decoding stays one of the choices, and every `EXPLORE_EVERY` steps without heads the
policy drafts with them once, so it can come back from plain when the text turns easier; each
such step in a row that does not pay doubles the wait (up to 16×: on a text the heads cannot
guess, exploring costs ~0.1 % of the time instead of ~2 %).
The tree is fixed before the forward, so every acceptance rule stays exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from core.drafters import estimates
from core.drafters.estimates import BINS, PRIOR_CURVE, CostCurve, bin_middles, greedy_order, probability_bins
from core.sequences import common_prefix

MAX_BUDGET = 32  # head nodes the policy may draft (the root not counted)
EXPLORE_EVERY = 16  # after at least this many steps without heads, draft with them once
EXPLORE_SHARE = 0.02  # and not more often than costs this share of the time (on dear trees, rarer)
EXPLORE_BACKOFF = 4  # each exploration in a row that did not pay doubles the wait, up to 2**this times
HEADS_RATE = 0.05  # weight of one step in the heads' running accuracy
CONTEXT_RATE = 0.2  # weight of one lookup in the context's running match chances
COST_RATE = 0.1  # weight of one step in the running cost scales
REALIZED_RATE = 0.1  # weight of one step in the running tokens and ms of its kind
REALIZED_MIN = 8  # steps of a kind before how they really ran overrules the estimate
CONTEXT_PRIOR = 0.5  # chance that a lookup continuation's next token matches, given the ones before did,
# before one was checked (about one matched token in all; then learnt from every step that finds
# one, drafted or not): a copy task pays from its first steps
CONTEXT_DEPTH = 16  # continuation tokens whose match chance is tracked (longer ones are cut there)
# before one was checked, the same for retrieval by the corpus's evidence class, where the corpus
# file does not say (its held-out hit rates, which `train-drafter` stores, come first; these are the
# embedded model's: first-token hits .08 / .22 / .33 / .35 / .70)
RETRIEVAL_PRIOR = (0.08, 0.2, 0.3, 0.35, 0.7)
CONTEXT_KEY = ("context", 0)  # the context lookup's key among the lookups' match chances
# A lookup is one key, or a pair of keys whose continuations start with different tokens: both are
# grafted, at most one can match, so the chance that the step matches k tokens is the sum of theirs.
Lookup = tuple  # tuple[str, int] | tuple[tuple[str, int], tuple[str, int]]
MARGIN = 1.03  # a tree must be expected this much faster than plain decoding to be chosen
RANKS = 10  # candidates per head the policy reads
TABULATED = 2 * MAX_BUDGET + 1  # node counts whose step time is kept in a table (more: interpolated)
CALIBRATION_RATE = 0.02  # weight of one checked candidate in its bin's running hit rate
RUN_HEADS = 0.95  # run the heads while their best tree is expected at least this share of the best other's speed


@dataclass(frozen=True)
class Choice:
    budget: int  # head nodes drafted (0: none)
    lookup: int  # lookup continuations grafted under the root, cut to this many tokens (0: none)
    nodes: int  # the verify forward's node count, root included
    expected_tokens: float  # tokens this step is expected to return
    expected_ms: float  # what it is expected to cost
    reason: str  # why, in a few words (shown in the step inspector)
    drafted: bool = False  # the heads ran (their tree may still be empty)
    paths: tuple[tuple[int, ...], ...] | None = None  # this step's own head tree (None: the running one's)
    lookup_key: Lookup = ("context", 0)  # which lookup(s) the continuations came from (see Lookup)

    @property
    def plain(self) -> bool:
        return self.nodes == 1

    @property
    def source(self) -> str:
        """Where the grafted continuations came from: "context", "retrieval" or both ("+")."""
        return label(self.lookup_key)


def keys(lookup: Lookup) -> tuple[tuple[str, int], ...]:
    """The keys of a lookup (one, or the pair)."""
    return tuple(lookup) if isinstance(lookup[0], tuple) else (lookup,)


def label(lookup: Lookup) -> str:
    return "+".join(k[0] for k in keys(lookup))


@dataclass
class Realized:
    """Running means of the tokens and ms of one kind of step, as the steps really ran."""

    tokens: float = 0.0
    ms: float = 0.0
    steps: int = 0

    def add(self, tokens: float, ms: float) -> None:
        rate = 1.0 if not self.steps else REALIZED_RATE  # the first step sets both
        self.tokens += rate * (tokens - self.tokens)
        self.ms += rate * (ms - self.ms)
        self.steps += 1


def prior_reliability(heads: int, known: Sequence[Sequence[float]] = ()) -> Tensor:
    """(heads, BINS) starting guess of how often a candidate of each probability is right: the
    calibration's where known (`calibrate` measures it), else the probability itself for the
    first head and half of it for later ones (heads guessing further ahead are overconfident)."""
    guess = torch.stack([bin_middles() * (1.0 if k == 0 else 0.5) for k in range(heads)])
    for k, row in enumerate(known[:heads]):
        if len(row) == BINS:
            guess[k] = torch.tensor(row, dtype=guess.dtype)
    return guess


def prior_accuracy(heads: int, top1: Sequence[float] = (), top10: Sequence[float] = ()) -> Tensor:
    """(heads, RANKS) starting guess of each head's rank accuracies: the calibration's top-1 and
    top-10 where known (the rest spread over ranks 2…10, halving each rank), a modest guess elsewhere."""
    acc = torch.zeros(heads, RANKS)
    weights = torch.tensor([0.5**r for r in range(RANKS - 1)])
    for k in range(heads):
        one = top1[k] if k < len(top1) else 0.3 * 0.6**k
        ten = top10[k] if k < len(top10) else 2 * one
        acc[k, 0] = one
        acc[k, 1:] = max(ten - one, 0.0) * weights / weights.sum()
    return acc


class Policy:
    """Chooses each step's tree; see the module's docstring. `curve()` gives the machine's cost
    curve, or None while it is being measured (then `PRIOR_CURVE` is used)."""

    def __init__(
        self,
        curve: Callable[[], CostCurve | None],
        accuracy: Tensor | None,
        use_heads: bool = True,
        use_lookup: bool = True,
        reliability: Sequence[Sequence[float]] = (),
        use_retrieval: bool = False,
        retrieval_prior: Sequence[float | None] = (),
    ) -> None:
        self.curve = curve
        self.accuracy = accuracy.clone() if accuracy is not None else torch.zeros(0, RANKS)
        self.use_heads = use_heads and self.accuracy.shape[0] > 0
        self.use_lookup, self.use_retrieval = use_lookup, use_retrieval
        # the retrieval's first-token hit rate per evidence class: the corpus's held-out one where known
        known = list(retrieval_prior) + [None] * len(RETRIEVAL_PRIOR)
        self.retrieval_prior = tuple(p if k is None else k for p, k in zip(RETRIEVAL_PRIOR, known, strict=False))
        # per lookup key: (CONTEXT_DEPTH,) chance that its best continuation matches its k-th token,
        # given it matched the ones before (a discrete hazard: a step that shows only the first
        # tokens says nothing of later ones)
        self.hazards: dict[tuple[str, int], Tensor] = {}
        self._reach: dict[Lookup, list[float]] = {}  # expected matched tokens by cut length (cached)
        self.scales = {False: 1.0, True: 1.0}  # observed ÷ the curve's step time, for plain and tree steps
        self._curve: CostCurve | None = None
        self._ms = np.zeros(0)  # the curve's step ms by node count (`_table`)
        self._floor = 0.01
        self._seen = {False: False, True: False}  # whether a plain / tree step was timed against this curve
        self.since_heads = 0  # steps since the heads last drafted
        self._promising = False  # the last exploring step beat a plain one: explore again at once
        self._missed = 0  # explorations in a row that did not beat a plain step (`EXPLORE_BACKOFF`)
        # how such steps ran lately: "heads" (the heads ran), and lookup-only steps by lookup key
        self.realized: dict = {"heads": Realized()}
        self._order: tuple[list[tuple[int, ...]], list[float]] | None = None
        # (heads, BINS) how often a candidate whose probability fell in the bin was right
        self.calibration = prior_reliability(max(self.accuracy.shape[0], 1), reliability)

    # -- choosing --------------------------------------------------------------------------------

    def order(self) -> tuple[list[tuple[int, ...]], list[float]]:
        """The greedy tree's paths in the order they join it, and the cumulative expected accepted
        tokens after each (§3.3.3: the path with the highest Π accuracy next, parents first)."""
        if self._order is None:
            self._order = greedy_order(self.accuracy, MAX_BUDGET)
        return self._order

    def choose(self, lookup_nodes: Sequence[int] = (), lookup: Lookup = CONTEXT_KEY) -> Choice:
        """The option with the most tokens per ms: plain, heads of some budget, the continuations
        of the lookup keyed `lookup` cut to some length (`lookup_nodes[k - 1]`: their nodes when cut
        to k tokens; empty: it found nothing), or both."""
        curve = self._current()
        plain_ms = self.plain_ms()
        plain = Choice(0, 0, 1, 1.0, plain_ms, "plain: no tree is expected to pay for its cost")
        _, gain = self.order() if self.use_heads else ((), [])
        heads = self._fastest(gain, lookup_nodes, curve.heads_ms, lookup, heads_only=True) if gain else None
        copy = self._fastest([], lookup_nodes, 0.0, lookup) if lookup_nodes and self._uses(lookup) else None
        copy = copy if copy and self._pays(lookup, copy, MARGIN / plain_ms, plain_ms) else None
        # the heads run while their best tree is expected nearly as fast as the best without them
        # (their own probabilities then pick the step's tree, in refine, often better than expected)
        rival = copy.expected_tokens / copy.expected_ms if copy else 1 / plain_ms
        if heads and self._pays("heads", heads, RUN_HEADS * rival, plain_ms):
            return heads
        if copy:
            return copy
        backoff = 2 ** min(self._missed, EXPLORE_BACKOFF)
        every = max(EXPLORE_EVERY, self.heads_ms() / (EXPLORE_SHARE * plain_ms)) * backoff
        if heads and (self.since_heads >= every or self._promising):  # re-measure the heads once in a while
            return replace(heads, reason=f"explore: {heads.reason}, to re-measure the heads")
        return plain

    def new_reply(self) -> None:
        """A new reply: what the context lookup matched and how lookup steps ran belong to the text
        just left (a poem's repeated lines say nothing of an email); what was learned of the heads,
        of the retrieval's evidence and of the machine stays."""
        self.hazards.pop(CONTEXT_KEY, None)
        self._reach.clear()
        self.realized = {"heads": self.realized["heads"]}

    def _uses(self, lookup: Lookup) -> bool:
        return all(self.use_retrieval if k[0] == "retrieval" else self.use_lookup for k in keys(lookup))

    def hazard(self, lookup: tuple[str, int]) -> Tensor:
        """(CONTEXT_DEPTH,) match chances of the lookup keyed `lookup` (its prior until observed)."""
        if lookup not in self.hazards:
            prior = self.retrieval_prior[lookup[1]] if lookup[0] == "retrieval" else CONTEXT_PRIOR
            self.hazards[lookup] = torch.full((CONTEXT_DEPTH,), prior)
        return self.hazards[lookup]

    def reach(self, lookup: Lookup, length: int) -> float:
        """Expected matched tokens of the lookup's best continuation cut to `length`: Σₖ P(match ≥ k)
        (for a pair, P summed: their first tokens differ, so at most one matches)."""
        if lookup not in self._reach:
            survival = sum(torch.cumprod(self.hazard(k), 0) for k in keys(lookup)).clamp(max=1.0)
            self._reach[lookup] = [0.0, *survival.cumsum(0).tolist()]
        return self._reach[lookup][min(length, CONTEXT_DEPTH)]

    def _pays(self, kind: str | Lookup, option: Choice, expected: float, plain_ms: float) -> bool:
        """Whether steps of `kind` ("heads": the heads run; a lookup key: that lookup only) beat plain
        ones: as `option` is estimated against the rate `expected` (tokens per ms), and as they really ran
        lately once there are enough of them. The heads' estimate is a model (calibrated
        probabilities) that may be wrong either way, so how their steps ran overrules it; the
        lookup's is itself a running record of matches, so how its steps ran can only veto it (it
        would otherwise keep a lookup that stopped matching for as long as the record remembers)."""
        estimated = option.expected_tokens / option.expected_ms >= expected
        real = self.realized.setdefault(kind, Realized())
        if real.steps < REALIZED_MIN:
            return estimated
        if kind == "heads":  # as fast as plain steps, and as the rival `expected` stands for
            return real.tokens / real.ms > max(1 / plain_ms, expected)
        return real.tokens / real.ms > 1 / plain_ms and estimated

    def plain_ms(self) -> float:
        """A plain step's expected ms on the current curve, as plain steps really ran (0 before any curve)."""
        return float(self._ms[1]) * self.scales[False] if len(self._ms) else 0.0

    def heads_ms(self) -> float:
        return self._current().heads_ms * self.scales[True]

    def refine(
        self, choice: Choice, probs: Tensor, lookup_nodes: Sequence[int] = (), lookup: Lookup = CONTEXT_KEY
    ) -> Choice:
        """This step's tree from the heads' own top-RANKS probabilities (heads, RANKS), once they ran
        for `choice`: the budget (0 included) with the most expected tokens per ms, the heads'
        cost being paid already."""
        values = self.calibrated(probs)
        values[(values < self._floor) | (probs < 0)] = 0  # never worth a node (or padding): fewer paths to rank
        paths, gain = greedy_order(values, MAX_BUDGET)
        best = self._fastest(gain, lookup_nodes, self._current().heads_ms, lookup, sunk=True)
        reason = best.reason if best.nodes > 1 else "plain: the heads are unsure this step"
        explore = "explore: " if choice.reason.startswith("explore") else ""
        return replace(best, reason=explore + reason, drafted=True, paths=tuple(paths[: best.budget]))

    def _fastest(
        self,
        gain: Sequence[float],
        lookup_nodes: Sequence[int],
        heads_ms: float,
        lookup: Lookup = CONTEXT_KEY,
        heads_only: bool = False,
        sunk: bool = False,
    ) -> Choice:
        """The tree step with the most tokens per ms: `gain[b - 1]` the drafted tokens expected of b
        head nodes, the lookup's continuations cut to k tokens (`lookup_nodes[k - 1]` nodes), or
        both; `heads_only`: at least one head node; `sunk`: the heads ran already (their cost in
        every option, plain included). Every cut is priced, as the cost curve is a staircase."""
        cuts = len(lookup_nodes) if self._uses(lookup) else 0
        reaches = [self.reach(lookup, cut) for cut in range(1, cuts + 1)]
        table = self._table(1 + len(gain) + max(lookup_nodes[:cuts], default=0))
        best = estimates.best_option(list(gain), list(lookup_nodes[:cuts]), reaches, table, heads_ms, heads_only, sunk)
        budget, cut, nodes, ms = best
        tokens = 1 + max(gain[budget - 1] if budget else 0.0, self.reach(lookup, cut) if cut else 0.0)
        parts = [f"{budget} head nodes"] * bool(budget) + [f"{nodes - 1 - budget} {label(lookup)} nodes"] * bool(cut)
        ms *= self.scales[True]
        return Choice(budget, cut, nodes, tokens, ms, " + ".join(parts), budget > 0 or sunk, lookup_key=lookup)

    def _table(self, most: int) -> np.ndarray:
        """The current curve's step ms by node count, up to `most` nodes at least."""
        if len(self._ms) <= most:
            self._ms = np.concatenate([self._ms, [self._curve.at(n) for n in range(len(self._ms), most + 1)]])
        return self._ms

    def calibrated(self, probs: Tensor) -> Tensor:
        """(heads, RANKS) probabilities → how often such candidates were right, per head."""
        return self.calibration.view(-1)[probability_bins(probs)]

    def _current(self) -> CostCurve:
        curve = self.curve() or PRIOR_CURVE
        if curve is not self._curve:  # a newly measured curve: what was learned against the old one is void
            self._curve, self.scales, self._seen = curve, {False: 1.0, True: 1.0}, {False: False, True: False}
            self._ms = np.array([curve.at(n) for n in range(TABULATED)])  # at() per node count, looked up each step
            # a path less likely than half a node's share of a step's cost never pays for its node
            self._floor = float(max(0.001, (self._ms[MAX_BUDGET + 1] - self._ms[1]) / (2 * MAX_BUDGET * self._ms[1])))
        return curve

    # -- learning --------------------------------------------------------------------------------

    def observe(
        self, choice: Choice, candidates: Tensor | None, truth: Sequence[int], found: Sequence[Sequence[int]],
        seconds: float, probs: Tensor | None = None, retrieved: Sequence[Sequence[int]] = (), evidence: int = 0,
    ) -> None:  # fmt: skip
        """After a step: `candidates` (heads, RANKS) the heads' tokens if they drafted and `probs`
        their probabilities, `truth` the tokens the step emitted (what came after the root, in
        order), `found` the context lookup's continuations and `retrieved` the retrieval's (of
        evidence class `evidence`), drafted or not, `seconds` what the step took."""
        if candidates is not None:
            self.since_heads = 0
            known = min(len(truth), candidates.shape[0])  # head k is checked only if the path got that far
            if known:
                match = (candidates[:known] == torch.tensor(truth[:known])[:, None]).float()
                self.accuracy[:known] += HEADS_RATE * (match - self.accuracy[:known])
                self._order = None
                if probs is not None:
                    self._calibrate(probs[:known], match)
        else:
            self.since_heads += 1
        if found:
            self._observe_lookup(CONTEXT_KEY, found, truth)
        if retrieved:
            self._observe_lookup(("retrieval", evidence), retrieved, truth)
        if choice.drafted or not choice.plain:
            kind = "heads" if choice.drafted else choice.lookup_key
            self.realized.setdefault(kind, Realized()).add(len(truth), 1000 * seconds)
        plain_ms = self.plain_ms()
        exploring = choice.reason.startswith("explore")
        # promising: a draft was accepted and the step, heads and all, beat a plain one
        self._promising = exploring and len(truth) > 1 and plain_ms > 0 and len(truth) / (1000 * seconds) > 1 / plain_ms
        if exploring:  # heads that keep not paying are tried ever more rarely
            self._missed = 0 if self._promising else self._missed + 1
        elif choice.drafted:
            self._missed = 0
        tree = not choice.plain or choice.drafted
        expected = choice.expected_ms / self.scales[tree]
        if expected > 0 and seconds > 0:
            ratio = 1000 * seconds / expected
            if not self._seen[tree]:  # the first step of its kind sets the scale
                self.scales[tree], self._seen[tree] = ratio, True
            else:  # later ones move it a little (one odd step, a little less)
                ratio = min(max(ratio, self.scales[tree] / 3), self.scales[tree] * 3)
                self.scales[tree] += COST_RATE * (ratio - self.scales[tree])

    def _observe_lookup(self, lookup: tuple[str, int], found: Sequence[Sequence[int]], truth: Sequence[int]) -> None:
        """Move the match chance of each continuation token this step could check: the best
        continuation matched `best` tokens; the one after them (if the step showed it) did not."""
        best = max(common_prefix(c, truth) for c in found)
        shown = min(len(truth), max(map(len, found)), CONTEXT_DEPTH)  # tokens this step could check
        checked = min(best + 1, shown)
        if checked:
            hit = (torch.arange(checked) < best).float()
            hazard = self.hazard(lookup)
            hazard[:checked] += CONTEXT_RATE * (hit - hazard[:checked])
            self._reach.clear()  # (pairs hold this key too)

    def _calibrate(self, probs: Tensor, match: Tensor) -> None:
        """Move each bin toward how often this step's checked candidates in it were right (n
        candidates in a bin weigh as n steps of `CALIBRATION_RATE`; padded ranks, -1, skipped)."""
        valid = (probs >= 0).flatten()
        index, hits = probability_bins(probs).flatten()[valid], match.flatten()[valid]
        flat = self.calibration.view(-1)
        count = torch.zeros_like(flat).index_add_(0, index, torch.ones_like(hits))
        total = torch.zeros_like(flat).index_add_(0, index, hits)
        seen = count > 0
        weight = 1 - (1 - CALIBRATION_RATE) ** count[seen]
        flat[seen] += weight * (total[seen] / count[seen] - flat[seen])
