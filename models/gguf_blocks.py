"""A GGUF file's quantized blocks in the form the kernel library's layers hold them
(`q4.Packed.put_blocks`), decoded without a float copy of the weight on the way.

- Q8_0 (w = d·q, q int8): 8-bit, as they are; Q4_0 and Q5_0 (w = d·(q − 8), d·(q − 16)) as 8-bit
  too, exactly (q − 8 or q − 16 and the step d), where the layers run at 8 bits (Gemma's files).
- Q4_0 (w = d·(q − 8)) and Q4_1 (w = d·q + m): 4-bit, q in [0, 15] as they are, the step d and
  the minimum −8d or m (float16, as the file's): the file's weights exactly. Dequantizing them
  and quantizing again per group (step = range / 15) moved most of a Q4_0 file's weights (a
  group rarely spans all 16 levels: 6.4 % relative RMS error, about Q4_0's own error again).
- Q4_K (256-weight blocks of eight 32-weight groups, w = d·sc·q − dmin·m with 6-bit sc and m):
  4-bit, q, sc and m as they are, d and −dmin per block: the file's weights exactly, in about the
  file's bytes (0.578 a weight against its 0.5625; a float16 step and minimum per group took 0.625,
  and rounded d·sc to float16: each weight within 2⁻¹¹ of its group's range of the file's value).

- Q5_0, Q5_1 and Q5_K (Q4_0, Q4_1 and Q4_K's forms with a fifth bit a value, w = d·(q − 16),
  d·q + m, d·sc·q − dmin·m, q in [0, 31]): 5-bit, as the 4-bit forms above (q mod 16, Q5_0's
  minimum −16d) plus the fifth bits (`FifthBits`): the file's weights exactly, in 0.75 bytes a
  weight (Q5_K 0.70; 8-bit layers took 1.06). 4-bit blocks go into 5-bit layers as they are.

Other types and forms (Q6_K, F16…; Q4_1, Q4_K, Q5_1 and Q5_K into 8-bit layers, whose groups
have no minimum) are dequantized and quantized again (`models.direct_gguf`).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch
from torch import Tensor

Kind = gguf.GGMLQuantizationType
FOUR, FIVE = (Kind.Q4_0, Kind.Q4_1, Kind.Q4_K), (Kind.Q5_0, Kind.Q5_1, Kind.Q5_K)
FORMS = {(Kind.Q8_0, 8), (Kind.Q4_0, 8), (Kind.Q5_0, 8)} | {(k, 4) for k in FOUR} | {(k, 5) for k in FOUR + FIVE}
# (type, bits of the layers) whose blocks the layers take as they are
# a block's bytes, those before its 4-bit values, and whether those lie in runs (see `Nibbles`)
LAYOUT = {Kind.Q4_0: (18, 2, 0), Kind.Q4_1: (20, 4, 0), Kind.Q4_K: (144, 16, 1)}
LAYOUT |= {Kind.Q5_0: (22, 6, 0), Kind.Q5_1: (24, 8, 0), Kind.Q5_K: (176, 48, 1)}
HIGH = {Kind.Q5_0: 2, Kind.Q5_1: 4, Kind.Q5_K: 16}  # where a 5-bit block's fifth bits begin (see `FifthBits`)


@dataclass(frozen=True)
class Nibbles:
    """A file's 4-bit values as its blocks hold them ((rows, a row's bytes) of `raw`): laid out by
    the library (`pack`, in one pass on every core) rather than first unpacked to a byte a weight
    (1.3 of a 1.7B file's 7-second load). Q4_0 and Q4_1 hold a group's value i in the low nibble of
    its byte i and 16 + i in the high one; Q4_K holds groups 2c and 2c + 1 in the low and high
    nibbles of a run of 32 bytes."""

    raw: np.ndarray
    kind: Kind
    shape: tuple[int, int]  # (rows, K), as the values unpacked
    dtype = torch.uint8  # as the values unpacked

    def pack(self, lib, out: int) -> None:
        """Lay the values out at `out` (`q4.Packed`'s bytes of the first row), with the library `lib`."""
        block, head, runs = LAYOUT[self.kind]
        lib.q4_pack_nibbles(self.raw.ctypes.data, *self.shape, self.raw.shape[1], block, head, runs, out)

    def unpacked(self) -> Tensor:
        """(rows, K) uint8 in [0, 15]: the values, a byte each."""
        block, head, runs = LAYOUT[self.kind]
        blocks = self.raw.reshape(self.shape[0], -1, block)[..., head:]
        return _torch(_nibbles(blocks.reshape(*blocks.shape[:2], 4, 32) if runs else blocks).reshape(self.shape))


@dataclass(frozen=True)
class FifthBits:
    """A file's 5-bit blocks' fifth bits ((rows, a row's bytes) of `raw`), laid out by the library
    (`pack`: `q4gemm.c`'s q4_pack_high). Q5_0 and Q5_1 hold value i's in bit i of a 32-bit word;
    Q5_K group g's value i's in bit g of byte i of 32."""

    raw: np.ndarray
    kind: Kind
    shape: tuple[int, int]  # (rows, K)

    def pack(self, lib, out: int) -> None:
        """Lay the bits out at `out` (`q4.Packed`'s fifth bits of the first row), with the library `lib`."""
        block, _, runs = LAYOUT[self.kind]
        lib.q4_pack_high(self.raw.ctypes.data, *self.shape, self.raw.shape[1], block, HIGH[self.kind], runs, out)


def decode(kind: Kind, raw: np.ndarray, bits: int) -> tuple:
    """(rows, a row's bytes) uint8 of blocks of `kind` → in the form of `bits`-bit layers ((kind,
    bits) one of `FORMS`): for 8 bits (rows, K) int8 q and (rows, K/32) float16 steps; for 4 bits
    q as `Nibbles`, float16 steps and minimums (w = step·q + minimum per 32 weights; Q4_K's per 256
    weights, and uint8 multipliers of each per 32: `q4.Packed.put_blocks`); for 5 bits the same
    (None where the form has no multipliers) and, for 5-bit kinds, their `FifthBits`."""
    rows = raw.shape[0]
    if bits == 8:
        return _eight(kind, raw)
    raw = np.ascontiguousarray(raw)
    block, _, _ = LAYOUT[kind]
    shape = (rows, raw.shape[1] // block * (256 if kind in (Kind.Q4_K, Kind.Q5_K) else 32))
    q = Nibbles(raw, kind, shape)
    if kind in (Kind.Q4_K, Kind.Q5_K):
        steps = _q4_k_steps(raw.reshape(rows, -1, block))
    else:
        blocks = raw.reshape(rows, -1, block)
        step = blocks[..., :2].view(np.float16)[..., 0]
        offset = {Kind.Q4_0: -8, Kind.Q5_0: -16}.get(kind)  # symmetric forms' minimum: −8d, −16d
        low = (
            (step.astype(np.float32) * offset).astype(np.float16)
            if offset
            else blocks[..., 2:4].view(np.float16)[..., 0]
        )
        steps = (_torch(step), _torch(low), None)
    if bits == 4:
        return (q, *steps) if kind == Kind.Q4_K else (q, *steps[:2])
    return q, *steps, FifthBits(raw, kind, shape) if kind in HIGH else None


def _eight(kind: Kind, raw: np.ndarray) -> tuple[Tensor, Tensor]:
    """Q8_0 (a float16 step, 32 int8), Q4_0 (a step, 16 bytes of nibbles) or Q5_0 (a step, 32 fifth
    bits, 16 bytes of nibbles) blocks → int8 q (the values less their offset) and the steps."""
    rows = raw.shape[0]
    width = {Kind.Q8_0: 34, Kind.Q4_0: 18, Kind.Q5_0: 22}[kind]
    blocks = raw.reshape(rows, -1, width)
    step = _torch(blocks[..., :2].view(np.float16)[..., 0])
    if kind == Kind.Q8_0:
        return _torch(blocks[..., 2:].view(np.int8).reshape(rows, -1)), step
    q = _nibbles(blocks[..., width - 16 :]).view(np.int8)
    if kind == Kind.Q5_0:
        high = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32) >> np.arange(32, dtype=np.uint32)
        q |= ((high & 1) << 4).astype(np.int8)
    return _torch((q - (16 if kind == Kind.Q5_0 else 8)).reshape(rows, -1)), step


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """(…, width) bytes → (…, 2·width) values: the low nibbles in order, then the high ones."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _q4_k_steps(blocks: np.ndarray) -> tuple[Tensor, Tensor, Tensor]:
    """(rows, n, 144 or 176) Q4_K or Q5_K blocks (d, dmin float16, 12 bytes of 6-bit scales and
    minimums, then the values) → (rows, n) float16 d and −dmin, and (rows, 8n, 2) uint8 each group's
    scale and minimum."""
    rows, n = blocks.shape[:2]
    d = blocks[..., 0:2].view(np.float16)[..., 0]
    dmin = blocks[..., 2:4].view(np.float16)[..., 0]
    scale, least = gguf.quants.Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    multipliers = np.stack([scale.reshape(rows, n * 8), least.reshape(rows, n * 8)], axis=-1).astype(np.uint8)
    return _torch(d), _torch(-dmin), _torch(multipliers)


def _torch(a: np.ndarray) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))
