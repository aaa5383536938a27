"""CPU speed: linear layers that keep their weight transposed.

MKL multiplies `x @ Wᵀ` markedly slower than `x @ W'` with W' = Wᵀ stored contiguously, for
the few-token inputs of decoding (measured on this project's 2-core AVX-512 machine: 20–45 %
less time at 1 and 17 tokens). GPUs don't care, so this is applied on the CPU only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class TransposedLinear(nn.Module):
    """Same maths as nn.Linear; the weight is stored as (in, out)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = linear.bias

    @property
    def weight(self) -> Tensor:
        """(out, in) view, for code that reads shapes or ties weights."""
        return self.weight_t.t()

    def forward(self, x: Tensor) -> Tensor:
        y = torch.matmul(x, self.weight_t)
        return y + self.bias if self.bias is not None else y


def transpose_linears(model: nn.Module) -> nn.Module:
    """Swap every nn.Linear of `model` (in place) for a TransposedLinear."""
    for name, child in list(model.named_children()):
        if type(child) is nn.Linear:
            setattr(model, name, TransposedLinear(child))
        else:
            transpose_linears(child)
    return model
