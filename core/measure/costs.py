"""This machine's step-cost curve for a loaded model: measured once, remembered, re-measured when needed.

The speculation policy needs what a verify step of n nodes costs here, against a one-node step,
and what drafting with the heads costs. `measure` times whole steps (verify → accept → commit)
of the profile's tree shapes on a real cache, a few seconds in all. `CurveStore` keeps one file
per model, dtype, forward, device, CPU kernels, threads and torch version, so a second launch
measures nothing; a file that is unreadable, from another format or for another machine is
measured again (one sentence on stderr). `StepCosts.steps` measures one size at a time, so the
chat can answer between sizes: the policy decodes with a cautious prior curve until the
measured one is there.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from core import heap
from core.backends import q4build
from core.backends.base import ATTENTION, Backend
from core.decode.settings import DecodeSettings
from core.decode.step import accept, commit, prefill, verify
from core.drafters.base import Draft, NoDrafter
from core.drafters.policy import RANKS, CostCurve
from core.measure import attention
from core.measure.clock import synchronizer, time_ms
from core.measure.profile import machine, shaped_tree
from core.measure.rates import RateMemory

MAX_NODES = 41  # the largest step the policy drafts: the root, 32 head nodes and 8 lookup nodes
# Every node count is measured, coarse ones first (what a cut budget leaves is still a curve): a
# step's cost is a staircase, not a line (torch's int4 CPU matmul works in blocks of 4 rows, so
# 5 nodes cost as much as 8), and a line between 4 and 6 nodes would price 5 at half a block less.
COARSE = (1, 2, 4, 8, 16, 32, MAX_NODES)
SIZES = COARSE + tuple(n for n in range(1, MAX_NODES + 1) if n not in COARSE)
CONTEXT = 128  # tokens already in the cache while timing (a short conversation)
FORMAT = 2  # bump when the file's meaning changes: older files are measured again
BUDGET_S = 15.0  # measuring stops adding sizes after this long (the largest are then extrapolated)


def curve_key(backend: Backend, heads: str | None) -> str:
    """Everything a measured curve depends on (`heads`: how they draft, None without heads)."""
    model = backend.model
    name = getattr(model.config, "_name_or_path", "") or model.config.model_type
    dtype = str(model.dtype).removeprefix("torch.")
    describe = backend.describe()
    return f"{name}|{dtype}|{describe}|heads={heads}|{machine(model.device).key}|kernels {q4build.source_id()}"


def measure(backend: Backend, heads, repeats: int = 3, budget_s: float = BUDGET_S) -> Iterator[CostCurve | None]:
    """Whole steps of each size in `SIZES` after a `CONTEXT`-token prompt (the fastest of
    `repeats`), then the heads' drafting time (0 without heads). Yields None after each size, so
    a caller can let other work run in between, and the curve last. Run it on the thread that
    runs the model: with OpenMP, a second thread's kernels run about half as fast."""
    device = backend.device
    sync = synchronizer(device)
    vocab = backend.model.config.get_text_config().vocab_size
    context = [(7919 * i) % vocab for i in range(1, CONTEXT + 1)]  # any real token ids
    settings = DecodeSettings()
    cache = backend.new_cache()
    spent = 0.0
    with torch.inference_mode():
        fwd = prefill(backend, cache, torch.tensor(context, device=device))
    past = backend.length(cache)
    hidden, root = fwd.hidden[-1], torch.tensor(context[-1], device=device)
    steps: dict[int, float] = {}
    for n in SIZES:
        if steps and spent > budget_s:
            break
        t0 = time.perf_counter()
        draft = Draft(torch.tensor(context[:n], device=device), shaped_tree(n).to(device))
        if n == 1:
            draft = NoDrafter(device).propose(hidden, root)
        with torch.inference_mode(), backend.kernels():
            steps[n] = time_ms(lambda d=draft: _step(backend, cache, past, d, settings), repeats, sync, fastest=True)
        spent += time.perf_counter() - t0
        heap.give_back()  # each size's working copies: a larger one fits no hole a smaller one left (+22 MB
        yield None  # for Gemma 3 270M's sizes 1-41, kept by the process's heap for good)
    heads_ms = 0.0
    if heads is not None:
        with torch.inference_mode():
            heads_ms = time_ms(lambda: heads.candidates(hidden, heads.num_heads, RANKS), repeats, sync, fastest=True)
    yield CostCurve(steps, heads_ms)


