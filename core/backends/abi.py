"""The kernel library's C functions as ctypes calls them: their argument and result types, declared
once per load (`core.backends.q4` builds and loads the library)."""

from __future__ import annotations

import ctypes
from pathlib import Path


def load(path: Path, version: int) -> ctypes.CDLL:
    """The library at `path` with its functions' C signatures declared (OSError: not that version)."""
    lib = ctypes.CDLL(str(path))
    lib.q4_version.restype = ctypes.c_int
    if lib.q4_version() != version:
        raise OSError(f"it is version {lib.q4_version()}, not {version}")
    lib.q4_quantize.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    lib.q4_quantize.argtypes += [ctypes.c_void_p] * 4
    lib.q4_quantize.restype = None
    lib.q4_run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p]
    lib.q4_run.argtypes += [ctypes.c_int64, ctypes.c_void_p]
    lib.q4_run.restype = ctypes.c_int
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.q4_attention.argtypes = [ctypes.c_int, ctypes.c_int, i64, i64, i64, i64, i64, ptr, i64, ptr, ptr, i64, ptr]
    lib.q4_attention.argtypes += [ctypes.c_float, ptr]
    lib.q4_attention.restype = ctypes.c_int
    lib.q4_rmsnorm.argtypes = [ctypes.c_int, i64, i64, ptr, i64, ptr, ctypes.c_int, ctypes.c_float, ptr]
    lib.q4_rmsnorm.restype = None
    lib.q4_kv8_store.argtypes, lib.q4_kv8_store.restype = [ptr, i64, ptr], None
    lib.q4_argmax.argtypes, lib.q4_argmax.restype = [ctypes.c_int, ctypes.c_int, i64, i64, ptr, i64, ptr], None
    lib.q4_top.argtypes = [ctypes.c_int, ctypes.c_int, i64, i64, ptr, i64, i64, ptr, ptr, ptr]
    lib.q4_top.restype = ctypes.c_int
    lib.q4_pack4.argtypes, lib.q4_pack4.restype = [ptr, i64, i64, ptr], None
    lib.q4_pack_nibbles.argtypes, lib.q4_pack_nibbles.restype = [ptr, i64, i64, i64, i64, i64, ctypes.c_int, ptr], None
    lib.q4_pack_high.argtypes, lib.q4_pack_high.restype = lib.q4_pack_nibbles.argtypes, None
    lib.q4_decode.argtypes = [ptr, ctypes.c_int, ctypes.c_int, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64]
    lib.q4_decode.argtypes += [ptr, i64, ptr]
    lib.q4_decode.restype = ctypes.c_int
    lib.q4_amx.argtypes = lib.q4_amx_attention.argtypes = []
    lib.q4_amx.restype = lib.q4_amx_attention.restype = ctypes.c_int
    lib.q4_avx_vnni.argtypes = [ctypes.c_int]
    lib.q4_avx_vnni.restype = ctypes.c_int
    lib.q4_rows8.argtypes, lib.q4_rows8.restype = [ptr, ptr, i64, ptr], ctypes.c_int
    lib.q4_split.argtypes, lib.q4_split.restype = [], ctypes.c_int64
    lib.q4_prefetch_l2.argtypes, lib.q4_prefetch_l2.restype = [ctypes.c_int], ctypes.c_int
    return lib
