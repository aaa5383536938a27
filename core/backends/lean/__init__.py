"""A lean decode forward for Llama-family, Qwen3 and Gemma 3 backbones on the CPU, with a
pre-allocated KV cache.

Most of a small model's decoding step on a CPU is not arithmetic: it is per-operator overhead
in the generic transformers forward (mask building, cache bookkeeping, dozens of small ops a
layer) and BLAS re-packing the weights on every multi-row matmul. This package removes both:

- `accelerate` (`surgery`) swaps the model's linear layers for `PackedLinear`s (`packed`; q/k/v
  and gate/up fused) whose weights are laid out once for the chosen kernel (oneDNN's pre-packed
  layout in fp32 or bf16, weight-only int4 with bf16 activations, or the kernel library's 4- and
  8-bit kernels). A packed matmul gives every row the same result whatever the number of rows, so
  a tree forward and a one-token forward round alike. It returns the `LeanBackend` (`backend`).
- `LeanForward` (`forward`) runs embedding → decoder layers (`LeanLayer`, `layer`; rotary
  positions, `rope`) → final norm straight from the model's own modules (nothing is copied),
  writing keys and values into a `StaticKV` (`kv`) by index; keeping an accepted path is one
  gather over all layers at once. Where every layer runs on the kernel library, a step's layers
  go through its whole-layer decoder in one call (`native`).

Only architectures whose layers are exactly RMSNorm → GQA attention with rotary positions →
gated MLP are served (`servable`: Llama, Mistral, Qwen2; Qwen3's q/k head norms; Gemma 3's
norms, GELU-tanh gate and sliding-window layers); everything else keeps the transformers backend. The parts
are named here too: the EAGLE draft layer (`core.drafters.eagle_tree`) is built of them.
"""

from core.backends.lean.backend import LeanBackend
from core.backends.lean.forward import LeanForward
from core.backends.lean.kv import StaticKV
from core.backends.lean.layer import LeanLayer, causal_mask, norm
from core.backends.lean.native import native_decoder, run_native
from core.backends.lean.packed import (
    KERNELS,
    LIBRARY,
    QUANTIZED,
    PackedEmbedding,
    PackedLinear,
    TiedHead,
    eight_bit_rows,
    kernel_works,
    padded_rows,
    rows_of,
    table_of,
)
from core.backends.lean.rope import Rope
from core.backends.lean.surgery import (
    GROUPS,
    SUPPORTED,
    PackAsRead,
    accelerate,
    pack_layer,
    servable,
    share_vocabulary,
)

__all__ = [
    "GROUPS",
    "KERNELS",
    "LIBRARY",
    "QUANTIZED",
    "SUPPORTED",
    "LeanBackend",
    "LeanForward",
    "LeanLayer",
    "PackAsRead",
    "PackedEmbedding",
    "PackedLinear",
    "Rope",
    "StaticKV",
    "TiedHead",
    "accelerate",
    "causal_mask",
    "eight_bit_rows",
    "kernel_works",
    "native_decoder",
    "norm",
    "pack_layer",
    "padded_rows",
    "rows_of",
    "run_native",
    "servable",
    "share_vocabulary",
    "table_of",
]
