"""The compute thread's shutdown: the job running ends, the jobs waiting are cancelled."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from app.worker import ComputeThread


def test_close_lets_a_cooperative_stream_end_cancels_queued_jobs_and_ends_the_thread():
    worker = ComputeThread()
    started = threading.Event()

    def reply():  # stops at its next step once the thread is closing, like core.decode.generate.stream
        started.set()
        n = 0
        while not worker.closing:
            n += 1
            yield n
        yield "cancelled"

    items = worker.stream(reply)
    assert next(items) == 1 and started.is_set()
    queued = worker.submit(lambda: "never")
    assert worker.close(timeout=5) and worker.closing
    assert list(items)[-1] == "cancelled"  # the stream's own ending is handed over, then it ends
    with pytest.raises(CancelledError):
        queued.result(timeout=1)
    with pytest.raises(CancelledError):
        worker.submit(lambda: "after close").result(timeout=1)
    assert worker.close(timeout=1)  # again: nothing left to do


def test_close_waits_for_the_running_job_up_to_the_timeout():
    worker, started, release = ComputeThread(), threading.Event(), threading.Event()

    def job() -> bool:
        started.set()
        return release.wait()

    running = worker.submit(job)
    assert started.wait(5)
    assert not worker.close(timeout=0.2)  # still busy: say so instead of abandoning it
    release.set()
    assert worker.close(timeout=5) and running.result(timeout=1) is True
