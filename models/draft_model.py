"""Loading a draft model for a target: any model of the target's tokenizer (a catalog id, a hub
repo, a folder), or `self`, the target's own weights in 4 bits, on the fastest kernels here."""

from __future__ import annotations

from core.backends import lean
from core.drafters.draft_model import DraftModel
from core.errors import UserError
from models.loader import Backbone, load_backbone, resolve

SELF = "self"  # the target's own weights in the project's 4-bit kernels
FOUR_BIT = ("int4", "q4")  # the lean forward's 4-bit layer kernels: a target already in 4 bits
NO_DRAFT = ("", "none")  # draft model names (any case) that mean none, as None does


def draft_name(name: str | None) -> str | None:
    """A draft model's name as given: stripped; None for none (None, "" or "none")."""
    if name is None or name.strip().lower() in NO_DRAFT:
        return None
    return name.strip()


def load_draft_model(target: Backbone, name: str, on_progress=None) -> DraftModel:
    """The draft model `name` for `target`, on the target's device: in int4 on a CPU where the
    lean forward serves it (else as `--quantization auto` loads it), nf4 on a GPU. One sentence
    (UserError) for a name that does not load, a vocabulary other than the target's, or `self`
    for a target that is already in 4 bits."""
    name = name.strip()
    if not name:
        raise UserError("The draft model's name is empty; give a catalog id, a folder, a .gguf file or self.")
    device = target.backend.device
    if name == SELF:
        if target.backend.layer_kernel in FOUR_BIT or _quantized(target):
            raise UserError(
                f"--draft-model self drafts with {target.name}'s own weights in 4 bits for the model in full "
                "precision, but it already runs in 4 bits; load it with --quantization none to get its "
                "full-precision replies faster."
            )
        spec = resolve(target.name, on_progress)
        label = f"{target.name} in 4 bits"
    else:
        spec = resolve(name, on_progress)
        label = name
    config = _config(spec.folder)
    servable = config is not None and lean.servable(config)
    if name == SELF and device.type == "cpu" and not servable:
        raise UserError(
            f"--draft-model self needs the 4-bit CPU kernels, which serve Llama-family models, not "
            f"{getattr(config, 'model_type', 'this model')}; choose a smaller model of the same tokenizer instead."
        )
    quantization = "int4" if device.type == "cpu" and servable else "auto"
    draft = load_backbone(spec.name, "auto", str(device), quantization, spec=spec, on_progress=on_progress)
    check_vocabulary(target, draft, label)
    return DraftModel(name, draft.backend, len(target.tokenizer))


def check_vocabulary(target: Backbone, draft: Backbone, label: str) -> None:
    """A UserError naming both models unless `draft` reads and writes the target's token ids."""
    mine, theirs = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if mine != theirs:
        differ = sum(theirs.get(token) != i for token, i in mine.items())
        raise UserError(
            f"The draft model {label} has another vocabulary than {target.name} ({len(theirs):,} tokens against "
            f"{len(mine):,}, {differ:,} of the target's with another id); a draft model must share the target's "
            "tokenizer."
        )


def _quantized(target: Backbone) -> bool:
    return bool(getattr(target.model.config, "quantization_config", None)) or getattr(
        target.model, "is_loaded_in_4bit", False
    )


def _config(folder):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError):
        return None  # load_backbone says why, in one sentence
