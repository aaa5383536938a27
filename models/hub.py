"""Downloads from the Hugging Face hub: only the files needed, into the standard hub cache.

Files land where every other tool looks (`HF_HOME` / `HF_HUB_CACHE` are respected), so a model
fetched by transformers or LM Studio's hub client is reused and vice versa. `huggingface_hub`
does the transfer: an interrupted file is kept as `.incomplete` and resumed with a Range
request, by its own retry or by the next call. This module adds a plan (what is missing, how
big), a free-disk check before anything is written, per-file progress for the CLI and the UI,
and one clear sentence when offline.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import DryRunError, HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled
from tqdm.auto import tqdm

from core.errors import UserError

try:  # the HTTP client huggingface_hub uses: its transport errors mean "no network"
    from httpx2 import TransportError
except ImportError:  # huggingface_hub releases before httpx2 (1.0 to ~1.35) use httpx
    from httpx import TransportError

MARGIN = 256 * 2**20  # keep this much disk free beyond the download


@dataclass(frozen=True)
class Progress:
    file: str  # the file being fetched
    file_done: int  # bytes of it so far
    file_total: int
    done: int  # bytes of the whole download so far
    total: int


@dataclass(frozen=True)
class Plan:
    repo_id: str
    revision: str  # the commit the files come from
    folder: Path  # the snapshot folder in the hub cache
    missing: tuple[tuple[str, int], ...]  # (file, size) still to fetch

    @property
    def missing_bytes(self) -> int:
        return sum(size for _, size in self.missing)


def is_offline() -> bool:
    return bool(constants.HF_HUB_OFFLINE)


def hub_cache() -> Path:
    return Path(constants.HF_HUB_CACHE)


def free_bytes(path: Path) -> int:
    """Free space on the disk that holds `path` (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def plan(
    repo_id: str,
    revision: str | None = None,
    patterns: list[str] | None = None,
    cache_dir: Path | None = None,
    endpoint: str | None = None,
    weights: bool = False,
) -> Plan:
    """Ask the hub which files match and which of them are not cached yet.

    With `weights`, a repo that has safetensors weights skips its .bin copies, and
    `consolidated*` files (for other inference engines) are skipped."""
    try:
        infos = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=patterns,
            cache_dir=cache_dir,
            endpoint=endpoint,
            dry_run=True,
        )
    except DryRunError as e:  # the hub's answer, if it gave one, is the cause
        if isinstance(e.__cause__, HfHubHTTPError):
            raise _refused(repo_id, e.__cause__) from e
        raise _NoNetwork() from e
    except (TransportError, OfflineModeIsEnabled, LocalEntryNotFoundError) as e:
        raise _NoNetwork() from e
    except HfHubHTTPError as e:
        raise _refused(repo_id, e) from e
    if not infos:
        raise UserError(f"{repo_id} has no files matching {patterns}; the repository layout may have changed.")
    if weights:
        infos = one_weight_format(infos)
    folder = Path(infos[0].local_path[: -len(infos[0].filename)])
    missing = tuple((i.filename, i.file_size or 0) for i in infos if i.will_download)
    return Plan(repo_id, infos[0].commit_hash, folder, missing)


def one_weight_format(infos: list) -> list:
    names = [i.filename for i in infos if not i.filename.startswith("consolidated")]
    has_safetensors = any(n.endswith(".safetensors") for n in names)
    return [i for i in infos if i.filename in names and not (has_safetensors and i.filename.endswith(".bin"))]


def fetch(
    repo_id: str,
    revision: str | None = None,
    patterns: list[str] | None = None,
    label: str | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    cache_dir: Path | None = None,
    endpoint: str | None = None,
    weights: bool = False,
) -> Path:
    """Download what is missing (with a terminal bar unless `on_progress` is given); the folder.

    Offline, the cached snapshot is returned if it is complete; otherwise a UserError names
    the model and the command that fetches it later.
    """
    label = label or repo_id
    if is_offline():
        return _cached(repo_id, revision, patterns, label, cache_dir)
    try:
        todo = plan(repo_id, revision, patterns, cache_dir, endpoint, weights)
    except _NoNetwork:
        return _cached(repo_id, revision, patterns, label, cache_dir)
    check_space(todo, label, free_bytes(Path(cache_dir) if cache_dir else hub_cache()))
    done = 0
    for file, size in todo.missing:
        bar = _bar(file, size, done, todo.missing_bytes, on_progress)
        try:
            hf_hub_download(
                repo_id, file, revision=todo.revision, cache_dir=cache_dir, endpoint=endpoint, tqdm_class=bar
            )
        except (TransportError, OfflineModeIsEnabled) as e:
            raise UserError(
                f"The download of {label} stopped ({type(e).__name__}); run the same command again to resume it."
            ) from e
        done += size
    return todo.folder


def check_space(todo: Plan, label: str, free: int) -> None:
    need = todo.missing_bytes + MARGIN
    if todo.missing and free < need:
        raise UserError(
            f"{label} needs {_gb(todo.missing_bytes)} more but only {_gb(free)} is free in "
            f"{hub_cache()}; free some space or set HF_HUB_CACHE to a bigger disk."
        )


def _cached(repo_id: str, revision: str | None, patterns: list[str] | None, label: str, cache_dir) -> Path:
    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=patterns,
                cache_dir=cache_dir,
                local_files_only=True,
            )
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, FileNotFoundError) as e:
        raise UserError(
            f"{label} is not downloaded and the hub cannot be reached; run `medusa-chat download {label}` "
            "when you are online."
        ) from e


class _NoNetwork(Exception):
    pass


def _refused(repo_id: str, e: HfHubHTTPError) -> UserError:
    response = getattr(e, "response", None)
    status = f"HTTP {response.status_code}" if response is not None else type(e).__name__
    return UserError(
        f"The hub refused {repo_id} ({status}); check the name, or accept its terms on the hub and "
        "log in (`hf auth login`) if it is gated."
    )


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GB" if n >= 2**28 else f"{n / 2**20:.1f} MB"


def _bar(file: str, size: int, before: int, total: int, on_progress: Callable[[Progress], None] | None):
    """A tqdm class for one file: a terminal bar, or silent and reporting to `on_progress`."""

    class Bar(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = on_progress is not None or kwargs.get("disable", False)
            kwargs.setdefault("file", sys.stderr)
            super().__init__(*args, **kwargs)
            self.bytes = int(kwargs.get("initial") or 0)  # a resumed file starts part-way

        def update(self, n: float | None = 1) -> bool | None:
            self.bytes += int(n or 0)
            if on_progress is not None:
                on_progress(Progress(file, self.bytes, size, before + self.bytes, total))
            return super().update(n)

    return Bar


def cached_state(sources: list) -> str:
    """'cached', 'partly cached' or 'not cached' for a model's sources, from the disk alone."""
    have = 0
    for source in sources:
        try:
            folder = Path(
                snapshot_download(
                    source.repo,
                    revision=source.revision,
                    allow_patterns=list(source.patterns),
                    local_files_only=True,
                )
            )
        except (LocalEntryNotFoundError, OfflineModeIsEnabled, FileNotFoundError):
            continue
        have += any(folder.iterdir())
    return "cached" if have == len(sources) else "partly cached" if have else "not cached"
