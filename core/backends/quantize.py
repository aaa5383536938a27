"""Group-32 quantization, the one home of it: 4-bit (GGUF Q4_1's form: a step and a minimum per 32
inputs) and 8-bit (Q8_0's: a step per 32 inputs), and what the kernel library computes with such
weights, in float32 torch (its tests' and self-test's reference).

The library (`core.backends.q4`) lays weights out in C with the same arithmetic; torch's int4
kernel (`core.backends.lean.packed`) takes the 4-bit form too.
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP = 32  # inputs per scale (GGUF Q4_1's and Q8_0's block)


def quantize(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(N, K) weight → q (N, K) uint8 in [0, 15], step and minimum (N, K/32): w ≈ step·q + minimum
    per group of 32 inputs. Weights that were GGUF Q4_1 blocks come back as they were."""
    n, k = w.shape
    groups = w.float().view(n, k // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    step = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    return q.contiguous(), step, low


def quantize8(w: Tensor) -> tuple[Tensor, Tensor]:
    """(N, K) weight → q (N, K) int8 in [-127, 127] and step (N, K/32): w ≈ step·q per group of 32
    inputs (GGUF Q8_0's form)."""
    n, k = w.shape
    groups = w.float().view(n, k // GROUP, GROUP)
    step = (groups.abs().amax(-1) / 127).clamp(min=1e-12)
    q = torch.round(groups / step[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
    return q.contiguous(), step


def reference(x: Tensor, weight: Tensor, bias: Tensor | None = None, bits: int = 4) -> Tensor:
    """What the kernel computes, in float32 torch: int8 activations per group of 32, 4- or 8-bit
    weights (quantized from their bf16 values, as `Packed` takes them)."""
    weight = weight.to(torch.bfloat16)
    if bits == 4:
        q, step, low = quantize(weight)
    else:
        (q, step), low = quantize8(weight), torch.zeros(1)
    step, low = step.half().float(), low.half().float()  # as the kernel stores them
    rows, k = x.shape
    a = x.float().view(rows, k // GROUP, GROUP)
    scale = a.abs().amax(-1, keepdim=True) / 127
    p = torch.round(a / torch.where(scale > 0, scale, 1)).clamp(-127, 127)
    dots = torch.einsum("rgi,ngi->rng", p, q.float().view(-1, k // GROUP, GROUP))
    sums = p.sum(-1) * scale.squeeze(-1)  # the quantized activations' sum: the minimum's term stays consistent
    y = (dots * step[None] * scale.transpose(1, 2)).sum(-1) + (sums[:, None, :] * low[None]).sum(-1)
    return y if bias is None else y + bias


def bytes_per_weight(bits: int, k: int = GROUP) -> float:
    """Memory of one weight of a K-wide `Packed` put from floats: 4 bits and a float16 step and
    minimum per group, or in Q4_K's form where K is a multiple of 256 (a byte multiplier of each
    per group, a float16 unit of each per 256); 8 bits and a float16 step per group (Q8_0's size)."""
    if bits == 8:
        return 1 + 2 / GROUP
    return 0.5 + (2 / GROUP + 4 / 256 if k % 256 == 0 else 4 / GROUP)


def on_grid(rows: Tensor) -> bool:
    """Whether each group of 32 of these rows holds at most 16 values (a 4-bit weight's, as a Q4_1
    file's converted): quantized per group they are kept exactly, in Q4_K's form they would move."""
    values = rows.float().view(-1, GROUP).sort(dim=1).values
    return bool(((values.diff(dim=1) != 0).sum(dim=1) < 16).all())
