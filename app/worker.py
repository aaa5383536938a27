"""One thread for all of a process's model work.

torch's CPU kernels run on OpenMP, and OpenMP keeps a pool of worker threads per thread that
starts parallel work. Once one thread has used the pool, kernels started from any other thread
run about half as fast on a small CPU (measured: a 576×3072 int4 matmul takes 57 µs from the
first thread, 131 µs from a second one; a whole decode step 14 ms against 25 ms). A UI serves
each request from some thread of its own, so it hands all model work (loading, decoding,
measuring) to a `ComputeThread`, which runs jobs one at a time, in order, on one thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")
_END = object()
_CLOSE = object()  # the job that ends the thread


class ComputeThread:
    def __init__(self, name: str = "medusa-compute") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future]] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if fn is _CLOSE:
                return
            if self._closing.is_set():
                future.cancel()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to whoever waits on the future
                future.set_exception(e)

    @property
    def closing(self) -> bool:
        """True once `close` was called: long work (a reply) should end at its next step."""
        return self._closing.is_set()

    def close(self, timeout: float | None = None) -> bool:
        """End the thread after the job running now, which is waited for (up to `timeout`
        seconds): a process that exits while torch works on another thread aborts. Jobs still
        queued are cancelled (their futures raise CancelledError), and so is any submitted later.
        True once the thread has ended."""
        if not self._closing.is_set():
            self._closing.set()
            self._jobs.put((_CLOSE, Future()))  # type: ignore[arg-type]
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` after the jobs already queued; its result (or exception) comes through the future."""
        future: Future[T] = Future()
        if self._closing.is_set():  # never runs: waiting on it raises CancelledError
            future.cancel()
        else:
            self._jobs.put((fn, future))
        return future

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` here and wait for it (from the compute thread itself: run it at once)."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.submit(fn).result()

    def stream(self, make: Callable[[], Iterator[T]]) -> Iterator[T]:
        """Iterate `make()` on the compute thread, its items handed over as they come. Closing the
        returned iterator early stops the work at its next item."""
        items: queue.SimpleQueue = queue.SimpleQueue()
        abandoned = threading.Event()

        def job() -> None:
            try:
                for item in make():
                    if abandoned.is_set():
                        break
                    items.put((True, item))
            except BaseException as e:
                items.put((False, e))
            finally:
                items.put((True, _END))

        # a job dropped by `close` never runs: the stream then ends with no items
        self.submit(job).add_done_callback(lambda f: f.cancelled() and items.put((True, _END)))
        try:
            while True:
                ok, item = items.get()
                if not ok:
                    raise item
                if item is _END:
                    return
                yield item
        finally:
            abandoned.set()
