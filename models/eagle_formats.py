"""Published EAGLE drafters (the SafeAILab/EAGLE project's `yuhuili/EAGLE-*` checkpoints) read
into `core.drafters.eagle.EagleDraft`, through the same hub code as heads.

EAGLE-1/2 checkpoints (`config.json` + `pytorch_model.bin` or `model.safetensors`) hold
`fc.{weight,bias}` over [token embedding; feature] and one decoder layer `layers.0.*` without
an input norm; the feature is the backbone's last hidden state after its final norm (what the
project's decode step returns) and the layer's output is read out by the backbone's lm_head
directly. That maps onto `EagleDraft(input_norm=False, output_norm=False)` over the whole
vocabulary, with fc's two halves swapped to the project's [feature; embedding] order.

EAGLE-3 checkpoints (`midlayer.*`, `fc` over three of the backbone's layers, `lm_head` over a
draft vocabulary mapped to the target's by `d2t`) load into `core.drafters.eagle3.Eagle3Draft`,
their layer's shape from their `config.json`; the layers read are the checkpoint's
`eagle_aux_hidden_state_layer_ids` where it names them, else EAGLE-3's own choice (the streams
entering layers 2, L // 2 and L − 3). A checkpoint whose width, vocabulary or layers do not fit
the backbone is one sentence. Pickles load with `torch.load(weights_only=True)` only.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn

from core.backends.lean import table_of
from core.drafters.eagle import EagleDraft, fill
from core.drafters.eagle3 import Eagle3Draft
from core.errors import UserError

if TYPE_CHECKING:
    from transformers import LlamaConfig

EAGLE_FILES = ["config.json", "pytorch_model.bin", "model.safetensors"]


def read_tensors(folder: Path) -> dict[str, Tensor]:
    """The checkpoint's tensors (safetensors first, else the pickle, weights only)."""
    file = folder / "model.safetensors"
    try:
        if file.is_file():
            return load_file(str(file))
        file = folder / "pytorch_model.bin"
        if file.is_file():
            return torch.load(file, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, SafetensorError, pickle.UnpicklingError, EOFError) as e:
        raise UserError(f"The EAGLE checkpoint {file} cannot be read ({type(e).__name__}); download it again.") from e
    raise UserError(f"{folder} holds no EAGLE checkpoint (model.safetensors or pytorch_model.bin).")


def load_published(folder: Path, model: nn.Module) -> EagleDraft:
    """An EAGLE-1/2 or EAGLE-3 checkpoint in `folder`, for `model` (its backbone)."""
    tensors = read_tensors(folder)
    if "d2t" in tensors or any(k.startswith("midlayer.") for k in tensors):
        return load_eagle3(folder, tensors, model)
    if any(k.startswith("layers.1.") for k in tensors):
        raise UserError(f"{folder} has more than one draft layer; EAGLE-1/2 drafters have one.")
    hidden = model.config.get_text_config().hidden_size
    fc = tensors.get("fc.weight")
    if fc is None or tuple(fc.shape) != (hidden, 2 * hidden):
        shape = "no fc.weight" if fc is None else f"fc.weight {tuple(fc.shape)}"
        raise UserError(f"{folder} is not an EAGLE drafter for this model ({shape}; width {hidden} expected).")
    vocab = model.get_output_embeddings().out_features
    draft = EagleDraft(model, torch.arange(vocab), input_norm=False, output_norm=False)
    ours = {
        "fc.weight": torch.cat([fc[:, hidden:], fc[:, :hidden]], dim=1),  # [embedding; feature] → ours
        "fc.bias": tensors.get("fc.bias", torch.zeros(hidden)),
        "vocab": torch.arange(vocab),
    }
    ours |= {
        "layer." + k.removeprefix("layers.0."): v
        for k, v in tensors.items()
        if k.startswith("layers.0.") and not k.endswith("inv_freq")  # old files kept the rotary table
    }
    dtype = table_of(model.get_input_embeddings())[0]
    return fill(draft, {k: v.to(dtype) if v.is_floating_point() else v for k, v in ours.items()}, str(folder))


def load_eagle3(folder: Path, tensors: dict[str, Tensor], model: nn.Module) -> Eagle3Draft:
    """The EAGLE-3 checkpoint `tensors` in `folder`, for `model`; one sentence if it was made for
    another model."""
    config = _eagle3_config(folder)
    text = model.config.get_text_config()
    hidden, layers = text.hidden_size, text.num_hidden_layers
    vocab = model.get_output_embeddings().out_features
    fc, head = tensors.get("fc.weight"), tensors.get("lm_head.weight")
    if fc is None or head is None or any(k.startswith("midlayer.0.") for k in tensors):
        raise UserError(f"{folder} is not an EAGLE-3 drafter of one layer with fc.weight and lm_head.weight.")
    d2t = tensors.get("d2t", torch.zeros(head.shape[0], dtype=torch.long)).to(torch.long)
    t2d = tensors.get("t2d")
    width, target_vocab = config.hidden_size, config.vocab_size
    if (
        width != hidden
        or getattr(config, "target_hidden_size", None) not in (None, hidden)
        or fc.shape[0] != hidden
        or target_vocab != vocab
        or (t2d is not None and t2d.numel() != vocab)
    ):
        raise UserError(
            f"{folder} is an EAGLE-3 drafter for another model (width {width}, vocabulary {target_vocab}); "
            f"this model has width {hidden} and vocabulary {vocab}."
        )
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None) or (
        getattr(config, "eagle_config", None) or {}
    ).get("eagle_aux_hidden_state_layer_ids")
    taps = tuple(sorted({int(t) for t in ids or (2, layers // 2, layers - 3)}))  # read in layer order
    if any(not 0 <= t < layers for t in taps) or len(taps) * hidden != fc.shape[1]:
        raise UserError(
            f"{folder} is an EAGLE-3 drafter for another model: its fc reads {fc.shape[1] // hidden} layers "
            f"and it taps layers {list(taps)}; this model has {layers}."
        )
    targets = torch.arange(d2t.numel()) + d2t  # draft id i is the target's i + d2t[i]
    if d2t.numel() != head.shape[0] or targets.min() < 0 or targets.max() >= vocab:
        raise UserError(f"{folder} maps its draft vocabulary (d2t) outside this model's {vocab} tokens.")
    draft = Eagle3Draft(model, config, taps, bool(getattr(config, "norm_before_residual", False)))
    ours = {"fc.weight": fc, "norm.weight": tensors.get("norm.weight"), "lm_head.weight": head, "vocab": targets}
    ours |= {k: v for k, v in tensors.items() if k.startswith("midlayer.") and not k.endswith("inv_freq")}
    dtype = table_of(model.get_input_embeddings())[0]
    cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ours.items() if v is not None}
    fill(draft, cast, str(folder))  # in place: the draft, moved to the backbone's device
    return draft


def _eagle3_config(folder: Path) -> LlamaConfig:
    """The draft layer's shape, from the checkpoint's config.json."""
    from transformers import LlamaConfig

    try:
        fields = json.loads((folder / "config.json").read_text())
        config = LlamaConfig(**{k: v for k, v in fields.items() if k not in ("architectures", "model_type")})
        config.draft_vocab_size = fields.get("draft_vocab_size")
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise UserError(f"{folder} is an EAGLE-3 drafter without a readable config.json ({type(e).__name__}).") from e
    return config
