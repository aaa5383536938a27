"""The drafter kinds by name: what each drafts from, what it needs loaded, how far it reaches.

`KINDS` is the one table every place that names a drafter reads: the CLI's `--drafter`, the chat's
drafter menu, the API's `drafter` field, tree presets (the kind they were calibrated with), the
engine and the CLI deciding what to load (`needs`), and `core.drafters.build`, which builds a kind
from its row, on a fixed tree or under the speculation policy. A new kind is one row here and, if
it drafts from something new, one branch there. This module imports no drafter (the tree presets,
which every drafter reads, read the names from here).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import astuple, dataclass

from core.errors import UserError

NO, OPTIONAL, REQUIRED = "no", "optional", "required"  # how a kind uses the EAGLE draft layer or a draft model


@dataclass(frozen=True)
class Kind:
    name: str
    summary: str  # what it drafts from, in a few words (--drafter's help)
    label: str  # its entry in the chat's drafter menu
    heads: bool  # drafts with the Medusa heads (they must be loaded)
    context: bool  # copies continuations from the conversation itself
    retrieval: bool  # copies continuations from the model's past replies (the reply corpus, where one ships)
    eagle: str = NO  # REQUIRED: drafts with the EAGLE layer; OPTIONAL: with --tree auto, also where the model has one
    draft: str = NO  # REQUIRED: drafts with a draft model; OPTIONAL: with --tree auto, also where one is given

    @property
    def copies(self) -> bool:
        """Whether it grafts copied continuations under the root (from the context or past replies)."""
        return self.context or self.retrieval

    def reach(self, heads: int, lookup_length: int) -> int:
        """How many tokens ahead its drafts reach (what per-depth stats are kept for), given the
        heads' depth and the lookups' continuation length: the heads' unless it copies from the
        conversation alone, the lookups' where it copies at all."""
        alone = self.context and not (self.heads or self.retrieval or self.eagle != NO or self.draft != NO)
        return max(0 if alone else heads, lookup_length if self.copies else 0)


KINDS = {k.name: k for k in (
    Kind("medusa", "heads", "Medusa heads",
         heads=True, context=False, retrieval=False),
    Kind("lookup", "copies from the conversation", "Context lookup",
         heads=False, context=True, retrieval=False),
    Kind("retrieval", "copies from the model's past replies", "Past replies",
         heads=False, context=False, retrieval=True),
    Kind("hybrid", "all in one tree", "Heads + context + past replies (hybrid)",
         heads=True, context=True, retrieval=True, eagle=OPTIONAL, draft=OPTIONAL),
    Kind("eagle", "an EAGLE draft layer and both lookups", "EAGLE layer + context + past replies",
         heads=False, context=True, retrieval=True, eagle=REQUIRED),
    Kind("draft", "a draft model (--draft-model) and both lookups", "Draft model + context + past replies",
         heads=False, context=True, retrieval=True, draft=REQUIRED),
)}  # fmt: skip
DRAFTERS = tuple(KINDS)  # the kinds' names, in the table's order


def kind(name: str) -> Kind:
    """The kind called `name`; a UserError naming the choices if there is none."""
    if name not in KINDS:
        raise UserError(f"Unknown drafter '{name}'; choose one of {', '.join(DRAFTERS)}.")
    return KINDS[name]


def default_kind(preset_kind: str, draft_model: bool) -> str:
    """The kind that runs where none was chosen: the tree preset's, unless a draft model was given
    and that kind never drafts with one (it was loaded to be used): then "draft"."""
    return "draft" if draft_model and kind(preset_kind).draft == NO else preset_kind


def help_text() -> str:
    """--drafter's help: each kind and what it drafts from."""
    return "; ".join(f"{k.name}: {k.summary}" for k in KINDS.values()) + " (default: the tree's)"


@dataclass(frozen=True)
class Needs:
    """What a set of drafters needs loaded with the model."""

    heads: bool = False  # the Medusa heads
    eagle: bool = False  # the EAGLE layer, which must load (a drafter cannot run without it)
    eagle_if_any: bool = False  # the EAGLE layer where the model has one (a drafter runs without it)
    corpus: bool = False  # the reply corpus, for retrieval
    draft: bool = False  # a draft model, which must be given (a drafter cannot run without it)

    def __or__(self, other: Needs) -> Needs:
        return Needs(*(a or b for a, b in zip(astuple(self), astuple(other), strict=True)))


def needs(names: Iterable[str], auto: bool) -> Needs:
    """What the drafters of kinds `names` need; `auto`: they are built for the speculation policy
    (`--tree auto`), where an OPTIONAL EAGLE layer runs too."""
    rows = [kind(n) for n in names]
    eagle = any(k.eagle == REQUIRED for k in rows)
    return Needs(
        heads=any(k.heads for k in rows),
        eagle=eagle,
        eagle_if_any=eagle or (auto and any(k.eagle == OPTIONAL for k in rows)),
        corpus=any(k.retrieval for k in rows),
        draft=any(k.draft == REQUIRED for k in rows),
    )
