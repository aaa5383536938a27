"""EAGLE drafter training by self-distillation, beside Medusa head training (`train`), on the
same transcripts (the model's greedy replies to the seed prompts).

1) features: one backbone pass per batch of transcripts gives the feature (last hidden state
   after the final norm) at every position, after the streams at the draft's `taps` (EAGLE-3's
   multi-layer features) where it has them; saved in chunks, so an interrupted run resumes.
2) train: row t reads (feature t, token t + 1) and learns feature t + 1 (SmoothL1) and token
   t + 2 (cross-entropy over the draft vocabulary), on reply positions. Training-time test
   (EAGLE-3): pass k feeds each row the feature pass k − 1 predicted one position earlier,
   attending to the true rows before and its own predicted ancestors, exactly as drafting
   k tokens ahead sees them; every pass has the same targets.
3) evaluate: the held-out chain acceptance by depth (depth k given depths < k right), read off
   the same passes.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel

from core.drafters.eagle import EagleDraft
from core.files import save_tensors
from core.train import runnable
from core.train.heads import transcripts_key

CHUNK = 128  # transcripts per feature file
TOKENS_PER_BATCH = 4096  # padded tokens a training batch holds
DRAFT_VOCAB = 8192  # tokens the draft reads out over (97 % of the embedded model's reply tokens)


@dataclass(frozen=True)
class Sequence:
    ids: Tensor  # (n,) prompt then reply
    features: Tensor  # (n, (taps + 1)·H) bf16: the tapped streams, then the last feature
    prompt: int  # prompt length
    targets: Tensor | None = None  # (n,) the model's argmax after each position, where the reply was sampled


def draft_vocab(records: list[dict], size: int = DRAFT_VOCAB) -> Tensor:
    """The `size` tokens the model wrote most often in its replies (ascending ids)."""
    counts = Counter(t for r in records for t in r["answer_ids"])
    return torch.tensor(sorted(t for t, _ in counts.most_common(size)), dtype=torch.long)


def features(
    model: PreTrainedModel,
    records: list[dict],
    work: Path,
    batch_size: int = 16,
    progress: Callable[[int, int], None] = lambda done, total: None,
    taps: tuple[int, ...] = (),
    targets: bool = False,
) -> list[Sequence]:
    """Every transcript's features, computed in chunks of `CHUNK` transcripts (kept in `work`;
    a rerun loads the chunks already made with the same `taps` from the same transcripts).
    `targets`: also the model's argmax after every position, the token a sampled reply's
    positions are trained to draft (drafting at temperature 0 meets the argmax, not the sample)."""
    work.mkdir(parents=True, exist_ok=True)
    out: list[Sequence] = []
    for c in range(0, len(records), CHUNK):
        chunk = records[c : c + CHUNK]
        file = work / f"features-{c // CHUNK:04d}.safetensors"
        meta = {"records": str(len(chunk)), "taps": json.dumps(list(taps)), "transcripts": transcripts_key(chunk)}
        if targets:
            meta["targets"] = "argmax"
        loaded = _load_chunk(file, meta)
        if loaded is None:
            loaded = _chunk_features(model, chunk, batch_size, taps, targets)
            tensors = {f"{i}.features": s.features.contiguous() for i, s in enumerate(loaded)}
            tensors |= {f"{i}.ids": s.ids for i, s in enumerate(loaded)}
            tensors |= {f"{i}.targets": s.targets for i, s in enumerate(loaded) if s.targets is not None}
            save_tensors(file, tensors, meta)
        out += [
            Sequence(s.ids, s.features, len(r["prompt_ids"]), s.targets) for s, r in zip(loaded, chunk, strict=True)
        ]
        progress(len(out), len(records))
    return out


def _load_chunk(file: Path, meta: dict[str, str]) -> list[Sequence] | None:
    try:
        with safe_open(str(file), "pt") as f:
            found = f.metadata() or {}
            if any(found.get(k, "[]" if k == "taps" else None) != v for k, v in meta.items()):
                return None
            seqs = []
            for i in range(int(meta["records"])):
                targets = f.get_tensor(f"{i}.targets") if "targets" in meta else None
                seqs.append(Sequence(f.get_tensor(f"{i}.ids"), f.get_tensor(f"{i}.features"), 0, targets))
            return seqs
    except (OSError, ValueError, RuntimeError, SafetensorError):
        return None


def _chunk_features(
    model: PreTrainedModel, chunk: list[dict], batch_size: int, taps: tuple[int, ...], targets: bool = False
) -> list[Sequence]:
    seqs = [r["prompt_ids"] + r["answer_ids"] for r in chunk]
    result: list[Sequence | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            batch = order[b : b + batch_size]
            width = max(len(seqs[i]) for i in batch)
            ids = torch.tensor([seqs[i] + [0] * (width - len(seqs[i])) for i in batch], device=model.device)
            mask = torch.tensor([[1] * len(seqs[i]) + [0] * (width - len(seqs[i])) for i in batch])
            out = runnable(model).base_model(
                input_ids=ids, attention_mask=mask.to(model.device), output_hidden_states=bool(taps)
            )
            hidden = torch.cat([*(out.hidden_states[t] for t in taps), out.last_hidden_state], dim=-1)
            for row, i in enumerate(batch):
                n = len(seqs[i])
                argmax = (
                    model.get_output_embeddings()(out.last_hidden_state[row, :n]).argmax(-1).cpu() if targets else None
                )
                result[i] = Sequence(ids[row, :n].cpu(), hidden[row, :n].to(torch.bfloat16).cpu().clone(), 0, argmax)
    return result  # type: ignore[return-value]


# -- training ---------------------------------------------------------------------------------


def pass_mask(lengths: list[int], width: int, passes: int, dtype: torch.dtype) -> list[Tensor]:
    """The additive masks (B, 1, L, k·L) of passes k = 1..`passes`: row i of pass k sees the true
    rows s ≤ i − k + 1 and, of each later pass j, its own ancestor row i − k + j."""
    i = torch.arange(width)
    valid = i[None, :] < torch.tensor(lengths)[:, None]  # (B, L) real (unpadded) keys
    masks = []
    for k in range(1, passes + 1):
        blocks = [(i[None, :] <= (i[:, None] - k + 1))[None] & valid[:, None, :]]  # true rows
        for j in range(2, k + 1):
            blocks.append((i[None, :] == (i[:, None] - k + j))[None].expand(len(lengths), -1, -1))
        seen = torch.cat(blocks, dim=-1)  # (B, L, k·L)
        mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)
        masks.append(mask[:, None])
    return masks


@dataclass(frozen=True)
class Batch:
    features: Tensor  # (B, L, H) true features at rows t
    ids: Tensor  # (B, L) tokens t + 1 (0 past the end)
    feature_targets: Tensor  # (B, L, H) features t + 1
    token_targets: Tensor  # (B, L) draft index of token t + 2 (or the argmax there), -100 where not learned
    lengths: list[int]  # the draft reads draft.fused(features); feature_targets are last features


def make_batch(seqs: list[Sequence], to_draft: Tensor, hidden: int) -> Batch:
    """Rows t = 0 … n − 2 of each sequence; tokens learned on reply positions (t + 2 ≥ prompt).
    `hidden`: the width of the last feature (the last columns of a sequence's features)."""
    width = max(len(s.ids) - 1 for s in seqs)
    feats = torch.zeros(len(seqs), width, seqs[0].features.shape[1], dtype=torch.bfloat16)
    targets = torch.zeros(len(seqs), width, hidden, dtype=torch.bfloat16)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    tokens = torch.full((len(seqs), width), -100, dtype=torch.long)
    for b, s in enumerate(seqs):
        n = len(s.ids) - 1
        feats[b, :n] = s.features[:n]
        targets[b, :n] = s.features[1 : n + 1, -hidden:]
        ids[b, :n] = s.ids[1 : n + 1]
        start = max(s.prompt - 2, 0)
        chosen = s.ids[start + 2 : n + 1] if s.targets is None else s.targets[start + 1 : n]
        tokens[b, start : n - 1] = to_draft[chosen]
    return Batch(feats, ids, targets, tokens, [len(s.ids) - 1 for s in seqs])


def passes_forward(draft: EagleDraft, batch: Batch, passes: int) -> list[Tensor]:
    """(B, L, H) predicted features of each pass (see the module docstring)."""
    width = batch.ids.shape[1]
    positions = torch.arange(width)[None].expand(len(batch.lengths), -1)
    masks = pass_mask(batch.lengths, width, passes, torch.float32)
    cache = DynamicCache()
    true = draft.fused(batch.features.float())  # what the draft reads at a committed position
    inputs = true
    outs = []
    for k in range(passes):
        out = draft(inputs, batch.ids, positions, masks[k], cache)
        outs.append(out)
        inputs = torch.cat([true[:, :1], out[:, :-1].float()], dim=1)  # shifted one row
    return outs


def loss_of(draft: EagleDraft, outs: list[Tensor], batch: Batch, token_weight: float, decay: float) -> Tensor:
    """Σ_k decay^k (SmoothL1 + token_weight · CE), on the rows whose token is learned."""
    rows = batch.token_targets != -100
    target = batch.token_targets[rows]
    total = outs[0].new_zeros((), dtype=torch.float32)
    for k, out in enumerate(outs):
        regression = nn.functional.smooth_l1_loss(out[rows].float(), batch.feature_targets[rows].float())
        ce = nn.functional.cross_entropy(draft.logits(out[rows]).float(), target)
        total = total + decay**k * (regression + token_weight * ce)
    return total


def batches(seqs: list[Sequence], tokens_per_batch: int, order: list[int]) -> Iterator[list[Sequence]]:
    """Consecutive groups of `order` of about `tokens_per_batch` padded tokens each."""
    group: list[Sequence] = []
    for i in order:
        group.append(seqs[i])
        if len(group) * max(len(s.ids) for s in group) >= tokens_per_batch:
            yield group
            group = []
    if group:
        yield group


def count_batches(seqs: list[Sequence], tokens_per_batch: int, order: list[int]) -> int:
    return sum(1 for _ in batches(seqs, tokens_per_batch, order))


def train_epoch(
    draft: EagleDraft,
    optimizer: torch.optim.Optimizer,
    schedule,
    seqs: list[Sequence],
    to_draft: Tensor,
    order: list[int],
    passes: int,
    token_weight: float,
    decay: float,
    tokens_per_batch: int = TOKENS_PER_BATCH,
) -> Iterator[float]:
    """One epoch over `order`; yields each batch's loss."""
    draft.train()
    for group in batches(seqs, tokens_per_batch, order):
        batch = make_batch(group, to_draft, draft.fc.out_features)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs = passes_forward(draft, batch, passes)
            loss = loss_of(draft, outs, batch, token_weight, decay)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        yield float(loss.detach())


def evaluate(
    draft: EagleDraft, seqs: list[Sequence], to_draft: Tensor, passes: int, tokens_per_batch: int = 8192
) -> dict:
    """Held-out chain acceptance: for a draft starting after true row s, depth k is pass k's
    top-1 at row s + k − 1; `acceptance[k]` is P(depth k right | depths < k right), and
    `chain_tokens_per_step` the mean tokens a chain of `passes` would give (root included)."""
    draft.eval()
    right: list[Tensor] = []  # per pass, (rows,) bool over every (sequence, row) in order
    valid: list[Tensor] = []
    loss = 0.0
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        for group in batches(seqs, tokens_per_batch, list(range(len(seqs)))):
            batch = make_batch(group, to_draft, draft.fc.out_features)
            outs = passes_forward(draft, batch, passes)
            loss += float(loss_of(draft, outs, batch, 1.0, 1.0)) * len(group)
            per_pass = [draft.logits(o).argmax(-1) == batch.token_targets for o in outs]  # (B, L)
            for b, n in enumerate(batch.lengths):
                right.append(torch.stack([p[b, :n] for p in per_pass]))  # (passes, n)
                valid.append(batch.token_targets[b, :n] != -100)
    reached = [0] * passes
    kept = [0] * passes
    tokens, starts = 0.0, 0
    for r, v in zip(right, valid, strict=True):
        n = r.shape[1]
        for s in range(n):
            if not v[s]:
                continue
            starts += 1
            tokens += 1
            for k in range(passes):
                row = s + k
                if row >= n or not v[row]:
                    break
                reached[k] += 1
                if not r[k, row]:
                    break
                kept[k] += 1
                tokens += 1
    acceptance = [kept[k] / reached[k] if reached[k] else 0.0 for k in range(passes)]
    return {
        "acceptance": [round(a, 4) for a in acceptance],
        "chain_tokens_per_step": round(tokens / max(starts, 1), 4),
        "loss": round(loss / max(len(seqs), 1), 4),
    }


def optimizer_for(draft: EagleDraft, lr: float, steps: int):
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=max(steps, 1), pct_start=0.05)
    return optimizer, schedule


