"""The model catalog: ready-made models, as data in `catalog.json`, read and checked here.

Two kinds of entry (`target`):
- **cpu**: a small chat model (0.1B–8B) whose weights come as one GGUF file (`gguf`, a Q4_K_M or
  Q4_0 quant on a well-known hub repo), run in 4-bit on the CPU; `--model ID` fetches that file
  alone and opens it as any GGUF file. `backbone` names its safetensors repo (not fetched).
- **gpu**: a backbone in safetensors with published Medusa heads (the Medusa paper's models), in
  NF4 on a GPU; `--model ID` fetches the backbone, the heads and the EAGLE drafter.

An entry also says which drafters exist for it: Medusa heads (`heads`), a published EAGLE-1/2
layer fetched with it (`eagle`), a published EAGLE-3 drafter to pass to `--eagle` (`eagle3`), a
smaller model of the same family and tokenizer to pass to `--draft-model` (`draft_model`: a
catalog id or a hub repo); with none of them the lookups draft. And its license, whether what
`--model ID` fetches is gated on the hub (`Source.gated`), its parameter count (`params_b`) and
the memory it takes in 4-bit, computed from that count (`memory_4bit_gb`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources

from core.errors import UserError

HEAD_FORMATS = ("medusa-chat", "legacy-pt", "medusa-v2", "full-checkpoint", "tgi")
TARGETS = ("cpu", "gpu")
GGUF_QUANTS = ("Q4_K_M", "Q4_0")  # the quantization a CPU entry's GGUF file is in
# Memory in 4-bit, from the parameter count: every weight in the project's 4-bit form (GGUF
# Q4_1's: 4 bits a weight, a 16-bit step and a 16-bit minimum per 32 weights, so 5 bits), plus
# the KV cache of a few thousand tokens and working buffers. GB here is 10^9 bytes, as the hub counts.
BITS_PER_WEIGHT_4BIT = 4 + (16 + 16) / 32
RUNTIME_GB = 0.3
ID = re.compile(r"[a-z0-9][a-z0-9.-]*")


def memory_4bit_gb(params_b: float) -> float:
    """GB a model of `params_b` billion parameters takes once loaded in 4-bit, to 0.1 GB."""
    return round(params_b * BITS_PER_WEIGHT_4BIT / 8 + RUNTIME_GB, 1)


@dataclass(frozen=True)
class Source:
    repo: str  # hub repo id
    revision: str  # branch, tag or commit
    patterns: tuple[str, ...]  # only these files are fetched
    gated: bool = False  # the hub asks users to accept terms (and log in) before it serves the files


@dataclass(frozen=True)
class Entry:
    id: str  # what users type: `--model ID`, `medusa-chat download ID`
    name: str  # display name
    backbone: Source | None  # the safetensors repo (fetched for gpu entries); None for the embedded model
    heads: Source | None  # None when the heads ship with the app or live in the backbone repo
    tokenizer: Source | None  # where the tokenizer comes from when the backbone repo lacks one
    head_format: str  # one of HEAD_FORMATS
    chat_template: str | None  # a template name from assets/templates, None = the tokenizer's (or file's) own
    tree: str  # default tree preset
    download_gb: float  # approximate download: the GGUF file (cpu), or backbone, heads and EAGLE layer (gpu)
    memory_gb_4bit: float  # approximate memory in 4-bit: computed from params_b, or given (gpu: with the heads)
    license: str  # short license note
    notes: str = ""
    eagle: Source | None = None  # a published EAGLE-1/2 drafter, fetched with the model (None: none)
    draft_model: str | None = None  # a smaller model of the same tokenizer to draft with (catalog id or hub repo)
    target: str = "gpu"  # one of TARGETS: what the entry is sized and packaged for
    family: str = ""  # entries of one family share a tokenizer (what a draft model needs)
    params_b: float | None = None  # parameters, billions (the language model's, embeddings included)
    gguf: Source | None = None  # cpu entries: the one GGUF file `--model ID` fetches
    eagle3: str | None = None  # a published EAGLE-3 drafter (hub repo) for `--eagle`; not fetched with the model

    @property
    def embedded(self) -> bool:
        return self.backbone is None

    @property
    def sources(self) -> list[Source]:
        """Everything a download of this model fetches."""
        if self.gguf is not None:
            return [self.gguf]
        return [s for s in (self.backbone, self.heads, self.tokenizer, self.eagle) if s]

    @property
    def gguf_file(self) -> str | None:
        """The GGUF file's name in its repo (cpu entries), else None."""
        return self.gguf.patterns[0] if self.gguf is not None else None

    @property
    def quantization(self) -> str:
        """What the weights come as: the GGUF file's quant type, 'Q4_1' for the embedded file,
        'safetensors' for a gpu entry."""
        if self.gguf_file:
            return _quant_of(self.gguf_file) or "?"
        return "Q4_1" if self.embedded else "safetensors"

    @property
    def gated(self) -> bool:
        """Whether the hub refuses what `--model ID` fetches until its terms are accepted."""
        return any(s.gated for s in self.sources)

    @property
    def drafters(self) -> list[str]:
        """The drafters this model has beyond the lookups, as short phrases."""
        out = []
        if self.embedded:
            out.append("shipped heads and EAGLE")
        elif self.heads or self.head_format == "full-checkpoint":
            out.append("Medusa heads")
        out += ["EAGLE"] if self.eagle else []
        out += [f"EAGLE-3 {self.eagle3}"] if self.eagle3 else []
        out += [f"draft {self.draft_model}"] if self.draft_model else []
        return out

    @property
    def drafter(self) -> str:
        """The drafters as one phrase; the lookups where there is no other."""
        return ", ".join(self.drafters) or "lookups"


