"""core.backends.q4's weights: quantized in C as in torch, put in parts as put whole, GGUF blocks put
as they are (4 and 8 bits, negative steps, symmetric and Q4_K forms) equal to the weight quantized
in C, and an 8-bit weight's rows read back as the kernel multiplies them."""

import pytest
import torch

from core.backends import lean as fast
from core.backends import q4, quantize
from core.backends.lean.packed import rows_in_torch
from tests.helpers import kernel_variants as variants
from tests.helpers import library_or_skip as loaded
from tests.helpers import unpacked


@pytest.mark.parametrize("bits", [4, 8])
def test_weights_are_quantized_in_c_as_in_torch(bits):
    """The library's one-pass quantizer gives quantize's (or quantize8's) steps and minimums."""
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn(48, 96, generator=gen) * 0.05).to(torch.bfloat16)
    layer = q4.Packed(loaded(), weight, None, bits=bits)
    tiles, groups = 48 // q4.TILE, 96 // quantize.GROUP

    def by_tile(x):
        return x.view(tiles, q4.TILE, groups).transpose(1, 2).flatten()

    if bits == 4:
        _, step, low = quantize.quantize(weight)
        assert torch.equal(layer.m, by_tile(low).half())
    else:
        _, step = quantize.quantize8(weight)
    assert torch.equal(layer.d, by_tile(step).half())


