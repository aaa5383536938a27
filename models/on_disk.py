"""Models already on this machine: the GGUF files in Ollama's store and LM Studio's models folder,
and the GGUF files and safetensors snapshots in the Hugging Face hub cache.

Each is listed with what its header says (architecture, quantization, parameters) and the string
to pass to `--model` (the file's own path, opened in place: nothing is copied; a hub snapshot's
repo id). Only headers are read (`models.headers`: tens of milliseconds a file). A damaged or
unsupported file is listed with one sentence why; listing never raises, and one bad file never
stops it.

Where they are looked for (read at each call, so tests plant folders through the environment):
Ollama: `$OLLAMA_MODELS`, else `~/.ollama/models` and the Linux service's `/usr/share/ollama/.ollama/models`;
LM Studio: `~/.lmstudio/models` (or the folder `~/.lmstudio-home-pointer` names) and `~/.cache/lm-studio/models`;
the hub cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `huggingface/hub` in `$XDG_CACHE_HOME` or `~/.cache`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from models import catalog
from models.gguf_config import SERVED  # the lean forward's; the loader is asked of others
from models.headers import Unreadable, quantization, read_gguf, safetensors_parameters

log = logging.getLogger(__name__)

OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
OLLAMA_REGISTRY, OLLAMA_LIBRARY = "registry.ollama.ai", "library"  # left out of names, as `ollama list` does


@dataclass(frozen=True)
class Found:
    name: str  # as the tool that keeps it names it: `qwen3:1.7b`, `publisher/repo/file.gguf`, `org/name`
    source: str  # "Ollama", "LM Studio" or "Hugging Face cache"
    ref: str  # what to pass to --model: the file's path, or a hub snapshot's repo id
    path: Path  # the GGUF file, or the snapshot folder
    size: int  # bytes on disk
    architecture: str = ""
    quantization: str = ""  # Q4_K_M, Q8_0, BF16, ...
    parameters: int = 0  # 0: not known
    problem: str = ""  # one sentence why it cannot be opened; "" where it can


def size_text(size: int) -> str:
    return f"{size / 1e9:.1f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"


def params_text(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


# -- one file ------------------------------------------------------------------------------------


def gguf_entry(name: str, source: str, path: Path) -> Found | None:
    """The listing of one GGUF file (None for a later part of a split model: its first part stands
    for it). Never raises: a file that cannot be read is listed with why."""
    try:
        size = path.stat().st_size
    except OSError:
        return Found(name, source, str(path), path, 0, problem="the file is missing (a broken link).")
    try:
        header = read_gguf(path)
    except Unreadable as e:
        return Found(name, source, str(path), path, size, problem=str(e))
    except Exception as e:  # never raises: the listing goes on
        log.warning("could not read %s", path, exc_info=True)
        return Found(name, source, str(path), path, size, problem=f"it could not be read ({type(e).__name__}).")
    meta = header["meta"]
    if meta.get("split.no"):
        return None
    arch = str(meta.get("general.architecture") or "")
    problem = ""
    if isinstance(meta.get("split.count"), int) and meta["split.count"] > 1:
        problem = f"it is split into {meta['split.count']} files; only single-file GGUFs open."
    elif not served(arch):
        problem = f"the architecture {arch or '(none)'} is not one this app can load."
    return Found(name, source, str(path), path, size, arch, quantization(header), header["parameters"], problem)


@functools.cache
def served(architecture: str) -> bool:
    """Whether `--model FILE.gguf` loads this GGUF architecture: the lean forward's at once, any
    other as the loader says (it asks transformers, whose import takes seconds: only for those)."""
    if architecture in SERVED:
        return True
    from models.gguf_files import supported_architectures

    known = supported_architectures()
    return bool(architecture) and any(
        a in known for a in (architecture, re.sub(r"[-]|(?<!_)(?=moe$)", "_", architecture))
    )


# -- where each tool keeps its models ------------------------------------------------------------


def ollama_roots() -> list[Path]:
    if os.environ.get("OLLAMA_MODELS"):
        return [Path(os.environ["OLLAMA_MODELS"]).expanduser()]
    return [Path.home() / ".ollama" / "models", Path("/usr/share/ollama/.ollama/models")]


def lmstudio_roots() -> list[Path]:
    roots = [Path.home() / ".lmstudio" / "models", Path.home() / ".cache" / "lm-studio" / "models"]
    try:  # LM Studio moved to another folder writes where in this file
        pointer = (Path.home() / ".lmstudio-home-pointer").read_text(encoding="utf-8").strip()
        if pointer:
            roots.insert(0, Path(pointer).expanduser() / "models")
    except (OSError, ValueError):
        pass
    return roots


def hub_root() -> Path:
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    cache = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "huggingface" / "hub"


def _ollama_name(parts: tuple[str, ...]) -> str:
    """registry/namespace/model/tag → `model:tag`, `namespace/model:tag` or `registry/namespace/model:tag`."""
    registry, namespace, model, tag = parts
    prefix = "" if registry == OLLAMA_REGISTRY else f"{registry}/"
    if not prefix and namespace == OLLAMA_LIBRARY:
        return f"{model}:{tag}"
    return f"{prefix}{namespace}/{model}:{tag}"


def ollama(root: Path) -> list[Found]:
    out = []
    manifests = root / "manifests"
    for manifest in sorted(manifests.glob("*/*/*/*")):
        if not manifest.is_file():
            continue
        name = _ollama_name(manifest.relative_to(manifests).parts)
        try:
            layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
            digest = next(layer["digest"] for layer in layers if layer.get("mediaType") == OLLAMA_MODEL_LAYER)
        except (OSError, ValueError, TypeError, AttributeError, KeyError):
            out.append(Found(name, "Ollama", str(manifest), manifest, 0, problem="its manifest is damaged."))
            continue
        except StopIteration:
            out.append(Found(name, "Ollama", str(manifest), manifest, 0, problem="its manifest names no model file."))
            continue
        blob = root / "blobs" / str(digest).replace(":", "-", 1)
        if not blob.is_file():
            out.append(
                Found(name, "Ollama", str(blob), blob, 0, problem="its model file is missing from Ollama's store.")
            )
        elif (found := gguf_entry(name, "Ollama", blob)) is not None:
            out.append(found)
    return out


def lmstudio(root: Path) -> list[Found]:
    files = sorted(root.glob("*/*/*.gguf"))
    found = (gguf_entry(f.relative_to(root).as_posix(), "LM Studio", f) for f in files)
    return [f for f in found if f is not None]


def _snapshot(repo: Path) -> Path | None:
    """The snapshot `refs/main` names, else the newest."""
    try:
        main = repo / "snapshots" / (repo / "refs" / "main").read_text(encoding="utf-8").strip()
        if main.is_dir():
            return main
    except (OSError, ValueError):
        pass
    snapshots = [s for s in (repo / "snapshots").glob("*") if s.is_dir()]
    return max(snapshots, key=lambda s: s.stat().st_mtime, default=None)


def hub(root: Path) -> list[Found]:
    out: list[Found] = []
    for repo in sorted(root.glob("models--*")):
        repo_id = repo.name.removeprefix("models--").replace("--", "/")
        try:  # one repo that cannot be read costs itself, never the rest of the cache
            out += _hub_repo(repo_id, repo)
        except Exception:
            log.warning("could not list %s", repo, exc_info=True)
            out.append(Found(repo_id, "Hugging Face cache", repo_id, repo, 0, problem="its folder could not be read."))
    return out


def _hub_repo(repo_id: str, repo: Path) -> list[Found]:
    snapshot = _snapshot(repo)
    if snapshot is None:
        return []
    found = [gguf_entry(f"{repo_id}/{f.relative_to(snapshot).as_posix()}", "Hugging Face cache", f)
             for f in sorted(snapshot.rglob("*.gguf"))]  # fmt: skip
    if (snapshot / "config.json").exists() and any(snapshot.glob("*.safetensors")):
        found.append(hub_snapshot(repo_id, snapshot))
    return [f for f in found if f is not None]


def hub_snapshot(repo_id: str, snapshot: Path) -> Found | None:
    """A transformers model in the hub cache, listed by its repo id (None: Medusa heads, not a model)."""
    weights = sorted(snapshot.glob("*.safetensors"))
    size = sum(w.stat().st_size for w in weights if w.exists())
    try:
        config = json.loads((snapshot / "config.json").read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError
    except (OSError, ValueError):
        return Found(repo_id, "Hugging Face cache", repo_id, snapshot, size, problem="its config.json is damaged.")
    if "medusa_num_heads" in config or all(w.name.startswith("medusa") for w in weights):
        return None
    arch = str(config.get("model_type") or "")
    quantized = config.get("quantization_config")
    quant = quantized.get("quant_method") if isinstance(quantized, dict) else None
    quant = quant or config.get("torch_dtype") or config.get("dtype")
    quant = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(str(quant), str(quant or ""))
    found = Found(repo_id, "Hugging Face cache", repo_id, snapshot, size, arch, quant)
    try:
        missing = [w.name for w in weights if not w.exists()]
        if missing:
            raise Unreadable(f"its download is incomplete ({len(missing)} of {len(weights)} weight files missing).")
        return replace(found, parameters=sum(safetensors_parameters(w) for w in weights))
    except Unreadable as e:
        return replace(found, problem=str(e))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return replace(found, problem=f"its weights could not be read ({type(e).__name__}).")


# -- the listing ----------------------------------------------------------------------------------


def find(skip_repos: frozenset[str] | None = None) -> list[Found]:
    """Every model on this machine, by tool, less the hub snapshots of `skip_repos` (None: the
    catalog's repos, which the catalog lists). Never raises: a folder that cannot be read is left out (and logged)."""
    if skip_repos is None:
        skip_repos = frozenset(s.repo for e in catalog.entries() for s in e.sources)
    places = [*((ollama, r) for r in ollama_roots()), *((lmstudio, r) for r in lmstudio_roots()), (hub, hub_root())]
    out, seen = [], set()
    for scan, root in places:
        try:
            if not root.is_dir():
                continue
            found = scan(root)
        except Exception:  # one unreadable folder costs its models, never the listing
            log.warning("could not list the models in %s", root, exc_info=True)
            continue
        for f in found:
            key = f.ref if f.ref == f.name else _real(f.path)
            if key not in seen and f.name not in skip_repos:
                seen.add(key)
                out.append(f)
    return out


def _real(path: Path) -> str:
    try:
        return str(path.resolve())
    except OSError:
        return str(path)
