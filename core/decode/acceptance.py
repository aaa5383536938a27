"""Acceptance rules: which path of the verified tree to keep, and the backbone's next token.

Pure functions of the verify forward's logits (T, V) and the tree's tokens (T,). Each returns
an `Acceptance`: the accepted node path (root first) and the token the backbone produces after
it, which becomes the next step's root. Node n > 0 holds a candidate for the position after its
parent, so "node n is right" is judged on the logits at parent[n].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from core.backends import stepops
from core.decode.tree import TreeBuffers
from core.errors import UserError


@dataclass(frozen=True)
class Acceptance:
    path: Tensor  # (A + 1,) accepted node indices, root first
    next_token: Tensor  # () the backbone's token after the path

    @property
    def accepted(self) -> int:
        """Drafted tokens accepted (the root is the backbone's own token)."""
        return self.path.numel() - 1


def check_typical(epsilon: float, delta: float) -> None:
    if not (isinstance(epsilon, (int, float)) and 0 < epsilon <= 1):
        raise UserError(f"ε (epsilon) must be in (0, 1], got {epsilon}; the default is 0.09.")
    if not (isinstance(delta, (int, float)) and 0 < delta <= 1):
        raise UserError(f"δ (delta) must be in (0, 1], got {delta}; the default is 0.3.")


def greedy(logits: Tensor) -> Tensor:
    """argmax over the last dimension: bf16 logits on the CPU by the kernel library where it is
    loaded (`stepops.argmax`), else in float32 (a bf16 argmax on the CPU costs about 5× the conversion
    and argmax together: 150 against 30 µs for a 49k vocabulary; bf16 → float32 is exact, so the
    token is the same)."""
    fast = stepops.argmax(logits)
    return fast if fast is not None else logits.float().argmax(dim=-1)


def _deepest_accepted(ok: Tensor, score: Tensor, tree: TreeBuffers) -> Tensor:
    """Deepest node whose whole path is ok; ties go to the higher score. Returns a () index."""
    path_ok = ~(tree.visible & ~ok).any(dim=1)  # (T,) every ancestor and the node itself ok
    depth = torch.where(path_ok, tree.depth, -1)
    best_depth = depth == depth.max()
    return torch.where(best_depth, score, -math.inf).argmax()


def accept_greedy(logits: Tensor, tokens: Tensor, tree: TreeBuffers) -> Acceptance:
    """Temperature 0: the longest path equal to the backbone's argmax chain (of equally deep
    ones, the first)."""
    argmax = greedy(logits)  # (T,)
    best = _deepest_greedy(argmax.tolist(), tokens.tolist(), tree.parents)
    return Acceptance(tree.path_to(best), argmax[best])


def _deepest_greedy(argmax: list[int], tokens: list[int], parents: list[int]) -> int:
    """The first of the deepest nodes whose path's every token is its parent's argmax (parents
    come before their children). In Python: a step's tree is small, and a dozen tensor
    operations on it cost more than the loop (about 60 against 10 µs)."""
    depth, best = [0] * len(tokens), 0  # depth of a node whose path holds, -1 where it breaks
    for i in range(1, len(tokens)):
        p = parents[i]
        depth[i] = depth[p] + 1 if depth[p] >= 0 and tokens[i] == argmax[p] else -1
        if depth[i] > depth[best]:
            best = i
    return best


def accept_typical(
    logits: Tensor,
    tokens: Tensor,
    tree: TreeBuffers,
    temperature: float,
    epsilon: float,
    delta: float,
) -> Acceptance:
    """Medusa §3.3.1: accept x when p(x) > min(ε, δ·exp(−H(p))); next token greedy.

    p is the backbone's distribution at temperature T (one-hot on the argmax at T = 0, which
    makes this rule greedy). Among equally long accepted paths the one with the higher summed
    log-probability wins.
    """
    if temperature > 0:
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (T, V)
    else:
        one_hot = torch.zeros_like(logits, dtype=torch.float32)
        logp = one_hot.scatter_(-1, greedy(logits)[:, None], 1.0).log()
    p = logp.exp()
    entropy = -(p * logp.nan_to_num(neginf=0.0)).sum(dim=-1)  # (T,)
    threshold = torch.clamp(delta * torch.exp(-entropy), max=epsilon)  # (T,)

    logp_token = logp[tree.parent, tokens]  # (T,) log p of each node's token at its parent
    ok = logp_token.exp() > threshold[tree.parent]
    ok[0] = True
    logp_token[0] = 0.0
    score = (tree.visible.float() * logp_token.nan_to_num(neginf=-1e9)).sum(dim=1)
    best = _deepest_accepted(ok, score, tree)
    return Acceptance(tree.path_to(int(best)), greedy(logits[best]))


def accept_sampling(
    logits: Tensor,
    tokens: Tensor,
    tree: TreeBuffers,
    to_probs: Callable[[Tensor], Tensor],
    generator: torch.Generator | None,
) -> Acceptance:
    """Temperature > 0, lossless: walk down from the root sampling from the backbone.

    At each node draw y ~ p(· | path); if y is one of the node's children (distinct tokens,
    fixed before sampling) descend into it, else y is the next token and the walk stops. Every
    emitted token is thus an exact draw from the backbone, one draw per token.
    """
    return _walk(lambda node: torch.multinomial(to_probs(logits[node]), 1, generator=generator)[0], tokens, tree)


def accept_greedy_walk(logits: Tensor, tokens: Tensor, tree: TreeBuffers) -> Acceptance:
    """`accept_greedy` as a walk down from the root, reading `logits[node]` only for the nodes on
    the accepted path (siblings are distinct tokens, so at most one child is the argmax)."""
    return _walk(lambda node: greedy(logits[node]), tokens, tree)


def _walk(pick: Callable[[int], Tensor], tokens: Tensor, tree: TreeBuffers) -> Acceptance:
    """From the root: y = pick(node); descend into the child whose token is y, else stop with y."""
    node = 0
    while True:
        y = pick(node)
        kids = tree.children[node]
        hit = kids[(kids >= 0) & (tokens[kids.clamp(min=0)] == y)]
        if hit.numel() == 0:
            return Acceptance(tree.path_to(node), y)
        node = int(hit[0])
