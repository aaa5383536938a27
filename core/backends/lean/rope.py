"""Rotary position embedding for the lean layer, as transformers' Llama (and Qwen3, Gemma 3) applies it."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn


class Rope:
    """Rotary cos and sin by position, from a table grown as positions grow (rotate-half
    convention, the sign folded into sin)."""

    def __init__(self, rotary: nn.Module, head_dim: int, dtype: torch.dtype, layer_type: str | None = None) -> None:
        self.rotary, self.head_dim, self.dtype = rotary, head_dim, dtype
        # the rotary module's table for this kind of layer (Gemma 3's sliding and full layers differ)
        self.kind = {} if layer_type is None else {"layer_type": layer_type}
        self._cos = self._sin = torch.empty(0)

    def __call__(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin (T, 1, head dim) at (T,) `positions`."""
        top = int(positions.max()) + 1
        if top > self._cos.shape[0]:
            size = max(top, 2 * self._cos.shape[0], 256)
            probe = torch.zeros(1, dtype=self.dtype, device=positions.device)
            cos, sin = self.rotary(probe, torch.arange(size, device=positions.device).view(1, -1), **self.kind)
            half = self.head_dim // 2
            sign = torch.cat([-torch.ones(half), torch.ones(self.head_dim - half)]).to(sin)
            self._cos, self._sin = cos[0], sin[0] * sign
        t = positions.numel()
        return self._cos[positions].view(t, 1, -1), self._sin[positions].view(t, 1, -1)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding as transformers' Llama applies it (rotate-half convention);
    `sin` carries the rotation's sign (−sin on the first half)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


def takes_kinds(rotary: nn.Module) -> bool:
    """Whether a rotary module keeps a table per kind of layer (Gemma 3's: `layer_type`)."""
    return "layer_type" in inspect.signature(rotary.forward).parameters
