"""The kernel library of `native/` (4- and 8-bit matmuls, a step's attention, norms and decoder
layers): built here with the C compiler, cached, and loaded.

torch's int4 CPU matmul unpacks the weights again for every block of 4 rows, so verifying a tree
of 8 or 16 nodes costs 2–4× a one-token step. `q4gemm.c` unpacks a group of weights once and uses
it for every row (int8 activations, integer dot products: AVX-512 VNNI or AVX2; AMX from a row
count measured here, `use_amx`, the same bits), so a tree's verify costs about what reading the
weights costs.

The library is compiled once per source and compiler into the user's cache (`q4build`). A cached
file that cannot be loaded, reports another version or fails the self-test is deleted and built
again, with one sentence on stderr. Where no compiler or no AVX2 is found, `library()` is None,
`unavailable()` says why, and the model keeps torch's int4 kernel.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading

import torch
from torch import Tensor

from core.backends import abi
from core.backends.q4build import VERSION, artifact, build, check, compiler
from core.backends.quantize import GROUP, on_grid, reference

TILE = 16  # outputs per tile (inputs per scale: `quantize.GROUP`)
ISAS = {"avx512-vnni": 2, "avx2": 1}  # the kernel variants, as q4_gemm numbers them

_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded CDLL or None, "why": the reason it is None


def isa() -> str | None:
    """The kernel variant this CPU runs, within the kernel ISA torch was allowed
    (`ATEN_CPU_CAPABILITY=avx2` makes an AVX-512 CPU use the AVX2 variant, as an AVX2-only CPU
    would); None below AVX2."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512") and torch.cpu._is_vnni_supported():
        return "avx512-vnni"
    if capability.startswith(("AVX2", "AVX512")) and torch.cpu._is_avx2_supported():
        return "avx2"
    return None


def amx() -> bool:
    """Whether the many-row passes may run on AMX here (amx.c): the CPU has it, the AVX-512 VNNI
    variant runs (AMX's results equal it bit for bit) and Linux grants this process the tile state."""
    lib = library()
    return lib is not None and isa() == "avx512-vnni" and torch.cpu._is_amx_tile_supported() and lib.q4_amx() == 0


def use_amx(rows: int) -> None:
    """Weights packed from now on take AMX for calls of `rows` rows or more (0: none), where
    `amx()` (a model's own measured count: the weights of a draft model loaded next keep theirs)."""
    _state["amx"] = rows if rows and amx() else 0


def amx_from() -> int:
    """The row count from which weights packed now take AMX (0: none)."""
    return _state.get("amx", 0)


def avx_vnni() -> bool:
    """Whether the AVX2 variant may take AVX-VNNI here (256-bit `vpdpbusd`: Intel's client CPUs
    without AVX-512; the same bits as AVX2's). Not where oneDNN is held to plain AVX2
    (`ONEDNN_MAX_CPU_ISA=AVX2`, as when an AVX2-only machine is emulated)."""
    lib = library()
    plain = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2"
    return lib is not None and isa() == "avx2" and not plain and lib.q4_avx_vnni(0) == 0


def use_avx_vnni(on: bool) -> None:
    """The AVX2 variant's passes on AVX-VNNI (on) or AVX2 alone, where `avx_vnni()`."""
    if avx_vnni():
        library().q4_avx_vnni(int(on))
        _state["avx-vnni"] = bool(on)


def prefetch_l2() -> bool:
    """Whether the library runs here (its few-row and 8-bit passes may prefetch to L2)."""
    return library() is not None


def use_prefetch_l2(few: bool, eight: bool) -> None:
    """The 4- and 5-bit one-to-four-row passes' weight prefetches (`few`) and the 8-bit passes'
    (`eight`) to L2, else L1 (common.h's PREFETCH_W; the same bits either way), where the library
    runs."""
    if prefetch_l2():
        library().q4_prefetch_l2(int(few) | int(eight) << 1)
        _state["prefetch-l2"] = (bool(few), bool(eight))


def flavors(amx_rows: int) -> str:
    """The kernel flavors in use beyond the variant ("" when none): AVX-VNNI, AMX from a row count
    (`amx_rows`: a weight's, see `Packed.amx`), weights prefetched to L2."""
    amx = f", AMX from {amx_rows} rows" if amx_rows else ""
    few, eight = _state.get("prefetch-l2", (False, False))
    l2 = {(True, True): "", (True, False): "4-bit ", (False, True): "8-bit "}.get((few, eight))
    l2 = "" if l2 is None else f", {l2}weights prefetched to L2"
    return f"{', AVX-VNNI' if _state.get('avx-vnni') else ''}{amx}{l2}"


