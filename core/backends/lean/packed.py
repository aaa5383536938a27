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

KERNELS = ("dense", "onednn", "int4", "q4", "q8")  # how a PackedLinear multiplies; see PackedLinear
QUANTIZED = ("int4", "q4", "q8")  # the kernels of quantized weights, run with bf16 activations
LIBRARY = ("q4", "q8")  # the kernels of the project's own library (core.backends.q4)
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
            self.packed = q4.Packed(lib, w, bias, bits=4 if kernel == "q4" else 8)
        elif kernel == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 16)
        elif kernel == "int4":
            self.packed, self.scales_zeros = _int4_pack(w)
        else:
            self.packed = w

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
