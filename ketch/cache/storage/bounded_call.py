"""Blocking calls with a deadline: one daemon thread runs them, the caller waits at most
`timeout_s` for each.

For a client library whose calls can block for seconds when its server is gone and that has no
timeout of its own (Mooncake's store client: about 4.4 s per call while its master is down). The
caller gets `DeadlinePassed` and goes on; the call itself runs to its end on the worker, and while
it does, new calls fail at once with `WorkerBusy` instead of queueing behind it, so a dead server
costs one deadline, not one per page. A call still queued when its caller gave up is cancelled:
it never runs after its caller was told it failed.

This only bounds calls that release the GIL while they block; one that holds it (Mooncake's
`setup` and `close` do) stops the waiting thread as well.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

T = TypeVar("T")


class WorkerBusy(Exception):
    """The call was not started: a call past its deadline is still running, or the worker is closed."""


class DeadlinePassed(Exception):
    """The call did not finish within the deadline (it may still finish on the worker)."""


class BoundedWorker:
    def __init__(self, timeout_s: float, name: str) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._late: Future[Any] | None = None  # the last call that outlived its deadline
        self._closed = False
        self._lock = threading.Lock()
        # daemon: a call stuck in the library must not keep the process from exiting
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """Whether a call that passed its deadline is still running."""
        late = self._late
        return late is not None and not late.done()

    def run(self, call: Callable[[], T]) -> T:
        """call()'s result; its exception as is; WorkerBusy or DeadlinePassed (above)."""
        with self._lock:
            if self._closed or self.busy:
                raise WorkerBusy("closed" if self._closed else "a call past its deadline is still running")
            future: Future[T] = Future()
            self._jobs.put((call, future))
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            if not future.cancel():  # already running: it ends on the worker, later calls wait for it
                with self._lock:
                    self._late = future
            raise DeadlinePassed(f"no answer within {self.timeout_s} s") from None

    def close(self) -> None:
        """Stop the thread once the calls queued so far are done (it is a daemon: it never holds up exit)."""
        with self._lock:
            self._closed = True
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, future = job
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up while it was queued
            try:
                future.set_result(call())
            except BaseException as e:  # handed to the caller, who decides
                future.set_exception(e)