class Layer(ctypes.Structure):
    """What q4_run needs of one packed weight (the C struct q4_layer)."""

    _fields_ = [(name, ctypes.c_int64) for name in ("n", "k", "bits")]
    _fields_ += [(name, ctypes.c_void_p) for name in ("w", "d", "m", "bias")] + [("amx", ctypes.c_int64)]
    _fields_ += [("k6", ctypes.c_void_p), ("hb", ctypes.c_void_p)]


def _load() -> ctypes.CDLL:
    cc = compiler()
    path = artifact(cc)
    opened = False  # whether this process has a library of this name loaded (its name then finds that one)
    if path.exists():
        try:
            check(path)
            opened = True
            lib = abi.load(path, VERSION)
            _self_test(lib)
            return lib
        except (OSError, AssertionError) as error:
            print(
                f"note: the cached 4-bit kernel {path.name} was unusable ({error}); building it again.", file=sys.stderr
            )
            path.unlink(missing_ok=True)
    build(cc, path)
    if not opened:
        lib = abi.load(path, VERSION)
    else:  # load the new build under a name of its own
        alias = path.with_name(f"{path.stem}-{os.getpid()}.so")
        os.link(path, alias)
        try:
            lib = abi.load(alias, VERSION)
        finally:
            alias.unlink()
    _self_test(lib)
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library (built on first use), or None where it cannot run here."""
    with _lock:
        if "lib" not in _state:
            if isa() is None:
                _state.update(lib=None, why="this CPU has no AVX2")
            else:
                try:
                    _state.update(lib=_load(), why="")
                except (OSError, AssertionError, subprocess.SubprocessError) as error:
                    _state.update(lib=None, why=str(error))
                    print(
                        f"note: the 4-bit kernel is not used: {error}; torch's int4 kernel runs instead.",
                        file=sys.stderr,
                    )
        return _state["lib"]


def loaded() -> ctypes.CDLL | None:
    """The library where this process has it loaded already, else None (nothing is built)."""
    return _state.get("lib")


def prepare() -> threading.Thread:
    """Build or load the library in the background (while a model loads)."""
    thread = threading.Thread(target=library, name="q4-build", daemon=True)
    thread.start()
    return thread


def unavailable() -> str:
    """Why `library()` is None ("" when it is not)."""
    library()
    return _state["why"]


def fits(out_features: int, in_features: int) -> bool:
    return out_features % TILE == 0 and in_features % GROUP == 0


class Packed:
    """One weight in the kernel's layout (4 bits: GGUF Q4_1's form, or Q4_K's; 5 bits: those and the
    values' fifth bits, as Q5_0, Q5_1 and Q5_K hold them; 8 bits: Q8_0's), with the C descriptor
    that points at it. `variant`: the kernel variant that will run it."""

    def __init__(
        self, lib: ctypes.CDLL, weight: Tensor, bias: Tensor | None, bits: int = 4, variant: str | None = None
    ) -> None:
        self._allocate(lib, *weight.shape, bits, variant)
        self.put(0, weight)
        self.set_bias(bias)

    @classmethod
    def empty(cls, lib: ctypes.CDLL, n: int, k: int, bits: int = 4, variant: str | None = None) -> Packed:
        """An (n, k) weight's memory, its rows to come with `put` (then its bias with `set_bias`)."""
        (packed := cls.__new__(cls))._allocate(lib, n, k, bits, variant)
        return packed

    def _allocate(self, lib: ctypes.CDLL, n: int, k: int, bits: int, variant: str | None) -> None:
        if bits not in (4, 5, 8):
            raise ValueError(f"the library holds 4-, 5- or 8-bit weights, not {bits}-bit ones")
        self.lib, self.n, self.k, self.bits = lib, n, k, bits
        self.variant = ISAS[variant or isa()]
        self.w = torch.empty(n * k // (1 if bits == 8 else 2), dtype=torch.uint8)
        self.d = torch.empty(n * k // GROUP, dtype=torch.float16)
        self.m = torch.empty(n * k // GROUP if bits != 8 else 0, dtype=torch.float16)  # 8 bits: no minimums
        self.k6 = torch.empty(0, dtype=torch.uint8)  # Q4_K's multipliers, where it is held in that form
        self.high = torch.zeros(n * k // 8 if bits == 5 else 0, dtype=torch.uint8)  # the fifth bits (q4gemm.c)
        self.bias, self.blank = None, True  # blank: no rows put yet
        self.layer = Layer(n, k, bits, self.w.data_ptr(), self.d.data_ptr(), self.m.data_ptr(), None, amx_from(), None)
        self.layer.hb = self.high.data_ptr() if bits == 5 else None
        self.address = ctypes.addressof(self.layer)

    def put(self, start: int, weight: Tensor) -> None:
        """Quantize `weight` into rows [start, start + its rows) (start a multiple of TILE): laid out
        in C, in one pass on every core, as `core.backends.quantize` computes it (4 bits and K a
        multiple of 256: in Q4_K's form, `q4gemm.c`'s quantize_k_row, unless the weight holds rows
        per group or its values lie on a grid per group already: `quantize.on_grid`); a 5-bit weight's
        rows at 4 bits (their fifth bits 0: the kernel takes 5-bit values from files' blocks only). A
        row's bytes do not depend on the others', so a weight put in parts is the weight put whole."""
        rows, k = weight.shape
        if start % TILE or rows % TILE or k != self.k or start + rows > self.n:
            raise ValueError(f"rows {start}-{start + rows} of width {k} do not fit a packed {self.n}×{self.k} weight")
        source = weight.detach().to(torch.bfloat16).contiguous()
        self._unsettle(form="k" if self.bits != 8 and k % 256 == 0 and not on_grid(source[:TILE]) else None)
        held = start * k // (256 if self.k6.numel() else GROUP)  # the tile-major layout: rows [start, …) begin here
        w, d, m, k6 = (
            self.w[start * self.w.numel() // self.n :],
            self.d[held:],
            self.m[held:],
            self.k6[start * k // 16 :],
        )
        pointers = (t.data_ptr() if t.numel() else None for t in (w, d, m, k6))
        self.lib.q4_quantize(source.data_ptr(), rows, k, 8 if self.bits == 8 else 4, *pointers)
        self.high[start * k // 8 : (start + rows) * k // 8] = 0

    def put_blocks(
        self,
        start: int,
        q: Tensor,
        step: Tensor,
        low: Tensor | None = None,
        multipliers: Tensor | None = None,
        high=None,
    ) -> None:
        """Rows [start, start + len(q)) from blocks taken as they are: 8 bits, (rows, K) int8 q, (rows, K/32)
        float16 steps (GGUF Q8_0's); 4 bits, uint8 q in [0, 15] (or `models.gguf_blocks.Nibbles`), float16
        steps and minimums per group (Q4_0/1's), or (`multipliers`, Q4_K's: w = d·sc·q − dmin·mn) its float16
        d and −dmin per 256 weights and (rows, K/32, 2) uint8 sc and mn per group, held so unless the weight
        holds rows per group already (then these are too). A 5-bit weight takes 4-bit blocks, and with
        `high` (`models.gguf_blocks.FifthBits`: Q5_0, Q5_1, Q5_K's) the values' fifth bits, q being the
        values mod 16."""
        (rows, k), bits = q.shape, 8 if low is None else 4
        held = 4 if self.bits == 5 else self.bits
        fits = (bits, q.dtype) == (held, torch.int8 if bits == 8 else torch.uint8) and k == self.k
        fits = fits and (high is None or self.bits == 5)
        if not fits or start % TILE or rows % TILE or start + rows > self.n or (multipliers is not None and k % 256):
            raise ValueError(f"{bits}-bit rows {start}-{start + rows} of width {k} do not fit this packed weight")
        groups, tiles = k // GROUP, slice(start // TILE, (start + rows) // TILE)
        self._unsettle(form=None if multipliers is None else "k")
        if multipliers is not None and not self.k6.numel():  # the weight is held per group: so are these
            step, low = (x.float().repeat_interleave(8, dim=1) * multipliers[..., i] for i, x in enumerate((step, low)))
            step, low, multipliers = step.half(), low.half(), None
        if low is not None:  # laid out in C, in one pass on every core (`pack`: a file's blocks as they lie)
            at = self.w[start * k // 2 :].data_ptr()
            q.pack(self.lib, at) if hasattr(q, "pack") else self.lib.q4_pack4(q.contiguous().data_ptr(), rows, k, at)
            held = groups if multipliers is None else groups // 8
            for mine, given in ((self.d, step), (self.m, low)):
                mine.view(-1, held, TILE)[tiles] = given.view(-1, TILE, held).permute(0, 2, 1)
            if multipliers is not None:  # (tile, group, 2, output)
                self.k6.view(-1, groups, 2, TILE)[tiles] = multipliers.view(-1, TILE, groups, 2).permute(0, 2, 3, 1)
            if high is not None:
                high.pack(self.lib, self.high[start * k // 8 :].data_ptr())
            elif self.bits == 5:
                self.high[start * k // 8 : (start + rows) * k // 8] = 0
            return
        self.d.view(-1, groups, TILE)[tiles] = step.view(-1, TILE, groups).permute(0, 2, 1)
        blocks = q.view(-1, TILE, groups, 8, 4)  # (tile, j, group, u, i) → the layout's (tile, group, u, j, i)
        self.w.view(torch.int8).view(-1, groups, 8, TILE, 4)[tiles] = blocks.permute(0, 2, 3, 1, 4)

    @property
    def amx(self) -> int:
        """From how many rows this weight's calls take AMX (0: none; `use_amx` sets it for weights
        packed after it)."""
        return self.layer.amx

    @amx.setter
    def amx(self, rows: int) -> None:
        self.layer.amx = rows if rows and amx() else 0

    def set_bias(self, bias: Tensor | None) -> None:
        """The bias, once the weight is whole: a 4-bit weight whose minimums are all −8·step (GGUF
        Q4_0's) then drops them (the kernels compute them: an eighth of its bytes)."""
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.layer.bias = self.bias_ptr()
        per_group = self.bits != 8 and self.m.numel() and not self.k6.numel()  # minimums per group held
        if per_group and torch.equal(self.m, (self.d.float() * -8).half()):
            self.m, self.layer.m = torch.empty(0, dtype=torch.float16), None

    def _unsettle(self, form: str | None) -> None:
        """Before rows come in `form` ("k": Q4_K's, None: per group): a blank weight takes Q4_K's form
        for them; one held in Q4_K's form takes rows per group by holding its own so first; one that
        dropped its minimums holds them again."""
        if self.bits != 8 and self.blank and form == "k":
            blocks = self.n * self.k // GROUP // 8
            self.d, self.m = torch.empty(blocks, dtype=torch.float16), torch.empty(blocks, dtype=torch.float16)
            self.k6 = torch.empty(self.n * self.k // GROUP * 2, dtype=torch.uint8)
        elif self.bits != 8 and (self.layer.m is None or (self.k6.numel() and form is None)):
            step, low = self.groups()
            self.d, self.m, self.k6 = step.half().flatten(), low.half().flatten(), self.k6[:0]
        self.layer.d, self.layer.m = self.d.data_ptr(), self.m.data_ptr() if self.m.numel() else None
        self.layer.k6, self.blank = self.k6.data_ptr() if self.k6.numel() else None, False

    def groups(self) -> tuple[Tensor, Tensor]:
        """A 4- or 5-bit weight's steps and minimums, (tiles, K/32, 16) float32 each, as the kernels make them."""
        groups = self.k // GROUP
        if not self.k6.numel():  # a weight that dropped its minimums: −8·step (set_bias)
            low = self.m.float() if self.m.numel() else self.d.float() * -8
            return self.d.view(-1, groups, TILE).float(), low.view(-1, groups, TILE)
        multipliers = self.k6.view(-1, groups, 2, TILE).float()
        held = (x.view(-1, groups // 8, TILE).float().repeat_interleave(8, dim=1) for x in (self.d, self.m))
        return tuple(multipliers[:, :, i] * x for i, x in enumerate(held))

    def bias_ptr(self) -> int | None:
        return None if self.bias is None else self.bias.data_ptr()

    def __call__(self, x: Tensor) -> Tensor:
        """(rows, K) bf16, rows contiguous → (rows, N) bf16."""
        rows = x.shape[0]
        y = torch.empty(rows, self.n, dtype=torch.bfloat16)
        code = self.lib.q4_run(
            self.address, self.variant, torch.get_num_threads(), rows, x.data_ptr(), x.stride(0), y.data_ptr()
        )
        if code:
            raise MemoryError("the 4-bit kernel could not allocate its scratch memory")
        return y


def _self_test(lib: ctypes.CDLL) -> None:
    """A small product against the same arithmetic in torch (raises AssertionError)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(32, 64, generator=gen) * 0.1
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(32, generator=gen)
    got = Packed(lib, weight, bias)(x).float()
    want = reference(x, weight, bias)
    error = float((got - want).abs().max() / want.abs().max())
    assert error < 2e-2, f"its self-test was off by {error:.3f}"
