"""Retrieval drafting's corpus: the model's own replies to seed prompts (distilled as for the
heads, `train.distill`), indexed; and how well it drafts on replies it does not hold.

`evaluate` replays each held-out reply as greedy decoding would meet it: at every step the
drafter proposes continuations of the history (prompt + reply so far), the step accepts the
longest prefix one of them shares with the reply, plus the model's own next token. That is
exactly what tree decoding would accept at temperature 0, as the replies are the model's own
greedy ones; the context lookup, retrieval and both (context first) are replayed alike.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from core.drafters.lookup import NgramIndex
from core.drafters.retrieval import EVIDENCE_CLASSES, RETRIEVAL_LENGTH, Corpus, SuffixIndex
from core.sequences import common_prefix

DRAFTS = ("context", "retrieval", "context+retrieval")  # what `evaluate` replays


def split(records: Sequence[dict], held_out: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(kept, held out): whole replies, a `held_out` share of them set aside at random."""
    order = sorted(records, key=lambda r: r["index"])
    random.Random(seed).shuffle(order)
    n = round(len(order) * held_out)
    return order[n:], order[:n]


def build(records: Sequence[dict]) -> tuple[Corpus, float]:
    """The replies' corpus and the seconds indexing took."""
    start = time.perf_counter()
    corpus = Corpus(SuffixIndex(r["answer_ids"] for r in records))
    return corpus, time.perf_counter() - start


def evaluate(
    corpus: Corpus,
    records: Sequence[dict],
    branches: int = 1,
    context_length: int = 4,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> dict:
    """Tokens per step of each of DRAFTS on `records` (greedy, as in the module's docstring), the
    retrieval's first-token hit rate by evidence class, and its mean lookup time."""
    tokens = {d: 0 for d in DRAFTS}
    steps = {d: 0 for d in DRAFTS}
    hits = [[0, 0] for _ in range(EVIDENCE_CLASSES)]  # [looked up, first token right]
    seconds, lookups = 0.0, 0
    for done, record in enumerate(records):
        prompt, reply = list(record["prompt_ids"]), list(record["answer_ids"])
        for draft in DRAFTS:
            index, t = NgramIndex(), 0
            while t < len(reply):
                history, truth = prompt + reply[:t], reply[t:]
                found: list[list[int]] = []
                if draft != "retrieval":
                    index.sync(history)
                    found = index.continuations(branches, context_length)
                if draft != "context" and not found:
                    start = time.perf_counter()
                    found, evidence = corpus.continuations(history, branches, RETRIEVAL_LENGTH)
                    seconds, lookups = seconds + time.perf_counter() - start, lookups + 1
                    if found and draft == "retrieval":
                        hits[evidence][0] += 1
                        hits[evidence][1] += found[0][0] == truth[0]
                accepted = max((common_prefix(c, truth) for c in found), default=0)
                t += accepted + 1
                steps[draft] += 1
            tokens[draft] += len(reply)
        progress(done + 1, len(records))
    return {
        "tokens_per_step": {d: round(tokens[d] / max(steps[d], 1), 3) for d in DRAFTS},
        "first_token_hits": [
            {"class": k, "lookups": n, "hit_rate": round(h / n, 3) if n else None} for k, (n, h) in enumerate(hits)
        ],
        "lookup_ms": round(1000 * seconds / max(lookups, 1), 4),
        "replies": len(records),
        "tokens": sum(len(r["answer_ids"]) for r in records),
    }
