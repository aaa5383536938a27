"""Reading model files' headers without their weights: a GGUF file's key-value section and tensor
table, a safetensors file's JSON header.

Not the `gguf` package's `GGUFReader`, which parses every token of the vocabulary into arrays
(2 s for the embedded model's 49k tokens, more for a 150k vocabulary): this skips arrays and reads
the scalars and the tensor table (~30 ms for the embedded file), and checks the tensors' extent
against the file's size. Whatever cannot be read raises `Unreadable` with one sentence why.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import gguf

_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SCALARS = {  # GGUF value type → struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
MAX_ARRAY = 4_000_000  # items in a metadata array (vocabularies are under 300k): more is a damaged header
_BLOCKS = {t.value: size for t, size in gguf.GGML_QUANT_SIZES.items()}  # tensor type → (block, bytes per block)
_FILE_TYPES = {t.value: t.name.removeprefix("MOSTLY_").removeprefix("ALL_") for t in gguf.LlamaFileType}
_headers: dict[tuple, dict] = {}  # (path, size, mtime) → header: a file is read once per process


class Unreadable(Exception):
    """A file that cannot be listed as a model; its message is the one sentence why."""


class _Cursor:
    """Little-endian reads over a memory-mapped file; reading past its end is truncation."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def take(self, fmt: struct.Struct):
        self.need(fmt.size)
        (value,) = fmt.unpack_from(self.buf, self.pos)
        self.pos += fmt.size
        return value

    def need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise Unreadable("the file ends inside its header (truncated or damaged).")

    def string(self) -> str:
        n = self.take(_U64)
        self.need(n)
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", "replace")

    def value(self, kind: int):
        """A value of this GGUF type; arrays are skipped (None)."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take(_U32), self.take(_U64)
            if item in _SCALARS:
                self.need(count * struct.calcsize(_SCALARS[item]))
                self.pos += count * struct.calcsize(_SCALARS[item])
                return None
            self.need(count * 8)  # a string or an array takes 8 bytes at least: no loop of damaged length
            if count > MAX_ARRAY:
                raise Unreadable(f"its header is damaged (an array of {count:,} items).")
            for _ in range(count):
                if item == _STRING:
                    n = self.take(_U64)
                    self.pos += n
                else:
                    self.value(item)
            self.need(0)
            return None
        if kind not in _SCALARS:
            raise Unreadable(f"its header is damaged (unknown value type {kind}).")
        return self.take(struct.Struct(_SCALARS[kind]))


def check_opening(size: int, head: bytes) -> None:
    """Unreadable with its sentence where a file of `size` bytes whose first bytes are `head` cannot
    be a GGUF file (both readers of a header check so: `read_gguf`, `direct_gguf.tensor_table`)."""
    if size == 0:
        raise Unreadable("the file is empty.")
    if head[:4] != b"GGUF":
        raise Unreadable("it is not a GGUF file.")


def read_gguf(path: Path) -> dict:
    """A GGUF file's header: its scalar metadata, parameter count and dominant tensor type, checked
    against the file's size. Raises Unreadable with one sentence where the file cannot be listed as a model."""
    with path.open("rb") as f:
        st = os.fstat(f.fileno())
        key = (str(path), st.st_size, st.st_mtime_ns)
        if key in _headers:
            return _headers[key]
        check_opening(st.st_size, f.read(4))
        if st.st_size < 24:
            raise Unreadable("the file is truncated (it ends inside its header).")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _headers[key] = _parse(_Cursor(buf), len(buf))
    return _headers[key]


def _parse(c: _Cursor, file_size: int) -> dict:
    c.pos = 4
    version = c.take(_U32)
    if version not in (2, 3):
        raise Unreadable(f"GGUF version {version} is not supported (2 and 3 are).")
    n_tensors, n_kv = c.take(_U64), c.take(_U64)
    if n_tensors > 1_000_000 or n_kv > 1_000_000:
        raise Unreadable("its header is damaged (impossible counts).")
    meta = {}
    for _ in range(n_kv):
        key = c.string()
        meta[key] = c.value(c.take(_U32))
    params, by_type, end = 0, {}, 0
    for _ in range(n_tensors):
        c.string()
        dims = [c.take(_U64) for _ in range(c.take(_U32))]
        kind, offset = c.take(_U32), c.take(_U64)
        count = 1
        for d in dims:
            count *= d
        block, type_size = _BLOCKS.get(kind, (0, 0))
        if not block:
            raise Unreadable(f"its tensor type {kind} is unknown.")
        nbytes = count // block * type_size
        params, end = params + count, max(end, offset + nbytes)
        by_type[kind] = by_type.get(kind, 0) + nbytes
    align = meta.get("general.alignment") or gguf.GGUF_DEFAULT_ALIGNMENT
    data_start = -(-c.pos // align) * align
    if data_start + end > file_size:
        raise Unreadable(
            f"the file is truncated ({file_size:,} of the {data_start + end:,} bytes its header describes)."
        )
    dominant = max(by_type, key=by_type.get) if by_type else None
    return {"meta": meta, "parameters": params, "dominant": dominant}


def quantization(header: dict) -> str:
    file_type = header["meta"].get("general.file_type")
    if isinstance(file_type, int) and (file_type & ~1024) in _FILE_TYPES:  # 1024: llama.cpp's "guessed" flag
        return _FILE_TYPES[file_type & ~1024]
    return gguf.GGMLQuantizationType(header["dominant"]).name if header["dominant"] is not None else ""


def safetensors_parameters(path: Path) -> int:
    """The parameters in one safetensors file, from its JSON header; Unreadable where it is damaged."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n <= 0 or 8 + n > size:
            raise Unreadable(f"{path.name} is truncated or not a safetensors file.")
        try:
            tensors = json.loads(f.read(n))
        except ValueError:
            raise Unreadable(f"{path.name} has a damaged header.") from None
    tensors.pop("__metadata__", None)
    count, end = 0, 0
    for t in tensors.values():
        n_items = 1
        for d in t["shape"]:
            n_items *= d
        count, end = count + n_items, max(end, t["data_offsets"][1])
    if 8 + n + end > size:
        raise Unreadable(f"{path.name} is truncated.")
    return count
