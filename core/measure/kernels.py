"""Which dtype and matmul kernel decode fastest on this CPU, measured here and remembered.

The candidates are `core.backends.lean`'s PackedLinear kernels in fp32 and bf16 (bf16 only where the CPU
has native bf16 arithmetic). Each is timed on the model's own MLP shapes at one row (a plain
step) and eight rows (a tree step), over enough distinct weights that they do not sit in the
CPU cache, as in a real forward. A kernel that fails here (oneDNN's bf16 needs AVX-512 or
AVX-NE-CONVERT; an ISA limit can withhold them) is skipped. The result is stored per machine
key (CPU, kernel ISA, threads, torch), shape and request, so a second launch measures nothing;
a launch that cannot have the kernel library a remembered choice needs (no C compiler now)
measures again among the kernels that run, and remembers that fallback apart from the choice.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from core.backends import lean, q4, q4build
from core.cpuinfo import cpu_flags
from core.measure.clock import time_ms
from core.measure.profile import machine

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
ROWS = (1, 8)  # a plain step and a typical tree step
WORKING_SET = 48 * 2**20  # bytes of weights cycled through while timing (beyond the CPU cache)
STREAMED = 96 * 2**20  # weights (4-bit: 54 MB) timed for the prefetches' flavor: from memory, as a large model's
DRAFT_TIMED = 64 * 2**20  # at most this many bytes of float32 weight timed for a drafting choice (see `drafting`)
CLEAR_WIN = 1.1  # a remeasured kernel choice replaces the one measured before only when it is this much faster
AMX_ROWS = (2, 4, 8, 12, 16, 32)  # the row counts timed for AMX (`amx_rows`)
FLAVOR_REPEATS = 5  # timings by turns of a kernel flavor on and off (`amx_rows`, `avx_vnni`)
HEAD_REPEATS = 9  # interleaved timings of one and eight rows through the lm_head (their medians compared)
WITHOUT_LIBRARY = "without the kernel library"  # the key suffix of a choice measured while the library was unavailable
_LIBRARY_ID = re.compile(r"\|kernels [0-9a-f]+")  # the kernel library's build in a record's key (see `_key`)


@dataclass(frozen=True)
class Choice:
    dtype: str  # the model's dtype: "float32" or "bfloat16"
    kernel: str  # the decoder layers' PackedLinear kernel
    head_kernel: str  # the lm_head's


def native_bf16() -> bool:
    """Whether the CPU has bf16 arithmetic (AVX512-BF16 or AMX); elsewhere bf16 is emulated."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def candidates(dtype: str | None, int4: bool) -> list[Choice]:
    """What may be timed for a request: a dtype (None: any) and whether int4 weights were asked for."""
    if int4:  # the 4-bit kernels run with bf16 activations; the lm_head stays bf16, or 8-bit with q4
        return [
            Choice("bfloat16", kernel, head)
            for kernel in ("int4", "q4")
            for head in ("onednn", "dense", *(["q8"] if kernel == "q4" else []))
        ]
    dtypes = [dtype] if dtype else ["float32", *(["bfloat16"] if native_bf16() else [])]
    return [Choice(d, k, k) for d in dtypes for k in ("onednn", "dense")]


def record_key(*what: str) -> str:
    """A record's key: the machine, what was measured, and the kernels it was measured among (new
    kernels, or a changed kernel library, are measured again)."""
    return "|".join((machine(torch.device("cpu")).key, *what, ",".join(lean.KERNELS), f"kernels {q4build.source_id()}"))


def choose(hidden: int, inner: int, dtype: str | None, int4: bool, record: Path) -> Choice:
    """The fastest working candidate; measured once per machine, shape and request. Where the
    kernel library that some candidates need cannot be had now (no compiler, say), the choice
    among the others is measured and remembered apart: the library's return restores the first."""
    key = record_key(f"{hidden}x{inner}", dtype or "auto", "int4" if int4 else "full")
    if any(_unavailable(c.kernel, c.head_kernel) for c in candidates(dtype, int4)):
        key = f"{key}|{WITHOUT_LIBRARY}"
    known = _read(record)
    with contextlib.suppress(TypeError, KeyError):
        choice = Choice(**known[key])
        if choice in candidates(dtype, int4) and not _unavailable(choice.kernel, choice.head_kernel):
            return choice
    timed = {c: _seconds(c, hidden, inner) for c in candidates(dtype, int4)}
    working = {c: s for c, s in timed.items() if s is not None}
    best = min(working, key=working.get) if working else Choice(dtype or "float32", "dense", "dense")
    earlier = _earlier(known, key)  # the choice measured for a former kernel library
    with contextlib.suppress(TypeError, KeyError):
        kept = Choice(**earlier)
        if kept in working and working[best] > working[kept] / CLEAR_WIN:
            best = kept
    known[key] = asdict(best)
    _write(record, known)
    return best


