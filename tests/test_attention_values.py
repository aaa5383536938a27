"""The attention kernels' weighted values over an 8-bit cache at their extremes: the dot kernel sums
them as exact int16 × int8 integers (attend_dot.c's q4_dot_values8), which must not overflow on a
whole part of keys, and every kernel must give each query the mean of the values it weighs alike."""

import pytest
import torch

from core.backends import stepops
from core.backends.lean.kv import from_kv8, to_kv8
from tests.helpers import library_or_skip


def ops(kernel: str) -> stepops.Ops:
    lib = library_or_skip()
    if not stepops.can_attend_with(kernel):
        pytest.skip(f"this CPU (or its Linux) does not run the {kernel} attention kernel")
    return stepops.Ops(lib, attention=kernel)


@pytest.mark.parametrize("kernel", ["vectors", *stepops.NAMES])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("rows", [1, 16])
def test_values_at_their_largest_over_whole_parts_average_without_overflow(kernel, sign, rows):
    """Keys all alike (every weight equal, each at the largest an int16 weight takes) and values at
    the 8-bit rows' extreme (±127 on their scale) over three whole parts of 512 keys: each query's
    output is that value, not a wrapped sum; then values that differ key by key, against torch."""
    attend = ops(kernel)
    heads, kv, d, length = 9, 3, 64, 1536
    keys = to_kv8(torch.ones(kv, length, d).to(torch.bfloat16))
    top = torch.full((kv, length, d), sign * 3.0).to(torch.bfloat16)
    top[..., 0] = -sign * 3.0  # each row's largest magnitude on both sides of 0
    values = to_kv8(top)
    q = torch.randn(rows, heads, d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = attend.attention(q, keys, values, length, None).view(rows, heads, d).float()
    want = from_kv8(values)[0, 0].float()  # every key's value row is this one
    assert torch.allclose(got, want.expand_as(got), rtol=1e-2, atol=1e-2)
    mixed = to_kv8(torch.randn(kv, length, d, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16) * 4)
    got = attend.attention(q, keys, mixed, length, None).view(rows, heads, d).float()
    mean = from_kv8(mixed).float().mean(dim=1)  # equal weights: each kv head's values averaged
    assert torch.allclose(got, mean.repeat_interleave(heads // kv, dim=0).expand_as(got), atol=2e-2)


WITHIN_A_PART = ((11, 90), (14, 230), (29, 90), (41, 131), (53, 177), (64, 300))  # (nodes, prefix)
UP_TO_A_CUT = ((24, 1000), (4, 1020), (64, 960), (1, 1023), (37, 1536), (2, 2046))  # as many as `tree_room`


@pytest.mark.parametrize("kernel", ["vectors", *stepops.NAMES])
@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("cases", [WITHIN_A_PART, UP_TO_A_CUT], ids=["within-a-part", "up-to-a-cut"])
def test_every_node_of_random_trees_gets_its_one_token_steps_bits(kernel, bits, cases):
    """Random trees of 2-64 nodes after prefixes: every node's output equals a one-token step's
    over its prefix and path laid out in order, bit for bit. (The weights' sums were made lane by
    lane by slot, so ~1 node in 10 came out a last bit apart.) Keys are cut into parts at multiples
    of 512 positions: a tree's slots go up to the next cut, no further (the decode loop's
    `tree_room`; past it 2 trees in 40 had a node a last bit apart: its path's keys fell in other
    parts than its one-token step's)."""
    attend = ops(kernel)
    gen = torch.Generator().manual_seed(5)
    heads, kv, d = 9, 3, 64
    for t, past in cases:
        assert t <= stepops.split() - past % stepops.split()
        rnd = torch.Generator().manual_seed(t * 7919 + past)
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=rnd)) for i in range(1, t)]
        paths = []
        for node in range(t):
            chain, p = [], node
            while p >= 0:
                chain, p = [p, *chain], parents[p]
            paths.append(chain)
        seen = torch.zeros(t, past + t, dtype=torch.bool)
        seen[:, :past] = True
        for node, chain in enumerate(paths):
            seen[node, [past + a for a in chain]] = True
        mask = torch.zeros(t, past + t).masked_fill(~seen, torch.finfo(torch.bfloat16).min).to(torch.bfloat16)
        keys, values = (torch.randn(kv, past + t + 20, d, generator=gen).to(torch.bfloat16) for _ in range(2))
        if bits == 8:
            keys, values = to_kv8(keys), to_kv8(values)
        q = torch.randn(t, heads, d, generator=gen).to(torch.bfloat16)
        got = attend.attention(q, keys, values, past + t, mask).view(t, heads, d)
        for node, chain in enumerate(paths):
            order = list(range(past)) + [past + a for a in chain]
            one = attend.attention(q[node : node + 1], keys[:, order].contiguous(), values[:, order].contiguous(),
                                   len(order), None)  # fmt: skip
            assert torch.equal(one.view(heads, d), got[node]), (t, past, node)


@pytest.mark.parametrize("kernel", ["dot", "dot-scores"])
def test_the_dot_kernels_8_bit_integers_on_amx_tiles_are_its_own_bits(kernel):
    """Where AMX runs, a dot kernel makes an 8-bit cache's scores (and, for "dot", weighted values)
    of a block of many queries on the tiles (`stepops.TILES`): the same exact integers as its VNNI
    products, so every output is the same bits with the tiles and without, for a step, a tree and a
    prompt's block, masked or not."""
    attend = ops(kernel)
    if not attend.variant & stepops.TILES:
        pytest.skip("this CPU (or its Linux) does not run AMX's tiles")
    plain = stepops.Ops(attend.lib, attention=kernel)
    plain.variant &= ~stepops.TILES
    gen = torch.Generator().manual_seed(3)
    heads, kv, d = 9, 3, 64
    for rows, length in ((1, 700), (8, 90), (16, 1500), (64, 4100), (64, 64)):
        keys, values = (to_kv8(torch.randn(kv, length, d, generator=gen).to(torch.bfloat16)) for _ in range(2))
        q = torch.randn(rows, heads, d, generator=gen).to(torch.bfloat16)
        mask = torch.zeros(rows, length, dtype=torch.bfloat16)
        for r in range(rows):  # causal over the last rows' keys, as a prompt's block
            mask[r, length - rows + r + 1 :] = float("-inf")
        for m in (None, mask.view(1, 1, rows, length)):
            assert torch.equal(
                attend.attention(q, keys, values, length, m), plain.attention(q, keys, values, length, m)
            )
