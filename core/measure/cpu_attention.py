"""How a model's steps attend on a CPU, measured here and remembered (in `kernels`' record):
the attention kernel — in vectors, on AMX, or AMX's in AVX-512 bf16 and VNNI products
(`attention_kernel`) — for keys and values in bf16 and in 8 bits, then which of the two, each with
its kernel (`kv_bits`).

Both are timed as a step at a long context meets them: over the keys and values of `CONTEXT`
tokens in the model's layers (up to `TIMED` bytes in bf16, in parts of `KEYS` keys), more than the
CPU cache holds, so that they are read at the memory's speed; for one row (a plain step), 16 (a
tree) and 64 (a prompt's block; these two over fewer parts: their time is arithmetic's), each
candidate and its rival by turns. Either choice changes a step's last bits, so a model keeps both for its
session: a tree's nodes and a kept cache are then read as the one-token steps that wrote them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from core.backends import q4, stepops
from core.backends.lean.kv import to_kv8
from core.backends.lean.layer import head_size
from core.measure.clock import time_ms
from core.measure.kernels import CLEAR_WIN, ratio_by_turns, recall, record_key

KEYS = 2048  # keys in a timed part of the context
CONTEXT, TIMED = 4096, 128 * 2**20  # the context whose keys and values are timed, and the most bytes of them in bf16
ROWS = (1, 16, 64)  # a plain step, a tree, a prompt's block
MANY_PARTS = 8  # parts of the context the timings of many rows read (their time is arithmetic's, not the memory's)
ONE_ROW_LOSS = 0.2  # the most a one-token step's attention may lose for a choice taken for its many rows
# (its attention is at most ~40 % of the step: Zen 4, 4,000 tokens, 3.1-3.6 of 8.5 ms; there the
# dot kernel's 16-row and 64-row attention took half the vector kernel's time, its one row 9-14 % more)
KV8_GAIN = 1.1  # 8-bit keys and values are taken where a one-token step, or `ROWS` on average, gain this much


def use_measured(config, int4: bool, record: Path, kv8: bool = True) -> None:
    """The step ops' attention choices for the models loaded next (`stepops.use_attention`,
    `stepops.use_kv_bits`), measured for `config`'s heads or remembered: the best kernel for bf16
    keys and values and for 8-bit ones, then the bits, each with its own kernel; 8-bit keys and
    values only with `int4` (the library's decoder reads them) and `kv8` (False: the model would not
    keep its answers with them, `models.kv_choice`). Nothing changes for a config without heads."""
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return
    shape = (heads, getattr(config, "num_key_value_heads", None) or heads, head_size(config))
    layers = getattr(config, "num_hidden_layers", 1)
    if not (int4 and kv8):
        stepops.use_kv_bits(16)
        stepops.use_attention(attention_kernel(*shape, layers, record, 16))
        return
    pair = tuple(attention_kernel(*shape, layers, record, bits) for bits in (16, 8))
    bits = kv_bits(*shape, layers, record, pair)
    stepops.use_kv_bits(bits)
    stepops.use_attention(pair[bits == 8])


def attention_kernel(heads: int, kv_heads: int, head_dim: int, layers: int, record: Path, bits: int = 16) -> str:
    """The attention kernel the models run here (`stepops.use_attention`): of those the CPU runs
    (`stepops.KERNELS`), the one whose one-token step's, 16-node tree's and 64-row prompt block's
    attention take the least time on average over keys and values in `bits` (`use_measured`
    measures it for both, then weighs the two against each other: `kv_bits`), timed against vectors
    by turns, where a one-token step loses no more than `ONE_ROW_LOSS` to vectors (what decoding
    runs most). Measured once per machine, shape, bits and kernel library, and remembered; a new
    measurement turns an earlier choice over only when another kernel is clearly faster."""
    kernels = [kernel for kernel in stepops.NAMES if stepops.can_attend_with(kernel)]
    if not stepops.amx_heads(head_dim) or not kernels:
        return "vectors"

    def decide(earlier: str | None) -> str:
        gains = {kernel: _gain(kernel, heads, kv_heads, head_dim, layers, bits) for kernel in kernels}
        gains["vectors"] = 1.0  # each kernel's: the vector kernel's time over its own
        best = max(gains, key=gains.get)
        return earlier if earlier in gains and gains[best] / gains[earlier] < CLEAR_WIN else best

    key = timed_key(f"attention kernel {heads}x{kv_heads}x{head_dim}", f"{bits}-bit KV")
    return recall(record, key, str, decide)


def kv_bits(
    heads: int, kv_heads: int, head_dim: int, layers: int, record: Path, kernels: tuple[str, str] = ("vectors",) * 2
) -> int:  # fmt: skip
    """The bits of the keys and values a model's cache keeps here (`stepops.use_kv_bits`): 8 where
    a one-token step's attention and the average over `ROWS` (1, 16, 64) both take no more time with
    them than in bf16, and one of the two `KV8_GAIN` less (AMX: one row 1.3× faster, many rows
    ~0.95×; Zen 4: one row ~1.1×, many rows 1.6-1.9×); else 16. Each timed with its own kernel
    (`kernels`: bf16's, then 8-bit's, `attention_kernel`'s choices): 8 bits save reading, and on a
    CPU with AVX-512's bf16 and VNNI products but no AMX their integer scores save arithmetic that
    bf16's dot-product kernels spend (Zen 4, 4,000 tokens' keys in 30 layers: one row 3.7 ms with
    vectors in bf16, 4.3-4.8 with dot-scores or dot, 3.1-3.6 with them in 8 bits; 64 rows 130, 72-92,
    65-91). Measured once per machine, shape and kernels, and remembered; a new measurement near the
    threshold keeps the earlier choice."""
    if not stepops.Ops.attends(head_dim) or q4.library() is None:
        return 16

    def decide(earlier: int | None) -> int:
        ratios = _kv8_ratios(heads, kv_heads, head_dim, layers, kernels)  # bf16's time over 8-bit's
        pair = ratios[0], sum(ratios) / len(ratios)  # a one-token step's, and the average
        if earlier is not None and abs(max(pair) - KV8_GAIN) < CLEAR_WIN - 1 and min(pair) >= 1:
            return earlier
        return 8 if max(pair) >= KV8_GAIN and min(pair) >= 1 else 16

    timed = kernels[0] if kernels[0] == kernels[1] else " against ".join(kernels)
    return recall(record, timed_key(f"kv bits {heads}x{kv_heads}x{head_dim}", timed), int, decide)


def timed_key(*what: str) -> str:
    """A choice's record key (`record_key`), naming the row counts it was timed at (another set is
    measured again)."""
    return record_key(*what, "rows " + ",".join(map(str, ROWS)))


def _gain(kernel: str, heads: int, kv_heads: int, head_dim: int, layers: int, bits: int = 16) -> float:
    """The vector kernel's median time over `kernel`'s for each of `ROWS` over keys and values in
    `bits`, averaged; or the one-row ratio where `kernel` loses more than `ONE_ROW_LOSS` there."""
    caches, lib = _caches(kv_heads, head_dim, layers, bits), q4.library()
    runs = {on: (stepops.Ops(lib, attention=kernel if on else "vectors"), caches) for on in (False, True)}
    ratios = _ratios(heads, head_dim, runs)
    return ratios[0] if ratios[0] < 1 - ONE_ROW_LOSS else sum(ratios) / len(ratios)


def _kv8_ratios(
    heads: int, kv_heads: int, head_dim: int, layers: int, kernels: tuple[str, str] = ("vectors",) * 2
) -> list[float]:  # fmt: skip
    """bf16 caches' median time (with the kernel `kernels[0]`) over 8-bit ones' (`kernels[1]`) for
    each of `ROWS`' attention."""
    lib = q4.library()
    runs = {
        on: (stepops.Ops(lib, attention=kernels[on]), _caches(kv_heads, head_dim, layers, 8 if on else 16))
        for on in (False, True)
    }
    return _ratios(heads, head_dim, runs)


