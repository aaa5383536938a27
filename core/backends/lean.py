"""A lean decode forward for Llama-family backbones on the CPU, with a pre-allocated KV cache.

Most of a small model's decoding step on a CPU is not arithmetic: it is per-operator overhead
in the generic transformers forward (mask building, cache bookkeeping, dozens of small ops a
layer) and BLAS re-packing the weights on every multi-row matmul. This module removes both:

- `accelerate` swaps the model's linear layers for `PackedLinear`s (q/k/v and gate/up fused)
  whose weights are laid out once for the chosen kernel (oneDNN's pre-packed layout in fp32 or bf16, or weight-only int4
  with bf16 activations). A packed matmul gives every row the same result whatever the number
  of rows, so a tree forward and a one-token forward round alike.
- `FastForward` runs embedding → decoder layers → final norm straight from the model's own
  modules (nothing is copied), writing keys and values into a `StaticKV` by index; keeping an
  accepted path is one gather over all layers at once.

Only architectures whose layers are exactly RMSNorm → GQA attention with rotary positions →
SwiGLU MLP are served (`SUPPORTED`); everything else keeps the transformers forward.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.backends import q4

SUPPORTED = ("llama", "mistral", "qwen2")  # model_type values whose decoder layers FastForward reproduces
KERNELS = ("dense", "onednn", "int4", "q4", "q8")  # how a PackedLinear multiplies; see PackedLinear
QUANTIZED = ("int4", "q4", "q8")  # the kernels of quantized weights, run with bf16 activations
LIBRARY = ("q4", "q8")  # the kernels of the project's own library (core.backends.q4)
_ATTR = "medusa_fast_forward"  # where a model carries its FastForward (see forward_of)
INT4_GROUP = 32  # int4 weights: one scale and zero per 32 inputs (the GGUF Q4_1 block)
ROW_STEP = 64  # every kernel takes a multiple of this many outputs (torch's int4 layout needs it)


class PackedLinear(nn.Module):
    """y = x Wᵀ + b with W laid out once for one kernel.

    - "dense": torch's own matmul on the plain weight.
    - "onednn": oneDNN's pre-packed layout (`mkldnn._reorder_linear_weight`), fp32 or bf16.
    - "int4": weight-only int4, asymmetric per group of `INT4_GROUP` inputs, bf16 activations
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
            y = torch._weight_int4pack_mm_for_cpu(x2, self.packed, INT4_GROUP, self.scales_zeros)
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

    Each group of `INT4_GROUP` inputs keeps its own minimum and step, so weights that were
    4-bit with such blocks to begin with (GGUF Q4_1) come back as they were, up to bf16 scales."""
    out, inp = w.shape
    groups = w.float().view(out, inp // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    step = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.int32).view(out, inp)
    zeros = low + 8 * step  # the kernel computes (q - 8) * step + zero
    scales_zeros = torch.stack([step.t(), zeros.t()], dim=-1).contiguous().to(torch.bfloat16)
    return torch._convert_weight_to_int4pack_for_cpu(q, 1), scales_zeros


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


def servable(config) -> bool:
    """Whether FastForward reproduces the forward of a model with this (transformers) config."""
    text = config.get_text_config()
    return (
        text.model_type in SUPPORTED
        and getattr(text, "hidden_act", "silu") == "silu"
        and not getattr(config, "quantization_config", None)
        and not any("sliding" in t for t in (getattr(text, "layer_types", None) or []))
    )


class Part(nn.Module):
    """Columns [start, stop) of a fused PackedLinear's output: what the original q/k/v or
    gate/up projection returned, so the transformers forward still works after fusing."""

    def __init__(self, fused: PackedLinear, start: int, stop: int) -> None:
        super().__init__()
        self.fused, self.start, self.stop = fused, start, stop

    def forward(self, x: Tensor) -> Tensor:
        return self.fused(x)[..., self.start : self.stop]


def _fuse(parent: nn.Module, names: tuple[str, ...], kernel: str) -> PackedLinear:
    """One PackedLinear over the concatenated outputs of `parent`'s linear layers `names`,
    which become Parts of it."""
    parts = [getattr(parent, n) for n in names]
    weight = torch.cat([p.weight for p in parts])
    biases = [p.bias for p in parts]
    bias = (
        None
        if all(b is None for b in biases)
        else torch.cat(
            [b if b is not None else weight.new_zeros(p.weight.shape[0]) for p, b in zip(parts, biases, strict=True)]
        )
    )
    fused = PackedLinear(weight, bias, kernel)
    start = 0
    for name, part in zip(names, parts, strict=True):
        stop = start + part.weight.shape[0]
        setattr(parent, name, Part(fused, start, stop))
        start = stop
    return fused


def pack_layer(layer: nn.Module, kernel: str) -> None:
    """Pack one decoder layer's linear layers in place (q/k/v and gate/up fused), for `LeanLayer`."""
    attn, mlp = layer.self_attn, layer.mlp
    attn.qkv = _fuse(attn, ("q_proj", "k_proj", "v_proj"), kernel)
    attn.o_proj = PackedLinear(attn.o_proj.weight, attn.o_proj.bias, kernel)
    mlp.gate_up = _fuse(mlp, ("gate_proj", "up_proj"), kernel)
    mlp.down_proj = PackedLinear(mlp.down_proj.weight, mlp.down_proj.bias, kernel)


