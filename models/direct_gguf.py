"""A GGUF file as a `models.direct.TensorSource`: its tensors read one at a time, dequantized to
float32 and given transformers' names and orientation.

What each tensor becomes is transformers' GGUF loader's own logic, reused rather than re-derived:
its name map (`get_gguf_hf_weights_map`) and its per-architecture processing (llama.cpp's q/k
row permutation reversed for Llama-family attention, Gemma's norms shifted...), applied to one
dequantized tensor at a time instead of the whole model. The tensor table is read without the
vocabulary (`models.headers`' reader), and tensors with plain reads at their offsets: neither the
file nor a float32 copy of the model is ever in memory.
"""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor

from core.backends import q4
from models.headers import _U32, _U64, _Cursor

WIDE = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"}  # quantized to over 4.5 bits a weight by choice
KEPT = {"Q4_1"}  # the type whose blocks the int4 layers hold as they are (a step and a minimum per 32, 16 levels)
_TYPED = {  # tensor types stored as plain numbers (the rest are blocks of bytes)
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
    gguf.GGMLQuantizationType.F64: np.float64,
}


@dataclass(frozen=True)
class Entry:
    kind: gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUFReader shapes its data: numbers, or rows of block bytes
    offset: int  # from the file's start
    length: int  # bytes


