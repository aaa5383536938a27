"""Medusa-1 head training by self-distillation (paper §3.2.1, §3.3.2), with a frozen backbone.

1) distill: the backbone answers seed prompts greedily, in batches; records are appended to a
   JSONL file per batch, so an interrupted run resumes where it stopped.
2) features: one backbone pass per transcript gives the last hidden states (after the final
   norm); they are computed once and kept, with the token ids they predict.
3) train: head k (0-based) at position t learns token t + k + 2 (the backbone's own lm_head
   predicts t + 1), with loss Σ_k λ^k · CE, on a held-out split; per-head top-1/top-5.

This module knows heads only as a module mapping (…, H) hidden states to (…, K, V) logits.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn
from transformers import PreTrainedModel

from core.backends.base import Backend
from core.decode.generate import collect, stream
from core.decode.settings import DecodeSettings
from core.errors import UserError
from core.files import save_tensors
from core.train import runnable

# -- 1) self-distillation ---------------------------------------------------------------------

# Sampled replies beside the greedy ones (more varied data for a drafter: a greedy reply often
# ends in a loop, a sampled one goes elsewhere); the temperature and top-p they are drawn at.
SAMPLED = DecodeSettings(temperature=0.8, top_p=0.95)
SEED_STRIDE = 1_000_003  # sampled reply k of prompt i: seed k · SEED_STRIDE + i (+ its length, where continued)


def done_records(out_file: Path) -> int:
    """How many prompts a previous run finished (complete lines only)."""
    if not out_file.exists():
        return 0
    lines = out_file.read_text(encoding="utf-8").splitlines()
    good = 0
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            break  # a line cut by an interruption: redo from here
        good += 1
    if good != len(lines):  # drop the partial tail so appends stay valid JSONL
        out_file.write_text("".join(line + "\n" for line in lines[:good]), encoding="utf-8")
    return good


def distill(
    backend: Backend,
    prompts: list[list[int]],
    out_file: Path,
    eos_ids: tuple[int, ...],
    pad_id: int,
    batch_size: int = 32,
    max_new_tokens: int = 160,
    progress: Callable[[int, int], None] = lambda done, total: None,
    sample: int = 0,
    indices: Iterable[int] | None = None,
) -> int:
    """Greedy answers to `prompts` (token ids), appended to `out_file`; returns records written.

    A record keeps its prompt's index: a rerun skips the replies already finished (ended by an
    end-of-turn token or `max_new_tokens` long) and continues those an earlier run cut at a lower
    cap, appending the longer reply (`read_records` keeps the last record of an index). Prompts
    are sorted by length so batches pad little. `sample` k > 0: each prompt's k-th sampled reply
    instead (`SAMPLED`, a generator seeded by k and the prompt's index). `indices`: only those
    prompts (default: all)."""
    done_records(out_file)  # drops a line an interruption cut
    have = {r["index"]: r for r in read_records(out_file)} if out_file.exists() else {}
    asked = sorted(set(range(len(prompts)) if indices is None else indices))
    finished = {i for i in asked if i in have and not unfinished(have[i], eos_ids, max_new_tokens)}
    todo = sorted(
        (i for i in asked if i not in finished),
        key=lambda i: len(prompts[i]) + len(have[i]["answer_ids"] if i in have else ()),
    )
    written = 0
    out_file.parent.mkdir(parents=True, exist_ok=True)
    progress(len(finished), len(asked))
    for b in range(0, len(todo), batch_size):
        batch = todo[b : b + batch_size]
        so_far = [have[i]["answer_ids"] if i in have else [] for i in batch]
        budget = max_new_tokens - min(map(len, so_far))
        asks = [prompts[i] + a for i, a in zip(batch, so_far, strict=True)]
        if sample:
            seeds = [SEED_STRIDE * sample + i + len(a) for i, a in zip(batch, so_far, strict=True)]
            answers = sampled_answers(backend, asks, eos_ids, budget, seeds)
        else:
            answers = greedy_answers(backend, asks, eos_ids, pad_id, budget)
        with out_file.open("a", encoding="utf-8") as f:
            for i, start, more in zip(batch, so_far, answers, strict=True):
                answer = start + more[: max_new_tokens - len(start)]
                f.write(json.dumps({"index": i, "prompt_ids": prompts[i], "answer_ids": answer}) + "\n")
        written += len(batch)
        progress(len(finished) + written, len(asked))
    return written


def sampled_answers(
    backend: Backend, prompts: list[list[int]], eos_ids: tuple[int, ...], max_new_tokens: int, seeds: list[int]
) -> list[list[int]]:
    """Each prompt's reply sampled as `SAMPLED` says, one prompt at a time through the project's
    own decoding loop, from a generator seeded with the prompt's seed."""
    settings = replace(SAMPLED, max_new_tokens=max_new_tokens)
    return [
        _own_loop(backend, prompt, settings, eos_ids, torch.Generator(backend.device).manual_seed(seed))
        for prompt, seed in zip(prompts, seeds, strict=True)
    ]


def _own_loop(
    backend: Backend, prompt: list[int], settings: DecodeSettings, eos_ids: tuple[int, ...],
    generator: torch.Generator | None = None,
) -> list[int]:  # fmt: skip
    """One reply through the project's own decoding loop (plain decoding, no drafter)."""
    return list(collect(stream(backend, prompt, settings, eos_ids=eos_ids, generator=generator))[1].token_ids)


def unfinished(record: dict, eos_ids: tuple[int, ...], max_new_tokens: int) -> bool:
    """Whether a reply stopped at a cap below `max_new_tokens` rather than at an end of turn."""
    answer = record["answer_ids"]
    return len(answer) < max_new_tokens and not (answer and answer[-1] in eos_ids)


def greedy_answers(
    backend: Backend, prompts: list[list[int]], eos_ids: tuple[int, ...], pad_id: int, max_new_tokens: int
) -> list[list[int]]:
    """Each prompt's greedy reply, up to and with its end-of-turn token.

    On a CPU with the lean forward (`core.backends.lean`), one prompt at a time through the project's own
    decoding loop: batching through transformers' `generate` re-copies the whole cache every step
    and runs 2–3× slower there. Elsewhere (a GPU), left-padded batches through `generate`."""
    model = backend.model
    if backend.layer_kernel is not None and model.device.type == "cpu":  # the lean forward's packed kernels
        settings = DecodeSettings(max_new_tokens=max_new_tokens)
        return [_own_loop(backend, p, settings, eos_ids) for p in prompts]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=list(eos_ids) or None, pad_token_id=pad_id,
        )  # fmt: skip
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        answers.append(row[:cut])
    return answers