def _earlier(known: dict, key: str) -> object:
    """The record of `key` as measured with another build of the kernel library (the same machine,
    shape and request), or None: a new measurement replaces its choice only when it wins clearly."""
    stem = _LIBRARY_ID.sub("", key)
    return next((value for other, value in known.items() if other != key and _LIBRARY_ID.sub("", other) == stem), None)


def head_by_row(head: lean.PackedLinear, record: Path) -> bool:
    """Whether a tree's logits are computed a node at a time (`core.backends.base.Backend.row_head`): whether 8
    rows through this lm_head cost more than twice one row. Measured once per machine, shape and
    kernel (interleaved, the median of `HEAD_REPEATS`), and remembered, so every launch of a
    model makes the same choice; a new measurement (a changed kernel library) turns an earlier
    choice over only when the ratio is clearly on the other side of 2."""
    key = record_key(f"lm_head by row {head.out_features}x{head.in_features}", head.kernel)

    def decide(earlier: bool | None) -> bool:
        ratio = _head_ratio(head)
        return earlier if earlier is not None and abs(ratio / 2 - 1) < CLEAR_WIN - 1 else ratio > 2

    return recall(record, key, bool, decide)


def recall(record: Path, key: str, kind: type, decide):
    """The value of type `kind` remembered in `record` under `key`; else `decide(earlier)` (which
    measures; `earlier`: the value measured with another build of the kernel library, or None),
    written there and returned."""
    known = _read(record)
    if isinstance(known.get(key), kind):
        return known[key]
    earlier = _earlier(known, key)
    value = decide(earlier if isinstance(earlier, kind) else None)
    known[key] = value
    _write(record, known)
    return value


