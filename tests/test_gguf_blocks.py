"""A GGUF file's 4- and 8-bit blocks in the layers' form (`models.gguf_blocks`): the file's own
weights exactly (Q4_0, Q4_1, Q4_K, Q8_0), which the former
route (dequantized, cast to bfloat16, quantized again) moved."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from core.backends import q4
from core.backends import quantize as grid
from models.gguf_blocks import Kind, Nibbles, decode
from tests.gguf_writer import quantize
from tests.helpers import unpacked


def weights(parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """What the blocks' (q, step[, minimum[, multipliers]]) hold: step·q (+ minimum) per group of
    32 (Q4_K's step and minimum per 256, times its multipliers per 32)."""
    q, step, *low = parts
    q = q.unpacked() if isinstance(q, Nibbles) else q
    if len(low) == 2:  # Q4_K's
        step, low = (x.float().repeat_interleave(8, dim=1) * low[1][..., i] for i, x in enumerate((step, low[0])))
        low = [low]
    values = q.float().view(q.shape[0], -1, grid.GROUP) * step.float()[..., None]
    if low:
        values = values + low[0].float()[..., None]
    return values.flatten(1)


def requantized(exact: torch.Tensor) -> torch.Tensor:
    """The former route's weights: the file's values in bfloat16, quantized again to 4 bits."""
    q, step, low = grid.quantize(exact.bfloat16())
    return weights((q, step.half(), low.half()))


@pytest.mark.parametrize(
    ("kind", "bits"), [("Q4_0", 4), ("Q4_1", 4), ("Q4_K", 4), ("Q8_0", 8), ("Q4_0", 8), ("Q5_0", 8)]
)
def test_blocks_hold_the_files_weights(kind, bits):
    rng = np.random.default_rng(7)
    raw = quantize(rng.normal(0, 0.05, (32, 512)).astype(np.float32), kind)
    exact = torch.from_numpy(gguf.quants.dequantize(raw, Kind[kind]).copy())
    parts = decode(Kind[kind], raw, bits)
    held = 512 // (256 if kind == "Q4_K" else grid.GROUP)  # steps a row
    assert len(parts) == (2 if bits == 8 else 4 if kind == "Q4_K" else 3)
    assert all(p.shape == (32, held) for p in parts[1:3])
    assert parts[0].dtype == (torch.int8 if bits == 8 else torch.uint8) and parts[0].shape == (32, 512)
    assert torch.equal(weights(parts), exact)
    if bits == 4:  # what quantizing again did: Q4_0's groups rarely span all 16 levels
        again = (requantized(exact) - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()
        assert again > 0.01 if kind == "Q4_0" else again > 0


def test_q4_0_steps_may_be_negative_and_the_minimum_is_eight_steps_down():
    """Q4_0's step is the largest-magnitude weight over −8: negative where that weight is positive."""
    weight = np.full((16, 32), 0.01, dtype=np.float32)
    weight[:8, 0], weight[8:, 0] = 0.5, -0.5
    _, step, low = decode(Kind.Q4_0, quantize(weight, "Q4_0"), 4)
    assert (step[:8] < 0).all() and (step[8:] > 0).all() and torch.equal(low, step * -8)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_nibbles_laid_out_as_they_lie_equal_the_values_unpacked_first(kind):
    """The library lays a file's 4-bit values out from its blocks (`Nibbles.pack`) as from the
    values unpacked a byte each: the same bytes, in any part of the rows."""
    if q4.library() is None:
        pytest.skip(q4.unavailable())
    rng = np.random.default_rng(8)
    raw = quantize(rng.normal(0, 0.05, (48, 512)).astype(np.float32), kind)
    q, *steps = decode(Kind[kind], raw, 4)
    direct = q4.Packed.empty(q4.library(), 48, 512, bits=4)
    direct.put_blocks(32, *decode(Kind[kind], raw[32:], 4))
    direct.put_blocks(0, *decode(Kind[kind], raw[:32], 4))
    from_values = q4.Packed.empty(q4.library(), 48, 512, bits=4)
    from_values.put_blocks(0, q.unpacked(), *steps)
    for name in ("w", "d", "m", "k6"):
        assert torch.equal(getattr(direct, name), getattr(from_values, name)), name
    assert bool(direct.k6.numel()) == (kind == "Q4_K")  # Q4_K's held in its own form
    exact = torch.from_numpy(gguf.quants.dequantize(raw, Kind[kind]).copy())
    assert torch.equal(unpacked(direct), exact)
