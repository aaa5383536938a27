"""EAGLE drafting (Li et al., EAGLE-1/2; shared/papers/003): a draft layer that reads the
backbone's feature at position t *and* the embedding of token t + 1, predicts the feature at
t + 1, and drafts autoregressively from what it predicts.

- `EagleDraft`: fc([feature; embedding]) → one decoder layer of the backbone's own architecture
  (its transformers class, built from its config) → a norm. Features are the backbone's last
  hidden states *after* its final norm, the states our decode step already returns: they are
  scale-free (the pre-norm ones have RMS ≈ 30 on the embedded model, which swamps the token
  loss), and the readout is the backbone's own lm_head on them, over a reduced draft
  vocabulary (EAGLE-3's draft-to-target map: the tokens the model itself writes most).
- Multi-layer features (EAGLE-3): a drafter made with `taps` also reads the residual stream
  after those decoder layers (EAGLE-3's low, middle and high: `eagle3_taps`), each RMS-scaled
  and fused with the last feature into one by a linear map (`fuse`), on the committed
  positions; a drafted position reads the draft's own output, as before. On the embedded
  model this raised held-out first-token acceptance by about a third at equal training.
- `EagleDrafter`: keeps the draft layer's own KV cache over the committed positions (fed the
  backbone's features as steps commit) and grows a dynamic tree by draft confidence
  (EAGLE-2): expand the most probable nodes depth by depth, then keep the most probable
  nodes to the budget. Children are distinct and fixed before verification, so every
  acceptance rule stays exact.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from core.backends import cache as kv
from core.backends.lean import rows_of, table_of
from core.errors import UserError
from core.files import save_tensors

FORMAT = "medusa-chat-eagle-1"  # the safetensors metadata "format" of a drafter file


class EagleDraft(nn.Module):
    """The draft model for one backbone. Only `fc`, the layer and `norm` are its own; the token
    embedding and the readout are the backbone's (frozen), read out over `vocab` only."""

    def __init__(
        self,
        model: nn.Module,
        vocab: Tensor,
        input_norm: bool = True,
        output_norm: bool = True,
        taps: tuple[int, ...] = (),
    ) -> None:
        """`input_norm` False: the layer reads fc's output as it is; `output_norm` False: the
        layer's output is the predicted feature (EAGLE-1/2 checkpoints have neither norm);
        `taps`: the backbone's hidden-state indices (the stream after that many decoder
        layers) fused with the last feature on committed positions (none: the last only)."""
        super().__init__()
        self.taps = tuple(sorted(set(taps)))
        base = model.base_model
        # the backbone's own decoder layer, norm and rotary classes (transformers' for a model built
        # without them: `models.light`)
        parts = model.hf_parts() if hasattr(model, "hf_parts") else None
        config = copy.deepcopy(model.config.get_text_config()) if parts is None else parts[0]
        layer_class, norm_class, rotary_class = (
            parts[1:] if parts else map(type, (base.layers[0], base.norm, base.rotary_emb))
        )
        config.num_hidden_layers = 1
        config._attn_implementation = "sdpa"
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        if self.taps:
            self.fuse = nn.Linear((len(self.taps) + 1) * hidden, hidden, bias=False)
        self.layer = layer_class(config, 0)
        self.norm = norm_class(hidden, eps=getattr(config, "rms_norm_eps", 1e-6))
        if not input_norm:
            self.layer.input_layernorm = nn.Identity()
        if not output_norm:
            self.norm = nn.Identity()
        self.input_norm, self.output_norm = input_norm, output_norm
        self.rotary = rotary_class(config)
        self.register_buffer("vocab", vocab.to(torch.long).clone(), persistent=True)
        self._embed = [base.embed_tokens]  # in a list: the backbone's, not a submodule of the draft
        self._head = [model.get_output_embeddings()]

    @property
    def backbone_dtype(self) -> torch.dtype:
        """The dtype the backbone computes in (the draft runs in it too)."""
        return table_of(self._embed[0])[0]

    @property
    def vocab_size(self) -> int:
        """The backbone's vocabulary size."""
        return self._head[0].out_features

    @property
    def readout_weight(self) -> Tensor:
        """(V_draft, H) the backbone's lm_head rows of the draft vocabulary."""
        return rows_of(self._head[0], self.vocab)

    def fused(self, features: Tensor) -> Tensor:
        """(…, (taps + 1)·H) the backbone's tapped streams then its last feature, as
        `backbone_features` gives them → (…, H) the feature the draft reads at a committed
        position (the last feature itself without taps)."""
        if not self.taps:
            return features
        return self.fuse(scaled_taps(features, len(self.taps)))

    def embed(self, ids: Tensor) -> Tensor:
        return self._embed[0](ids).detach()

    def forward(
        self,
        features: Tensor,
        ids: Tensor,
        positions: Tensor,
        mask: Tensor | None,
        cache=None,
    ) -> Tensor:
        """(B, T, H) features at positions t and (B, T) tokens t + 1 → (B, T, H) predicted features
        at t + 1. `mask`: (B, 1, T, past + T) additive float mask (None: causal); `cache`: a
        transformers Cache the T new keys and values are appended to."""
        x = self.fc(torch.cat([features, self.embed(ids).to(features.dtype)], dim=-1))
        cos_sin = self.rotary(x, positions)
        x = self.layer(
            x,
            attention_mask=mask,
            position_ids=positions,
            **kv.argument(self.layer, cache),
            use_cache=cache is not None,
            position_embeddings=cos_sin,
        )
        x = x[0] if isinstance(x, tuple) else x
        return self.norm(x)

    def logits(self, predicted: Tensor) -> Tensor:
        """(…, H) predicted features → (…, V_draft) logits over the draft vocabulary."""
        return predicted @ self.readout_weight.to(predicted.dtype).t()


