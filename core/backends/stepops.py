"""The kernel library's step ops (step.c): a decoding step's bf16 attention and RMSNorm, row by
row, so a tree's rows get exactly the bits one-token steps would (see q4gemm.c)."""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from core.backends.q4 import ISAS, amx, isa, library, loaded
from core.cpuinfo import cpu_flags

HEAD_STEP, MAX_HEAD = 16, 512  # the head sizes the attention kernel takes (step.c)
AMX_SCORES, AMX_VALUES = 4, 8  # added to the variant's number: attention on AMX (attend_amx.c)
KV8 = 16  # added too: keys and values in 8 bits (an 8-bit `StaticKV`, common.h's KV8_ROW)
DOT = 32  # added too, with AMX's: AMX's attention with its tile products in AVX-512 vectors (attend_dot.c)
TILES = 64  # and with DOT where AMX runs: an 8-bit cache's integers of many queries on the tiles (the same ones)
AMX_HEAD_STEP = 32  # the head sizes AMX's attention takes are multiples of this (common.h's amx_mode)
# The attention kernels: in vectors (attend.c), on AMX's tiles, AMX's in AVX-512 bf16 and VNNI products
# (an 8-bit cache's weighted values there in exact int16 sums instead), or its scores so and the
# weighted values in vectors
KERNELS = {
    "vectors": 0, "amx": AMX_SCORES | AMX_VALUES, "dot": AMX_SCORES | AMX_VALUES | DOT, "dot-scores": AMX_SCORES | DOT
}  # fmt: skip
NAMES = {"amx": "AMX attention", "dot": "bf16-dot attention", "dot-scores": "dot-product scores"}  # (vectors: none)
_chosen = {"attention": "vectors", "kv bits": 16}


class Ops:
    """The library's bf16 attention and RMSNorm for a decoding step, row by row: a tree's rows get
    exactly the bits one-token steps would (see q4gemm.c)."""

    MAX_ROWS = 64  # longer blocks (a prompt's prefill) keep torch's attention

    def __init__(self, lib: ctypes.CDLL, attention: str | None = None) -> None:
        """`attention`: the attention kernel, one of `KERNELS` (None: as `use_attention` chose
        last; one this CPU cannot run: vectors)."""
        kernel = _chosen["attention"] if attention is None else runnable(attention)
        self.lib, self.kernel, self.variant = lib, kernel, ISAS[isa()] | KERNELS[kernel] | _tiles(kernel)

    def attention_kernel(self, head_dim: int) -> str:
        """The kernel that attends over heads of `head_dim` (the tiles' kernels take multiples of
        `AMX_HEAD_STEP`; vectors elsewhere)."""
        return self.kernel if amx_heads(head_dim) else "vectors"

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """(rows, n) bf16 with contiguous rows → the same shape, normalized. A bf16 `weight`:
        Llama's norm (normalized, rounded, times the weight); a float32 one: Gemma's (times the
        weight, 1 + its stored one, in float32, rounded once)."""
        rows, n = x.shape
        y = torch.empty(rows, n, dtype=torch.bfloat16)
        wide = int(weight.dtype == torch.float32)
        self.lib.q4_rmsnorm(
            self.variant, rows, n, x.data_ptr(), x.stride(0), weight.data_ptr(), wide, eps, y.data_ptr()
        )
        return y

    @classmethod
    def takes(cls, rows: int, mask: Tensor | None, causal: bool, dtype: torch.dtype) -> bool:
        """Whether the step kernels take a block of `rows` rows: a decoding step (not a causal
        prefill block), at most `MAX_ROWS` rows, its mask (if any) in the model's dtype."""
        return not causal and rows <= cls.MAX_ROWS and (mask is None or mask.dtype == dtype)

    @staticmethod
    def attends(head_dim: int) -> bool:
        """Whether the attention kernel takes heads of this size."""
        return head_dim % HEAD_STEP == 0 and head_dim <= MAX_HEAD

    def attention(
        self, q: Tensor, keys: Tensor, values: Tensor, length: int, mask: Tensor | None, scale: float | None = None,
        window: bool = False,
    ) -> Tensor:  # fmt: skip
        """q (t, heads, d) with contiguous heads, keys and values (kv heads, capacity, d), or 8-bit
        rows (kv heads, capacity, d + 4) uint8 (an 8-bit `StaticKV`'s), of which the first `length`
        are used; mask (t, length) bf16, 0 where a key is seen, or None (all seen) → (t, heads · d).
        `scale`: the scores' (default d^-0.5); `window`: a sliding-window layer's (its mask hides
        early keys: AMX then makes the scores alone, see attend_amx.c)."""
        t, heads, d = q.shape
        kv, capacity = keys.shape[0], keys.shape[1]
        out = torch.empty(t, heads * d, dtype=torch.bfloat16)
        variant = (self.variant & ~AMX_VALUES if window else self.variant) | cache_flags(keys)
        code = self.lib.q4_attention(
            variant, torch.get_num_threads(), t, heads, kv, d, length, q.data_ptr(), q.stride(0),
            keys.data_ptr(), values.data_ptr(), capacity, None if mask is None else mask.data_ptr(),
            d**-0.5 if scale is None else scale,
            out.data_ptr(),
        )  # fmt: skip
        raise_for(code, d)
        return out


def cache_flags(keys: Tensor) -> int:
    """The flags a cache's format adds to the variant's number: `KV8` for 8-bit rows (uint8)."""
    return KV8 if keys.dtype == torch.uint8 else 0