def accelerate(
    model: nn.Module, kernel: str, head_kernel: str, by_row: Callable[[PackedLinear], bool] | None = None
) -> FastForward:
    """Pack the model's linear layers (in place) and give it a FastForward, which every
    consumer of the model (`core.backends.cache.new_cache`, `core.decode.step`) then uses.

    Decoder layers get `kernel` with q/k/v and gate/up fused into one matmul each; the lm_head
    gets `head_kernel` and keeps its `weight` (tied to the embedding), which Medusa heads read.
    `by_row(head)`: whether a tree's logits go a node at a time (default: timed here, now; the
    loader passes `core.measure.kernels.head_by_row`, which remembers it)."""
    for layer in model.base_model.layers:
        pack_layer(layer, kernel)
    head = model.get_output_embeddings()
    packed = PackedLinear(head.weight, head.bias, head_kernel)
    packed.weight = head.weight
    model.set_output_embeddings(packed)
    forward = FastForward(model)
    forward.row_head = (by_row or _cost_grows_by_row)(packed)
    setattr(model, _ATTR, forward)
    return forward


def row_head(model: nn.Module) -> bool:
    """Whether a tree's logits are better computed a node at a time (see `step.RowLogits`)."""
    forward = forward_of(model)
    return forward is not None and forward.row_head


def _cost_grows_by_row(head: PackedLinear, rows: int = 8) -> bool:
    """Whether `rows` rows through the lm_head cost more than twice one row (a kernel that
    re-reads the weights per row, such as bf16 emulated without native bf16 arithmetic)."""
    from core.measure.profile import time_ms  # core.measure builds on this module

    x = torch.zeros(rows, head.in_features, dtype=torch.bfloat16 if head.kernel in QUANTIZED else head.packed.dtype)
    with torch.inference_mode():
        one, many = (time_ms(lambda n=n: head(x[:n]), repeats=3, fastest=True) for n in (1, rows))
    return many > 2 * one


def forward_of(model: nn.Module) -> FastForward | None:
    """The model's FastForward if `accelerate` gave it one."""
    return getattr(model, _ATTR, None)


def layer_kernel(model: nn.Module) -> str | None:
    """The decoder layers' PackedLinear kernel, or None where the transformers forward runs."""
    forward = forward_of(model)
    return forward.layers[0].qkv.kernel if forward is not None and forward.layers else None


def describe(model: nn.Module) -> str:
    """How the model's forward runs, for reports and the step-cost key: "lean, int4 layers, onednn
    lm_head", "lean, q4 layers in one call, q8 lm_head" or "transformers"."""
    kernel = layer_kernel(model)
    if kernel is None:
        return "transformers"
    head = getattr(model.get_output_embeddings(), "kernel", "dense")
    whole = " in one call" if forward_of(model).native is not None else ""
    return f"lean, {kernel} layers{whole}, {head} lm_head{' by node' if row_head(model) else ''}"


