"""The draft-model drafter: a whole smaller language model of the target's tokenizer (or the
target's own weights in 4 bits) proposes, the target verifies.

The draft runs on its own backend (`core.backends.base.Backend`: the lean CPU forward on the
fastest kernels of the machine, or transformers') with its own KV cache over the committed
tokens. Before each step its cache is brought up to the conversation: cut back to what it shares
with the tokens committed since (the accepted drafts usually), then the rest read in one forward;
its last hidden state predicts the token after the root. It drafts a tree by its own confidence
(`core.drafters.confident`: a chain where one continuation is sure, branches where it is not,
sized by the measured step costs), and the lookups' continuations are grafted under the root.
The target never sees the draft's probabilities: lossless and typical acceptance are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from core.backends.base import Backend
from core.decode.tree import DRAFT
from core.drafters.confident import ConfidenceTree
from core.drafters.estimates import CostCurve
from core.drafters.retrieval import Corpus
from core.errors import UserError
from core.sequences import common_prefix

DEPTH = 8  # how far ahead it may draft (each depth one draft forward, taken only while it pays)
LEAST_CHANCE = 0.05  # a node this unlikely is never expanded, however cheap a draft forward

MISSING = (
    "No draft model is loaded; pass --draft-model with a model of the same tokenizer (a catalog id, a hub repo "
    "or a folder; or self, the model's own weights in 4 bits), or choose another drafter."
)


class DraftModelDrafter(ConfidenceTree):
    """Drafts with the model behind `backend`; `vocab_size`: the target's vocabulary (a draft
    whose output rows run past it never proposes those ids)."""

    name = "draft model"

    def __init__(self, backend: Backend, vocab_size: int, *args, depth: int = DEPTH, **options) -> None:
        """`args`, `options`: `ConfidenceTree`'s (curve, lookup, corpus, budget, branches, length)."""
        super().__init__(DRAFT, *args, depth=depth, **options)
        self.backend = backend
        self.vocab_size = vocab_size
        self.cache = backend.new_cache()
        self.ids: list[int] = []  # the tokens the draft's cache holds
        self._last: Tensor | None = None  # (1, H) the draft's last hidden state (after `ids`)

    @property
    def dtype(self) -> torch.dtype:
        return self.backend.dtype

    @property
    def device(self) -> torch.device:
        return self.backend.device

    def _ready(self, history: Sequence[int]) -> bool:
        """Cut the draft's cache back to what it shares with `history`, then read the rest (at
        least the root, whose hidden state drafts the next token)."""
        if not history:
            return False
        history = [int(t) for t in history]
        keep = min(common_prefix(self.ids, history), len(history) - 1)
        self.backend.truncate(self.cache, keep)
        with torch.inference_mode():
            hidden, _ = self.backend.prefill(self.cache, torch.tensor(history[keep:], device=self.device))
        self.ids, self._last = history, hidden[-1:]
        return True

    @torch.inference_mode()
    def _logits(self, hidden: Tensor) -> Tensor:
        return self.backend.logits(hidden).full()[:, : self.vocab_size]

    def _start(self) -> tuple[Tensor, Any]:
        return self._logits(self._last)[0], None

    def _expand(self, inputs: list[Any], tokens: list[int], position: int, mask: Tensor) -> tuple[Tensor, list[Any]]:
        ids = torch.tensor(tokens, device=self.device)
        positions = torch.full((len(tokens),), position, device=self.device)
        with torch.inference_mode():
            hidden, _ = self.backend.run(ids, positions, mask, self.cache)
        return self._logits(hidden), [None] * len(tokens)

    def _min_chance(self, curve: CostCurve) -> float:
        """A depth more is drafted while a node is likely enough to be accepted that the token it
        may add is worth the draft forward it costs: its chance × what a token costs now (the
        drafting steps' running milliseconds a token) above one draft forward's running time."""
        if self.expand_ms is None or self.draft_rate is None:
            return LEAST_CHANCE
        return max(LEAST_CHANCE, self.expand_ms * self.draft_rate)

    def _length(self) -> int:
        return self.backend.length(self.cache)

    def _cut(self, size: int) -> None:
        if size < self._length():
            self.backend.truncate(self.cache, size)


@dataclass(frozen=True)
class DraftModel:
    """A loaded draft model, as the drafters are built from it."""

    name: str  # what the user gave (a catalog id, a folder, a file, or "self")
    backend: Backend  # its forward and cache kind
    vocab_size: int  # the target's vocabulary: ids past it are never drafted


def draft_model_drafter(
    draft: DraftModel | None,
    curve: Callable[[], CostCurve | None] = lambda: None,
    corpus: Corpus | None = None,
    budget: int | None = None,
    branches: int = 2,
    length: int = 4,
) -> DraftModelDrafter:
    """The "draft" drafter: `draft` with the context's and `corpus`'s continuations; `budget` None:
    each step's node count chosen from the machine's costs (`curve`)."""
    if draft is None:
        raise UserError(MISSING)
    return DraftModelDrafter(draft.backend, draft.vocab_size, curve, True, corpus, budget, branches, length)
