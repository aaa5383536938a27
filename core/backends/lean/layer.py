"""One lean decoder layer, straight from the model's own (packed) modules, writing its keys and
values into a `StaticKV`: RMSNorm → GQA attention with rotary positions → RMSNorm → gated MLP.

The families it reproduces: Llama, Mistral and Qwen2; Qwen3 (an RMSNorm over each head of q and
k before the rotation); Gemma 3 (norms x·(1 + w) in float32, q/k head norms, a norm on the
attention's and on the MLP's output before each residual add, a GELU-tanh gate, its own
attention scale; sliding-window layers get their window as their mask, from the forward).

The norms and a step's attention run on the kernel library's row-by-row ops where they can
(`core.backends.stepops.Ops`), else on torch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.backends import stepops
from core.backends.lean.kv import StaticKV
from core.backends.lean.rope import rotate
from core.backends.torch import windows

ACTS = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}  # the MLP gates served
_ACT_NAMES = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config names → ACTS


def act_name(config) -> str | None:
    """The MLP gate of a (text) config as one of `ACTS`, None where it is another."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"
    return _ACT_NAMES.get(name)


class LeanLayer:
    """One decoder layer (packed by `surgery.pack_layer`) writing its keys and values into slot
    `index` of a StaticKV. `kind` and `window`: its `layer_types` entry and, for a
    "sliding_attention" layer, its window (0: full attention; the forward builds its mask)."""

    def __init__(self, layer: nn.Module, config, index: int) -> None:
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = head_size(config)
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.inner = config.intermediate_size
        self.index = index
        types = getattr(config, "layer_types", None)
        self.kind = types[index] if types and index < len(types) else "full_attention"
        slides = windows(config) or {}  # as transformers' forward masks: by layer type, or "" for every layer (Mistral)
        self.window = slides.get(self.kind if types else "", 0)
        scalar = getattr(config, "query_pre_attn_scalar", None)
        self.scale = None if scalar is None else float(scalar) ** -0.5  # None: head_dim^-0.5
        self.act = act_name(config) or "silu"
        self.ops = stepops.ops(*_dtype_device(layer))  # the library's ops for host tensors only
        attn = layer.self_attn
        self.norm1 = norm(layer.input_layernorm, self.ops)
        self.q_norm = norm(attn.q_norm) if hasattr(attn, "q_norm") else None
        self.k_norm = norm(attn.k_norm) if hasattr(attn, "k_norm") else None
        if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma's sandwich: post_attention_layernorm is on the output
            self.post_attn = norm(layer.post_attention_layernorm, self.ops)
            self.norm2 = norm(layer.pre_feedforward_layernorm, self.ops)
            self.post_mlp = norm(layer.post_feedforward_layernorm, self.ops)
        else:
            self.norm2, self.post_attn, self.post_mlp = norm(layer.post_attention_layernorm, self.ops), None, None
        self.qkv, self.o_proj = attn.qkv, attn.o_proj
        self.gate_up, self.down = layer.mlp.gate_up, layer.mlp.down_proj

    def __call__(self, x: Tensor, rope: tuple[Tensor, Tensor], cache: StaticKV, past: int, mask, causal: bool):
        """(T, H) residual stream in and out; the T new keys and values go to [past, past + T)."""
        t, end, i = x.shape[0], past + x.shape[0], self.index
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        if cache.bits != 16:
            raise ValueError("8-bit keys and values are read and written by the kernel library's decoder only")
        qkv = self.qkv(self.norm1(x))
        qk = qkv[:, : self.q_size + self.kv_size].view(t, heads + kv, d)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
        qk = rotate(qk, *rope)
        cache.keys[i, :, past:end] = qk[:, heads:].transpose(0, 1)
        cache.values[i, :, past:end] = qkv[:, self.q_size + self.kv_size :].view(t, kv, d).transpose(0, 1)
        if self.ops is not None and self.ops.attends(d) and stepops.Ops.takes(t, mask, causal, qk.dtype):
            seen = None if mask is None else mask[0, 0].contiguous()
            a = self.ops.attention(
                qk[:, :heads], cache.keys[i], cache.values[i], end, seen, self.scale, self.window > 0
            )
        else:
            a = (
                F.scaled_dot_product_attention(
                    qk[:, :heads].transpose(0, 1).unsqueeze(0),
                    cache.keys[i, :, :end].unsqueeze(0),
                    cache.values[i, :, :end].unsqueeze(0),
                    attn_mask=mask,
                    is_causal=causal,
                    scale=self.scale,
                    enable_gqa=heads != kv,
                )[0]
                .transpose(0, 1)
                .reshape(t, -1)
            )
        o = self.o_proj(a)
        x = x + (o if self.post_attn is None else self.post_attn(o))
        gu = self.gate_up(self.norm2(x))
        m = self.down(ACTS[self.act](gu[:, : self.inner]) * gu[:, self.inner :])
        return x + (m if self.post_mlp is None else self.post_mlp(m))


