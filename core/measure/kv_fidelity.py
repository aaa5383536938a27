"""Whether a model keeps its answers with its keys and values in 8 bits: measured on its own
weights, once, against bf16 keys and values.

8-bit keys and values (one scale a row: `StaticKV(bits=8)`) halve what a step reads at long
contexts, and most models barely notice: the embedded SmolLM2-135M's top-1 agreement with its
file's exact answer went from 94.5 % to 94.4 % (767 positions). Gemma 3 270M (heads of 256: one
scale for 256 values a row) went from 96.2 % to 92.2 %, 4 points under llama.cpp's own; which of
its keys or values lose most was not measured. So the choice is the model's: the mean KL divergence of its next-token
distributions with 8-bit keys and values from those with bf16 ones, teacher-forced over a fixed
text (the calibration prompts), must stay under `KV8_KL` (measured: the embedded model 0.008,
Gemma 3 270M 0.012 nats; a random-weight 1.7B model 0.002).
"""

from __future__ import annotations

import torch
from torch import Tensor

KV8_KL = 0.01  # nats: the most mean divergence 8-bit keys and values may add
SKIP = 32  # first positions left out (too little context to say much)
FLOATS = 1 << 20  # logits made at a time (4 MB of float32: a 262k vocabulary's 4 positions, a 49k one's 21)


def kv8_divergence(backend, ids: Tensor) -> float:
    """The mean KL divergence (nats) of the next-token distributions with 8-bit keys and values from
    those with bf16 ones over the prompt `ids` (read at once), past its first `SKIP` positions.
    `backend`: a lean one (`backend.forward.new_cache(bits)`). The logits are made `FLOATS` at a
    time: a 262k vocabulary's over 512 positions would take 0.5 GB each, and 16 positions' working
    copies ~90 MB (a first launch's peak memory, measured: 869 MB for Gemma 3 270M)."""
    hidden = {}
    for bits in (16, 8):
        with torch.inference_mode():
            hidden[bits] = backend.prefill(backend.forward.new_cache(bits), ids)[0][SKIP:]
    total, count = 0.0, len(hidden[16])
    rows = max(1, min(16, FLOATS // backend.model.config.get_text_config().vocab_size))
    for start in range(0, count, rows):
        with torch.inference_mode():
            bf16, eight = (
                backend.logits(hidden[b][start : start + rows]).full().float().log_softmax(-1) for b in (16, 8)
            )
        total += float(torch.nn.functional.kl_div(eight, bf16, log_target=True, reduction="sum"))
    return total / max(count, 1)
