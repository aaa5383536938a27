"""The glue to the kernel library's whole-layer decoder (`core.backends.q4.Decoder`): every decoder
layer of a step in one call, where every layer runs on the library's 4- or 8-bit kernels."""

from __future__ import annotations

from torch import Tensor, nn

from core.backends import q4
from core.backends.lean.kv import StaticKV
from core.backends.lean.layer import LeanLayer, eps
from core.backends.lean.packed import LIBRARY


def run_native(
    decoder: q4.Decoder | None, x: Tensor, rope, past: int, mask, causal: bool, cache: StaticKV, first: int = 0
) -> bool:
    """Run the decoder layers in the library (x updated in place) where it takes this step:
    up to `q4.Ops.MAX_ROWS` rows, not a causal block (a prompt's prefill). False: it did not.
    `first`: the cache layer the decoder's first layer writes (a decoder over some layers)."""
    t = x.shape[0]
    if decoder is None or not q4.Ops.takes(t, mask, causal, x.dtype):
        return False
    cos, sin = (r.reshape(t, -1).contiguous() for r in rope)
    seen = None if mask is None else mask[0, 0].contiguous()
    decoder(x, cos, sin, past, seen, cache.keys[first:], cache.values[first:])
    return True


def native_decoder(layers: nn.ModuleList, config, lean: list[LeanLayer]) -> q4.Decoder | None:
    """The library's whole-layer decoder where every layer has both norms and runs on its 4- or
    8-bit kernel with its ops (else None)."""
    if not lean or any(
        layer.ops is None
        or not layer.ops.attends(layer.head_dim)
        or any(isinstance(n, nn.Identity) for n in (m.input_layernorm, m.post_attention_layernorm))
        or any(p.kernel not in LIBRARY for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
        for m, layer in zip(layers, lean, strict=True)
    ):
        return None
    epsilon = eps(layers[0].input_layernorm)
    weights = [
        (
            m.input_layernorm.weight,
            m.post_attention_layernorm.weight,
            *(p.packed for p in (one.qkv, one.o_proj, one.gate_up, one.down)),
        )
        for m, one in zip(layers, lean, strict=True)
    ]
    one = lean[0]
    return q4.Decoder(one.ops, weights, config.hidden_size, one.heads, one.kv_heads, one.head_dim, one.inner, epsilon)
