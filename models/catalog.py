"""The model catalog: ready-made (backbone, Medusa heads) pairs, as data in `catalog.json`.

An entry says where the backbone and the heads come from (hub repo, revision, which files),
how the heads are stored, which chat template and tree preset to use, and what the download
and the 4-bit memory cost roughly, and which smaller model of the same tokenizer drafts for it
(`draft_for`). This module only reads and validates that data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources

from core.errors import UserError

HEAD_FORMATS = ("medusa-chat", "legacy-pt", "medusa-v2", "full-checkpoint", "tgi")


@dataclass(frozen=True)
class Source:
    repo: str  # hub repo id
    revision: str  # branch, tag or commit
    patterns: tuple[str, ...]  # only these files are fetched


@dataclass(frozen=True)
class Entry:
    id: str  # what users type: `--model ID`, `medusa-chat download ID`
    name: str  # display name
    backbone: Source | None  # None for the embedded model
    heads: Source | None  # None when the heads ship with the app or live in the backbone repo
    tokenizer: Source | None  # where the tokenizer comes from when the backbone repo lacks one
    head_format: str  # one of HEAD_FORMATS
    chat_template: str | None  # a template name from assets/templates, None = the tokenizer's own
    tree: str  # default tree preset
    download_gb: float  # approximate download, backbone and heads
    memory_gb_4bit: float  # approximate memory once loaded in 4-bit
    license: str  # short license note
    notes: str = ""
    eagle: Source | None = None  # a published EAGLE-1/2 drafter for this backbone (None: none)
    draft_model: str | None = None  # a smaller model of the same tokenizer to draft with (a hub repo; None: none known)

    @property
    def embedded(self) -> bool:
        return self.backbone is None

    @property
    def sources(self) -> list[Source]:
        """Everything a download of this model fetches."""
        return [s for s in (self.backbone, self.heads, self.tokenizer, self.eagle) if s]


def _source(data: dict | None) -> Source | None:
    if data is None:
        return None
    return Source(data["repo"], data.get("revision", "main"), tuple(data["patterns"]))


@cache
def entries() -> tuple[Entry, ...]:
    raw = json.loads((resources.files("models") / "catalog.json").read_text(encoding="utf-8"))
    out = []
    for e in raw["models"]:
        entry = Entry(
            id=e["id"],
            name=e["name"],
            backbone=_source(e.get("backbone")),
            heads=_source(e.get("heads")),
            tokenizer=_source(e.get("tokenizer")),
            head_format=e["head_format"],
            chat_template=e.get("chat_template"),
            tree=e["tree"],
            download_gb=float(e["download_gb"]),
            memory_gb_4bit=float(e["memory_gb_4bit"]),
            license=e["license"],
            notes=e.get("notes", ""),
            eagle=_source(e.get("eagle")),
            draft_model=e.get("draft_model"),
        )
        assert entry.head_format in HEAD_FORMATS, entry
        assert entry.draft_model is None or (entry.draft_model and not entry.embedded), entry
        out.append(entry)
    return tuple(out)


def find(model_id: str) -> Entry | None:
    return next((e for e in entries() if e.id == model_id), None)


def draft_for(model_id: str) -> str | None:
    """The draft model the catalog suggests for `model_id` (a hub repo of the same tokenizer, for
    `--draft-model`); None for a model outside the catalog, the embedded one, or one with none known."""
    entry = find(model_id)
    return entry.draft_model if entry is not None else None


def get(model_id: str) -> Entry:
    entry = find(model_id)
    if entry is None:
        ids = ", ".join(e.id for e in entries())
        raise UserError(f"Unknown model '{model_id}'; choose one of {ids} (see `medusa-chat models`).")
    return entry
