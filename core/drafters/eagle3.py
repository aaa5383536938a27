"""Published EAGLE-3 drafters (Li et al., EAGLE-3: the `LlamaForCausalLMEagle3` checkpoints, e.g.
`yuhuili/EAGLE3-LLaMA3.1-Instruct-8B`), drafting in the project's EAGLE tree.

What the published code computes, and how it differs from the project's own `EagleDraft`:

- On a committed position the feature is `fc` over the backbone's streams entering three of its
  layers (low, middle, high), side by side and as they are (3H → H, no bias); the backbone's
  last feature is not read. A drafted position reads the draft's own output instead, without fc.
- The one decoder layer's attention reads [input_layernorm(embedding of token t + 1);
  hidden_norm(feature)], 2H wide, while its residual stream is the feature itself (its normed
  copy where the checkpoint says `norm_before_residual`); the MLP half is a Llama layer's.
- The layer's output, before `norm`, is the feature the next drafted position reads; the
  logits are the draft's own `lm_head(norm(output))` over a draft vocabulary, whose id i is the
  target's i + d2t[i] (`vocab` holds the target ids, so drafted tokens enter the tree as the
  backbone's). The embedding is the backbone's.

`Eagle3Draft` holds the weights (an `EagleDraft` to every caller: same members, same meaning);
`LeanEagle3` runs it on packed weights with the lean backend's parts, as `lean_draft.LeanDraft`
runs the project's own.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from core.backends import cache as kv
from core.backends import lean as fast
from core.drafters.eagle import EagleDraft
from core.drafters.lean_draft import LeanDraft, draft_kernel

if TYPE_CHECKING:  # transformers' model code is imported where a draft is built
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def midlayer(config: LlamaConfig) -> LlamaDecoderLayer:
    """EAGLE-3's decoder layer: a Llama layer whose q/k/v read 2H inputs, with a `hidden_norm`
    (its parameter names are the checkpoint's `midlayer.*`)."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    layer = LlamaDecoderLayer(config, 0)
    attn, wide = layer.self_attn, 2 * config.hidden_size
    bias = getattr(config, "attention_bias", False)
    for name in ("q_proj", "k_proj", "v_proj"):
        setattr(attn, name, nn.Linear(wide, getattr(attn, name).out_features, bias=bias))
    layer.hidden_norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
    return layer


class Eagle3Draft(EagleDraft):
    """A published EAGLE-3 draft for one backbone: `fc`, `midlayer`, `norm` and `lm_head` its own,
    the token embedding the backbone's; `vocab`: the target id of each draft id."""

    def __init__(
        self, model: nn.Module, config: LlamaConfig, taps: tuple[int, ...], norm_before_residual: bool = False
    ) -> None:
        """`config`: the checkpoint's (the draft layer's shape and rotary positions); `taps`: the
        backbone's hidden-state indices fc reads, in order."""
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        nn.Module.__init__(self)  # EagleDraft's constructor builds the backbone's layer, which this draft has not
        config = copy.deepcopy(config)
        config.num_hidden_layers, config._attn_implementation = 1, "sdpa"
        hidden, draft_vocab = config.hidden_size, config.draft_vocab_size or config.vocab_size
        self.config, self.taps, self.norm_before_residual = config, tuple(taps), norm_before_residual
        self.fc = nn.Linear(len(self.taps) * hidden, hidden, bias=False)
        self.midlayer = midlayer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("vocab", torch.arange(draft_vocab), persistent=True)
        self._embed = [model.get_input_embeddings()]  # in a list: the backbone's, not a submodule of the draft
        self._head = [model.get_output_embeddings()]

    @property
    def readout_weight(self) -> Tensor:
        """(V_draft, H) the draft's own lm_head (read after `norm`: see `logits`)."""
        return self.lm_head.weight.detach()

    def fused(self, features: Tensor) -> Tensor:
        """(…, (taps + 1)·H) the tapped streams then the last feature → (…, H) fc over the streams."""
        return self.fc(features[..., : self.fc.in_features])

    def forward(
        self, features: Tensor, ids: Tensor, positions: Tensor, mask: Tensor | None, cache=None
    ) -> Tensor:  # fmt: skip
        """(B, T, H) features at positions t and (B, T) tokens t + 1 → (B, T, H) the layer's output
        (before `norm`), which the next drafted position reads. `mask`: (B, 1, T, past + T)
        additive (None: causal); `cache`: a transformers Cache the new keys and values go to."""
        layer = self.midlayer
        embedded = layer.input_layernorm(self.embed(ids).to(features.dtype))
        normed = layer.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        attended = layer.self_attn(
            torch.cat([embedded, normed], dim=-1),
            position_embeddings=self.rotary(features, positions),
            attention_mask=mask,
            **kv.argument(layer.self_attn, cache),
        )[0]
        x = residual + attended
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits(self, predicted: Tensor) -> Tensor:
        """(…, H) the layer's output → (…, V_draft) logits over the draft vocabulary."""
        return self.lm_head(self.norm(predicted))


class _MidLayer(fast.LeanLayer):
    """EAGLE-3's layer on packed weights: `LeanLayer`'s attention reads `norm1(x)`, here the
    normed embedding and the normed feature side by side, and its residual stream is the feature."""

    def __init__(self, layer: nn.Module, config: LlamaConfig, norm_before_residual: bool) -> None:
        super().__init__(layer, config, 0)
        self.norm_embedding, self.norm_hidden = self.norm1, fast.norm(layer.hidden_norm, self.ops)
        self.before = norm_before_residual
        self._embedded: Tensor | None = None
        self.norm1 = self._attention_input

    def _attention_input(self, x: Tensor) -> Tensor:
        hidden = x if self.before else self.norm_hidden(x)  # normed already where it is the residual too
        return torch.cat([self.norm_embedding(self._embedded), hidden], dim=-1)

    def run(self, x: Tensor, embedded: Tensor, rope, cache: fast.StaticKV, past: int, mask, causal: bool) -> Tensor:
        """(T, H) features and (T, H) embeddings of the next tokens → (T, H) the layer's output."""
        self._embedded = embedded
        return self(self.norm_hidden(x) if self.before else x, rope, cache, past, mask, causal)


class LeanEagle3(LeanDraft):
    """`Eagle3Draft` on packed weights, a `LeanDraft` (its cache and room for rows): fc → the layer on a
    StaticKV; `logits` reads out through norm and the draft's lm_head."""

    def __init__(self, draft: Eagle3Draft, dtype: torch.dtype) -> None:  # not LeanDraft's: another layer
        device = draft.fc.weight.device
        kernel = draft_kernel(device, dtype)
        layer = copy.deepcopy(draft.midlayer).to(device=device, dtype=dtype)  # a copy to pack
        fast.pack_layer(layer, kernel)
        self.layer = _MidLayer(layer, draft.config, draft.norm_before_residual)
        self.fc = fast.PackedLinear(draft.fc.weight.to(dtype), None, kernel)
        self.rope = fast.Rope(draft.rotary, self.layer.head_dim, dtype)
        self.norm = fast.norm(copy.deepcopy(draft.norm).to(device=device, dtype=dtype))
        self.readout = fast.PackedLinear(draft.lm_head.weight.to(dtype), None, kernel)
        self.taps, self.vocab, self.embed = draft.taps, draft.vocab, draft.embed
        self.dtype, self.device = dtype, device

    def fused(self, features: Tensor) -> Tensor:
        """The committed positions' (n, (taps + 1)·H) features → (n, H): fc over the tapped streams."""
        return self.fc(features[:, : self.fc.in_features].to(self.dtype))

    def __call__(self, features: Tensor, ids: Tensor, positions: Tensor, mask, cache: fast.StaticKV) -> Tensor:
        """(T, H) features and (T,) next tokens at (T,) positions → (T, H) the layer's outputs;
        their keys and values are appended after the cache's length (which is not moved)."""
        past, mask, causal = self.room(ids.numel(), mask, cache)
        embedded = self.embed(ids).to(self.dtype)
        return self.layer.run(features.to(self.dtype), embedded, self.rope(positions), cache, past, mask, causal)

    def logits(self, predicted: Tensor) -> Tensor:
        return self.readout(self.norm(predicted))
