"""Loading a model straight into the lean CPU backend's packed layers, one tensor at a time.

`from_pretrained` followed by `lean.accelerate` holds the whole model in full precision before
packing it: several times the packed size at its peak. Here the model is built on the meta
device (no memory), each weight is read from its file (`TensorSource`: a safetensors folder here,
a GGUF file in `models.direct_gguf`), cast to the activations' dtype and set, and each decoder
layer is packed (`lean.pack_layer`) as soon as its last weight is in: at any time the process
holds the packed layers, one layer in the activations' dtype and one tensor as read. A GGUF
file's Q4_0, Q4_1, Q4_K (4-bit layers), Q8_0, Q5_0 and Q4_0 (8-bit) weights skip the float copy:
their blocks go into the packed layers as they are (`models.gguf_blocks`), the file's own weights.

Otherwise the model is the one `from_pretrained(dtype=...)` then `accelerate` gives, bit for
bit: the same tensors, cast the same way, packed by the same code. Files are read with plain reads, not
memory-mapped, so pages of the file never count in the process's memory.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor, nn

from core import heap
from core.backends import lean
from core.errors import UserError
from models import light

if TYPE_CHECKING:
    from transformers import PreTrainedModel

LAYER = re.compile(r"\.layers\.(\d+)\.")  # a decoder layer's weight, by the index it carries
CHUNK = 8 << 20  # bytes of a large tensor's values read, cast or dequantized at a time
ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class TensorSource(Protocol):
    """Where a model's weights are read from, by their transformers names."""

    def names(self) -> Iterable[str]:
        """The transformers names of the tensors it holds (others it holds are not listed)."""

    def read(self, name: str, dtype: torch.dtype) -> Tensor:
        """The tensor `name` in `dtype`, in the model's orientation (a large one read in parts)."""

    def close(self) -> None:
        """Done reading."""


def needed(model: PreTrainedModel) -> list[str]:
    """The parameters a file must give: all of them, but a tied output layer's (the embedding's)."""
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    output = model.get_output_embeddings()
    if output is not None and _ties(model):
        head = next(n for n, m in model.named_modules() if m is output)
        names = [n for n in names if n != f"{head}.weight"]
    return names


def _ties(model: PreTrainedModel) -> bool:
    return bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))


def covers(model: PreTrainedModel, source: TensorSource) -> bool:
    """Whether `source` holds every parameter `model` needs."""
    return set(needed(model)) <= set(source.names())


def packed_model(
    config, dtype: torch.dtype, kernel: str, head_kernel: str, gguf: Path | None, folder: Path
) -> PreTrainedModel | None:
    """The model of `config` in `dtype`, its decoder layers packed for `kernel` (a tied vocabulary
    for `head_kernel`: `lean.share_vocabulary`), its weights read
    a tensor at a time from the GGUF file `gguf`, else from `folder`'s safetensors files. None
    where they cannot be read so (other files, other names): `from_pretrained` loads them."""
    from models.direct_gguf import GgufFile, say_requantized
    from models.headers import Unreadable

    model = light.skeleton(config, dtype, folder)
    try:
        source = GgufFile(gguf, model, CHUNK) if gguf is not None else folder_source(folder)
    except Unreadable as e:  # its message is the sentence why (as `gguf_files.check` says it)
        raise UserError(f"{gguf} cannot be read: {e}") from e
    except (OSError, ValueError) as e:
        raise UserError(f"{gguf} is damaged or truncated: its tensors do not read ({e}).") from e
    if source is None or not covers(model, source):
        return None
    kernels = None  # each layer's fused weights' kernels by their packed names, where a file sets them
    if gguf is not None:
        kernel = source.layer_kernel(linears(model), kernel)
        groups = fused(model)
        chosen = {names: source.group_kernel(names, kernel) for names in groups}
        say_requantized(gguf, source.requantized(chosen), kernel)
        kernels = [{} for _ in model.base_model.layers]
        for names, (i, packed) in groups.items():
            kernels[i][packed] = chosen[names]
    try:
        fill(model, source, dtype, kernel, head_kernel, kernels)
    except KeyError:
        return None  # a tensor transformers' loader would have renamed or split
    except OSError as e:
        raise UserError(f"The weights of {gguf or folder} do not read ({e}).") from e
    finally:
        source.close()
    heap.give_back()
    return model


def linears(model: PreTrainedModel) -> list[str]:
    """The decoder layers' matrices: what the layer kernel holds."""
    return [name for name, p in model.named_parameters() if LAYER.search(name) and p.dim() == 2]


def fused(model: PreTrainedModel) -> dict[tuple[str, ...], tuple[int, str]]:
    """The decoder layers' fused weights (`lean.GROUPS`: q/k/v, o, gate/up, down), by the names of
    their parts: (the layer, the packed name)."""
    prefixes = {int(m.group(1)): name[: m.end()] for name in linears(model) if (m := LAYER.search(name))}
    return {
        tuple(f"{prefix}{parent}.{one}.weight" for one in parts): (i, packed)
        for i, prefix in prefixes.items()
        for parent, packed, parts in lean.GROUPS
    }


