"""The EAGLE drafter in the decode loop: the draft layer's own KV cache over the committed
positions, and a dynamic tree by draft confidence (EAGLE-2, `core.drafters.confident`).

Positions follow the backbone's: after a step the backbone's cache holds tokens 0 … P − 1 and
the root x_P is not yet in it; the draft's cache then holds entries 0 … P − 1, entry j read
from (feature j, token j + 1), so the last entry's output predicts the feature at P and with it
the token after the root. A drafted node at depth d sits at position P + d − 1 and attends to
every committed entry, its ancestors and itself. Where a step is plain, the features still
reach the draft's cache (lazily, in one forward when drafting resumes).

The draft layer sees the last `WINDOW` to 2 · `WINDOW` committed positions: a 4,000-token
prompt would otherwise cost a forward of the draft layer over every position (~1/30 of reading
the prompt, 0.5 s on two cores) before its first tree, and every drafted depth an attention over
all of them. Slot i of its cache holds position `offset` + i.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from core.backends import lean as fast
from core.backends import stepops
from core.decode.tree import EAGLE
from core.drafters.confident import ConfidenceTree
from core.drafters.confident import closed as _closed  # noqa: F401 (the tests read it here)
from core.drafters.eagle import EagleDraft
from core.drafters.eagle3 import Eagle3Draft, LeanEagle3
from core.drafters.estimates import CostCurve
from core.drafters.lean_draft import LeanDraft
from core.drafters.retrieval import Corpus
from core.errors import UserError
from core.sequences import common_prefix

WINDOW = 512  # committed positions the draft layer sees at least (at most twice as many)


class EagleDrafter(ConfidenceTree):
    """Drafts with an EAGLE draft layer; with `lookup` the context's continuations (and with a
    `corpus` the model's past replies) are grafted under the root as well."""

    window = WINDOW
    reads_features = True  # its own cache holds the draft layer's entries of every committed position
    name = "EAGLE"

    def __init__(self, draft: EagleDraft, dtype: torch.dtype, *args, **options) -> None:
        """`args`, `options`: `ConfidenceTree`'s (curve, lookup, corpus, budget, branches, length, depth)."""
        super().__init__(EAGLE, *args, **options)
        self.lean = LeanEagle3(draft, dtype) if isinstance(draft, Eagle3Draft) else LeanDraft(draft, dtype)
        self.cache = self.lean.new_cache()
        self.offset = 0  # the position of the cache's slot 0
        self._pending: list[tuple[Tensor, Tensor]] = []  # fed rows not yet run through the draft
        self._pending_rows = 0
        self._last_out: Tensor | None = None  # (H,) output of the last committed entry
        self._read: list[int | None] = [None]  # token 0, then the token each entry read (None: not known)

    @property
    def taps(self) -> tuple[int, ...]:
        """The backbone layers whose streams `feed` must carry before the last feature."""
        return self.lean.taps

    @property
    def dtype(self) -> torch.dtype:
        return self.lean.dtype

    @property
    def device(self) -> torch.device:
        return self.lean.device

    # -- the committed positions --------------------------------------------------------------
    def feed(self, features: Tensor, next_ids: Tensor, position: int) -> None:
        """The backbone's features at positions `position` … (with `taps`, the tapped streams
        then the last feature, side by side) and the token after each (the last one the next
        root). Position 0 starts a new reply."""
        if position == 0 or position != self.offset + self.cache.length + self._pending_rows:
            first = self._read[:1] if position == 0 and len(self._read) == 1 else [None]  # token 0 if `rewind` said
            self.cache.truncate(0)
            self._pending, self._pending_rows, self._last_out, self._read = [], 0, None, first
            self.offset = 0
            if position != 0:  # not where the draft left off: nothing to draft from until a new reply
                return
        self._pending.append((features, next_ids))
        self._pending_rows += len(next_ids)
        self._read += next_ids.tolist()

    def rewind(self, prompt_ids: Sequence[int], reused: int) -> int:
        """A new reply to `prompt_ids`, of which the backbone's cache holds the first `reused`
        positions: keep the entries this prompt shares, up to `reused` (entry j read feature j and
        token j + 1, so it needs the prompt's first j + 2 tokens), and say how many; the prefill
        feeds the rest from there."""
        keep = max(0, min(reused, len(self._read) - 1, common_prefix(self._read, prompt_ids) - 1))
        if keep <= self.offset + self.cache.length:
            if keep < self.offset:  # it parts before the window: the draft sees from there on
                self.offset = keep
            self.cache.truncate(keep - self.offset)
            self._pending, self._pending_rows = [], 0
        else:  # part of the pending rows stays
            room, pending = keep - self.offset - self.cache.length, []
            for features, ids in self._pending:
                if room > 0:
                    pending.append((features[:room], ids[:room]))
                    room -= len(ids)
            self._pending, self._pending_rows = pending, keep - self.offset - self.cache.length
        self._last_out = None  # the prefill's feed brings the rows it is computed from
        self._read = list(prompt_ids[: keep + 1])
        return keep

    def _flush(self) -> bool:
        """Run the pending rows into the draft's cache; False when it has nothing to draft from."""
        if self._pending_rows:
            features = torch.cat([f for f, _ in self._pending])[-self.window :]
            ids = torch.cat([i for _, i in self._pending])[-self.window :]
            self._slide(len(ids))
            features = self.lean.fused(features)
            # where the library's decoder runs the layer, in causal blocks of the rows it takes (a
            # long prompt's rows otherwise go through torch's attention and matmuls: 0.6 s at 4,000)
            chunk = stepops.Ops.MAX_ROWS if getattr(self.lean, "native", None) is not None else len(ids)
            for start in range(0, len(ids), chunk):
                rows, past = ids[start : start + chunk], self.cache.length
                positions = torch.arange(self.offset + past, self.offset + past + len(rows), device=ids.device)
                mask = fast.causal_mask(len(rows), past, self.dtype, self.device) if chunk < len(ids) else None
                out = self.lean(features[start : start + chunk], rows, positions, mask, self.cache)
                self.cache.length = past + len(rows)
            self._last_out = out[-1]
            self._pending, self._pending_rows = [], 0
        return self._last_out is not None

    def _slide(self, rows: int) -> None:
        """Make the window's room for `rows` new entries (at most `window`; the pending rows before
        them are skipped): past 2 · `window` entries, only the last `window` stay."""
        skipped = self._pending_rows - rows
        if skipped:  # the cache's entries and the skipped rows all fall out of the window
            self.offset += self.cache.length + skipped
            self.cache.truncate(0)
        elif self.cache.length + rows > 2 * self.window:
            drop = self.cache.length + rows - self.window
            self.cache.drop_front(drop)
            self.offset += drop

    def _ready(self, history: Sequence[int]) -> bool:
        return self._flush()

    def _start(self) -> tuple[Tensor, Any]:
        return self.lean.logits(self._last_out.view(1, -1))[0], self._last_out

    def _expand(self, inputs: list[Any], tokens: list[int], position: int, mask: Tensor) -> tuple[Tensor, list[Any]]:
        ids = torch.tensor(tokens, device=self.device)
        out = self.lean(
            torch.stack(inputs),
            ids,
            torch.full((len(tokens),), self.offset + position, device=self.device),
            mask,
            self.cache,
        )
        self.cache.length += len(tokens)
        return self.lean.logits(out), list(out)

    def _length(self) -> int:
        return self.cache.length

    def _cut(self, size: int) -> None:
        self.cache.length = size

    def _token_ids(self, indices: Tensor) -> list[int]:
        return self.lean.vocab[indices].tolist()


def eagle_drafter(
    draft: EagleDraft | None,
    curve: Callable[[], CostCurve | None] = lambda: None,
    corpus: Corpus | None = None,
    budget: int | None = None,
    branches: int = 2,
    length: int = 4,
) -> EagleDrafter:
    """The "eagle" drafter: `draft` with the context's and `corpus`'s continuations; `budget` None:
    each step's node count chosen from the machine's costs (`curve`)."""
    if draft is None:
        raise UserError(
            "No EAGLE drafter for this model; make one with `medusa-chat train-drafter --kind eagle` "
            "and pass it with --eagle FILE, or choose another drafter."
        )
    return EagleDrafter(draft, draft.backbone_dtype, curve, True, corpus, budget, branches, length)