def transcripts_key(records: Iterable[dict]) -> str:
    """A digest of the transcripts' token ids, in order: cached features are reused only for the
    same ones (a rerun may have continued replies without changing how many there are)."""
    ids = [(r["prompt_ids"], r["answer_ids"]) for r in records]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def read_records(file: Path) -> list[dict]:
    """The file's records, the last one of each index (a continued reply supersedes its start)."""
    records = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    return list({r["index"]: r for r in records}.values())


# -- 2) features ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Features:
    hidden: Tensor  # (N, H) last hidden state at each training position
    targets: Tensor  # (N, K) token each head must predict there (-100: past the end)
    source: Tensor | None = None  # (N,) transcript of each position, so splits keep transcripts whole

    def save(self, file: Path, transcripts: str) -> None:
        """Cache on disk (bf16 hidden states: half the size, ample for training), marked with the
        `transcripts_key` of the transcripts they were made from."""
        tensors = {"hidden": self.hidden.to(torch.bfloat16).contiguous(), "targets": self.targets.contiguous()}
        if self.source is not None:
            tensors["source"] = self.source.contiguous()
        save_tensors(file, tensors, {"transcripts": transcripts})

    @staticmethod
    def load(file: Path, transcripts: str, num_heads: int) -> Features | None:
        """The cached features if they were made from these transcripts for `num_heads` heads."""
        try:
            with safe_open(file, "pt") as f:
                if f.metadata().get("transcripts") != transcripts:
                    return None
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        except (OSError, ValueError, KeyError):
            return None
        if tensors["targets"].shape[1] != num_heads:
            return None
        return Features(tensors["hidden"].float(), tensors["targets"], tensors.get("source"))


def head_targets(ids: list[int], positions: range, num_heads: int) -> Tensor:
    """(len(positions), K): head k at position t predicts ids[t + k + 2], or -100 past the end."""
    rows = []
    for t in positions:
        rows.append([ids[t + k + 2] if t + k + 2 < len(ids) else -100 for k in range(num_heads)])
    return torch.tensor(rows, dtype=torch.long).reshape(len(positions), num_heads)


def features(
    model: PreTrainedModel, records: list[dict], num_heads: int, progress: Callable[[list], Iterable] = iter
) -> Features:
    """Hidden states of every answer position (from the prompt's last token on), one pass each."""
    hidden, targets, source = [], [], []
    with torch.inference_mode():
        for n, r in enumerate(progress(records)):
            ids = r["prompt_ids"] + r["answer_ids"]
            positions = range(len(r["prompt_ids"]) - 1, len(ids) - 2)  # something left for head 0
            if len(positions) == 0:
                continue
            out = runnable(model).base_model(input_ids=torch.tensor([ids], device=model.device))
            hidden.append(out.last_hidden_state[0, positions.start : positions.stop].float().cpu())
            targets.append(head_targets(ids, positions, num_heads))
            source.append(torch.full((len(positions),), n, dtype=torch.long))
    if not hidden:
        raise UserError(
            f"None of the {len(records)} transcripts is long enough to train on; "
            "use more prompts or a larger --max-new-tokens."
        )
    return Features(
        torch.cat(hidden).clone(), torch.cat(targets), torch.cat(source)
    )  # clone: a normal tensor, usable by autograd


