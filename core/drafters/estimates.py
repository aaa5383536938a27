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

import torch
from torch import Tensor

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
    tokens of the tree so far (the sum of its paths' Π accuracy). Ranks of accuracy 0 are never used."""
    k_heads, ranks = accuracy.shape
    acc = accuracy.tolist()
    frontier = [(-acc[0][r], (r,)) for r in range(ranks) if acc[0][r] > 0]
    heapq.heapify(frontier)
    paths: list[tuple[int, ...]] = []
    gains: list[float] = []
    while frontier and len(paths) < budget:
        neg, path = heapq.heappop(frontier)
        paths.append(path)
        gains.append((gains[-1] if gains else 0.0) - neg)
        if len(path) < k_heads:
            for r in range(ranks):
                if acc[len(path)][r] > 0:
                    heapq.heappush(frontier, (neg * acc[len(path)][r], (*path, r)))
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