@pytest.mark.parametrize("bits", [4, 8])
def test_a_weight_put_in_parts_is_the_weight_put_whole(bits):
    """Rows put a tile-aligned part at a time (as a load packs q, k and v one by one into the
    fused weight) give the same bytes, steps and products as the weight packed at once."""
    gen = torch.Generator().manual_seed(11)
    weight = (torch.randn(80, 96, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(80, generator=gen)
    whole = q4.Packed(loaded(), weight, bias, bits=bits)
    parts = q4.Packed.empty(loaded(), 80, 96, bits=bits)
    for start, stop in ((48, 80), (0, 16), (16, 48)):  # any order
        parts.put(start, weight[start:stop])
    parts.set_bias(bias)
    for name in ("w", "d", "m"):
        assert torch.equal(getattr(parts, name), getattr(whole, name))
    x = torch.randn(3, 96, generator=gen).to(torch.bfloat16)
    assert torch.equal(parts(x), whole(x))
    with pytest.raises(ValueError, match="do not fit"):
        parts.put(8, weight[:16])  # not on a tile


def test_rows_of_an_8bit_weight_read_back_as_the_kernel_multiplies_them():
    gen = torch.Generator().manual_seed(5)
    weight = (torch.randn(64, 96, generator=gen) * 0.05).to(torch.bfloat16)
    layer = q4.Packed(loaded(), weight, None, bits=8)
    q, step = quantize.quantize8(weight)
    want = (q.float().view(64, -1, quantize.GROUP) * step.half().float()[..., None]).view(64, 96)
    ids = torch.tensor([0, 17, 63, 17, 40])
    assert torch.equal(fast.eight_bit_rows(layer, ids, torch.float32), want[ids])
    assert torch.equal(fast.eight_bit_rows(layer, ids, torch.bfloat16), want[ids].bfloat16())
    every = torch.arange(64)  # bf16 rows in the library's one call: torch's rows, rounded alike
    assert torch.equal(fast.eight_bit_rows(layer, every, torch.bfloat16), rows_in_torch(layer, every).bfloat16())
    with pytest.raises(IndexError, match="outside"):
        fast.eight_bit_rows(layer, torch.tensor([3, 64]), torch.bfloat16)
    with pytest.raises(ValueError, match="8-bit"):
        fast.eight_bit_rows(q4.Packed(loaded(), weight, None, bits=4), ids, torch.float32)


def test_8bit_blocks_put_as_they_are_equal_the_weight_quantized_in_c():
    """Q8_0-form blocks (int8 q and a float16 step per 32) put straight into the layout give what
    quantizing their values in C gives: bytes, steps, sums, products."""
    gen = torch.Generator().manual_seed(9)
    q = torch.randint(-127, 128, (48, 64), generator=gen, dtype=torch.int8)
    q[:, ::32] = 127  # every group reaches 127, as Q8_0's do: its step is then the one quantize8 finds
    step = (2.0 ** -torch.randint(5, 12, (48, 2), generator=gen)).half()  # values bf16 holds exactly
    values = (q.float().view(48, 2, 32) * step.float()[..., None]).view(48, 64)
    for variant in variants():
        whole = q4.Packed(loaded(), values.bfloat16(), None, bits=8, variant=variant)
        assert torch.equal(fast.eight_bit_rows(whole, torch.arange(48), torch.float32), values)
        blocks = q4.Packed.empty(loaded(), 48, 64, bits=8, variant=variant)
        blocks.put_blocks(32, q[32:], step[32:])
        blocks.put_blocks(0, q[:32], step[:32])
        for name in ("w", "d", "m"):
            assert torch.equal(getattr(blocks, name), getattr(whole, name)), name
        x = torch.randn(2, 64, generator=gen).bfloat16()
        assert torch.equal(fast.eight_bit_rows(blocks, torch.arange(48), torch.float32), values)
        assert torch.equal(blocks(x), whole(x))


def test_4bit_blocks_put_as_they_are_equal_the_weight_quantized_in_c():
    """4-bit blocks (q in [0, 15], a float16 step and minimum per 32: GGUF Q4_0's, Q4_1's, Q4_K's
    in that form) put straight into the layout give what quantizing their values in C gives."""
    gen = torch.Generator().manual_seed(4)
    weight = (torch.randn(48, 64, generator=gen) * 0.05).to(torch.bfloat16)
    q, step, low = quantize.quantize(weight)
    whole = q4.Packed(loaded(), weight, None, bits=4)
    blocks = q4.Packed.empty(loaded(), 48, 64, bits=4)
    blocks.put_blocks(32, q[32:], step[32:].half(), low[32:].half())
    blocks.put_blocks(0, q[:32], step[:32].half(), low[:32].half())
    for name in ("w", "d", "m"):
        assert torch.equal(getattr(blocks, name), getattr(whole, name)), name
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    assert torch.equal(blocks(x), whole(x))
    with pytest.raises(ValueError, match="8-bit rows 0-16 of width 64 do not fit"):
        blocks.put_blocks(0, q[:16].to(torch.int8), step[:16].half())


def test_negative_4bit_steps_multiply_as_their_weights():
    """Q4_0's steps are negative where a group's largest weight is positive (w = d·(q − 8)): the
    kernel multiplies those weights as closely as their mirror image with positive steps."""
    gen = torch.Generator().manual_seed(6)
    q = torch.randint(0, 16, (32, 64), generator=gen, dtype=torch.uint8)
    step = -(torch.rand(32, 2, generator=gen) * 0.01 + 0.001).half()
    twins = ((q, step, step * -8), (15 - q, -step, step * 7))  # the same weights (up to float16 rounding)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    errors = []
    for qs, steps, lows in twins:
        packed = q4.Packed.empty(loaded(), 32, 64, bits=4)
        packed.put_blocks(0, qs, steps, lows)
        values = (qs.float().view(32, 2, 32) * steps.float()[..., None] + lows.float()[..., None]).view(32, 64)
        errors.append((packed(x).float() - x.float() @ values.T).abs().max())
    assert errors[0] <= 2 * errors[1] + 1e-3


@pytest.mark.parametrize("variant", ["avx512-vnni", "avx2"])
def test_a_symmetric_weight_drops_its_minimums_and_keeps_its_bits(variant):
    """Q4_0's blocks (every minimum −8·step): once whole, the weight keeps no minimums (the
    kernels compute them) and multiplies bit for bit as with them, at every row count; a weight
    with one other minimum keeps them."""
    if variant not in variants():
        pytest.skip(f"this CPU does not run the {variant} variant")
    gen = torch.Generator().manual_seed(12)
    q = torch.randint(0, 16, (80, 320), generator=gen, dtype=torch.uint8)
    step = ((torch.rand(80, 10, generator=gen) - 0.3) * 0.01).half()
    bias = torch.randn(80, generator=gen)
    x = torch.randn(40, 320, generator=gen).to(torch.bfloat16)
    x[3, :7] *= 40
    layers = []
    for symmetric in (True, False):
        layer = q4.Packed.empty(loaded(), 80, 320, bits=4, variant=variant)
        layer.put_blocks(0, q[:48], step[:48], step[:48] * -8)
        layer.put_blocks(48, q[48:], step[48:], step[48:] * -8)
        layer.set_bias(bias)
        if not symmetric:
            layer._unsettle(form=None)  # the same weight holding its minimums again
        assert (layer.m.numel() == 0) == symmetric and (layer.layer.m is None) == symmetric
        layers.append(layer)
    assert torch.equal(layers[0].groups()[1], layers[1].groups()[1])
    for rows in (1, 3, 4, 5, 17, 40):
        assert torch.equal(layers[0](x[:rows]), layers[1](x[:rows])), rows
    if variant == "avx512-vnni" and q4.amx():  # AMX's passes too
        layers[0].amx = 1
        for rows in (1, 16, 17, 40):
            assert torch.equal(layers[0](x[:rows]), layers[1](x[:rows])), rows
    other = step[:48] * -8
    other[5, 2] += 0.001
    kept = q4.Packed.empty(loaded(), 80, 320, bits=4)
    kept.put_blocks(0, q[:48], step[:48], other)
    kept.put_blocks(48, q[48:], step[48:], step[48:] * -8)
    kept.set_bias(None)
    assert kept.m.numel() == 80 * 10
    weight = torch.randn(16, 320, generator=gen) * 0.05  # rows put after it settled: minimums held again
    layers[0].put(16, weight)
    layers[1].put(16, weight)
    assert layers[0].layer.m is not None and torch.equal(layers[0](x[:5]), layers[1](x[:5]))


@pytest.mark.parametrize("variant", ["avx512-vnni", "avx2"])
def test_q4_k_form_multiplies_as_its_steps_per_group(variant):
    """A weight put in Q4_K's form (float16 d and −dmin per 256 weights, byte multipliers per 32)
    holds a fourteenth fewer bytes than one with float16 steps and minimums per group, and
    multiplies bit for bit as that one where its products d·sc and dmin·m are float16 exactly
    (d a power of two), at every row count; rows put per group later turn it into that form."""
    if variant not in variants():
        pytest.skip(f"this CPU does not run the {variant} variant")
    gen = torch.Generator().manual_seed(14)
    n, k = 80, 512
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    d, dmin = ((2.0 ** -torch.randint(8, 14, (n, k // 256), generator=gen)).half() for _ in range(2))
    d[3, 1] = 0  # a block of zeros
    multipliers = torch.randint(0, 64, (n, k // 32, 2), generator=gen, dtype=torch.uint8)
    step, low = (x.float().repeat_interleave(8, dim=1) * multipliers[..., i] for i, x in enumerate((d, -dmin)))
    x = torch.randn(40, k, generator=gen).to(torch.bfloat16)
    x[3, :7] *= 40
    compact, groups = (q4.Packed.empty(loaded(), n, k, bits=4, variant=variant) for _ in range(2))
    for start, stop in ((48, 80), (0, 48)):
        compact.put_blocks(start, q[start:stop], d[start:stop], -dmin[start:stop], multipliers[start:stop])
        groups.put_blocks(start, q[start:stop], step[start:stop].half(), low[start:stop].half())
    compact.set_bias(None)
    groups.set_bias(None)
    size = sum(t.numel() * t.element_size() for t in (compact.w, compact.d, compact.m, compact.k6))
    assert compact.k6.numel() and size == n * k * (0.5 + 2 / 32 + 4 / 256)
    assert all(torch.equal(a, b) for a, b in zip(compact.groups(), groups.groups(), strict=True))
    for rows in (1, 2, 3, 4, 5, 17, 40):
        assert torch.equal(compact(x[:rows]), groups(x[:rows])), rows
    if variant == "avx512-vnni" and q4.amx():  # AMX's passes too
        compact.amx = 1
        for rows in (1, 16, 17, 40):
            assert torch.equal(compact(x[:rows]), groups(x[:rows])), rows
        compact.amx = 0
    compact.put_blocks(16, q[16:32], step[16:32].half(), low[16:32].half())  # per group: the form changes
    assert not compact.k6.numel() and torch.equal(compact(x[:5]), groups(x[:5]))
    late = q4.Packed.empty(loaded(), n, k, bits=4, variant=variant)  # Q4_K's blocks into a weight held per group
    late.put_blocks(0, q[:16], step[:16].half(), low[:16].half())
    late.put_blocks(0, q, d, -dmin, multipliers)
    assert not late.k6.numel() and torch.equal(late(x[:5]), groups(x[:5]))


def test_weights_quantized_in_q4_k_form_keep_every_value_within_half_a_step():
    """A 4-bit weight of K a multiple of 256 is quantized in Q4_K's form (0.578 bytes a weight):
    each group's step and minimum are multiples of its block's float16 units, rounded so that its
    range fits its 16 levels: every weight lies within half its group's step of its value (none
    clamped), and the products stay as close to the exact ones as the per-group form's."""
    gen = torch.Generator().manual_seed(15)
    weight = (torch.randn(64, 768, generator=gen) * 0.05).to(torch.bfloat16)
    weight[5, 256:288] = weight[5, 256:288].abs() + 0.3  # a group above 0: its minimum is 0
    weight[9, :256] = 0  # a block of zeros
    x = torch.randn(4, 768, generator=gen).to(torch.bfloat16)
    exact = x.float() @ weight.float().T
    errors = []
    for form in ("k", None):
        packed = q4.Packed.empty(loaded(), 64, 768, bits=4)
        packed.blank = form == "k"  # a weight held per group keeps that form
        packed.put(0, weight)
        packed.set_bias(None)
        assert bool(packed.k6.numel()) == (form == "k")
        step = packed.groups()[0].transpose(1, 2).reshape(64, -1, 1)  # (row, group, 1)
        off = (unpacked(packed) - weight.float()).view(64, 24, 32).abs()
        assert form is None or (off <= step * 0.5001 + 1e-7).all()  # (float16 steps per group may clamp)
        errors.append(float((packed(x).float() - exact).pow(2).mean().sqrt()))
    assert errors[0] < 1.1 * errors[1]
