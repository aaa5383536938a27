"""Wall-clock time that is true on a GPU too.

A CUDA kernel returns before it has run, so time read right after launching work measures the
launch, not the work: every timed region must wait for the device at its start and its end.
Every timing in the project (a step and its drafting in the decode loop, the policy's and EAGLE's
measurements, the profile, the step-cost curve, the benchmark) reads the clock through `now`,
which waits for `device` first; on a CPU it is `time.perf_counter` alone. `time_ms` times a
function over repeats; it lives here, below everything that times itself (the lean backend times
its lm_head), so that no timing user has to import the profile.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device | str | None) -> None:
    """Wait for the work queued on `device` (nothing to wait for on a CPU)."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def now(device: torch.device | str | None = None) -> float:
    """Seconds on the performance counter, once `device`'s queued work has finished."""
    synchronize(device)
    return time.perf_counter()


def synchronizer(device: torch.device | str | None) -> Callable[[], None]:
    """`synchronize` bound to `device` (what `time_ms` takes)."""
    return lambda: synchronize(device)


def time_ms(
    fn: Callable[[], object], repeats: int = 5, sync: Callable[[], None] = lambda: None, fastest: bool = False
) -> float:
    """Median (or, `fastest`, the shortest) wall time of `fn` in ms, after one warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1000 * (min(times) if fastest else sorted(times)[len(times) // 2])
