"""The glue to the kernel library's whole-layer decoder (`q4_decode`, core/backends/native/decode.c):
every decoder layer of a step in one call, where every layer runs on the library's 4- or 8-bit
kernels (Llama, Mistral, Qwen2, Qwen3 and Gemma 3 layers)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from core.backends import q4, stepops
from core.backends.lean.kv import StaticKV
from core.backends.lean.layer import LeanLayer, Norm
from core.backends.lean.packed import LIBRARY


def run_native(
    decoder: Decoder | None, x: Tensor, rope, past: int, mask, causal: bool, cache: StaticKV,
    positions: Tensor | None = None, taps: tuple[int, ...] = (),
) -> Tensor | None:  # fmt: skip
    """Run the decoder layers in the library (x updated in place) where it takes this step:
    up to `stepops.Ops.MAX_ROWS` rows, not a causal block (a prompt's prefill). None: it did not;
    else the streams after `taps` layers side by side (t, len(taps) · hidden; empty without taps).
    `rope`: (cos, sin), or a list of them (one per rotary table the layers read); `positions`:
    the rows' positions (needed by sliding-window layers)."""
    t = x.shape[0]
    if decoder is None or not stepops.Ops.takes(t, mask, causal, x.dtype):
        return None
    tables = [rope] if isinstance(rope, tuple) else rope
    cos, sin = (torch.stack([r[i].reshape(t, -1) for r in tables]).contiguous() for i in (0, 1))
    seen = None if mask is None else mask[0, 0].contiguous()
    return decoder(x, cos, sin, past, seen, cache.keys, cache.values, positions, taps)


def native_decoder(
    layers: nn.ModuleList, config, lean: list[LeanLayer], rope_of: list[int] | None = None
) -> Decoder | None:
    """The library's whole-layer decoder where every layer has its norms and runs on its 4- or
    8-bit kernel with its ops (else None). `rope_of`: the rotary table each layer reads (default 0)."""
    if not lean or len(layers) != len(lean) or not all(_takes(one) for one in lean):
        return None
    one = lean[0]
    if len({(x.norm1.gemma, x.act, x.scale, x.q_norm is None) for x in lean}) > 1:
        return None  # one model's layers, alike
    weights = [
        Weights(
            x.norm1.weight,
            x.norm2.weight,
            *(p.packed for p in (x.qkv, x.o_proj, x.gate_up, x.down)),
            *(None if n is None else n.weight for n in (x.q_norm, x.k_norm, x.post_attn, x.post_mlp)),
            window=x.window,
            rope=0 if rope_of is None else rope_of[i],
        )
        for i, x in enumerate(lean)
    ]
    shape = Shape(
        config.hidden_size, one.heads, one.kv_heads, one.head_dim, one.inner, one.norm1.eps, one.scale,
        one.norm1.gemma, one.act,
    )  # fmt: skip
    return Decoder(one.ops, weights, shape)


def _takes(layer: LeanLayer) -> bool:
    """Whether the library's decoder runs this layer: its norms (no nn.Identity), its four matmuls
    on the library's kernels, heads the attention takes, an MLP gate it computes."""
    norms = [layer.norm1, layer.norm2, layer.q_norm, layer.k_norm, layer.post_attn, layer.post_mlp]
    return (
        layer.ops is not None
        and layer.ops.attends(layer.head_dim)
        and layer.act in ACTS
        and all(n is None or isinstance(n, Norm) for n in norms)
        and (layer.q_norm is None) == (layer.k_norm is None)
        and len({n.gemma for n in norms if isinstance(n, Norm)}) == 1
        and all(n.weight.dtype == (torch.float32 if n.gemma else torch.bfloat16) for n in norms if isinstance(n, Norm))
        and all(p.kernel in LIBRARY for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    )


class Block(ctypes.Structure):
    """One decoder layer for q4_decode (the C struct q4_block)."""

    _fields_ = [
        *(
            (name, ctypes.c_void_p)
            for name in ("norm1", "norm2", "qkv", "o", "gate_up", "down", "q_norm", "k_norm", "post_attn", "post_mlp")
        ),
        ("window", ctypes.c_int64),
        ("rope", ctypes.c_int64),
    ]


class Model(ctypes.Structure):
    """The decoder layers for q4_decode (the C struct q4_model)."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inner")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("gemma", ctypes.c_int64),
        ("act", ctypes.c_int64),
        ("blocks", ctypes.c_void_p),
    ]


ACTS = ("silu", "gelu_tanh")  # the MLP gates q4_decode computes, by its number


@dataclass(frozen=True)
class Shape:
    """What q4_decode needs to know of a model's layers besides their weights. `scale`: the
    attention's (None: head_dim^-0.5); `gemma`: norms as Gemma's (float32 weights 1 + w, one
    rounding); `act`: one of `ACTS`."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inner: int
    eps: float
    scale: float | None = None
    gemma: bool = False
    act: str = "silu"


@dataclass(frozen=True)
class Weights:
    """One decoder layer's weights for q4_decode: the four matmuls as `Packed` weights and the
    norms' weights (bf16, or float32 in a Gemma model; the optional ones None); `window`: a
    sliding-window layer's window (0: full attention), `rope`: which rotary table it reads."""

    norm1: Tensor
    norm2: Tensor
    qkv: q4.Packed
    o: q4.Packed
    gate_up: q4.Packed
    down: q4.Packed
    q_norm: Tensor | None = None
    k_norm: Tensor | None = None
    post_attn: Tensor | None = None
    post_mlp: Tensor | None = None
    window: int = 0
    rope: int = 0

    def block(self) -> Block:
        def address(t: Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        norms = (self.norm1, self.norm2)
        optional = (self.q_norm, self.k_norm, self.post_attn, self.post_mlp)
        linears = (self.qkv, self.o, self.gate_up, self.down)
        return Block(
            *map(address, norms), *(p.address for p in linears), *map(address, optional), self.window, self.rope
        )


class Decoder:
    """Every decoder layer of a step in one call into the library: norms, q4 matmuls, rotary
    positions, cache writes, attention and the gated MLP, for up to `Ops.MAX_ROWS` rows.

    `layers`: one `Weights` per layer; the tensors must outlive the decoder."""

    def __init__(self, ops: stepops.Ops, layers: list[Weights], shape: Shape) -> None:
        self.lib, self.variant = ops.lib, ops.variant
        self.layers = layers
        self.windowed = any(w.window for w in layers)
        self.blocks = (Block * len(layers))(*(w.block() for w in layers))
        scale = shape.head_dim**-0.5 if shape.scale is None else shape.scale
        self.model = Model(
            len(layers), shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.inner, shape.eps, scale,
            int(shape.gemma), ACTS.index(shape.act), ctypes.addressof(self.blocks),
        )  # fmt: skip
        self.address = ctypes.addressof(self.model)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, past: int, mask: Tensor | None, keys: Tensor,
                 values: Tensor, positions: Tensor | None = None, taps: tuple[int, ...] = ()) -> Tensor:  # fmt: skip
        """x (t, hidden) bf16, contiguous: the residual stream, updated in place; cos, sin (t, head
        dim), or (rotary tables, t, head dim); keys and values (layers, kv heads, capacity, head
        dim), rows [past, past + t) written; mask (t, past + t) bf16, 0 where a key is seen, or
        None; positions (t,): the rows' positions (needed where a layer has a sliding window).
        Returns the streams after `taps` layers (counts, 0 to all), side by side: (t, len(taps) · hidden)."""
        if self.windowed and positions is None:
            raise ValueError("a decoder with sliding-window layers needs the rows' positions")
        at = None if positions is None else positions.to(torch.int64).contiguous()
        t, hidden = x.shape
        counts = torch.tensor(taps, dtype=torch.int64)
        streams = torch.empty(t, len(taps) * hidden, dtype=x.dtype)
        variant = self.variant | stepops.cache_flags(keys)
        code = self.lib.q4_decode(
            self.address, variant, torch.get_num_threads(), t, x.data_ptr(), cos.data_ptr(),
            sin.data_ptr(), None if at is None else at.data_ptr(), past, None if mask is None else mask.data_ptr(),
            keys.data_ptr(), values.data_ptr(), keys.shape[2], counts.data_ptr(), len(taps), streams.data_ptr(),
        )  # fmt: skip
        stepops.raise_for(code, self.model.head_dim)
        return streams
