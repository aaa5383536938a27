"""One lean decoder layer: RMSNorm → GQA attention with rotary positions → RMSNorm → SwiGLU MLP,
straight from the model's own (packed) modules, writing its keys and values into a `StaticKV`.

The norms and a step's attention run on the kernel library's row-by-row ops where they can
(`core.backends.q4.Ops`), else on torch's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.backends import q4
from core.backends.lean.kv import StaticKV
from core.backends.lean.rope import rotate


class LeanLayer:
    """One decoder layer (packed by `surgery.pack_layer`) writing its keys and values into slot
    `index` of a StaticKV: RMSNorm → GQA attention with rotary positions → RMSNorm → SwiGLU MLP."""

    def __init__(self, layer: nn.Module, config, index: int) -> None:
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.inner = config.intermediate_size
        self.index = index
        self.ops = q4.ops(*_dtype_device(layer))  # the library's ops for host tensors only
        self.norm1, self.norm2 = norm(layer.input_layernorm, self.ops), norm(layer.post_attention_layernorm, self.ops)
        self.qkv, self.o_proj = layer.self_attn.qkv, layer.self_attn.o_proj
        self.gate_up, self.down = layer.mlp.gate_up, layer.mlp.down_proj

    def __call__(self, x: Tensor, rope: tuple[Tensor, Tensor], cache: StaticKV, past: int, mask, causal: bool):
        """(T, H) residual stream in and out; the T new keys and values go to [past, past + T)."""
        t, end, i = x.shape[0], past + x.shape[0], self.index
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(self.norm1(x))
        qk = rotate(qkv[:, : self.q_size + self.kv_size].view(t, heads + kv, d), *rope)
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


def _dtype_device(layer: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype a decoder layer computes in and the device it runs on (its first floating parameter's)."""
    weight = next(p for p in layer.parameters() if p.is_floating_point())
    return weight.dtype, weight.device


def eps(norm: nn.Module) -> float:
    """An RMSNorm module's epsilon, under either of the names transformers gives it."""
    return getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)


def norm(module: nn.Module, ops: q4.Ops | None = None) -> Callable[[Tensor], Tensor]:
    """An RMSNorm module as one fused call (same maths as transformers' Llama RMSNorm; the
    library's row-by-row kernel where `ops` is given, for (T, H) inputs); an nn.Identity (a
    layer without that norm) as itself."""
    if isinstance(module, nn.Identity):
        return module
    weight, epsilon = module.weight, eps(module)
    shape = (weight.shape[0],)
    if ops is not None:
        return lambda x: (
            ops.rms_norm(x, weight, epsilon)
            if x.dim() == 2 and x.stride(-1) == 1
            else torch.rms_norm(x, shape, weight, epsilon)
        )
    return lambda x: torch.rms_norm(x, shape, weight, epsilon)