def head_size(config) -> int:
    """A config's attention head size: its `head_dim`, else hidden size ÷ heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def causal_mask(t: int, past: int, dtype: torch.dtype, device=None) -> Tensor:
    """(1, 1, t, past + t) additive mask of a causal block after `past` cached positions."""
    mask = torch.zeros(1, 1, t, past + t, dtype=dtype, device=device)
    hidden = torch.ones(t, t, dtype=torch.bool, device=device).triu(1)
    mask[0, 0, :, past:].masked_fill_(hidden, torch.finfo(dtype).min)
    return mask


def window_mask(
    mask: Tensor | None, causal: bool, positions: Tensor, past: int, window: int, dtype: torch.dtype
) -> tuple[Tensor | None, bool]:
    """The mask and causal flag of a sliding-window layer for T rows at `positions` after `past`
    cached positions (cache index = position there): on top of `mask` (or causal, or none), a row
    at position p does not see the keys at positions <= p - window. Unchanged where the window
    hides nothing."""
    t = positions.numel()
    lowest = 0 if past else int(positions.min())
    if not window or int(positions.max()) - window < lowest:
        return mask, causal
    at = torch.cat([torch.arange(past, device=positions.device), positions])  # every key's position
    hidden = at.view(1, -1) <= positions.view(-1, 1) - window
    if mask is not None:
        base = mask[0, 0]
    elif causal:
        base = causal_mask(t, past, dtype, positions.device)[0, 0]
    else:
        base = torch.zeros(t, past + t, dtype=dtype, device=positions.device)
    return base.masked_fill(hidden, torch.finfo(dtype).min).view(1, 1, t, past + t), False


def _dtype_device(layer: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype a decoder layer computes in and the device it runs on (its first floating parameter's)."""
    weight = next(p for p in layer.parameters() if p.is_floating_point())
    return weight.dtype, weight.device


def eps(norm: nn.Module) -> float:
    """An RMSNorm module's epsilon, under either of the names transformers gives it."""
    return getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)


def unit_offset(module: nn.Module) -> bool:
    """Whether an RMSNorm module scales by 1 + its weight, in float32 (Gemma's: transformers' classes
    say so by their name, `models.light`'s by an attribute)."""
    return getattr(module, "unit_offset", type(module).__name__.startswith("Gemma"))


class Norm:
    """An RMSNorm module as one fused call. Llama's (and Qwen's): normalized in float32, rounded
    to the model's dtype, times the weight; Gemma's: times 1 + the weight in float32, rounded once
    (`weight` then holds 1 + w in float32, what transformers computes on every call). The
    library's row-by-row kernel where `ops` is given, for (T, H) bf16 inputs."""

    def __init__(self, module: nn.Module, ops: stepops.Ops | None = None) -> None:
        self.gemma = unit_offset(module)
        self.weight = (1.0 + module.weight.detach().float()) if self.gemma else module.weight
        self.eps, self.ops, self.shape = eps(module), ops, (module.weight.shape[0],)

    def __call__(self, x: Tensor) -> Tensor:
        if self.ops is not None and x.dim() == 2 and x.stride(-1) == 1 and x.dtype == torch.bfloat16:
            return self.ops.rms_norm(x, self.weight, self.eps)
        if self.gemma:
            return torch.rms_norm(x.float(), self.shape, self.weight, self.eps).to(x.dtype)
        return torch.rms_norm(x, self.shape, self.weight, self.eps)


def norm(module: nn.Module, ops: stepops.Ops | None = None) -> Norm | nn.Identity:
    """An RMSNorm module as one fused call (`Norm`); an nn.Identity (a layer without that norm) as itself."""
    return module if isinstance(module, nn.Identity) else Norm(module, ops)
