"""The estimates drafting runs on, shared by the runtime policy and the offline calibration
(`core.train.calibrate` imports them from here, never the reverse):

- how often a head's candidate is right, by the probability the head gave it (`BINS` bins);
- the greedy tree of Medusa §3.3.3: rank paths by estimated acceptance, parents first;
- what one step costs on this machine, by node count (`CostCurve`, linear between measured sizes).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

SMALL_GRID = 40  # `best_option`'s options priced one at a time up to this many (in arrays beyond)
BINS = 10  # a head's probabilities in bins 0.1 wide, for how often candidates of each were right


def probability_bins(probs: Tensor) -> Tensor:
    """(…, K, R) head probabilities → index into a flattened (K, BINS) table: head k's bin of each."""
    heads = torch.arange(probs.shape[-2]).unsqueeze(-1)  # (K, 1)
    return (probs.float() * BINS).long().clamp(0, BINS - 1) + BINS * heads


def bin_middles() -> Tensor:
    """(BINS,) the middle probability of each bin."""
    return (torch.arange(BINS) + 0.5) / BINS


def greedy_order(accuracy: Tensor, budget: int) -> tuple[list[tuple[int, ...]], list[float]]:
    """The `budget` rank paths with the highest estimated acceptance Π_k accuracy[k, r_k], in the
    order they join the tree (each node's parent first), and after each the expected accepted
    tokens of the tree so far (the sum of its paths' Π accuracy). Ranks of accuracy 0 are never used.

    Best first from the root: a path joins when it is the best left whose parent joined (a
    child's product is at most its parent's, accuracies being at most 1), ties to the lesser path.
    A joined path offers its children in order of their products, the next only once the one
    before has joined (with any that tie it at once), so a step pushes about two paths, not a
    head's every rank: the same paths in the same order (tested against pushing them all)."""
    k_heads, ranks = accuracy.shape
    acc = accuracy.tolist()
    ranked = [sorted((r for r in range(ranks) if row[r] > 0), key=lambda r, row=row: (-row[r], r)) for row in acc]
    frontier: list[tuple[float, tuple[int, ...], float, int]] = []  # (-Π, path, the parent's -Π, group end)
    offered: dict[tuple[int, ...], int] = {}  # a joined path → how many of its children are offered

    def offer(neg: float, parent: tuple[int, ...], i: int) -> None:
        """The parent's children from its i-th best on, as many as tie the i-th's product."""
        row, order = acc[len(parent)], ranked[len(parent)]
        j, key = i, neg * row[order[i]] if i < len(order) else 0.0
        while j < len(order) and neg * row[order[j]] == key:
            j += 1
        for r in order[i:j]:
            heapq.heappush(frontier, (key, (*parent, r), neg, j))
        offered[parent] = j

    offer(-1.0, (), 0)
    paths: list[tuple[int, ...]] = []
    gains: list[float] = []
    while frontier and len(paths) < budget:
        neg, path, parent_neg, end = heapq.heappop(frontier)
        paths.append(path)
        gains.append((gains[-1] if gains else 0.0) - neg)
        if offered[path[:-1]] == end:  # the first of its group to join: the next group is offered
            offer(parent_neg, path[:-1], end)
        if len(path) < k_heads:
            offer(neg, path, 0)
    return paths, gains


def interpolate(latency: dict[int, float], size: float) -> float:
    """Step latency at a (fractional) node count, linear between measured sizes."""
    xs = sorted(latency)
    if size <= xs[0] or len(xs) == 1:
        return latency[xs[0]]
    for a, b in itertools.pairwise(xs):
        if size <= b:
            return latency[a] + (latency[b] - latency[a]) * (size - a) / (b - a)
    a, b = xs[0], xs[-1]  # beyond: the mean slope (the last two sizes may share one step of a staircase)
    return latency[b] + (latency[b] - latency[a]) * (size - b) / (b - a)


@dataclass(frozen=True)
class CostCurve:
    """What one step costs on this machine: verify + accept + commit by node count, and the heads."""

    step_ms: dict[int, float]  # node count (root included) → ms
    heads_ms: float  # the heads' forward and top-k, paid by every step that drafts with them

    def at(self, nodes: float) -> float:
        """Step time at a node count, linear between measured sizes (and beyond the last two)."""
        return interpolate(self.step_ms, nodes)


# Before this machine's curve is measured: a steep guess (a many-row forward costs 20 % more a
# node), so the policy risks little until it knows better.
PRIOR_CURVE = CostCurve({1: 1.0, 64: 13.6}, 0.2)


def best_option(
    gain: list[float], lookup_nodes: list[int], reaches: list[float], table: np.ndarray, heads_ms: float,
    heads_only: bool = False, sunk: bool = False,
) -> tuple[int, int, int, float]:  # fmt: skip
    """The tree step with the most expected tokens per ms, as (head budget, lookup cut, nodes, ms):
    `gain[b - 1]` the drafted tokens expected of b head nodes, a cut to k tokens adds
    `lookup_nodes[k - 1]` nodes expected to match `reaches[k - 1]` tokens (the better of the two
    counts), `table[n]` the step's ms at n nodes (long enough for every option), `heads_ms` paid
    by every option with head nodes (`sunk`: by every option, the heads having run; budget 0 is
    then allowed with no cut, and else only with a cut, unless `heads_only`). Every pair is priced
    (the cost curve is a staircase, so no cut or budget can be skipped): at once in arrays where
    there are more than `SMALL_GRID`, else one at a time; the first best in cut-major order wins a
    tie. (0, 0, 1, 0.0) where no option is allowed."""
    if (len(gain) + 1) * (len(lookup_nodes) + 1) <= SMALL_GRID:  # one at a time: arrays would cost more
        return _best_in_turn(gain, lookup_nodes, reaches, table, heads_ms, heads_only, sunk)
    gains = np.array([0.0, *gain])
    extra = np.array([0, *lookup_nodes])
    context = np.array([0.0, *reaches])
    budgets = np.arange(len(gains))
    nodes = 1 + budgets[None, :] + extra[:, None]  # (cuts, budgets)
    ms = table[nodes] + np.where((budgets > 0) | sunk, heads_ms, 0.0)
    rate = (1 + np.maximum(gains[None, :], context[:, None])) / ms
    if not sunk:  # budget 0: only with a cut, and not where a head node is required
        rate[slice(None) if heads_only else 0, 0] = -np.inf
    best = int(np.argmax(rate))
    if rate.flat[best] == -np.inf:
        return 0, 0, 1, 0.0
    cut, budget = divmod(best, len(gains))
    return budget, cut, int(nodes[cut, budget]), float(ms[cut, budget])


def _best_in_turn(
    gain: list[float], lookup_nodes: list[int], reaches: list[float], table: np.ndarray, heads_ms: float,
    heads_only: bool, sunk: bool,
) -> tuple[int, int, int, float]:  # fmt: skip
    """`best_option`'s choice, each option priced in turn."""
    best, best_rate = (0, 0, 1, 0.0), -1.0
    for cut in range(len(lookup_nodes) + 1):
        extra, context = (lookup_nodes[cut - 1], reaches[cut - 1]) if cut else (0, 0.0)
        for budget in range(0 if sunk or (cut and not heads_only) else 1, len(gain) + 1):
            nodes = 1 + budget + extra
            ms = float(table[nodes]) + (heads_ms if budget or sunk else 0.0)
            rate = (1 + max(gain[budget - 1] if budget else 0.0, context)) / ms
            if rate > best_rate:
                best, best_rate = (budget, cut, nodes, ms), rate
    return best
