"""What the drafters need, loaded with the model: the Medusa heads, the EAGLE draft layer, the
reply corpus and a draft model, as far as `core.drafters.registry.Needs` asks for them. The CLI's commands load what
their drafters need; the chat's engine loads all of it (the user may switch drafters)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from core.drafters.draft_model import MISSING, DraftModel
from core.drafters.eagle import EagleDraft
from core.drafters.registry import Needs
from core.drafters.retrieval import Corpus
from core.errors import UserError
from models.draft_model import load_draft_model
from models.heads import MedusaHeads
from models.loader import Backbone, corpus_for, eagle_for, heads_for

EVERYTHING = Needs(heads=True, eagle_if_any=True, corpus=True)  # the chat's: every kind may be asked for


@dataclass(frozen=True)
class Parts:
    heads: MedusaHeads | None  # None where nothing drafts with them
    trained: bool  # False: untrained heads (few drafts accepted), or none
    corpus: Corpus | None  # the model's past replies (None: none ships, or none needed)
    eagle: EagleDraft | None  # the EAGLE draft layer (None: none given or ships, or none needed)
    draft: DraftModel | None = None  # the draft model (None: none given)


def load_parts(
    backbone: Backbone,
    needs: Needs,
    heads_dir: str | Path | None,
    eagle_path: Path | None,
    num_heads: int = 4,
    draft_model: str | None = None,
) -> Parts:
    """The parts `needs` asks for, and the draft model `draft_model` where one is named;
    `num_heads`: how many untrained heads to make where no trained ones are found. An EAGLE layer
    that does not fit is one sentence on stderr and None, unless a drafter cannot run without it
    (`needs.eagle`): then the UserError is raised. A draft model that does not load or fit is
    always a UserError (it was asked for by name)."""
    if needs.draft and not draft_model:
        raise UserError(MISSING)
    heads, trained = heads_for(backbone, heads_dir, num_heads=num_heads) if needs.heads else (None, False)
    corpus = corpus_for(backbone) if needs.corpus else None
    try:
        eagle = eagle_for(backbone, eagle_path)
    except UserError as e:
        if needs.eagle:
            raise
        print(f"{e} The EAGLE drafter is off.", file=sys.stderr)  # hybrid runs the heads' tree alone
        eagle = None
    draft = load_draft_model(backbone, draft_model) if draft_model else None
    return Parts(heads, trained, corpus, eagle, draft)
