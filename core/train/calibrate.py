"""Calibration: the tree (and drafter) that maximises tokens per second on this machine.

Medusa §3.3.3 builds a tree greedily from per-head top-k accuracies. Here that is only the
first half; the second half is the hardware: a bigger tree accepts more tokens per step but
costs more per verify forward, and on a CPU the forward grows fast with the token count.

1) `Reply`: a greedy reply to a calibration prompt, and at every reply position the heads'
   top-k candidates and whether each equals the true token (one backbone pass per reply).
2) `rank_accuracies` → `greedy_tree` for every node budget.
3) Exact replay: greedy decoding accepts the longest drafted path that equals the greedy
   continuation, so replaying each reply step by step with a given tree (and the lookup
   branches the context gives at that point) yields the true tokens per step, without
   running the model again.
4) Expected speed = tokens per step / measured step latency at the tree's size; the best wins.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from core.backends.base import Backend
from core.decode.settings import DecodeSettings
from core.decode.step import accept, commit, prefill, verify
from core.decode.tree import build_tree
from core.drafters.base import Draft, NoDrafter
from core.drafters.estimates import BINS, bin_middles, greedy_order, interpolate, probability_bins
from core.drafters.fixed import LookupDrafter, MedusaDrafter
from core.drafters.lookup import NgramIndex, node_count
from core.measure.clock import time_ms
from core.train import runnable

LOOKUP_SETTINGS = ((1, 4), (2, 4), (3, 4), (1, 6), (2, 6), (3, 6), (4, 8))  # (branches, length) tried

# -- 1) positions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    ids: list[int]  # prompt + greedy reply
    start: int  # index of the reply's first token (the first step's root)
    match: Tensor  # (n, K, R) bool: at reply position j (root = ids[start + j]), head k's rank r is right
    probs: Tensor | None = None  # (n, K, R) the heads' probabilities of those candidates


def reply_positions(ids: list[int], start: int, candidates: Tensor, probs: Tensor | None = None) -> Reply:
    """`candidates` (n, K, R): the heads' top-R at the hidden state before each reply token.

    Root j is ids[start + j]; head k proposes ids[start + j + k + 1] (the root is the backbone's own)."""
    n, k_heads, _ = candidates.shape
    truth = torch.full((n, k_heads), -1, dtype=torch.long)
    for k in range(k_heads):
        ahead = torch.tensor(ids[start + k + 1 : start + n + k + 1], dtype=torch.long)
        truth[: len(ahead), k] = ahead
    return Reply(ids, start, candidates == truth[..., None], probs)


# -- 2) greedy trees --------------------------------------------------------------------------


def rank_accuracies(replies: Sequence[Reply]) -> Tensor:
    """(K, R): how often head k's rank-r candidate is the right token."""
    match = torch.cat([r.match for r in replies]).float()
    return match.mean(dim=0)


def reliability(replies: Sequence[Reply], prior: float = 5.0) -> Tensor:
    """(K, BINS): how often head k's candidates whose probability fell in each bin were right
    (every rank counted; `prior` pseudo-candidates at the bin's middle steady the sparse bins)."""
    probs = torch.cat([r.probs for r in replies])
    match = torch.cat([r.match for r in replies]).float()
    k_heads = probs.shape[1]
    bins = probability_bins(probs).flatten()
    count = torch.zeros(k_heads * BINS).index_add_(0, bins, torch.ones(bins.numel()))
    hits = torch.zeros(k_heads * BINS).index_add_(0, bins, match.flatten())
    return ((hits + prior * bin_middles().repeat(k_heads)) / (count + prior)).view(k_heads, BINS)


def greedy_tree(accuracy: Tensor, budget: int) -> list[list[int]]:
    """The `budget` rank paths with the highest estimated acceptance Π_k accuracy[k, r_k],
    grown from the root (each node's parent is added first, as §3.3.3 does)."""
    return [list(p) for p in greedy_order(accuracy, budget)[0]]


def expected_accept(accuracy: Tensor, paths: list[list[int]]) -> float:
    """Independence estimate of the drafted tokens accepted per step (§3.3.3)."""
    acc = accuracy.tolist()
    total = 0.0
    for p in paths:
        v = 1.0
        for k, r in enumerate(p):
            v *= acc[k][r]
        total += v
    return total


# -- 3) exact replay --------------------------------------------------------------------------


def medusa_accepts(reply: Reply, paths: list[list[int]]) -> list[int]:
    """At each reply position: drafted tokens the tree would have accepted there."""
    if not paths:
        return [0] * reply.match.shape[0]
    n = reply.match.shape[0]
    ok = torch.ones(n, len(paths), dtype=torch.bool)
    for i, p in enumerate(paths):
        for k, r in enumerate(p):
            ok[:, i] &= reply.match[:, k, r]
    depth = torch.tensor([len(p) for p in paths])
    return torch.where(ok, depth, 0).max(dim=1).values.tolist()


def lookup_accepts(reply: Reply, branches: int, length: int, max_ngram: int = 4) -> tuple[list[int], list[int]]:
    """At each reply position: tokens accepted from lookup branches, and the branches' node count."""
    index = NgramIndex(max_ngram)
    ids, start = reply.ids, reply.start
    n = reply.match.shape[0]
    accepts, nodes = [], []
    index.extend(ids[:start])
    for j in range(n):
        index.extend(ids[start + j : start + j + 1])  # the history up to root j, one token more per position
        found = index.continuations(branches, length) if branches else []
        truth = ids[start + j + 1 : start + j + 1 + length]
        best = 0
        for cont in found:
            same = 0
            while same < min(len(cont), len(truth)) and cont[same] == truth[same]:
                same += 1
            best = max(best, same)
        accepts.append(best)
        nodes.append(node_count(found))
    return accepts, nodes


@dataclass(frozen=True)
class Replay:
    tokens_per_step: float
    mean_nodes: float  # verify-forward tokens per step, root included


def replay(
    replies: Sequence[Reply], medusa: Sequence[list[int]], lookup: Sequence[tuple[list[int], list[int]]], tree_size: int
) -> Replay:
    """Walk each reply as greedy decoding does: the prefill makes root 0; a step at root j
    accepts the drafts that match and makes the next root. Counts steps as `bench` does."""
    tokens = steps = nodes = decode_steps = 0
    for reply, med, (look, look_nodes) in zip(replies, medusa, lookup, strict=True):
        n, j = reply.match.shape[0], 0
        steps += 1  # the prefill
        while j < n - 1:
            accepted = max(med[j], look[j])  # the merged tree holds exactly the union of both paths
            nodes += tree_size + look_nodes[j]  # an upper bound: lookups that repeat a head node are merged
            steps += 1
            decode_steps += 1
            j += accepted + 1
        tokens += n
    return Replay(tokens / max(steps, 1), nodes / max(decode_steps, 1))


# -- 4) latency and the choice ----------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    drafter: str  # "medusa", "lookup" or "hybrid"
    paths: list[list[int]]
    branches: int
    length: int
    tokens_per_step: float
    mean_nodes: float
    step_ms: float

    @property
    def tokens_per_second(self) -> float:
        return 1000 * self.tokens_per_step / self.step_ms


def search(
    replies: Sequence[Reply],
    budgets: Sequence[int],
    lookups: Sequence[tuple[int, int]],
    step_ms: Callable[[str, float], float],
) -> list[Candidate]:
    """Every (drafter, budget, lookup setting) replayed and priced; best first.

    `step_ms(drafter, nodes)` is the measured step latency of that drafter at that tree size."""
    accuracy = rank_accuracies(replies)
    looks = {cfg: [lookup_accepts(r, *cfg) for r in replies] for cfg in lookups}
    none = [([0] * r.match.shape[0], [0] * r.match.shape[0]) for r in replies]
    out = []
    for budget in budgets:
        paths = greedy_tree(accuracy, budget)
        medusa = [medusa_accepts(r, paths) for r in replies]
        options = [("medusa" if budget else "plain", 0, 0, none)]
        options += [("hybrid" if budget else "lookup", b, n, looks[(b, n)]) for b, n in lookups]
        for drafter, b, n, look in options:
            result = replay(replies, medusa, look, len(paths) + 1)
            ms = step_ms(drafter, result.mean_nodes)
            out.append(Candidate(drafter, paths, b, n, result.tokens_per_step, result.mean_nodes, ms))
    return sorted(out, key=lambda c: -c.tokens_per_second)


# -- measuring (needs the model) --------------------------------------------------------------


def head_candidates(model, heads, ids: list[int], start: int, top: int) -> tuple[Tensor, Tensor]:
    """(n, K, top) the heads' candidates before each reply token ids[start:] and their
    probabilities, from one forward."""
    with torch.inference_mode():
        out = runnable(model).base_model(input_ids=torch.tensor([ids], device=model.device))
        hidden = out.last_hidden_state[0, start - 1 : len(ids) - 1]  # the state that chose each root
        candidates, probs = heads.top(hidden, heads.num_heads, top)
        return candidates.cpu(), probs.float().cpu()


def verify_latency(backend: Backend, context: list[int], trees: dict[int, object], settings) -> dict[int, float]:
    """Verify + accept + cache commit time (ms) of one step, by tree size, after `context`."""
    cache = backend.new_cache()
    with torch.inference_mode():
        prefill(backend, cache, torch.tensor(context, device=backend.device))
    past = backend.length(cache)
    out = {}
    for size, tree in sorted(trees.items()):
        tokens = torch.tensor((context * (size // len(context) + 1))[:size], device=backend.device)  # real tokens

        def step(tokens: Tensor = tokens, tree=tree) -> None:
            with torch.inference_mode():
                draft = Draft(tokens, tree)
                result = accept(verify(backend, cache, draft), draft, settings, None)
                commit(backend, cache, past, result)
                backend.truncate(cache, past)  # back to the context

        out[size] = time_ms(step)
    return out


# -- the whole calibration --------------------------------------------------------------------


@dataclass(frozen=True)
class Calibration:
    ranked: list[Candidate]  # every option replayed and priced, fastest first
    replies: list[Reply]
    accuracy: Tensor  # (K, R) rank accuracies of the heads
    reliability: Tensor  # (K, BINS) how often candidates of each probability were right
    verify_ms: dict[int, float]  # step latency by node count
    heads_ms: float  # drafting with the heads
    lookup_ms: float  # drafting from the context
    plain_ms: float  # a plain step


def calibrate(
    backend: Backend, heads, encoded: Sequence[list[int]], eos_ids, pad: int, max_new_tokens: int,
    budgets: Sequence[int], lookups: Sequence[tuple[int, int]], progress: Callable[[int], None] = lambda n: None,
    say: Callable[[str], None] = lambda text: None,
) -> Calibration:  # fmt: skip
    """Greedy replies to `encoded` prompts, the heads' candidates at every reply position, this
    machine's step latency by tree size, and every (drafter, budget, lookup) option replayed."""
    from core.train import heads as train

    model = backend.model
    # 1) greedy replies and the heads' candidates at every reply position
    replies = []
    for b in range(0, len(encoded), 8):
        batch = list(encoded[b : b + 8])
        answers = train.greedy_answers(backend, batch, eos_ids, pad, max_new_tokens)
        for ids, answer in zip(batch, answers, strict=True):
            if len(answer) > 1:
                full = ids + answer
                replies.append(reply_positions(full, len(ids), *head_candidates(model, heads, full, len(ids), 10)))
        progress(len(batch))
    accuracy = rank_accuracies(replies)

    # 2) this machine: step latency by tree size, and what drafting costs
    say("timing verify forwards…")
    context = replies[0].ids
    sizes = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 80, min(budgets[-1], 128) + 1})
    built = (build_tree(greedy_tree(accuracy, n - 1)).to(model.device) for n in sizes)
    trees = {t.size: t for t in built}  # keyed by the size built: heads may have fewer useful ranks
    verify_ms = verify_latency(backend, context, trees, DecodeSettings())
    hidden = torch.zeros(model.config.get_text_config().hidden_size, device=model.device, dtype=model.dtype)
    root = torch.tensor(context[-1], device=model.device)
    medusa = MedusaDrafter(heads, trees[max(trees)])  # the deepest tree: every head computed
    heads_ms = time_ms(lambda: medusa.propose(hidden, root, context))
    lookup = LookupDrafter(None, 3, 6)
    lookup_ms = time_ms(lambda: lookup.propose(hidden, root, context))
    plain = NoDrafter(model.device)
    plain_ms = time_ms(lambda: plain.propose(hidden, root)) + verify_ms[1]

    def step_ms(kind: str, nodes: float) -> float:
        extra = {"plain": 0.0, "medusa": heads_ms, "lookup": lookup_ms, "hybrid": heads_ms + lookup_ms}[kind]
        return interpolate(verify_ms, nodes) + extra

    # 3) replay every option and price it
    ranked = search(replies, budgets, lookups, step_ms)
    return Calibration(ranked, replies, accuracy, reliability(replies), verify_ms, heads_ms, lookup_ms, plain_ms)