def amx_heads(head_dim: int) -> bool:
    """Whether AMX's attention takes heads of `head_dim` (elsewhere the vector kernel runs)."""
    return head_dim % AMX_HEAD_STEP == 0 and Ops.attends(head_dim)


def can_attend_with(kernel: str) -> bool:
    """Whether the attention kernel `kernel` (one of `KERNELS`) runs here: vectors everywhere;
    "amx" where the many-row passes may run on AMX (`q4.amx`) and the CPU has AMX's bf16 products
    and AVX-512's bf16 conversions; "dot" and "dot-scores" where the AVX-512 variant runs and the CPU
    has AVX-512's bf16 and VNNI products (attend_dot.c). All need a library built with them."""
    if kernel == "vectors":
        return True
    lib = library()
    if kernel not in KERNELS or lib is None or isa() != "avx512-vnni" or lib.q4_amx_attention() != 0:
        return False
    if kernel == "amx":
        return {"amx_bf16", "avx512_bf16"} <= cpu_flags() and amx()
    return {"avx512_bf16", "avx512_vnni"} <= cpu_flags()


def _tiles(kernel: str) -> int:
    """`TILES` for a dot kernel where AMX's tiles run (an 8-bit cache's scores and weighted values
    of a block of many queries there: the same exact integers as its VNNI products, at about AMX's
    own speed: 64 rows ~1.9× faster), else 0."""
    return TILES if KERNELS.get(kernel, 0) & DOT and can_attend_with("amx") else 0


def runnable(kernel: str) -> str:
    """`kernel` where `can_attend_with` it, else vectors."""
    return kernel if can_attend_with(kernel) else "vectors"


def use_attention(kernel: str) -> None:
    """The models loaded from now on attend with `kernel` (one of `KERNELS`; vectors where
    `can_attend_with` says no). A model keeps its kernel for its whole session: they differ in their
    last bits, and a kept cache must be read with the kernel that wrote it."""
    _chosen["attention"] = runnable(kernel)


def use_kv_bits(bits: int) -> None:
    """The models loaded from now on keep their keys and values in `bits` (8 or 16) where the
    library's decoder runs their layers (an 8-bit `StaticKV`); a model keeps its cache's format
    for its whole session, as its attention kernel."""
    _chosen["kv bits"] = 8 if bits == 8 else 16


def attention() -> str:
    """The attention kernel `use_attention` chose last (vectors unless it chose another)."""
    return _chosen["attention"]


def kv_bits() -> int:
    """The bits of keys and values `use_kv_bits` chose last (16 unless it chose 8)."""
    return _chosen["kv bits"]


def split() -> int | None:
    """The multiple of key positions at which the library's attention cuts a long key range into
    parts, each attended on its own and then joined (step.c's q4_split); None without the library."""
    lib = library()
    return None if lib is None else lib.q4_split()


def raise_for(code: int, head_dim: int) -> None:
    """The exception a step kernel's return code stands for (0: none)."""
    if code == -2:
        raise ValueError(f"the attention kernel does not take heads of size {head_dim} (multiples of {HEAD_STEP})")
    if code:
        raise MemoryError("the step kernel could not allocate its scratch memory")


def ops(dtype: torch.dtype, device: torch.device | str = "cpu") -> Ops | None:
    """The library's step ops for a model in `dtype` (bf16 only) on `device` (the CPU only: they
    read host memory), or None where they do not run."""
    lib = library() if dtype == torch.bfloat16 and torch.device(device).type == "cpu" else None
    return None if lib is None else Ops(lib)


def argmax(x: Tensor) -> Tensor | None:
    """torch's `x.argmax(-1)` for bf16 logits on the CPU, a (V,) row or (T, V) rows with contiguous
    rows, from the library where this process has it loaded (the same indices: the first of equal
    values, a NaN as the largest); None where it does not take them. torch widens them to float32
    first: 0.4 ms a row of a 262k vocabulary, 3.5 ms for a 16-node tree's rows."""
    lib = loaded()
    if lib is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() not in (1, 2):
        return None
    if x.shape[-1] == 0 or x.stride(-1) != 1:
        return None
    rows = x.unsqueeze(0) if x.dim() == 1 else x
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    shape, address = (rows.shape[0], rows.shape[1]), rows.data_ptr()
    lib.q4_argmax(ISAS[isa()], torch.get_num_threads(), *shape, address, rows.stride(0), out.data_ptr())
    return out[0] if x.dim() == 1 else out


def top(x: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor] | None:
    """Each row's k largest logits, their indices and the row's log-sum-exp (`top.c`) for bf16
    rows on the CPU, (R, V) with contiguous rows: torch's `x.topk(k)` (its values as float32; of
    equal values the lower index first, where torch's order is its own) and `x.float().logsumexp(-1)`
    to float rounding, with no copy of a row (on a 262k vocabulary torch's take ~5 MB of working
    memory a row). None where the library does not take them, or a row holds a NaN or +inf."""
    lib = loaded()
    if lib is None or x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.dim() != 2:
        return None
    if not 0 < k <= x.shape[-1] or x.stride(-1) != 1:
        return None
    rows = x.shape[0]
    values, indices, lse = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.int64), torch.empty(rows)
    bad = lib.q4_top(
        ISAS[isa()], torch.get_num_threads(), rows, x.shape[1], x.data_ptr(), x.stride(0), k,
        values.data_ptr(), indices.data_ptr(), lse.data_ptr(),
    )  # fmt: skip
    return None if bad else (values, indices, lse)