def fill(
    model: PreTrainedModel,
    source: TensorSource,
    dtype: torch.dtype,
    kernel: str,
    head_kernel: str,
    kernels: list[dict[str, str]] | None = None,
) -> None:
    """Set `model`'s parameters (a `skeleton`'s) from `source` in `dtype`, packing each decoder
    layer for `kernel` as its last weight comes in, and a tied vocabulary for `head_kernel` as
    soon as it is in, before the layers (`lean.share_vocabulary`: its dense table then never
    stands beside them; an output layer of its own is left to `lean.accelerate`). Weights whose
    blocks the source holds in the layers' form go in as they are (`_blocks`). `kernels`: each layer's
    fused weights' own kernels by their packed names (`fused`), where they are not `kernel`. Raises KeyError
    naming a parameter `source` lacks."""
    layers = model.base_model.layers
    waiting = {i: sum(1 for _ in layer.parameters()) for i, layer in enumerate(layers)}
    embedding = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    shared = False
    readers = [lean.PackAsRead(layer, kernel, kernels[i] if kernels else None) for i, layer in enumerate(layers)]
    for name in sorted(needed(model), key=_order):
        if name == embedding and (blocks := _blocks(source, name, 8)) is not None:
            shared = lean.share_vocabulary(model, head_kernel, blocks)
            if shared:
                continue  # the table as the file holds it, its dense weight never made
        match = LAYER.search(name)
        reader, leaf = (readers[int(match.group(1))], name[match.end() :]) if match else (None, name)
        bits = reader.bits(leaf) if reader is not None else None
        blocks = _blocks(source, name, bits) if bits else None
        if blocks is None or not reader.take_blocks(leaf, blocks):
            value = source.read(name, dtype)
            if reader is None or not reader.take(leaf, value):
                _put(model, name, value)
            del value  # a packed weight's full-precision copy goes before the next is read
            heap.give_back()  # and its heap: Gemma 3 270M's load peaked ~4 MB lower than a trim a layer
        if name == embedding:
            shared = lean.share_vocabulary(model, head_kernel)
            heap.give_back()
        if match is not None:
            index = int(match.group(1))
            waiting[index] -= 1
            if not waiting[index]:  # the layer's last weight: packed now, its full-precision weights freed
                lean.pack_layer(layers[index], kernel)
                heap.give_back()  # the freed weights' heap, before the next layer fragments it
    if _ties(model) and not shared:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    if left := [name for name, p in model.named_parameters() if p.is_meta]:
        raise KeyError(left[0])


def _blocks(source: TensorSource, name: str, bits: int) -> Iterable | None:
    """The tensor's blocks as `source` holds them, in the form of `bits`-bit layers (a GGUF file's
    `models.gguf_blocks.FORMS`), else None."""
    blocks = getattr(source, "blocks", None)
    return blocks(name, bits) if blocks is not None else None


def _order(name: str) -> tuple[int, str]:
    """Embeddings and other model-wide weights first (while nothing is packed yet: the largest
    tensor's float32 copy then costs least), then layer by layer."""
    match = LAYER.search(name)
    return (int(match.group(1)) if match else -1, name)


def _put(model: nn.Module, name: str, value: Tensor) -> None:
    owner, _, leaf = name.rpartition(".")
    module = model.get_submodule(owner)
    module._parameters[leaf] = nn.Parameter(value, requires_grad=value.is_floating_point())  # as from_pretrained


class SafetensorsFolder:
    """A folder's safetensors files (one, or shards named by model.safetensors.index.json), each
    tensor read with a plain read at its offset."""

    def __init__(self, folder: Path) -> None:
        self.where: dict[str, tuple[Path, str, list[int], int, int]] = {}
        for file in _shards(folder):
            with file.open("rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            header.pop("__metadata__", None)
            for name, entry in header.items():
                start, stop = entry["data_offsets"]
                self.where[name] = (file, entry["dtype"], entry["shape"], 8 + size + start, stop - start)

    def names(self) -> Iterable[str]:
        return [name for name, (_, dtype, *_) in self.where.items() if dtype in ST_DTYPES]

    def close(self) -> None:
        pass  # each read opens its file

    def read(self, name: str, dtype: torch.dtype) -> Tensor:
        file, stored, shape, offset, length = self.where[name]
        out = torch.empty(shape, dtype=dtype)
        if not out.numel():
            return out
        with file.open("rb") as f:
            if ST_DTYPES[stored] == dtype:  # straight into the tensor
                _read_into(f, out, offset, name)
                return out
            rows = out.view(shape[0] if shape else 1, -1)  # cast a part of the rows at a time
            width = length // rows.shape[0]
            step = max(1, CHUNK // width)
            for start in range(0, rows.shape[0], step):
                part = torch.empty((min(step, rows.shape[0] - start), rows.shape[1]), dtype=ST_DTYPES[stored])
                _read_into(f, part, offset + start * width, name)
                rows[start : start + len(part)] = part
        return out


def _read_into(f, tensor: Tensor, offset: int, name: str) -> None:
    """`tensor`'s bytes from the open file `f` at `offset`."""
    view = tensor.view(-1).view(torch.uint8).numpy()
    if os.preadv(f.fileno(), [view], offset) != view.nbytes:
        raise OSError(f"{f.name} ends inside its tensor {name} (truncated)")


def _shards(folder: Path) -> list[Path]:
    """The safetensors files of a transformers folder (none where it has none)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        mapping = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [folder / name for name in dict.fromkeys(mapping.values())]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def folder_source(folder: Path) -> SafetensorsFolder | None:
    """The safetensors weights of `folder`, or None where it has none (or they do not read)."""
    try:
        return SafetensorsFolder(folder) if _shards(folder) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # from_pretrained says what is wrong with them
