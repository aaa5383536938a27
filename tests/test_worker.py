"""The compute thread's shutdown: what runs stops at its next item, what waits is cancelled."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest

from core.worker import ComputeThread


def test_close_stops_a_stream_cancels_queued_jobs_and_ends_the_thread():
    worker = ComputeThread()
    started, produced = threading.Event(), []

    def endless():
        started.set()
        while True:
            produced.append(len(produced))
            yield produced[-1]

    items = worker.stream(endless)
    assert next(items) == 0 and started.is_set()
    queued = worker.submit(lambda: "never")
    worker.close(timeout=5)
    assert not worker._thread.is_alive()
    with pytest.raises(CancelledError):
        queued.result(timeout=1)
    with pytest.raises(CancelledError):
        worker.submit(lambda: "after close").result(timeout=1)
    rest = list(items)  # what was handed over before the stop, then the end (no hang)
    assert rest == list(range(1, len(rest) + 1))
    n = len(produced)
    time.sleep(0.05)
    assert len(produced) == n  # the generator is no longer driven
