"""Turning logits into the distribution tokens are drawn from: temperature, then top-k, then top-p.

The order and the top-p rule follow transformers' logits warpers, so our plain loop and
`generate` sample from the same distribution for the same settings.
"""

from __future__ import annotations

import torch
from torch import Tensor

NUCLEUS_FIRST = (64, 1024)  # how many of the most likely tokens top-p looks for its nucleus among, before a sort


def apply_temperature(logits: Tensor, temperature: float) -> Tensor:
    return logits / temperature


def apply_top_k(logits: Tensor, top_k: int) -> Tensor:
    """Keep the top_k largest logits (0 keeps all)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of tokens whose probability reaches top_p (1.0 keeps all).

    The nucleus is looked for among the 64, then the 1024 most likely tokens first (`torch.topk`),
    so a step sorts the whole vocabulary only where the nucleus is wider: a sort of a 49k
    vocabulary costs more than the embedded model's whole step."""
    if top_p >= 1.0:
        return logits
    vocab = logits.shape[-1]
    every = logits.float().softmax(dim=-1)
    for k in NUCLEUS_FIRST:
        if k >= vocab:
            break
        probs = torch.topk(every, k, dim=-1).values  # descending
        below = 1 - (probs.cumsum(dim=-1) - probs)  # each rank's mass with every less likely token
        dropped = below <= 1 - top_p
        dropped[..., :1] = False  # always keep the most likely token
        if bool(dropped[..., -1].all()):  # every row's nucleus ends inside the k
            kept = (~dropped).sum(dim=-1, keepdim=True)
            floor = probs.gather(-1, kept - 1)  # each row's least likely kept token
            return logits.masked_fill(every < floor, float("-inf"))
    return _top_p_sorted(logits, top_p)


def _top_p_sorted(logits: Tensor, top_p: float) -> Tensor:
    """`apply_top_p` by sorting the whole vocabulary (transformers' `TopPLogitsWarper` rule)."""
    sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop_sorted = cumulative <= 1 - top_p
    drop_sorted[..., -1:] = False  # always keep the most likely token
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def probabilities(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """(…, V) logits → (…, V) float32 probabilities after temperature, top-k and top-p."""
    x = apply_temperature(logits.float(), temperature)
    return apply_top_p(apply_top_k(x, top_k), top_p).softmax(dim=-1)