def eagle3_taps(layers: int) -> tuple[int, ...]:
    """EAGLE-3's low, middle and high feature layers for a backbone of `layers` decoder layers
    (the hidden-state indices: the stream entering layers 2, L // 2 and L − 3; below L, whose
    hidden state in transformers is the final, normed one)."""
    return tuple(sorted({min(t, layers - 1) for t in (2, layers // 2, max(layers - 3, 0))}))


def scaled_taps(features: Tensor, taps: int) -> Tensor:
    """(…, (taps + 1)·H) → the same with each tapped stream scaled to unit RMS (the residual
    stream's scale grows with depth, to RMS ≈ 30 on the embedded model); the last feature,
    already normed by the backbone, is kept as it is."""
    parts = list(features.float().chunk(taps + 1, dim=-1))
    parts[:taps] = [p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + 1e-6) for p in parts[:taps]]
    return torch.cat(parts, dim=-1).to(features.dtype)


def init_from_backbone(draft: EagleDraft, model: nn.Module) -> None:
    """Warm start: the layer from the backbone's last decoder layer, the norm from its final norm,
    fc reading the feature straight through plus the embedding."""
    draft.layer.load_state_dict(model.base_model.layers[-1].state_dict())
    draft.norm.load_state_dict(model.base_model.norm.state_dict())
    hidden = draft.fc.out_features
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, :hidden].copy_(torch.eye(hidden))
        draft.fc.weight[:, hidden:].copy_(torch.eye(hidden))
        draft.fc.bias.zero_()
        if draft.taps:  # the fused feature starts as the last feature alone
            draft.fuse.weight.zero_()
            draft.fuse.weight[:, -hidden:].copy_(torch.eye(hidden))


# -- files ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DrafterCard:
    model: str  # the backbone it was trained for
    vocab_size: int  # the backbone's vocabulary
    hidden_size: int
    acceptance: tuple[float, ...] = ()  # held-out chain acceptance by depth (each given the ones before)


def save_draft(file: Path, draft: EagleDraft, card: DrafterCard) -> None:
    tensors = {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v for k, v in draft.state_dict().items()}
    meta = {
        "format": FORMAT,
        "model": card.model,
        "vocab_size": str(card.vocab_size),
        "hidden_size": str(card.hidden_size),
        "acceptance": json.dumps(list(card.acceptance)),
        "norms": json.dumps({"input": draft.input_norm, "output": draft.output_norm}),
        "taps": json.dumps(list(draft.taps)),
    }
    save_tensors(file, tensors, meta)


def load_draft(file: Path, model: nn.Module, model_name: str | None = None) -> tuple[EagleDraft, DrafterCard]:
    """The drafter in `file` for `model`; a file for another model, or a damaged one, is one
    UserError sentence."""
    try:
        with safe_open(str(file), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        raise UserError(f"The EAGLE drafter {file} cannot be read ({e.__class__.__name__}); replace it.") from e
    vocab = model.get_output_embeddings().out_features
    hidden = model.config.get_text_config().hidden_size
    not_ours = UserError(f"{file} is not a medusa-chat EAGLE drafter; make one with `medusa-chat train-drafter`.")
    if meta.get("format") != FORMAT or "vocab" not in tensors:
        raise not_ours
    try:
        card = DrafterCard(
            meta.get("model", ""),
            int(meta.get("vocab_size", -1)),
            int(meta.get("hidden_size", -1)),
            tuple(json.loads(meta.get("acceptance", "[]"))),
        )
        norms = json.loads(meta.get("norms", "{}"))
        taps = tuple(int(t) for t in json.loads(meta.get("taps", "[]")))
    except (ValueError, TypeError):  # metadata damaged past its format tag
        raise not_ours from None
    if card.vocab_size != vocab or card.hidden_size != hidden or (model_name and card.model not in ("", model_name)):
        raise UserError(
            f"The EAGLE drafter {file} was made for {card.model or 'another model'} "
            f"(vocabulary {card.vocab_size}, width {card.hidden_size}), not this one; train one for it."
        )
    layers = model.config.get_text_config().num_hidden_layers
    if any(not 0 <= t < layers for t in taps):
        raise UserError(f"The EAGLE drafter {file} reads layers {list(taps)}; this model has {layers}.")
    draft = EagleDraft(model, tensors["vocab"], norms.get("input", True), norms.get("output", True), taps)
    return fill(draft, tensors, str(file)), card


def fill(draft: EagleDraft, tensors: dict[str, Tensor], name: str) -> EagleDraft:
    """`draft` with every weight from `tensors`, which must hold exactly the draft's."""
    model_device = table_of(draft._embed[0])[1]
    try:
        missing, unexpected = draft.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # a tensor of the wrong shape
        first = str(e).strip().splitlines()[-1].strip()
        raise UserError(f"The EAGLE drafter {name} does not fit this model's layer ({first}).") from e
    if missing or unexpected:
        raise UserError(
            f"The EAGLE drafter {name} does not fit this model's layer "
            f"(missing {', '.join(missing) or 'nothing'}; unexpected {', '.join(unexpected) or 'nothing'})."
        )
    return draft.to(device=model_device).eval()
