"""Packed linear layers: y = x Wᵀ + b with W laid out once for one matmul kernel.

A packed matmul gives every row the same result whatever the number of rows (measured, not
assumed: `kernel_works`), so a tree forward and a one-token forward round alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.backends import q4
from core.backends.quantize import GROUP, quantize

KERNELS = ("dense", "onednn", "int4", "q4", "q5", "q8")  # how a PackedLinear multiplies; see PackedLinear
QUANTIZED = ("int4", "q4", "q5", "q8")  # the kernels of quantized weights, run with bf16 activations
BITS = {"q4": 4, "q5": 5, "q8": 8}  # the kernels of the project's own library (core.backends.q4): their bits
LIBRARY = tuple(BITS)
ROW_STEP = 64  # every kernel takes a multiple of this many outputs (torch's int4 layout needs it)
PACK_ROWS = 16 * ROW_STEP  # outputs packed for the int4 kernel at a time


class PackedLinear(nn.Module):
    """y = x Wᵀ + b with W laid out once for one kernel.

    - "dense": torch's own matmul on the plain weight.
    - "onednn": oneDNN's pre-packed layout (`mkldnn._reorder_linear_weight`), fp32 or bf16.
    - "int4": weight-only int4, asymmetric per group of `quantize.GROUP` inputs, bf16 activations
      (torch's packed int4 CPU matmul).
    - "q4": the same 4-bit weights with int8 activations, through `core.backends.q4`'s kernel, whose cost
      barely grows with the rows up to 8 (torch's int4 kernel costs per block of 4 rows). A
      shape the kernel does not take (outputs not a multiple of 16) gets "dense".
    - "q5": 5-bit weights (GGUF Q5_0, Q5_1 and Q5_K's forms) with int8 activations, through the
      same library: a file's blocks as they are (`q4.Packed.put_blocks`; a weight given in full
      precision goes in at 4 bits).
    - "q8": 8-bit weights (GGUF Q8_0's form, as the embedded model keeps its lm_head) with int8
      activations, through the same library.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, kernel: str) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}")
        self.kernel = kernel
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        w = weight.detach()
        if kernel in LIBRARY and not q4.fits(*w.shape):
            self.kernel = kernel = "dense"
        if kernel in LIBRARY:
            lib = q4.library()
            if lib is None:
                raise RuntimeError(f"the kernel library is unavailable: {q4.unavailable()}")
            self.packed = q4.Packed(lib, w, bias, bits=BITS[kernel])
        elif kernel == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 16)
        elif kernel == "int4":
            self.packed, self.scales_zeros = _int4_pack(w)
        else:
            self.packed = w

    @classmethod
    def empty(cls, out_features: int, in_features: int, kernel: str) -> PackedLinear:
        """A PackedLinear of the library's `kernel` (the shape one it takes) whose weight comes in
        rows later: `packed.put`, then `set_bias`."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.kernel, layer.out_features, layer.in_features, layer.bias = kernel, out_features, in_features, None
        layer.packed = q4.Packed.empty(q4.library(), out_features, in_features, bits=BITS[kernel])
        return layer

    def set_bias(self, bias: Tensor | None) -> None:
        self.bias = None if bias is None else bias.detach()
        self.packed.set_bias(bias)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).contiguous()
        if self.kernel == "onednn":
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        elif self.kernel == "int4":
            y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, GROUP, self.scales_zeros)
            y = y if self.bias is None else y + self.bias
        elif self.kernel in LIBRARY:
            y = self.packed(x2 if x2.dtype == torch.bfloat16 else x2.to(torch.bfloat16)).to(x.dtype)
        else:
            y = F.linear(x2, self.packed, self.bias)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.kernel}"


class TiedHead(PackedLinear):
    """A tied lm_head on the library's 8-bit kernel that is also the embedding table
    (`PackedEmbedding` reads its rows): the vocabulary is held once, in the kernel's layout, and no
    dense copy is kept. `weight` makes the dense table when read (a reader that keeps it holds its
    memory); `rows` reads a few rows, `dtype` and `device` describe it without making it."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__(weight, None, "q8")
        if self.kernel != "q8":
            raise ValueError(f"a {tuple(weight.shape)} table does not fit the 8-bit kernel")
        self.dtype, self.device = weight.dtype, weight.device

    @classmethod
    def from_blocks(cls, shape: tuple[int, int], dtype: torch.dtype, blocks) -> TiedHead:
        """The (V, H) table from 8-bit blocks as a file holds them (`q4.Packed.put_blocks`'s parts:
        first row, int8 q, float16 steps), taken exactly, with no dense copy on the way."""
        head = cls.empty(*shape, "q8")
        for start, q, step in blocks:
            head.packed.put_blocks(start, q, step)
        head.dtype, head.device = dtype, torch.device("cpu")
        return head

    def rows(self, ids: Tensor) -> Tensor:
        """(n,) token ids → (n, H) their rows of the table, in `dtype`."""
        return eight_bit_rows(self.packed, ids.reshape(-1), self.dtype).view(*ids.shape, self.in_features)

    @property
    def weight(self) -> Tensor:
        ids = torch.arange(self.out_features)
        return torch.cat([self.rows(ids[i : i + PACK_ROWS]) for i in range(0, len(ids), PACK_ROWS)])