# -- 3) training ------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadAccuracy:
    top1: tuple[float, ...]  # per head, on the held-out split
    top5: tuple[float, ...]
    loss: float  # weighted held-out loss


def split(n: int, held_out: float, seed: int = 0, source: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(train, held-out) position indices. With `source`, whole transcripts are held out, so
    neighbouring positions of one answer never sit on both sides."""
    if source is None:
        order = list(range(n))
        random.Random(seed).shuffle(order)
        cut = max(1, int(n * held_out))
        return torch.tensor(order[cut:]), torch.tensor(order[:cut])
    groups = sorted(set(source.tolist()))
    random.Random(seed).shuffle(groups)
    held = torch.tensor(groups[: max(1, int(len(groups) * held_out))])
    is_held = torch.isin(source.cpu(), held)
    return (~is_held).nonzero().squeeze(1), is_held.nonzero().squeeze(1)


def medusa_loss(logits: Tensor, targets: Tensor, decay: float) -> Tensor:
    """Σ_k decay^k · CE(logits[:, k], targets[:, k]); logits (B, K, V), targets (B, K)."""
    total = logits.new_zeros((), dtype=torch.float32)
    for k in range(logits.shape[1]):
        if (targets[:, k] != -100).any():
            total = total + decay**k * nn.functional.cross_entropy(
                logits[:, k].float(), targets[:, k], ignore_index=-100
            )
    return total


def evaluate(heads: nn.Module, data: Features, index: Tensor, decay: float, batch: int = 256) -> HeadAccuracy:
    k, device = data.targets.shape[1], data.targets.device
    hit1, hit5, count = (torch.zeros(k, device=device) for _ in range(3))
    loss, batches = 0.0, 0
    with torch.inference_mode():
        for b in range(0, len(index), batch):
            i = index[b : b + batch]
            with _fast_matmuls(data.hidden.device):
                logits, target = heads(data.hidden[i]).float(), data.targets[i]
            loss += medusa_loss(logits, target, decay).item()
            batches += 1
            top5 = logits.topk(5, dim=-1).indices  # (B, K, 5)
            valid = target != -100
            hit1 += ((top5[..., 0] == target) & valid).sum(0)
            hit5 += ((top5 == target[..., None]).any(-1) & valid).sum(0)
            count += valid.sum(0)
    count = count.clamp(min=1)
    return HeadAccuracy(tuple((hit1 / count).tolist()), tuple((hit5 / count).tolist()), loss / max(batches, 1))


def _fast_matmuls(device: torch.device):
    """bf16 matmuls with fp32 master weights: the (V, H) projection dominates training and
    runs about 3× faster in bf16 on CPUs with AVX512-BF16 (and on any modern GPU)."""
    return torch.autocast(device.type, dtype=torch.bfloat16)


def batches_per_epoch(n_train: int, batch_size: int) -> int:
    return math.ceil(n_train / batch_size)


def train(
    heads: nn.Module,
    data: Features,
    epochs: int = 5,
    lr: float = 1e-3,
    decay: float = 0.8,
    batch_size: int = 256,
    held_out: float = 0.1,
    weight_decay: float = 0.01,
    seed: int = 0,
) -> Iterator[tuple[int, float, HeadAccuracy | None]]:
    """Train in place; yields (step, loss) every batch and the held-out accuracy after each epoch."""
    shuffle = torch.Generator().manual_seed(seed)
    train_idx, val_idx = split(len(data.hidden), held_out, seed, data.source)
    params = [p for p in heads.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    steps = epochs * math.ceil(len(train_idx) / batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=max(steps, 1), pct_start=0.1)
    step = 0
    for _ in range(epochs):
        heads.train()
        order = train_idx[torch.randperm(len(train_idx), generator=shuffle)]
        for b in range(0, len(order), batch_size):
            i = order[b : b + batch_size]
            with _fast_matmuls(data.hidden.device):
                loss = medusa_loss(heads(data.hidden[i]), data.targets[i], decay)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
            yield step, loss.item(), None
        heads.eval()
        yield step, float("nan"), evaluate(heads, data, val_idx, decay)