def _quant_of(file: str) -> str | None:
    upper = file.upper()
    return next((q for q in GGUF_QUANTS if re.search(rf"(?<![A-Z0-9]){q}(?![A-Z0-9_])", upper)), None)


def _source(data: dict | None) -> Source | None:
    if data is None:
        return None
    return Source(data["repo"], data.get("revision", "main"), tuple(data["patterns"]), bool(data.get("gated", False)))


def _entry(e: dict) -> Entry:
    params, memory = e.get("params_b"), e.get("memory_gb_4bit")
    if memory is None and params is None:
        raise ValueError(f"models/catalog.json: {e.get('id')}: give params_b (the memory is computed from it)")
    return Entry(
        id=e["id"],
        name=e["name"],
        backbone=_source(e.get("backbone")),
        heads=_source(e.get("heads")),
        tokenizer=_source(e.get("tokenizer")),
        head_format=e.get("head_format", "medusa-chat"),
        chat_template=e.get("chat_template"),
        tree=e["tree"],
        download_gb=float(e["download_gb"]),
        memory_gb_4bit=float(memory) if memory is not None else memory_4bit_gb(params),
        license=e["license"],
        notes=e.get("notes", ""),
        eagle=_source(e.get("eagle")),
        draft_model=e.get("draft_model"),
        target=e["target"],
        family=e["family"],
        params_b=float(params) if params is not None else None,
        gguf=_source(e.get("gguf")),
        eagle3=e.get("eagle3"),
    )


def problems(all_entries: tuple[Entry, ...]) -> list[str]:
    """What is wrong with the catalog's data, one sentence each (none: [])."""
    out = []
    ids = [e.id for e in all_entries]
    out += [f"{i}: the id is used twice" for i in sorted({i for i in ids if ids.count(i) > 1})]
    by_id = {e.id: e for e in all_entries}
    ranks = [TARGETS.index(e.target) for e in all_entries if e.target in TARGETS]
    if ranks != sorted(ranks):
        out.append("the cpu entries must come before the gpu entries")
    for e in all_entries:
        out += [f"{e.id}: {p}" for p in _entry_problems(e, by_id)]
    return out


def _entry_problems(e: Entry, by_id: dict[str, Entry]) -> list[str]:
    out = []
    if not ID.fullmatch(e.id):
        out.append("an id is lower-case letters, digits, dots and hyphens")
    if e.target not in TARGETS:
        out.append(f"target {e.target!r} is not one of {TARGETS}")
    if e.head_format not in HEAD_FORMATS:
        out.append(f"head_format {e.head_format!r} is not one of {HEAD_FORMATS}")
    if not e.family:
        out.append("no family")
    if e.target == "cpu" and (e.params_b is None or (e.gguf is None and not e.embedded)):
        out.append("a cpu entry needs params_b and a gguf source (or to be the embedded model)")
    if e.params_b is not None and e.memory_gb_4bit < memory_4bit_gb(e.params_b):
        out.append(f"memory_gb_4bit {e.memory_gb_4bit} is less than its {e.params_b}B parameters take in 4-bit")
    if e.gguf is not None:
        file = e.gguf.patterns[0] if len(e.gguf.patterns) == 1 else ""
        if not file.endswith(".gguf") or any(c in file for c in "*?[]/"):
            out.append("gguf.patterns must be one file name ending .gguf, no wildcards")
        elif _quant_of(file) is None:
            out.append(f"the GGUF file {file} is not one of {GGUF_QUANTS}")
        if e.heads or e.eagle or e.tokenizer:
            out.append("a gguf entry fetches its file alone: no heads, eagle or tokenizer sources")
    if e.draft_model is not None:
        out += _draft_problems(e, by_id)
    return out


def _draft_problems(e: Entry, by_id: dict[str, Entry]) -> list[str]:
    """A draft model must be a smaller model of the entry's family; a hub repo the catalog knows
    (as an entry's backbone) is held to the same rule."""
    if e.embedded or not e.draft_model:
        return ["the embedded model has no draft model; an empty draft_model is none: leave it out"]
    draft = by_id.get(e.draft_model) or next(
        (d for d in by_id.values() if d.backbone and d.backbone.repo == e.draft_model), None
    )
    if draft is None:
        return [] if "/" in e.draft_model else [f"draft_model {e.draft_model} is no catalog id nor hub repo"]
    out = []
    if draft.family != e.family:
        out.append(f"draft_model {e.draft_model} is of family {draft.family}, not {e.family}")
    if e.params_b is not None and draft.params_b is not None and draft.params_b >= e.params_b:
        out.append(f"draft_model {e.draft_model} is not smaller ({draft.params_b}B against {e.params_b}B)")
    return out


@cache
def entries() -> tuple[Entry, ...]:
    raw = json.loads((resources.files("models") / "catalog.json").read_text(encoding="utf-8"))
    out = tuple(_entry(e) for e in raw["models"])
    if found := problems(out):
        raise ValueError("models/catalog.json: " + "; ".join(found))
    return out


def find(model_id: str) -> Entry | None:
    return next((e for e in entries() if e.id == model_id), None)


def draft_for(model_id: str) -> str | None:
    """The draft model the catalog suggests for `model_id` (a catalog id or hub repo of the same
    tokenizer, for `--draft-model`); None for a model outside the catalog, the embedded one, or one
    with none known."""
    entry = find(model_id)
    return entry.draft_model if entry is not None else None


def get(model_id: str) -> Entry:
    entry = find(model_id)
    if entry is None:
        ids = ", ".join(e.id for e in entries())
        raise UserError(f"Unknown model '{model_id}'; choose one of {ids} (see `medusa-chat models`).")
    return entry