class PackedEmbedding(nn.Module):
    """The token embedding of a tied model, read from its `TiedHead`'s rows (what the lm_head
    multiplies: a GGUF file's own 8-bit blocks where it holds them, else each weight within half an
    8-bit step of its value), times the embedding's scale
    where the family has one (Gemma's √H, applied as its embedding does)."""

    def __init__(self, head: TiedHead, scale: Tensor | None) -> None:
        super().__init__()
        self._head = [head]  # in a list: the lm_head's, not a submodule of the embedding
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.scale = None if scale is None else scale.to(head.dtype)

    @property
    def weight(self) -> Tensor:
        return self._head[0].weight

    def forward(self, ids: Tensor) -> Tensor:
        rows = self._head[0].rows(ids)
        return rows if self.scale is None else rows * self.scale


def eight_bit_rows(packed: q4.Packed, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """(n,) output indices → (n, K) those rows of an 8-bit `q4.Packed` weight as the kernel multiplies
    them (q · step, in `dtype`): per tile and group, byte 64u + 4j + i holds row j's input 4u + i."""
    if packed.bits != 8:
        raise ValueError("rows are read back from 8-bit weights only")
    if dtype == torch.bfloat16:  # in one call of the library (~0.13 ms of torch ops a one-token step)
        at = ids.to(torch.int64).contiguous()
        rows = torch.empty(at.numel(), packed.k, dtype=dtype)
        if packed.lib.q4_rows8(packed.address, at.data_ptr(), at.numel(), rows.data_ptr()):
            raise IndexError(f"a row index is outside the weight's {packed.n} rows")
        return rows
    return rows_in_torch(packed, ids).to(dtype)


def rows_in_torch(packed: q4.Packed, ids: Tensor) -> Tensor:
    """`eight_bit_rows` in torch's ops, float32."""
    groups = packed.d.numel() // packed.n
    tile, j = ids // q4.TILE, ids % q4.TILE
    q = packed.w.view(torch.int8).view(-1, groups, 8, q4.TILE, 4)[tile, :, :, j, :]  # (n, groups, 8, 4)
    step = packed.d.view(-1, groups, q4.TILE)[tile, :, j].float()  # (n, groups)
    return (q.reshape(len(ids), groups, GROUP).float() * step.unsqueeze(-1)).flatten(1)


def rows_of(module: nn.Module, ids: Tensor) -> Tensor:
    """Rows `ids` of an embedding's or lm_head's table (detached), without making the whole of a
    packed one."""
    if isinstance(module, PackedEmbedding):
        module = module._head[0]
    return module.rows(ids) if isinstance(module, TiedHead) else module.weight.detach()[ids]


def table_of(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of an embedding's or lm_head's table, without making a dense copy of a
    packed one."""
    if isinstance(module, PackedEmbedding):
        module = module._head[0]
    if isinstance(module, TiedHead):
        return module.dtype, module.device
    return module.weight.dtype, module.weight.device


def padded_rows(rows: int) -> int:
    """`rows` outputs rounded up to what every kernel takes (the extra rows are zeros, cut off)."""
    return rows + (-rows % ROW_STEP)


def _int4_pack(w: Tensor) -> tuple[Tensor, Tensor]:
    """(out, in) weight → torch's packed int4 layout and its (in/group, out, 2) scales and zeros.

    The 4-bit form is `quantize.quantize`'s (each group's own minimum and step), so weights that
    were 4-bit with such blocks to begin with (GGUF Q4_1) come back as they were, up to bf16 scales.
    Done `PACK_ROWS` outputs at a time (the layout goes by rows): a large weight's float32 working
    copies would otherwise take several times its size."""
    if w.shape[0] > PACK_ROWS:
        parts = [_int4_pack(w[i : i + PACK_ROWS]) for i in range(0, w.shape[0], PACK_ROWS)]
        return torch.cat([p for p, _ in parts]), torch.cat([s for _, s in parts], dim=1)
    q, step, low = quantize(w)
    zeros = low + 8 * step  # the kernel computes (q - 8) * step + zero
    scales_zeros = torch.stack([step.t(), zeros.t()], dim=-1).contiguous().to(torch.bfloat16)
    return torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1), scales_zeros


def kernel_works(kernel: str, dtype: torch.dtype) -> bool:
    """Whether this CPU (with the kernel ISA torch was allowed) runs `kernel` in `dtype` and gives
    each row the same result at any row count. A kernel whose rounding depends on the row count
    (MKL's fp32 gemv against its gemm, on some CPUs) would make tree decoding drift from plain
    decoding, so it is not used: this is measured here, not assumed."""
    if kernel in QUANTIZED and dtype != torch.bfloat16:
        return False  # the 4-bit kernels are fast only with bf16 activations
    gen = torch.Generator().manual_seed(0)
    try:
        layer = PackedLinear((torch.randn(256, 576, generator=gen) * 0.05).to(dtype), None, kernel)
        x = torch.randn(8, 576, generator=gen).to(dtype)
        whole = layer(x)
        return all(torch.equal(layer(x[i : i + 1]), whole[i : i + 1]) for i in range(8))
    except (RuntimeError, NotImplementedError):
        return False
