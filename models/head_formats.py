"""Every published Medusa head layout, detected from the files and read into one key layout.

The canonical keys are FasterDecoding's: `{head}.{layer}.linear.weight`, `{head}.{layer}.linear.bias`
and, for a head with its own vocabulary projection, `{head}.{layers}.weight`.

- medusa-chat, TGI (V1 and V2) and Medusa v2: `medusa_lm_head.safetensors`, canonical keys
  (no projection when the heads share the backbone's lm_head);
- FasterDecoding legacy: `medusa_lm_head.pt`, a pickled state dict with canonical keys;
- FasterDecoding "medusa-1.0": full checkpoint shards (`*.safetensors` or `*.bin`) next to the
  fine-tuned backbone, keys `medusa_head.` + canonical.

Pickles are read with `torch.load(weights_only=True)` only: a file that needs arbitrary
unpickling is refused.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor

from core.errors import UserError

SAFETENSORS = "medusa_lm_head.safetensors"
PICKLE = "medusa_lm_head.pt"
PREFIX = "medusa_head."
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def read_head_tensors(folder: Path) -> tuple[dict[str, Tensor], str]:
    """Canonical head tensors from `folder`, and the name of the layout they were found in."""
    if (folder / SAFETENSORS).is_file():
        return _strip(_load_safetensors(folder / SAFETENSORS)), "safetensors"
    if (folder / PICKLE).is_file():
        return _strip(_load_pickle(folder / PICKLE)), "legacy .pt"
    shards = _checkpoint_shards(folder)
    if shards:
        tensors: dict[str, Tensor] = {}
        for shard in shards:
            tensors |= _heads_from_shard(shard)
        if tensors:
            return _strip(tensors), "full checkpoint"
    raise UserError(
        f"No Medusa heads in {folder}: expected {SAFETENSORS}, {PICKLE}, or checkpoint shards with '{PREFIX}' tensors."
    )


def _strip(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k.removeprefix(PREFIX): v for k, v in tensors.items()}


def _load_safetensors(file: Path) -> dict[str, Tensor]:
    try:
        return load_file(file)
    except Exception as e:  # safetensors raises several types for a damaged file
        raise UserError(f"The heads file {file} is damaged ({e}); download or train it again.") from e


def _load_pickle(file: Path) -> dict[str, Tensor]:
    try:
        data = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise UserError(
            f"{file} needs arbitrary code to unpickle, which medusa-chat refuses; use a safetensors copy."
        ) from e
    except (RuntimeError, EOFError, OSError) as e:
        raise UserError(f"The heads file {file} is damaged ({e}); download it again.") from e
    if not isinstance(data, dict) or not all(isinstance(v, Tensor) for v in data.values()):
        raise UserError(f"{file} is not a state dict of tensors; it is not a Medusa heads file.")
    return dict(data)


def _checkpoint_shards(folder: Path) -> list[Path]:
    """Shards that may hold `medusa_head.*` tensors: those the index names for them, else all."""
    for name in INDEXES:
        index = folder / name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise UserError(f"{index} is not a readable checkpoint index ({e}).") from e
            return sorted({_inside(folder, f, index) for k, f in weight_map.items() if k.startswith(PREFIX)})
    return sorted(folder.glob("*.safetensors")) + sorted(folder.glob("pytorch_model*.bin"))


def _inside(folder: Path, name: object, index: Path) -> Path:
    """A shard named by an index, refused unless it is a file name inside `folder`."""
    path = folder / str(name)
    if not isinstance(name, str) or Path(name).is_absolute() or not path.resolve().is_relative_to(folder.resolve()):
        raise UserError(f"{index} names the shard {name!r} outside its folder; the checkpoint is not usable.")
    return path


def _heads_from_shard(shard: Path) -> dict[str, Tensor]:
    if shard.suffix == ".safetensors":
        try:
            with safe_open(shard, framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys() if k.startswith(PREFIX)}  # noqa: SIM118
        except Exception as e:
            raise UserError(f"The checkpoint shard {shard} is damaged ({e}); download it again.") from e
    # mmap: only the head tensors are read from a multi-GB shard
    return {k: v for k, v in _load_pickle(shard).items() if k.startswith(PREFIX)}
