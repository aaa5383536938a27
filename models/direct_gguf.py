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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import Tensor

from core.backends import q4
from core.backends.lean.packed import BITS
from models import gguf_blocks
from models.headers import _U32, _U64, Unreadable, _Cursor, check_opening

WIDE = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"}  # quantized to over 4.5 bits a weight by choice
SAME = slice(None)  # a tensor's rows in the file's order (`GgufFile._row_order`)
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

    @property
    def elements(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.kind]
        return self.length // type_size * block


def tensor_table(path: Path) -> tuple[dict, dict[str, Entry]]:
    """A GGUF file's scalar metadata and its tensors by name (`Unreadable` with its sentence where
    it is empty, no GGUF file, its header is cut short or a tensor lies past its end)."""
    with path.open("rb") as f:
        check_opening(os.fstat(f.fileno()).st_size, f.read(4))
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
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
            raise Unreadable(f"its tensor {name} lies past the file's end (truncated).")
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
        if self._heads(theirs) is not None:
            return self._processed(entry, theirs, rows, columns, dtype)
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
                if done.weights is not part:  # processing changes it
                    return self._processed(entry, theirs, rows, columns, dtype)
                out = torch.empty((rows, *part.shape[1:]), dtype=dtype)
            out[start:stop] = torch.from_numpy(part)
        return out

    def _processed(self, entry: Entry, theirs: str, rows: int, columns: int, dtype: torch.dtype) -> Tensor:
        """A tensor the processing changes: processed whole, in float32; Llama's q and k (whose
        rows llama.cpp permuted within each head) a block of whole heads at a time, each block
        processed as a tensor of that many heads (a 2,048-row one's float32 copies otherwise stand
        beside the packed layers at a load's peak)."""
        heads = self._heads(theirs)
        if heads is None or rows % heads:
            return self._process(self._rows(entry, theirs, 0, rows), theirs, self.processor).to(dtype)
        per_head = rows // heads
        block = max(1, self.chunk // (4 * columns * per_head))  # heads whose float32 rows take `chunk` bytes
        out = torch.empty((rows, columns), dtype=dtype)
        processors = {}
        for first in range(0, heads, block):
            count = min(block, heads - first)
            if count not in processors:
                config = self.config | {"num_attention_heads": count, "num_key_value_heads": count}
                processors[count] = type(self.processor)(config=config)
            part = self._rows(entry, theirs, first * per_head, (first + count) * per_head)
            out[first * per_head : (first + count) * per_head] = self._process(part, theirs, processors[count])
        return out

    def blocks(self, name: str, bits: int) -> Iterator[tuple] | None:
        """The tensor `name` as its blocks in the form of `bits`-bit layers (`models.gguf_blocks`),
        a part of its rows at a time: each part (first row, then what `q4.Packed.put_blocks` takes),
        a multiple of `q4.TILE` rows; None where the file holds it otherwise, or the processing
        would change its values (Llama's q and k rows, which it only reorders, are reordered)."""
        theirs = self.by_name[name]
        entry = self.table[theirs]
        if (entry.kind, bits) not in gguf_blocks.FORMS or len(entry.shape) != 2 or entry.shape[0] % q4.TILE:
            return None
        rows, row = entry.shape[0], entry.length // entry.shape[0]
        order = self._row_order(theirs, rows)
        if order is None:
            return None
        step = max(q4.TILE, self.chunk // (2 * row) // q4.TILE * q4.TILE)  # rows whose q take < `chunk` bytes

        def parts() -> Iterator[tuple]:
            whole = None if order is SAME else self._bytes(entry, theirs, 0, rows).reshape(rows, row)
            for start in range(0, rows, step):
                stop = min(rows, start + step)
                raw = self._bytes(entry, theirs, start, stop) if whole is None else whole[order[start:stop]]
                yield (start, *gguf_blocks.decode(entry.kind, raw.reshape(stop - start, row), bits))

        return parts()

    def _row_order(self, theirs: str, rows: int):
        """What transformers' processing does to a tensor's values, probed with each row's index:
        `SAME` nothing; an index array where it reorders whole rows (row i of the result is that
        row of the file's); None where it does more."""
        probe = np.arange(rows, dtype=np.float32).reshape(rows, 1)
        try:
            done = self.processor.process(
                weights=probe, name=theirs, tensor_key_mapping=self.mapping, parsed_parameters={"tensors": {}}
            )
        except Exception:  # a processing that takes no such probe: the values are read
            return None
        result = np.asarray(done.weights).reshape(-1)
        if done.name != theirs or result.shape != (rows,):
            return None
        if done.weights is probe or np.array_equal(result, probe[:, 0]):
            return SAME
        order = result.astype(np.int64)
        return order if np.array_equal(np.sort(order), np.arange(rows)) and np.array_equal(order, result) else None

    def _heads(self, theirs: str) -> int | None:
        """The heads of a tensor whose processing permutes rows within each head, else None."""
        from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

        if not isinstance(self.processor, LlamaTensorProcessor):
            return None
        key = "num_attention_heads" if ".attn_q." in theirs else "num_key_value_heads" if ".attn_k." in theirs else None
        return self.config.get(key) if key else None

    def _process(self, weights: np.ndarray, theirs: str, processor) -> Tensor:
        done = processor.process(
            weights=weights, name=theirs, tensor_key_mapping=self.mapping, parsed_parameters={"tensors": {}}
        )
        return torch.from_numpy(np.ascontiguousarray(done.weights))

    def _rows(self, entry: Entry, theirs: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a tensor (all of a one-row tensor), dequantized to float32."""
        raw = self._bytes(entry, theirs, start, stop)
        shape = (stop - start, *entry.shape[1:]) if len(entry.shape) > 1 else entry.shape
        data = raw.view(_TYPED.get(entry.kind, np.uint8)).reshape(shape)
        return gguf.quants.dequantize(data, entry.kind)

    def _bytes(self, entry: Entry, theirs: str, start: int, stop: int) -> np.ndarray:
        """The file's bytes of rows [start, stop) of a tensor (all of a one-row tensor)."""
        row = entry.length // (entry.shape[0] if len(entry.shape) > 1 else 1)
        raw = np.empty((stop - start) * row, dtype=np.uint8)
        if os.preadv(self.file.fileno(), [raw], entry.offset + start * row) != raw.nbytes:
            raise OSError(f"{self.path} ends inside its tensor {theirs} (truncated)")
        return raw

    def requantized(self, kernels: dict[tuple[str, ...], str]) -> list[str]:
        """The tensor types of weights (by the names of fused weights' parts, with their kernel) that
        layers of their kernel do not take as they are: the library's take its bits' blocks
        (`blocks`); torch's int4 kernel quantizes again what it is given, which leaves Q4_1's values
        as they were."""
        changed = set()
        for names, kernel in kernels.items():
            bits = BITS.get(kernel)
            kept = {k.name for k, b in gguf_blocks.FORMS if b == bits} if bits else {"Q4_1"}
            changed |= {kind.name for kind in self._kinds(names)} - kept
        return sorted(changed)

    def group_kernel(self, names: tuple[str, ...], kernel: str) -> str:
        """The kernel of a fused weight (q/k/v, gate/up…; by its parts' names) in layers of `kernel`:
        in 8-bit layers, 4 or 5 bits where each part's blocks go in as they are (Q4_0, Q4_1, Q4_K:
        4; with Q5_0, Q5_1 or Q5_K among them: 5; each the file's weights exactly, in 0.58-0.75
        bytes a weight against 8 bits' 1.06), else `kernel`."""
        kinds = set(self._kinds(names))
        if kernel != "q8" or not names or not all(n in self.by_name for n in names):
            return kernel
        if not kinds <= set(gguf_blocks.FOUR + gguf_blocks.FIVE):
            return kernel
        return "q5" if kinds & set(gguf_blocks.FIVE) else "q4"

    def layer_kernel(self, names: list[str], kernel: str) -> str:
        """The kernel the layers run with: the library's 8-bit one instead of its 4-bit one where
        most of these weights are wider than 4 bits in the file (Gemma's Q4_K_M files are mostly
        Q5_0 and Q8_0): 4 bits would lose what they hold (top-1 agreement with the file's exact
        logits fell to ~70 % on google/gemma-3-270m's; 8 bits keep ~98 %), and each fused weight
        whose parts it holds as they are at 4 or 5 bits then takes those (`group_kernel`). That
        holds whichever 4-bit kernel was measured fastest here (torch's int4 or the library's q4),
        wherever the library runs."""
        kinds = [kind.name for kind in self._kinds(names)]
        wide = sum(kind in WIDE for kind in kinds)
        four_bit = kernel in ("q4", "int4") and q4.library() is not None
        return "q8" if four_bit and kinds and wide > len(kinds) / 2 else kernel

    def _kinds(self, names) -> list[gguf.GGMLQuantizationType]:
        """The tensor types of those of these weights (transformers names) the file holds."""
        return [self.table[self.by_name[n]].kind for n in names if n in self.by_name]

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
