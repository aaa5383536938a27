"""A chi-square goodness-of-fit test in torch (no scipy needed)."""

from __future__ import annotations

from collections import Counter

import torch


def chi_square_p_value(observed: Counter, expected_probs: dict, n: int, min_expected: float = 5.0) -> float:
    """p-value that `observed` (counts of n draws) comes from `expected_probs`.

    Cells expected fewer than `min_expected` times are pooled into one; an outcome that should
    be impossible but was observed gives p = 0.
    """
    if any(k not in expected_probs or expected_probs[k] == 0 for k in observed):
        return 0.0
    cells, pooled_obs, pooled_exp = [], 0.0, 0.0
    for k, p in expected_probs.items():
        e = p * n
        if e >= min_expected:
            cells.append((observed.get(k, 0), e))
        else:
            pooled_obs, pooled_exp = pooled_obs + observed.get(k, 0), pooled_exp + e
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))
