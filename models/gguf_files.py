"""GGUF files as models: the file a user points `--model` at (LM Studio's, Ollama's, llama.cpp's),
and the embedded model's, converted once into a transformers folder in the user cache.

The conversion is transformers' GGUF loader (`from_pretrained(..., gguf_file=...)`), which
dequantizes every tensor type the `gguf` package reads and builds the tokenizer and chat
template from the file's metadata; the result is written as float32 safetensors (every GGUF
type dequantizes exactly into float32), into a temporary folder moved into place, so a half-written
conversion is never used. A user's file converts into `models/gguf-<key>`, the key the first 16
hex digits of its SHA-256, computed once and remembered by path, size and modification time. A
conversion whose `config.json` or `model.safetensors` cannot be read is done again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import platformdirs

from core.errors import UserError
from models import gguf_config, gguf_tokenizer

GGUF_MAGIC = b"GGUF"
USER_ERROR = 2  # the describing process's exit status for a file it cannot read (its sentence last on stderr)
INDEX = "gguf-index.json"  # {absolute path: {"size", "mtime_ns", "sha256"}}, in cache_dir()
NOT_CAUSAL = {"general", "tokenizer", "t5", "t5encoder", "umt5"}  # transformers reads them, but no chat model


def cache_dir() -> Path:
    """The user cache folder: conversions, the hash index, kernel choices, step costs."""
    return Path(platformdirs.user_cache_dir("medusa-chat"))


def is_gguf(name: str) -> bool:
    """Whether `--model NAME` names a GGUF file: a path ending .gguf (there or not, so a missing one
    is refused as such), or an existing file that starts as a GGUF file does (Ollama's blobs)."""
    if name.lower().endswith(".gguf"):
        return True
    path = Path(name).expanduser()
    try:
        with path.open("rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:  # not there, a folder, unreadable
        return False


def folder_for(path: Path) -> Path:
    """The transformers folder of the GGUF file at `path`, converted on first use."""
    path = _existing(path)
    return convert(path, folder_of(path), str(path))


def described_folder(path: Path) -> Path:
    """The folder of the GGUF file at `path` with its config, generation config and tokenizer (its
    weights stay in the file: `models.direct_gguf` reads them), written on first use."""
    path = _existing(path)
    return describe(path, folder_of(path))


def folder_of(path: Path) -> Path:
    """Where the GGUF file at `path` is described and, where asked for, converted."""
    return cache_dir() / "models" / f"gguf-{file_key(path)}"


def _existing(path: Path) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"There is no GGUF file at {path}; check the path.")
    return path


def file_key(path: Path) -> str:
    """16 hex digits of the file's SHA-256, hashed once per path, size and modification time."""
    stat = path.stat()
    where = str(path.resolve())
    index = _read_index()
    known = index.get(where)
    if known and known.get("size") == stat.st_size and known.get("mtime_ns") == stat.st_mtime_ns:
        return str(known["sha256"])[:16]
    digest = sha256_of(path)
    index = {k: v for k, v in index.items() if Path(k).is_file()}  # forget files that are gone
    index[where] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
    _write_index(index)
    return digest[:16]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _read_index() -> dict:
    try:
        index = json.loads((cache_dir() / INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: files are hashed again
    return index if isinstance(index, dict) else {}


def _write_index(index: dict) -> None:
    file = cache_dir() / INDEX
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{INDEX}.{os.getpid()}")
        tmp.write_text(json.dumps(index, indent=1), encoding="utf-8")
        tmp.replace(file)
    except OSError:
        pass  # a cache that cannot be written costs a hash at the next launch, nothing else


def is_converted(folder: Path) -> bool:
    """Whether `folder` holds a whole conversion: a readable config.json and model.safetensors."""
    from safetensors import SafetensorError, safe_open

    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        with safe_open(folder / "model.safetensors", framework="pt") as weights:
            weights.keys()  # the header is read whole, and checked against the file's length
    except (OSError, ValueError, SafetensorError):
        return False
    return isinstance(config, dict) and (folder / "tokenizer_config.json").is_file()


def is_described(folder: Path) -> bool:
    """Whether `folder` holds a readable config.json and a tokenizer (a description or a conversion)."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and (folder / "tokenizer_config.json").is_file()


def describe(gguf: Path, target: Path, what: str | None = None) -> Path:
    """`target` with the config, generation config and tokenizer of the GGUF file `gguf`, read from
    its metadata unless they are there already (a damaged description is written again); `what`
    names it in the one progress line."""
    if is_described(target):
        return target
    check(gguf)
    print(f"Reading the tokenizer and config of {what or gguf} (once)…", file=sys.stderr, flush=True)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".describe-"))
    except OSError as e:
        raise UserError(f"The model cache {target.parent} cannot be written ({e.strerror or e}).") from e
    try:
        _write_description(gguf, tmp)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except OSError as e:
        if not is_described(target):  # else another process got there first
            raise UserError(f"The description of {gguf} could not be written ({e.strerror or e}).") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_description(gguf: Path, folder: Path) -> None:
    """`_describe_here`, in a process of its own (`python -m models.gguf_files GGUF FOLDER`):
    transformers' reading of a tokenizer leaves its modules and heap behind (a Llama file's config
    class imports transformers' model-loading machinery: accelerate, torch.distributed, sympy), which
    a launch would keep beside the weights for its whole session: the embedded file's first launch
    peaked ~85 MB higher than its later ones. Its one sentence where the file cannot be read."""
    root = Path(__file__).resolve().parent.parent  # where `models` is, installed or not: the process runs
    # there, so that a `models` package in the user's working folder cannot stand in for ours
    command = [sys.executable, "-m", "models.gguf_files", os.path.abspath(gguf), os.path.abspath(folder)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=root)
    said = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode == USER_ERROR and said:
        raise UserError(said[-1])
    if done.returncode != 0:
        why = said[-1] if said else f"exit status {done.returncode}"
        raise UserError(f"{gguf} could not be read: the reading stopped ({why}).")
    if said:  # transformers' warnings, as they would have been said in this process
        print("\n".join(said), file=sys.stderr)


def _describe_here(gguf: Path, folder: Path) -> None:
    """The config (as the conversion writes it), generation config and tokenizer of `gguf` in `folder`."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    gguf_config.register()  # its config (and the tokenizer's) read without the vocabulary
    try:
        with _no_progress_bar():
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except (ValueError, KeyError, IndexError, TypeError, RuntimeError, NotImplementedError) as e:
        raise UserError(f"{gguf} could not be read ({type(e).__name__}: {e}); the file may be damaged.") from e
    values = config.to_dict()
    values.pop("quantization_config", None)
    plain = type(config).from_dict(values)
    plain.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]  # by name: the class imports its code
    plain.save_pretrained(folder)
    GenerationConfig.from_model_config(plain).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    gguf_tokenizer.compact_merges(folder / "tokenizer.json")


def with_weights(folder: Path, gguf: Path | None) -> Path:
    """`folder` with the model's weights as `from_pretrained` reads them: the GGUF file's it
    describes (if any) converted into it on first use."""
    return folder if gguf is None else convert(gguf, folder, str(gguf))


def convert(gguf: Path, target: Path, what: str) -> Path:
    """`target`, converted from the GGUF file `gguf` unless a whole conversion is there already;
    `what` names it in the one progress line."""
    if is_converted(target):
        return target
    size = check(gguf)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(target.parent).free
    except OSError as e:
        raise UserError(f"The model cache {target.parent} cannot be written ({e.strerror or e}).") from e
    if free < size * 1.05:
        raise UserError(
            f"Converting {gguf} needs about {_amount(size * 1.05)} free in {target.parent}, which has "
            f"{_amount(free)}; free some space."
        )
    print(f"Converting {what} (once)…", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        with _no_progress_bar():  # the one line above says what is happening
            _write_folder(gguf, tmp)
        if target.exists():  # a damaged conversion: replaced by this one
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)  # atomic: a half-written copy is never seen
    except OSError as e:
        if not is_converted(target):  # else another process converting the same file got there first
            raise UserError(f"The conversion of {gguf} could not be written ({e.strerror or e}).") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _amount(size: float) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


def check(gguf: Path) -> int:
    """One UserError sentence unless `gguf` is a whole GGUF file of a chat architecture transformers
    converts, with its tokenizer and tensor types the `gguf` package reads; else the bytes its
    float32 conversion takes. Its header is read without the vocabulary (`direct_gguf.tensor_table`)."""
    from models.direct_gguf import tensor_table
    from models.headers import Unreadable

    try:
        meta, table = tensor_table(gguf)
    except Unreadable as e:  # its message is the sentence why
        raise UserError(f"{gguf} cannot be read: {e}") from e
    except (ValueError, OSError) as e:
        raise UserError(f"{gguf} cannot be read as a GGUF file ({e}); it may be damaged or truncated.") from e
    architecture = meta.get("general.architecture")
    architecture = architecture if isinstance(architecture, str) else None
    supported = supported_architectures()
    if architecture not in supported and _renamed(architecture) not in supported:
        raise UserError(
            f"{gguf} is a model of the {architecture or 'unstated'} architecture, which transformers cannot load "
            f"from GGUF; it loads these families: {', '.join(sorted(supported))}."
        )
    if "tokenizer.ggml.model" not in meta or "tokenizer.ggml.tokens" not in meta:
        raise UserError(
            f"{gguf} has no tokenizer (no tokenizer.ggml.* metadata); use a GGUF file that carries its "
            "tokenizer, as llama.cpp's converter writes it."
        )
    _check_types(gguf, table)
    return 4 * sum(entry.elements for entry in table.values())


def supported_architectures() -> set[str]:
    """The GGUF architectures transformers builds a causal language model from: its legacy
    reader's and those its fast reader has a config builder for (the same as its conversion
    table's, `GGUF_ARCHS`, which imports transformers' loading machinery with it: accelerate,
    torch.distributed, sympy, ~750 modules, ~35 MB kept; tested equal)."""
    from transformers.integrations.gguf.gguf_config_mapping import GGUF_CONFIG_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return (set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_CONFIG_ARCHS)) - NOT_CAUSAL


def _renamed(architecture: str | None) -> str | None:
    """A file's architecture as transformers' loader spells it (qwen2moe is its qwen2_moe)."""
    return gguf_config.RENAMED.get(architecture or "", architecture)


def _check_types(gguf: Path, table: dict) -> None:
    """A UserError naming a tensor type the `gguf` package cannot dequantize: a block of each
    type in the file is dequantized to find out."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    first = {}
    for name, entry in table.items():
        first.setdefault(entry.kind, (name, entry))
    with gguf.open("rb") as f:
        for kind, (name, entry) in first.items():
            size = GGML_QUANT_SIZES[kind][1]
            try:
                block = np.frombuffer(os.pread(f.fileno(), size, entry.offset), dtype=np.uint8)
                dequantize(block.reshape(1, size), kind)
            except NotImplementedError as e:
                raise UserError(
                    f"{gguf} holds {kind.name} tensors, which cannot be converted yet; use a file in Q4_0, Q4_1, "
                    "Q4_K, Q5_K, Q6_K, Q8_0, F16 or BF16."
                ) from e
            except (ValueError, IndexError, OSError) as e:
                raise UserError(f"{gguf} is damaged or truncated: its {name} does not read ({e}).") from e


def _write_folder(gguf: Path, folder: Path) -> None:
    """The model and tokenizer of `gguf`, in float32, saved as a transformers folder in `folder`."""
    import torch  # here, not above: the command line reads this module before anything heavy loads
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, KeyError, IndexError, TypeError, RuntimeError, NotImplementedError) as e:
        raise UserError(
            f"{gguf} could not be converted ({type(e).__name__}: {e}); the file may be damaged or truncated."
        ) from e
    # A GGUF-loaded model refuses save_pretrained; rebuild it from a plain config.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(type(model.config).from_dict(config), dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    del model
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@contextlib.contextmanager
def _no_progress_bar():
    """transformers without its progress bars on stderr while it converts: its own (loading,
    writing) and the tqdm bar its GGUF reader draws for the tensors, which its switch misses."""
    import transformers.modeling_gguf_pytorch_utils as reader
    from transformers.utils import logging as hf_logging

    bar, shown = getattr(reader, "tqdm", None), hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if bar is not None:
        reader.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            reader.tqdm = bar
        if shown:
            hf_logging.enable_progress_bar()


def _main(argv: list[str]) -> int:
    """`python -m models.gguf_files GGUF FOLDER`: `_describe_here`, a UserError's sentence last on
    stderr with `USER_ERROR`."""
    try:
        _describe_here(Path(argv[0]), Path(argv[1]))
    except UserError as e:
        print(e, file=sys.stderr)
        return USER_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