def epoch_orders(n: int, epochs: int, seed: int) -> list[list[int]]:
    """The shuffled order of the `n` training sequences in each epoch."""
    rng = random.Random(seed)
    orders = []
    for _ in range(epochs):
        order = list(range(n))
        rng.shuffle(order)
        orders.append(order)
    return orders


def total_batches(seqs: list[Sequence], epochs: int, seed: int) -> int:
    return sum(count_batches(seqs, TOKENS_PER_BATCH, o) for o in epoch_orders(len(seqs), epochs, seed))


def to_draft_index(vocab: Tensor, vocab_size: int) -> Tensor:
    """(V,) each token's index in the draft vocabulary, -100 for tokens outside it."""
    index = torch.full((vocab_size,), -100, dtype=torch.long)
    index[vocab] = torch.arange(len(vocab))
    return index


def fit(
    draft: EagleDraft,
    train_seqs: list[Sequence],
    held: list[Sequence],
    epochs: int,
    lr: float,
    passes: int,
    work: Path,
    token_weight: float = 1.0,
    decay: float = 0.8,
    seed: int = 0,
    progress: Callable[[int, float], None] = lambda batches, loss: None,
    on_epoch: Callable[[int, dict], None] = lambda epoch, result: None,
) -> tuple[dict, int]:
    """Train `draft` in place for `epochs`; after each epoch the held-out chain acceptance is
    measured and the weights saved in `work` (a rerun resumes after the last finished epoch).
    The epoch whose chain gives the most tokens per step is loaded back at the end.
    Returns (that epoch's held-out result, its epoch)."""
    from safetensors.torch import load_file

    to_draft = to_draft_index(draft.vocab, draft.vocab_size)
    orders = epoch_orders(len(train_seqs), epochs, seed)
    per_epoch = [count_batches(train_seqs, TOKENS_PER_BATCH, o) for o in orders]
    optimizer, schedule = optimizer_for(draft, lr, sum(per_epoch))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "epochs.jsonl"
    done: list[dict] = []
    if log.exists():
        done = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]
        done = [d for d in done if (work / f"epoch-{d['epoch']}.safetensors").exists()][:epochs]
    if done:  # resume: the last finished epoch's weights, the schedule advanced past it
        draft.load_state_dict(load_file(str(work / f"epoch-{done[-1]['epoch']}.safetensors")))
        for _ in range(sum(per_epoch[: len(done)])):
            schedule.step()
        progress(sum(per_epoch[: len(done)]), math.nan)
        for d in done:
            on_epoch(d["epoch"], d["result"])
    for epoch in range(len(done) + 1, epochs + 1):
        for loss in train_epoch(draft, optimizer, schedule, train_seqs, to_draft, orders[epoch - 1], passes,
                                token_weight, decay):  # fmt: skip
            progress(1, loss)
        result = evaluate(draft, held, to_draft, passes + 1)
        save_tensors(work / f"epoch-{epoch}.safetensors", {k: v.detach() for k, v in draft.state_dict().items()})
        with log.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"epoch": epoch, "result": result}) + "\n")
        done.append({"epoch": epoch, "result": result})
        on_epoch(epoch, result)
    best = max(done, key=lambda d: d["result"]["chain_tokens_per_step"])
    draft.load_state_dict(load_file(str(work / f"epoch-{best['epoch']}.safetensors")))
    return best["result"], best["epoch"]