def tensor_table(path: Path) -> tuple[dict, dict[str, Entry]]:
    """A GGUF file's scalar metadata and its tensors by name (ValueError where the table does not
    read or a tensor lies past the file's end)."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        c = _Cursor(buf)
        c.pos = 8  # magic and version
        n_tensors, n_kv = c.take(_U64), c.take(_U64)
        meta = {}
        for _ in range(n_kv):
            key = c.string()
            meta[key] = c.value(c.take(_U32))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            dims = [c.take(_U64) for _ in range(c.take(_U32))]
            infos.append((name, dims, c.take(_U32), c.take(_U64)))
        align = meta.get("general.alignment") or gguf.GGUF_DEFAULT_ALIGNMENT
        start, size = -(-c.pos // align) * align, len(buf)
    table = {}
    for name, dims, kind, offset in infos:
        entry = _entry(gguf.GGMLQuantizationType(kind), dims, start + offset)
        if entry.offset + entry.length > size:
            raise ValueError(f"its tensor {name} lies past the file's end (truncated)")
        table[name] = entry
    return meta, table


def _entry(kind: gguf.GGMLQuantizationType, dims: list[int], offset: int) -> Entry:
    """Where a tensor lies and how GGUFReader would shape it (see its `_build_tensors`)."""
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    count = int(np.prod(dims)) if dims else 1
    shape = tuple(reversed(dims))
    if kind not in _TYPED:
        shape = gguf.quant_shape_to_byte_shape(shape, kind)
    return Entry(kind, shape, offset, count * type_size // block)


class GgufFile:
    """The tensors of the GGUF file at `path` for `model` (a skeleton of the file's config)."""

    def __init__(self, path: Path, model, chunk: int = 16 << 20) -> None:
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
        )

        self.path, self.chunk = path, chunk  # chunk: float32 bytes of a large tensor dequantized at a time
        meta, self.table = tensor_table(path)
        self.config = model.config.to_dict()
        architecture = str(meta.get("general.architecture"))
        self.processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=self.config)
        self.mapping = get_gguf_hf_weights_map(_Names(model), self.processor)  # GGUF name → transformers name
        self.by_name = {ours: theirs for theirs, ours in self.mapping.items() if theirs in self.table}
        self.file = path.open("rb")

    def names(self) -> list[str]:
        return list(self.by_name)

    def read(self, name: str, dtype: torch.dtype) -> Tensor:
        """The tensor `name` in `dtype`: dequantized, processed as transformers' loader does it; a
        large one a part of its rows at a time, where the processing leaves it as it is."""
        theirs = self.by_name[name]
        entry = self.table[theirs]
        rows = entry.shape[0] if len(entry.shape) > 1 else 1
        columns = (
            int(
                np.prod(
                    gguf.quant_shape_from_byte_shape(entry.shape, entry.kind)
                    if entry.kind not in _TYPED
                    else entry.shape
                )
            )
            // rows
        )
        step = max(1, self.chunk // (4 * columns))  # rows whose float32 values take `chunk` bytes
        out = None
        for start in range(0, rows, step):
            stop = min(rows, start + step)
            part = self._rows(entry, theirs, start, stop)
            if out is None:
                done = self.processor.process(
                    weights=part, name=theirs, tensor_key_mapping=self.mapping, parsed_parameters={"tensors": {}}
                )
                if done.name != theirs:
                    raise KeyError(name)  # a tensor transformers' loader renames or splits (not served)
                if stop == rows:
                    return torch.from_numpy(np.ascontiguousarray(done.weights)).to(dtype)
                if done.weights is not part:  # processing changes it: the whole tensor processed at once
                    return self._processed(self._rows(entry, theirs, 0, rows), theirs).to(dtype)
                out = torch.empty((rows, *part.shape[1:]), dtype=dtype)
            out[start:stop] = torch.from_numpy(part)
        return out

    def _processed(self, weights: np.ndarray, theirs: str) -> Tensor:
        done = self.processor.process(
            weights=weights, name=theirs, tensor_key_mapping=self.mapping, parsed_parameters={"tensors": {}}
        )
        return torch.from_numpy(np.ascontiguousarray(done.weights))

    def _rows(self, entry: Entry, theirs: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a tensor (all of a one-row tensor), dequantized to float32."""
        rows = entry.shape[0] if len(entry.shape) > 1 else 1
        row = entry.length // rows
        raw = np.empty((stop - start) * row, dtype=np.uint8)
        if os.preadv(self.file.fileno(), [raw], entry.offset + start * row) != raw.nbytes:
            raise OSError(f"{self.path} ends inside its tensor {theirs} (truncated)")
        shape = (stop - start, *entry.shape[1:]) if len(entry.shape) > 1 else entry.shape
        data = raw.view(_TYPED.get(entry.kind, np.uint8)).reshape(shape)
        return gguf.quants.dequantize(data, entry.kind)

    def requantized(self, names: list[str]) -> list[str]:
        """The tensor types of these weights that 4-bit layers do not take as they are."""
        kinds = {self.table[self.by_name[n]].kind.name for n in names if n in self.by_name}
        return sorted(kinds - KEPT)

    def layer_kernel(self, names: list[str], kernel: str) -> str:
        """The kernel the layers run with: the library's 8-bit one instead of its 4-bit one where
        most of these weights are wider than 4 bits in the file (Gemma's Q4_K_M files are mostly
        Q5_0 and Q8_0): 4 bits would lose what they hold (top-1 agreement with the file's exact
        logits fell to ~70 % on google/gemma-3-270m's; 8 bits keep ~98 %). That holds whichever
        4-bit kernel was measured fastest here (torch's int4 or the library's q4), wherever the
        library runs."""
        kinds = [self.table[self.by_name[n]].kind.name for n in names if n in self.by_name]
        wide = sum(kind in WIDE for kind in kinds)
        four_bit = kernel in ("q4", "int4") and q4.library() is not None
        return "q8" if four_bit and kinds and wide > len(kinds) / 2 else kernel

    def close(self) -> None:
        self.file.close()


class _Names:
    """What `get_gguf_hf_weights_map` reads of a model, without the children it would map again one
    by one (seconds for a small model; Llama-family names all map at the top)."""

    def __init__(self, model) -> None:
        self.config, self.keys = model.config, list(model.state_dict())

    def state_dict(self) -> dict:
        return dict.fromkeys(self.keys)

    def named_children(self) -> list:
        return []


def say_requantized(path: Path, kinds: list[str], kernel: str = "q4") -> None:
    """One line on stderr where the file's layer weights are of types the layers hold otherwise."""
    if kinds:
        form = (
            "8-bit (groups of 32, a step each)" if kernel == "q8" else "4-bit (groups of 32, a step and a minimum each)"
        )
        print(
            f"note: {path.name}'s {', '.join(kinds)} layer weights run as {form}; --quantization none keeps "
            "them as they are.",
            file=sys.stderr,
        )
