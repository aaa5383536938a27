"""A loaded model's keys and values in 8 bits only where they keep its answers
(`core.measure.kv_fidelity`), measured once per model (its folder: a hub snapshot, or a GGUF
file's conversion key) and machine, and remembered with the kernel choices."""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path

import torch

from core import heap
from core.backends import stepops
from core.measure import cpu_attention, kernels, kv_fidelity

TOKENS = 512  # of the calibration prompts, read at once


def faithful(backend, config, tokenizer, folder: Path, record: Path, rebuild):
    """`backend`, or where its 8-bit keys and values diverge by more than `kv_fidelity.KV8_KL`,
    `rebuild()`'s backend after choosing bf16 ones (and the attention kernel for them)."""
    forward = getattr(backend, "forward", None)
    if getattr(forward, "kv_bits", 16) != 8 or getattr(forward, "native", None) is None:
        return backend
    # with the attention kernel the model runs: the dot-product ones round each query to int8 too
    key = kernels.record_key("kv8 divergence", str(folder), f"{stepops.attention()} attention")
    positions = getattr(config, "max_position_embeddings", None) or TOKENS
    divergence = kernels.recall(record, key, float, lambda _: _measure(backend, _text(tokenizer, positions)))
    if divergence <= kv_fidelity.KV8_KL:
        return backend
    print(
        f"Keys and values kept in bf16: in 8 bits they would change this model's answers "
        f"(divergence {divergence:.3f} > {kv_fidelity.KV8_KL} nats).",
        file=sys.stderr,
    )
    cpu_attention.use_measured(config, int4=True, record=record, kv8=False)
    return rebuild()


def _measure(backend, ids: torch.Tensor) -> float:
    """The divergence, its working copies (a 262k vocabulary's logits: MBs each) each given back
    to the system when freed, not kept in the heap beside the model (Gemma 3 270M's first
    launch peaked 17 MB lower)."""
    print("checking this model's answers with 8-bit keys and values (once, two prompt reads)…", file=sys.stderr)
    with heap.large_blocks_apart():
        divergence = kv_fidelity.kv8_divergence(backend, ids)
    heap.give_back()
    return divergence


def _text(tokenizer, positions: int) -> torch.Tensor:
    """The first `TOKENS` tokens of the calibration prompts, one after another (at most half the
    model's `positions`)."""
    file = Path(str(resources.files("assets") / "prompts" / "calibration.jsonl"))
    lines = file.read_text(encoding="utf-8").splitlines()
    text = "\n\n".join(json.loads(line)["prompt"] for line in lines if line.strip())
    return torch.tensor(tokenizer(text)["input_ids"][: min(TOKENS, positions // 2)])