class StaticKV:
    """Keys and values of every layer in two pre-allocated tensors, (layers, kv heads, capacity,
    head dim); the first `length` positions are the committed prefix."""

    def __init__(
        self, layers: int, heads: int, head_dim: int, dtype: torch.dtype, capacity: int = 256, device=None
    ) -> None:
        self.keys = torch.zeros(layers, heads, capacity, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def reserve(self, size: int) -> None:
        """Room for `size` positions (doubling, so appends stay amortised O(1))."""
        capacity = self.keys.shape[2]
        if size <= capacity:
            return
        new = max(size, 2 * capacity)
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = old.new_zeros(old.shape[0], old.shape[1], new, old.shape[3])
            grown[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, grown)

    def truncate(self, size: int) -> None:
        self.length = min(size, self.length)

    def keep_path(self, prefix_len: int, path: Tensor) -> None:
        """Keep [0, prefix_len) and the nodes `path` (relative to prefix_len), every layer at once."""
        keep = path + prefix_len
        end = prefix_len + path.numel()
        if not torch.equal(keep, torch.arange(prefix_len, end)):
            self.keys[:, :, prefix_len:end] = self.keys[:, :, keep]
            self.values[:, :, prefix_len:end] = self.values[:, :, keep]
        self.length = end


class Rope:
    """Rotary cos and sin by position, from a table grown as positions grow (rotate-half
    convention, the sign folded into sin)."""

    def __init__(self, rotary: nn.Module, head_dim: int, dtype: torch.dtype) -> None:
        self.rotary, self.head_dim, self.dtype = rotary, head_dim, dtype
        self._cos = self._sin = torch.empty(0)

    def __call__(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and sin (T, 1, head dim) at (T,) `positions`."""
        top = int(positions.max()) + 1
        if top > self._cos.shape[0]:
            size = max(top, 2 * self._cos.shape[0], 256)
            probe = torch.zeros(1, dtype=self.dtype, device=positions.device)
            cos, sin = self.rotary(probe, torch.arange(size, device=positions.device).view(1, -1))
            half = self.head_dim // 2
            sign = torch.cat([-torch.ones(half), torch.ones(self.head_dim - half)]).to(sin)
            self._cos, self._sin = cos[0], sin[0] * sign
        t = positions.numel()
        return self._cos[positions].view(t, 1, -1), self._sin[positions].view(t, 1, -1)


class LeanLayer:
    """One decoder layer (packed by `pack_layer`) writing its keys and values into slot `index`
    of a StaticKV: RMSNorm → GQA attention with rotary positions → RMSNorm → SwiGLU MLP."""

    def __init__(self, layer: nn.Module, config, index: int) -> None:
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.inner = config.intermediate_size
        self.index = index
        self.ops = q4.ops(*_dtype_device(layer))  # the library's ops for host tensors only
        self.norm1, self.norm2 = _norm(layer.input_layernorm, self.ops), _norm(layer.post_attention_layernorm, self.ops)
        self.qkv, self.o_proj = layer.self_attn.qkv, layer.self_attn.o_proj
        self.gate_up, self.down = layer.mlp.gate_up, layer.mlp.down_proj

    def __call__(self, x: Tensor, rope: tuple[Tensor, Tensor], cache: StaticKV, past: int, mask, causal: bool):
        """(T, H) residual stream in and out; the T new keys and values go to [past, past + T)."""
        t, end, i = x.shape[0], past + x.shape[0], self.index
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(self.norm1(x))
        qk = _rotate(qkv[:, : self.q_size + self.kv_size].view(t, heads + kv, d), *rope)
        cache.keys[i, :, past:end] = qk[:, heads:].transpose(0, 1)
        cache.values[i, :, past:end] = qkv[:, self.q_size + self.kv_size :].view(t, kv, d).transpose(0, 1)
        if self.ops is not None and self.ops.attends(d) and q4.Ops.takes(t, mask, causal, qk.dtype):
            seen = None if mask is None else mask[0, 0].contiguous()
            a = self.ops.attention(qk[:, :heads], cache.keys[i], cache.values[i], end, seen)
        else:
            a = (
                F.scaled_dot_product_attention(
                    qk[:, :heads].transpose(0, 1).unsqueeze(0),
                    cache.keys[i, :, :end].unsqueeze(0),
                    cache.values[i, :, :end].unsqueeze(0),
                    attn_mask=mask,
                    is_causal=causal,
                    enable_gqa=heads != kv,
                )[0]
                .transpose(0, 1)
                .reshape(t, -1)
            )
        x = x + self.o_proj(a)
        gu = self.gate_up(self.norm2(x))
        return x + self.down(F.silu(gu[:, : self.inner]) * gu[:, self.inner :])


def causal_mask(t: int, past: int, dtype: torch.dtype, device=None) -> Tensor:
    """(1, 1, t, past + t) additive mask of a causal block after `past` cached positions."""
    mask = torch.zeros(1, 1, t, past + t, dtype=dtype, device=device)
    hidden = torch.ones(t, t, dtype=torch.bool, device=device).triu(1)
    mask[0, 0, :, past:].masked_fill_(hidden, torch.finfo(dtype).min)
    return mask


class FastForward:
    """Embedding → decoder layers → final norm of a Llama-family model, on a StaticKV."""

    def __init__(self, model: nn.Module) -> None:
        base = model.base_model
        config = model.config.get_text_config()
        self.embed = base.embed_tokens
        self.layers = [LeanLayer(layer, config, i) for i, layer in enumerate(base.layers)]
        first = self.layers[0]
        self.kv_heads, self.head_dim = first.kv_heads, first.head_dim
        self.dtype = model.dtype
        self.rope = Rope(base.rotary_emb, self.head_dim, self.dtype)
        self.final_norm = _norm(base.norm, q4.ops(self.dtype, model.device))
        self.row_head = False  # a tree's logits a node at a time (set by `accelerate`, measured)
        self.native = native_decoder(base.layers, config, self.layers)  # every layer in one call, or None
        self._modules, self._config = base.layers, config
        self._segments: dict[tuple[int, ...], list[tuple[int, int, q4.Decoder]]] = {}

    def new_cache(self) -> StaticKV:
        return StaticKV(len(self.layers), self.kv_heads, self.head_dim, self.dtype)

    def __call__(self, ids: Tensor, positions: Tensor, mask: Tensor | None, cache: StaticKV) -> Tensor:
        """(T,) tokens at (T,) positions after the cache's prefix → (T, H) final hidden states.

        `mask`: (1, 1, T, past + T) additive float mask, or None for causal attention. The T new
        keys and values are appended to the cache."""
        return self.run(ids, positions, mask, cache)[0]

    def run(
        self, ids: Tensor, positions: Tensor, mask: Tensor | None, cache: StaticKV, taps: tuple[int, ...] = ()
    ) -> tuple[Tensor, Tensor | None]:
        """As calling it, and with `taps` (hidden-state indices, ascending: the stream after that
        many layers) also (T, len(taps)·H) those streams side by side (None without taps)."""
        t, past = ids.numel(), cache.length
        cache.reserve(past + t)
        causal = mask is None and t > 1
        if causal and past:  # a causal block after a prefix: build the mask (prefill on top of a cache)
            mask, causal = causal_mask(t, past, self.dtype), False
        rope = self.rope(positions)
        x = self.embed(ids).contiguous()
        tapped: list[Tensor] = []
        if not taps:
            if not run_native(self.native, x, rope, past, mask, causal, cache):
                for layer in self.layers:
                    x = layer(x, rope, cache, past, mask, causal)
        elif self.native is not None and q4.Ops.takes(t, mask, causal, x.dtype):
            tapped += [x.clone()] if 0 in taps else []
            for start, stop, decoder in self._segments_for(taps):
                run_native(decoder, x, rope, past, mask, causal, cache, start)
                if stop in taps:
                    tapped.append(x.clone())
        else:
            tapped += [x.clone()] if 0 in taps else []
            for i, layer in enumerate(self.layers, 1):
                x = layer(x, rope, cache, past, mask, causal)
                tapped += [x.clone()] if i in taps else []
        cache.length = past + t
        return self.final_norm(x), torch.cat(tapped, dim=-1) if taps else None

    def _segments_for(self, taps: tuple[int, ...]) -> list[tuple[int, int, q4.Decoder]]:
        """The library's decoders over the layers between consecutive taps (built once per taps)."""
        if taps not in self._segments:
            bounds = sorted({0, *taps, len(self.layers)})
            self._segments[taps] = [
                (a, b, native_decoder(self._modules[a:b], self._config, self.layers[a:b]))
                for a, b in itertools.pairwise(bounds)
            ]
        return self._segments[taps]


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
    eps = _eps(layers[0].input_layernorm)
    weights = [
        (
            m.input_layernorm.weight,
            m.post_attention_layernorm.weight,
            *(p.packed for p in (one.qkv, one.o_proj, one.gate_up, one.down)),
        )
        for m, one in zip(layers, lean, strict=True)
    ]
    one = lean[0]
    return q4.Decoder(one.ops, weights, config.hidden_size, one.heads, one.kv_heads, one.head_dim, one.inner, eps)


def _dtype_device(layer: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype a decoder layer computes in and the device it runs on (its first floating parameter's)."""
    weight = next(p for p in layer.parameters() if p.is_floating_point())
    return weight.dtype, weight.device


def _eps(norm: nn.Module) -> float:
    """An RMSNorm module's epsilon, under either of the names transformers gives it."""
    return getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)


def _norm(module: nn.Module, ops: q4.Ops | None = None):
    """An RMSNorm module as one fused call (same maths as transformers' Llama RMSNorm; the
    library's row-by-row kernel where `ops` is given, for (T, H) inputs); an nn.Identity (a
    layer without that norm) as itself."""
    if isinstance(module, nn.Identity):
        return module
    weight, eps = module.weight, _eps(module)
    shape = (weight.shape[0],)
    if ops is not None:
        return lambda x: (
            ops.rms_norm(x, weight, eps)
            if x.dim() == 2 and x.stride(-1) == 1
            else torch.rms_norm(x, shape, weight, eps)
        )
    return lambda x: torch.rms_norm(x, shape, weight, eps)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding as transformers' Llama applies it (rotate-half convention);
    `sin` carries the rotation's sign (−sin on the first half)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin
