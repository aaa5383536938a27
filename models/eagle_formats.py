"""Published EAGLE drafters (the SafeAILab/EAGLE project's `yuhuili/EAGLE-*` checkpoints) read
into `core.drafters.eagle.EagleDraft`, through the same hub code as heads.

EAGLE-1/2 checkpoints (`config.json` + `pytorch_model.bin` or `model.safetensors`) hold
`fc.{weight,bias}` over [token embedding; feature] and one decoder layer `layers.0.*` without
an input norm; the feature is the backbone's last hidden state after its final norm (what the
project's decode step returns) and the layer's output is read out by the backbone's lm_head
directly. That maps onto `EagleDraft(input_norm=False, output_norm=False)` over the whole
vocabulary, with fc's two halves swapped to the project's [feature; embedding] order.

EAGLE-3 checkpoints (`midlayer.*`, `d2t`) read three of the backbone's layers at once and are
refused with one sentence. Pickles load with `torch.load(weights_only=True)` only.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn

from core.drafters.eagle import EagleDraft, fill
from core.errors import UserError

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
    """An EAGLE-1/2 checkpoint in `folder`, for `model` (its backbone)."""
    tensors = read_tensors(folder)
    if "d2t" in tensors or any(k.startswith("midlayer.") for k in tensors):
        raise UserError(
            f"{folder} is an EAGLE-3 drafter, which reads three of the backbone's layers at once; "
            "this version drafts with EAGLE-1/2 checkpoints and its own (`train-drafter --kind eagle`)."
        )
    if any(k.startswith("layers.1.") for k in tensors):
        raise UserError(f"{folder} has more than one draft layer; EAGLE-1/2 drafters have one.")
    hidden = model.config.get_text_config().hidden_size
    fc = tensors.get("fc.weight")
    if fc is None or tuple(fc.shape) != (hidden, 2 * hidden):
        shape = "no fc.weight" if fc is None else f"fc.weight {tuple(fc.shape)}"
        raise UserError(f"{folder} is not an EAGLE drafter for this model ({shape}; width {hidden} expected).")
    vocab = model.get_output_embeddings().weight.shape[0]
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
    dtype = model.get_input_embeddings().weight.dtype
    return fill(draft, {k: v.to(dtype) if v.is_floating_point() else v for k, v in ours.items()}, str(folder))
