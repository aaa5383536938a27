"""Retrieval drafting: continuations copied from the model's own earlier replies (REST,
SuffixDecoding), with no forward pass at all.

A model answers alike across chats: the same openings, list scaffolding, code idioms and
closing lines. `SuffixIndex` is a suffix array over a corpus of its replies (token ids, one
document each), sorted by prefix doubling with torch in well under a second for 400k tokens
and kept as compact `array`s (4 bytes a token and a suffix). A query finds the longest suffix of
the history (`MIN_MATCH`…`MAX_MATCH` tokens) that occurs in the corpus by binary search, then
follows up to `SAMPLE` of its occurrences and drafts, for each of the most frequent next tokens,
the path of the most frequent token after each (the greedy path through the continuations'
frequency tree). `Corpus` keeps the shipped index as it is and rebuilds only a small second one
as the user's own replies are added (merged into the first once it grows as large).
"""

from __future__ import annotations

import json
from array import array
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from core.errors import UserError
from core.files import save_tensors

MIN_MATCH = 2  # suffix tokens that must occur in the corpus before it drafts (one token says little)
MAX_MATCH = 16  # the longest suffix matched (longer ones rarely narrow the continuations further)
SORT_DEPTH = 32  # suffixes are sorted on this many tokens (≥ MAX_MATCH, so every query range is exact)
RETRIEVAL_LENGTH = 8  # tokens a retrieved continuation runs to (the policy cuts it to what pays)
SAMPLE = 256  # occurrences followed per query, evenly spread over the range (a common phrase has thousands)
SEPARATOR = -1  # between documents: sorts before every token and never matches one
FORMAT = 1  # of the corpus file
EVIDENCE_CLASSES = 5  # how strongly the corpus can back a draft (see `evidence`)