def _step(backend: Backend, cache, past: int, draft: Draft, settings: DecodeSettings) -> None:
    commit(backend, cache, past, accept(verify(backend, cache, draft), draft, settings, None))
    backend.truncate(cache, past)


class CurveStore:
    """Measured curves on disk, one JSON file per key."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, key: str) -> Path:
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"

    def load(self, key: str, say: Callable[[str], None] = lambda s: None) -> CostCurve | None:
        """The stored curve for `key`; None (and one sentence through `say`) if it is missing or unusable."""
        path = self.path(key)
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") != FORMAT or data.get("key") != key:
                raise ValueError("stale")
            steps = {int(n): float(ms) for n, ms in data["step_ms"].items()}
            heads_ms = float(data["heads_ms"])
            if 1 not in steps or not all(math.isfinite(v) and v > 0 for v in steps.values()) or heads_ms < 0:
                raise ValueError("bad figures")
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
            reason = "from another version" if str(e) == "stale" else "damaged"
            say(f"The stored step-cost profile {path.name} is {reason}; measuring this machine again.")
            path.unlink(missing_ok=True)
            return None
        return CostCurve(steps, heads_ms)

    def attention(self, key: str) -> str | None:
        """The attention kernels the stored curve was measured with (None: not stored)."""
        try:
            chosen = json.loads(self.path(key).read_text(encoding="utf-8")).get("attention")
        except (OSError, ValueError, AttributeError):
            return None
        return chosen if chosen in ATTENTION else None

    def save(self, key: str, curve: CostCurve, attention: str = "default") -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        data = {"format": FORMAT, "key": key, "step_ms": curve.step_ms, "heads_ms": curve.heads_ms}
        data["attention"] = attention
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(tmp, path)


def _stderr(text: str) -> None:
    print(text, file=sys.stderr)


class StepCosts:
    """The curve for one loaded model: from the store, else None until `measure` (or every step of
    `steps`) has run, which saves it."""

    def __init__(
        self, backend: Backend, heads, store: CurveStore, key: str, say: Callable[[str], None] = _stderr
    ) -> None:
        self.backend, self.heads, self.store, self.key, self.say = backend, heads, store, key, say
        self._curve = store.load(key, say)
        if self._curve is not None:  # steps run with the attention kernels the curve was measured with
            chosen = store.attention(key)
            if chosen is None and backend.device.type == "cuda":
                self._curve = None  # measured before a GPU's kernels were chosen: measured again
            backend.attention = chosen or "default"
        self.seconds: float | None = None  # how long measuring took (None: loaded from the store)

    def curve(self) -> CostCurve | None:
        return self._curve

    @property
    def needed(self) -> bool:
        return self._curve is None

    def steps(self) -> Iterator[None]:
        """Measure, one tree size per item (the caller may run other work between items)."""
        self.say("measuring what a decoding step costs on this machine (once, a few seconds)…")
        t0 = time.perf_counter()
        curve = None
        try:
            self.backend.attention = attention.choose(self.backend)
            if self.backend.attention != "default":
                self.say(f"attention kernels: {self.backend.attention} (measured faster here)")
            yield None
            for curve in measure(self.backend, self.heads):
                if curve is None:
                    yield None
            self.store.save(self.key, curve, self.backend.attention)
        except (RuntimeError, OSError, ValueError) as e:  # the policy keeps its prior curve
            self.say(f"Measuring the step cost failed ({type(e).__name__}: {e}); speculation stays cautious.")
            return
        self.seconds = time.perf_counter() - t0
        self._curve = curve
        self.say(f"step cost measured in {self.seconds:.1f} s")

    def rates(self, kind: str) -> RateMemory:
        """Where the switch between drafters of `kind` remembers its trials on this machine."""
        return RateMemory(self.store.folder, f"{self.key}|drafter {kind}", self.say)

    def measure(self) -> CostCurve | None:
        """Measure now, in this thread, if not known yet."""
        if self.needed:
            for _ in self.steps():
                pass
        return self._curve