def _head_ratio(head: lean.PackedLinear, rows: int = 8) -> float:
    """The median time of `rows` rows through `head` over that of one row, the two timed by turns."""
    x = torch.zeros(
        rows, head.in_features, dtype=torch.bfloat16 if head.kernel in lean.QUANTIZED else head.packed.dtype
    )
    ones, manys = [], []
    with torch.inference_mode():
        for _ in range(HEAD_REPEATS):
            ones.append(time_ms(lambda: head(x[:1]), repeats=1))
            manys.append(time_ms(lambda: head(x), repeats=1))
    return sorted(manys)[len(manys) // 2] / sorted(ones)[len(ones) // 2]


def amx_rows(hidden: int, inner: int, record: Path) -> int:
    """From how many rows the 4-bit kernels' AMX passes beat their VNNI ones on this model's MLP
    shapes here (0: at no row count, or no AMX), for `q4.use_amx`. Both give the same bits, so
    the choice moves only the time. Timed by turns at `AMX_ROWS` (the median of `FLAVOR_REPEATS`):
    the smallest count from which AMX wins at every count timed. Measured once per machine, shape
    and kernel library, and remembered; a new measurement keeps the earlier count unless the
    two differ clearly (`CLEAR_WIN`) at it."""
    if not q4.amx():
        return 0

    def decide(earlier: int | None) -> int:
        ratios = _amx_ratios(hidden, inner)  # VNNI's time over AMX's, by row count
        if earlier in ratios and abs(ratios[earlier] - 1) < CLEAR_WIN - 1:
            return earlier
        winning = [rows for rows in AMX_ROWS if all(ratios[r] > 1 for r in AMX_ROWS if r >= rows)]
        return winning[0] if winning else 0

    return recall(record, record_key(f"amx rows {hidden}x{inner}"), int, decide)


def _amx_ratios(hidden: int, inner: int) -> dict[int, float]:
    """{rows: VNNI's median time over AMX's} through the 4-bit kernel on an MLP's two shapes."""
    return _by_turns(hidden, inner, AMX_ROWS, lambda on, layers: [setattr(w, "amx", int(on)) for w in layers])


def avx_vnni(hidden: int, inner: int, record: Path) -> bool:
    """Whether the AVX2 variant's passes take AVX-VNNI here (`q4.use_avx_vnni`; the same bits):
    whether one and eight rows through this model's MLP shapes take less time with it."""
    return _flavor("avx-vnni", q4.avx_vnni(), lambda: _avx_vnni_ratio(hidden, inner), hidden, inner, record)


def _avx_vnni_ratio(hidden: int, inner: int) -> float:
    """AVX2's median time over AVX-VNNI's for one and eight rows, added up."""
    ratios = _by_turns(hidden, inner, ROWS, lambda on, layers: q4.use_avx_vnni(on))
    return sum(ratios.values()) / len(ratios)


def prefetch_l2(hidden: int, inner: int, record: Path) -> tuple[bool, bool]:
    """Whether the 4- and 5-bit few-row passes, then the 8-bit passes, prefetch the weights to L2
    here (`q4.use_prefetch_l2`, set to them; the same bits): whether one and four rows through this
    model's MLP shapes at those bits, from memory, take less time so. The library's setting is the
    process's: the last model loaded sets it (a draft model beside its target, measured alike)."""
    few = _flavor("prefetch l2", q4.prefetch_l2(), lambda: _prefetch_l2_ratio(hidden, inner, 4), hidden, inner, record)
    q4.use_prefetch_l2(few, False)
    eight = _flavor(
        "prefetch l2 8-bit", q4.prefetch_l2(), lambda: _prefetch_l2_ratio(hidden, inner, 8, few), hidden, inner, record
    )
    q4.use_prefetch_l2(few, eight)
    return few, eight


def _prefetch_l2_ratio(hidden: int, inner: int, bits: int, few: bool = False) -> float:
    """The `bits`-bit weights prefetched to L1's median time over L2's for one and four rows, added
    up (8 bits: with the 4-bit passes' as `few`): over `STREAMED` weights (64 copies of the shapes
    at most), which no 2-core share of a CPU's cache holds, as a 1-8B model's layers are read."""
    copies = max(1, min(64, STREAMED // (2 * inner * hidden)))  # 64: a tiny test model's shapes time fast

    def switch(on: bool, layers: list) -> None:
        if bits == 8:
            q4.use_prefetch_l2(few, on)
        else:
            q4.use_prefetch_l2(on, False)

    ratios = _by_turns(hidden, inner, (1, 4), switch, copies, bits)
    return sum(ratios.values()) / len(ratios)


def _flavor(name: str, available: bool, ratio: Callable[[], float], hidden: int, inner: int, record: Path) -> bool:
    """Whether a flavor of the kernels (the same bits on or off) is taken here, where `available`:
    whether `ratio()`, its median time off over on timed by turns, is above 1. Measured once per
    machine, shape and kernel library, and remembered; a new measurement turns an earlier choice
    over only when the ratio is clearly on the other side."""
    if not available:
        return False

    def decide(earlier: bool | None) -> bool:
        measured = ratio()
        return earlier if earlier is not None and abs(measured - 1) < CLEAR_WIN - 1 else measured > 1

    return recall(record, record_key(f"{name} {hidden}x{inner}"), bool, decide)


def _by_turns(
    hidden: int, inner: int, counts: tuple[int, ...], switch, copies: int = 0, bits: int = 4
) -> dict[int, float]:
    """{rows: the median time of the `bits`-bit kernel on an MLP's two shapes with `switch(False,
    layers)` over that with `switch(True, layers)`}, the two timed by turns; left switched off.
    Over `copies` of the two (0: up to 8, `WORKING_SET` weights)."""
    count = copies or max(1, min(8, WORKING_SET // (inner * hidden)))  # beyond the CPU cache
    gen = torch.Generator().manual_seed(0)
    lib = q4.library()
    weights = [torch.randn(o, i, generator=gen) * 0.05 for o, i in ((inner, hidden), (hidden, inner))]
    layers = [q4.Packed(lib, weight, None, bits) for _ in range(count) for weight in weights]
    del weights
    ratios = {}
    with torch.inference_mode():
        for rows in counts:
            x = {i: torch.randn(rows, i, generator=gen).to(torch.bfloat16) for i in (hidden, inner)}

            def timed(on: bool, x=x) -> float:
                switch(on, layers)
                return time_ms(lambda: [layer(x[layer.k]) for layer in layers], repeats=1)

            ratios[rows] = ratio_by_turns(timed)
    switch(False, layers)
    return ratios


def ratio_by_turns(timed) -> float:
    """The median of `timed(False)` (ms) over that of `timed(True)`, the two called by turns,
    `FLAVOR_REPEATS` times each."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(FLAVOR_REPEATS):
        for on in (False, True):
            times[on].append(timed(on))
    middle = FLAVOR_REPEATS // 2
    return sorted(times[False])[middle] / sorted(times[True])[middle]


def _remembered_draft(known: dict, key: str) -> tuple[str, str] | None:
    with contextlib.suppress(TypeError, ValueError, KeyError):
        dtype, kernel = known[key]
        if dtype in DTYPES and kernel in lean.KERNELS:
            return dtype, kernel
    return None


def _unavailable(*kernels: str) -> bool:
    """Whether a kernel among `kernels` is the kernel library's and the library cannot be had here
    now (`q4.library()` then says why on stderr, once)."""
    return any(k in lean.LIBRARY for k in kernels) and q4.library() is None


def _read(record: Path) -> dict:
    """What was measured before; a missing or damaged record is an empty one (measured again)."""
    try:
        known = json.loads(record.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _write(record: Path, known: dict) -> None:
    with contextlib.suppress(OSError):
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(known, indent=1))


def drafting(out: int, inp: int, rows: int, record: Path) -> tuple[str, str]:
    """(dtype, kernel) of the fastest (rows, inp) × (inp, out) matmul here, for drafting: any
    kernel that runs, whether or not it rounds alike at every row count (drafts are checked by
    the verify forward). Measured once per machine and shape, remembered in `record`; a new
    measurement (a changed kernel library) replaces the earlier choice only when it wins clearly."""
    out = lean.padded_rows(out)  # as the heads pack it: a kernel that needs whole tiles is timed, not replaced
    key = record_key(f"draft {rows}x{inp}x{out}")
    known = _read(record)
    remembered = _remembered_draft(known, key)
    if remembered is not None and _unavailable(remembered[1]):  # as in `choose`
        key = f"{key}|{WITHOUT_LIBRARY}"
        remembered = _remembered_draft(known, key)
    if remembered is not None and not _unavailable(remembered[1]):
        return remembered
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(timed_outputs(out, inp), inp, generator=gen) * 0.05
    x = torch.randn(rows, inp, generator=gen)
    timed = {}
    for dtype in DTYPES:
        for kernel in lean.KERNELS:
            with contextlib.suppress(RuntimeError, NotImplementedError):
                layer, dt = lean.PackedLinear(weight.to(DTYPES[dtype]), None, kernel), DTYPES[dtype]
                timed[dtype, kernel] = time_ms(lambda layer=layer, dt=dt: layer(x.to(dt)), repeats=5)
    best = min(timed, key=timed.get) if timed else ("float32", "dense")
    with contextlib.suppress(TypeError, ValueError):  # as in `choose`: an earlier choice yields only to a clear win
        kept = tuple(_earlier(known, key))
        if kept in timed and timed[best] > timed[kept] / CLEAR_WIN:
            best = kept
    known[key] = list(best)
    _write(record, known)
    return best


def timed_outputs(out: int, inp: int) -> int:
    """The outputs of a drafting matmul that are timed: all of them up to `DRAFT_TIMED` bytes of
    float32 weight, else that much (still beyond the CPU cache, as the whole is; each kernel's cost
    grows with the outputs alike). A 49,152-token readout at 2,048 wide timed whole held 2.5 GB
    at its peak, the model's weights beside it."""
    cap = lean.padded_rows(max(1, DRAFT_TIMED // (4 * inp)))
    return min(out, cap)


def _seconds(choice: Choice, hidden: int, inner: int, repeats: int = 3) -> float | None:
    """Time of one MLP's matmuls at one and eight rows with the layers' kernel plus the same with
    the lm_head's (each kernel once), or None if a kernel of the choice does not run here."""
    dt = DTYPES[choice.dtype]
    used = dict.fromkeys((choice.kernel, choice.head_kernel))
    if not all(lean.kernel_works(k, dt) for k in used):
        return None
    return sum(_kernel_seconds(k, dt, hidden, inner, repeats) for k in used)


def _kernel_seconds(kernel: str, dt: torch.dtype, hidden: int, inner: int, repeats: int) -> float:
    """Time of one MLP's matmuls with `kernel` at one and eight rows (the best of `repeats`)."""
    count = max(2, min(16, WORKING_SET // (2 * inner * hidden * dt.itemsize)))
    gen = torch.Generator().manual_seed(0)
    layers = [
        lean.PackedLinear((torch.randn(o, i, generator=gen) * 0.05).to(dt), None, kernel)
        for _ in range(count)
        for o, i in ((inner, hidden), (hidden, inner))
    ]
    inputs = {m: {i: torch.randn(m, i, generator=gen).to(dt) for i in (hidden, inner)} for m in ROWS}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats + 1):  # the first round warms up
            start = time.perf_counter()
            for m in ROWS:
                for layer in layers:
                    layer(inputs[m][layer.in_features])
            best = min(best, time.perf_counter() - start)
    return best / count
