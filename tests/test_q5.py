"""5-bit weights (`q4.Packed` with bits 5: a 4-bit weight and its values' fifth bits, as GGUF Q5_0,
Q5_1 and Q5_K hold them): a file's blocks held exactly, in less than 8-bit layers' memory, and
multiplied as exact integer sums, so every variant and row count gives the same bits."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from core.backends import q4
from core.backends.quantize import GROUP
from models.gguf_blocks import Kind, decode
from tests.gguf_writer import quantize
from tests.helpers import unpacked


def library():
    lib = q4.library()
    if lib is None:
        pytest.skip(q4.unavailable())
    return lib


def variants() -> list[str]:
    return ["avx512-vnni", "avx2"] if q4.isa() == "avx512-vnni" else [q4.isa()]


def five_bit(raw: np.ndarray, kind: str, variant: str | None = None) -> q4.Packed:
    """A 5-bit weight of a file's blocks `raw`, put in two parts, the later rows first."""
    packed = q4.Packed.empty(library(), raw.shape[0], _columns(raw, kind), bits=5, variant=variant)
    half = raw.shape[0] // 2 // q4.TILE * q4.TILE
    packed.put_blocks(half, *decode(Kind[kind], raw[half:], 5))
    packed.put_blocks(0, *decode(Kind[kind], raw[:half], 5))
    packed.set_bias(None)
    return packed


def _columns(raw: np.ndarray, kind: str) -> int:
    block, size = gguf.GGML_QUANT_SIZES[Kind[kind]]
    return raw.shape[1] // size * block


def exact(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, Kind[kind]).copy())


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K", "Q4_0", "Q4_1", "Q4_K"])
def test_a_files_blocks_go_into_5_bit_weights_exactly_in_under_8_bit_memory(kind):
    rng = np.random.default_rng(5)
    raw = quantize(rng.normal(0, 0.05, (48, 512)).astype(np.float32), kind)
    packed = five_bit(raw, kind)
    assert torch.equal(unpacked(packed), exact(raw, kind))
    held = sum(t.numel() * t.element_size() for t in (packed.w, packed.d, packed.m, packed.k6, packed.high))
    assert held / packed.n / packed.k <= (0.71 if kind.endswith("K") else 0.75) < 1 + 2 / GROUP  # 8 bits: 1.06
    if kind.startswith("Q4"):  # 4-bit blocks: fifth bits all 0
        assert not packed.high.any()


def extreme_q5_0(rows: int, k: int) -> np.ndarray:
    """Q5_0 blocks whose values are all 31 (w = 15·d, d = 1): a group's integer sum with
    activations at ±127 is 32·31·127, past what int16 holds (the AVX2 pass's half-group sums)."""
    block = np.zeros(22, dtype=np.uint8)
    block[:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    block[2:] = 0xFF
    return np.tile(block, (rows, k // 32))


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K", "extreme"])
def test_5_bit_products_are_the_same_bits_on_every_variant_and_at_every_row_count(kind):
    rng = np.random.default_rng(6)
    gen = torch.Generator().manual_seed(6)
    if kind == "extreme":
        raw, kind = extreme_q5_0(80, 512), "Q5_0"
        x = torch.full((70, 512), 0.5).to(torch.bfloat16)
        x[1::2] *= -1
    else:
        raw = quantize(rng.normal(0, 0.05, (80, 512)).astype(np.float32), kind)
        x = torch.randn(70, 512, generator=gen).to(torch.bfloat16)
        x[3, :7] *= 40  # an outlier sets its group's scale
    weights = exact(raw, kind)
    a = x.float().view(70, -1, GROUP)
    scale = a.abs().amax(-1, keepdim=True) / 127
    p = torch.round(a / torch.where(scale > 0, scale, 1)).clamp(-127, 127) * scale  # int8 activations
    want = p.flatten(1).double() @ weights.double().T
    outputs = []
    for variant in variants():
        layer = five_bit(raw, kind, variant)
        whole = layer(x)
        assert (whole.double() - want).abs().max() <= 1e-2 * want.abs().max()
        for rows in (1, 2, 3, 4, 5, 17):
            assert torch.equal(layer(x[:rows]), whole[:rows]), (variant, rows)
        outputs.append(whole)
    assert all(torch.equal(out, outputs[0]) for out in outputs)


def test_avx_vnni_5_bit_passes_give_the_avx2_passes_bits():
    lib = library()
    if "avx2" not in variants() or lib.q4_avx_vnni(0) != 0:
        pytest.skip("this CPU has no AVX-VNNI")
    raw = extreme_q5_0(32, 256)
    x = torch.full((5, 256), 0.5).to(torch.bfloat16)
    layer = five_bit(raw, "Q5_0", "avx2")
    try:
        plain = layer(x)
        assert lib.q4_avx_vnni(1) == 0
        assert torch.equal(layer(x), plain)
    finally:
        lib.q4_avx_vnni(0)


def test_a_5_bit_weight_takes_no_fifth_bits_into_other_widths_and_full_precision_rows_at_4_bits():
    lib = library()
    rng = np.random.default_rng(7)
    raw = quantize(rng.normal(0, 0.05, (32, 256)).astype(np.float32), "Q5_0")
    four = q4.Packed.empty(lib, 32, 256, bits=4)
    with pytest.raises(ValueError):
        four.put_blocks(0, *decode(Kind.Q5_0, raw, 5))  # 4-bit layers: no fifth bits
    packed = five_bit(raw, "Q5_0")
    weight = torch.from_numpy(rng.normal(0, 0.05, (16, 256)).astype(np.float32))
    packed.put(16, weight)  # rows in full precision: 4-bit values, their fifth bits cleared
    assert not packed.high[16 * 256 // 8 :].any() and packed.high[: 16 * 256 // 8].any()
    again = q4.Packed.empty(lib, 32, 256, bits=4)  # a 4-bit weight held per group too (Q4_0's blocks)
    again.put_blocks(0, *decode(Kind.Q4_0, quantize(rng.normal(0, 0.05, (16, 256)).astype(np.float32), "Q4_0"), 4))
    again.put(16, weight)
    assert torch.equal(unpacked(packed)[16:], unpacked(again)[16:])
