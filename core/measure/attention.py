"""Which attention kernels a GPU's decoding steps run with, measured on this machine.

A tree's verify forward hands PyTorch's attention a mask, and for a masked call PyTorch may pick
cuDNN's attention on Hopper GPUs (the H100 and H200), which builds an execution plan for each new
shape. Decoding grows the context at every step, so every step is a new shape: on an H200 a tree
step of the embedded model cost 2.5-3.2× a plain step, its attention taking ~26 ms of host time a
forward (docs/gpu.md). `choose` times a few steps at growing lengths, as decoding runs them, with
PyTorch's own choice and with cuDNN's kernels left out, and keeps the faster one by a clear margin
(PyTorch's choice on a tie). A CPU has nothing to choose: its steps keep PyTorch's choice.
"""

from __future__ import annotations

import statistics

import torch

from core.backends.base import ATTENTION, Backend
from core.decode.settings import DecodeSettings
from core.decode.step import accept, commit, prefill, verify
from core.drafters.base import Draft
from core.measure.clock import now
from core.measure.profile import shaped_tree

MARGIN = 0.9  # another choice must take under 90 % of the default's time to replace it
CONTEXT = 128  # tokens in the cache before the first timed step


def choose(backend: Backend, nodes: int = 8, steps: int = 6) -> str:
    """The key of `ATTENTION` whose tree steps of `nodes` nodes run fastest on `backend`'s device
    ("default" on a CPU, where nothing is measured)."""
    if backend.device.type != "cuda":
        return "default"
    median = {name: _median_step_ms(backend, name, nodes, steps) for name in ATTENTION}
    best = min(median, key=median.__getitem__)
    return best if median[best] < MARGIN * median["default"] else "default"


def _median_step_ms(backend: Backend, name: str, nodes: int, steps: int) -> float:
    """The median time of `steps` whole tree steps (verify → accept → commit) under the `name`
    kernels, each at a new context length, after one untimed step (first-call set-up)."""
    device = backend.device
    vocab = backend.model.config.get_text_config().vocab_size
    tokens = torch.tensor([(7919 * i) % vocab for i in range(1, CONTEXT + nodes + 1)], device=device)
    tree = shaped_tree(nodes).to(device)
    before, backend.attention = backend.attention, name
    cache, times, settings = backend.new_cache(), [], DecodeSettings()
    try:
        with torch.inference_mode(), backend.kernels():
            prefill(backend, cache, tokens[:CONTEXT])
            for _ in range(steps + 1):
                past = backend.length(cache)
                draft = Draft(tokens[CONTEXT : CONTEXT + nodes], tree)
                start = now(device)
                commit(backend, cache, past, accept(verify(backend, cache, draft), draft, settings, None))
                times.append(now(device) - start)
    finally:
        backend.attention = before
    return 1000 * statistics.median(times[1:])