class SuffixIndex:
    """A suffix array over documents of token ids (see the module's docstring)."""

    def __init__(self, docs: Iterable[Sequence[int]]) -> None:
        ids = array("i")
        for doc in docs:
            ids.extend(map(int, doc))
            ids.append(SEPARATOR)
        self.ids = ids
        self.documents = ids.count(SEPARATOR)
        self.order = array("i", _suffix_order(ids).tolist()) if ids else array("i")

    def __len__(self) -> int:
        return len(self.ids) - self.documents

    @property
    def nbytes(self) -> int:
        return self.ids.itemsize * len(self.ids) + self.order.itemsize * len(self.order)

    def _range(self, query: array) -> tuple[int, int]:
        """Where the suffixes starting with `query` lie in the sorted order (lo == hi: nowhere)."""
        ids, m = self.ids, len(query)
        prefix = lambda s: ids[s : s + m]  # noqa: E731 (arrays compare element by element)
        lo = bisect_left(self.order, query, key=prefix)
        return lo, bisect_right(self.order, query, lo, key=prefix)

    def occurrences(self, history: Sequence[int]) -> tuple[int, list[int]]:
        """The longest suffix of `history` found (its length, 0 if under `MIN_MATCH`) and where,
        for up to `SAMPLE` of its occurrences, the token after it lies."""
        found, where = 0, (0, 0)
        for m in range(MIN_MATCH, min(MAX_MATCH, len(history)) + 1):
            lo, hi = self._range(array("i", history[-m:]))
            if lo == hi:
                break  # a longer suffix contains this one, so it cannot occur either
            found, where = m, (lo, hi)
        if not found:
            return 0, []
        lo, hi = where
        stride = max(1, (hi - lo) // SAMPLE)
        return found, [self.order[j] + found for j in range(lo, hi, stride)][:SAMPLE]


class Corpus:
    """The shipped replies' index plus one over the user's own, searched together."""

    def __init__(self, base: SuffixIndex | None = None, hit_rates: Sequence = ()) -> None:
        self.base = base or SuffixIndex([])
        # held out, how often the first drafted token was right, per evidence class (None: unmeasured)
        self.hit_rates = tuple(hit_rates)
        self.own: list[list[int]] = []  # the user's replies not merged into the base yet
        self.recent = SuffixIndex([])

    def __len__(self) -> int:
        return len(self.base) + len(self.recent)

    @property
    def nbytes(self) -> int:
        return self.base.nbytes + self.recent.nbytes

    def add(self, docs: Iterable[Sequence[int]]) -> None:
        """Index more replies: only the second index is rebuilt (never larger than the first), and
        it joins the first once it is as large, so the first at least doubles at each merge."""
        self.own.extend(list(d) for d in docs if len(d) > MIN_MATCH)
        if sum(map(len, self.own)) >= len(self.base):
            self.base = SuffixIndex([*_documents(self.base.ids), *self.own])
            self.own, self.recent = [], SuffixIndex([])
        else:
            self.recent = SuffixIndex(self.own)

    def continuations(self, history: Sequence[int], branches: int, length: int) -> tuple[list[list[int]], int]:
        """Up to `branches` continuations (≤ `length` tokens) of the history's longest suffix that
        the corpus holds (the longer match of the two indexes; both when they tie): one per most
        frequent next token, each followed by the most frequent token after it; and the first's
        evidence class (`evidence`)."""
        parts = [(index, *index.occurrences(history)) for index in (self.base, self.recent) if len(index)]
        longest = max((m for _, m, _ in parts), default=0)
        if not longest:
            return [], 0
        paths: list[tuple[int, ...]] = []
        for index, m, starts in parts:
            if m == longest:
                ids = index.ids
                for s in starts:
                    path = tuple(ids[s : s + length])
                    if SEPARATOR in path:  # the document ends within it
                        path = path[: path.index(SEPARATOR)]
                    if path:
                        paths.append(path)
        return _greedy_paths(paths, branches)


def evidence(share: float, support: int) -> int:
    """How strongly the corpus backs a continuation's first token, as a class 0…4: by the share of
    the followed occurrences that go on with it (under ¼, ½, ¾, or more), the last split by
    whether more than two occurrences back it (one or two may be the same reply's chance)."""
    if share >= 0.75:
        return 4 if support > 2 else 3
    return int(share * 4)


def _greedy_paths(paths: list[tuple[int, ...]], branches: int) -> tuple[list[list[int]], int]:
    """For each of the `branches` most frequent first tokens, the path that then takes the most
    frequent next token among the paths agreeing so far (ties: the one seen first); and the
    evidence class of the first."""
    if not paths:
        return [], 0
    out = []
    firsts = Counter(p[0] for p in paths).most_common(branches)
    for first, _ in firsts:
        chosen, agree = [first], [p for p in paths if p[0] == first]
        while True:
            depth = len(chosen)
            nxt = Counter(p[depth] for p in agree if len(p) > depth).most_common(1)
            if not nxt:
                break
            chosen.append(nxt[0][0])
            agree = [p for p in agree if len(p) > depth and p[depth] == chosen[-1]]
        out.append(chosen)
    return out, evidence(firsts[0][1] / len(paths), firsts[0][1])


def _documents(ids: array) -> Iterable[list[int]]:
    doc: list[int] = []
    for t in ids:
        if t == SEPARATOR:
            yield doc
            doc = []
        else:
            doc.append(t)


def _suffix_order(ids: array) -> torch.Tensor:
    """Start positions sorted by the `SORT_DEPTH` tokens that follow (prefix doubling: each round
    ranks pairs of ranks `k` apart, so log2(SORT_DEPTH) sorts in all)."""
    tokens = torch.frombuffer(ids, dtype=torch.int32).long()
    n = len(tokens)
    rank = torch.unique(tokens, return_inverse=True)[1] + 1  # 1…; 0 stands for "past the end"
    k = 1
    while k < SORT_DEPTH and k < n and int(rank.max()) < n:  # (all ranks distinct: the order is final)
        after = torch.zeros(n, dtype=torch.long)
        after[: n - k] = rank[k:]
        rank = torch.unique(rank * (n + 1) + after, return_inverse=True)[1] + 1
        k *= 2
    return torch.sort(rank, stable=True).indices


def save_corpus(
    file: Path, docs: Sequence[Sequence[int]], model: str, vocab_size: int, hit_rates: Sequence = ()
) -> None:
    """The replies as one int32 tensor and their lengths, with the model they came from and the
    held-out hit rate of each evidence class (what the speculation policy starts from)."""
    flat = torch.tensor([t for d in docs for t in d], dtype=torch.int32)
    lengths = torch.tensor([len(d) for d in docs], dtype=torch.int32)
    meta = {"format": str(FORMAT), "model": model, "vocab_size": str(vocab_size), "hit_rates": json.dumps(hit_rates)}
    save_tensors(file, {"ids": flat, "lengths": lengths}, meta)


def load_corpus(file: Path, vocab_size: int) -> Corpus:
    """The corpus in `file`, indexed (UserError if it is unreadable or for another vocabulary)."""
    try:
        with safe_open(file, "pt") as f:
            meta = f.metadata() or {}
            ids, lengths = f.get_tensor("ids"), f.get_tensor("lengths")
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        raise UserError(f"The reply corpus {file} cannot be read ({e}).") from e
    if meta.get("format") != str(FORMAT) or meta.get("vocab_size") != str(vocab_size):
        raise UserError(f"The reply corpus {file} was made for another model or format; it is not used.")
    if int(lengths.sum()) != len(ids) or (len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size)):
        raise UserError(f"The reply corpus {file} is damaged; it is not used.")
    try:
        rates = json.loads(meta.get("hit_rates", "[]"))
        rates = [r if isinstance(r, (int, float)) and 0 <= r <= 1 else None for r in rates][:EVIDENCE_CLASSES]
    except (ValueError, TypeError):
        rates = []  # the policy's own priors then
    docs = torch.split(ids, lengths.tolist())
    return Corpus(SuffixIndex(d.tolist() for d in docs), rates)