def _caches(kv_heads: int, head_dim: int, layers: int, bits: int) -> list[tuple[Tensor, Tensor]]:
    """The keys and values of `CONTEXT` tokens in `layers` layers (at most `TIMED` bytes in bf16), in
    parts of `KEYS` keys: (keys, values) a part, bf16 or 8-bit rows; random, each part a copy of the
    first (the time does not depend on the values, and copies are made ~50× faster)."""
    gen = torch.Generator().manual_seed(0)
    part = 4 * kv_heads * KEYS * head_dim  # bytes of a part's keys and values in bf16
    keys, values = (torch.randn(kv_heads, KEYS, head_dim, generator=gen).bfloat16() for _ in range(2))
    first = (keys, values) if bits == 16 else (to_kv8(keys), to_kv8(values))
    return [tuple(x.clone() for x in first) for _ in range(max(2, min(layers * CONTEXT // KEYS, TIMED // part)))]


def _ratios(heads: int, head_dim: int, runs: dict) -> list[float]:
    """For each of `ROWS`: the median time of attending over every part (many rows: the first
    `MANY_PARTS`) with runs[False] (ops, parts) over that with runs[True], the two timed by turns."""
    gen = torch.Generator().manual_seed(1)
    ratios = []
    for rows in ROWS:
        q = torch.randn(rows, heads, head_dim, generator=gen).bfloat16()

        def timed(on: bool, q=q, rows=rows) -> float:
            ops, parts = runs[on]
            parts = parts[:MANY_PARTS] if rows > 1 else parts
            return time_ms(lambda: [ops.attention(q, keys, values, KEYS, None) for keys, values in parts], repeats=3)

        ratios.append(ratio_by_turns(timed))
    return ratios
