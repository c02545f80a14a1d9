"""BoundedWorker (ketch/cache/storage/bounded_call.py): a blocking call is given up at its deadline,
later calls fail at once while it still runs, a call whose caller gave up while it was queued
never runs, and a call's own exception reaches the caller unchanged. The blocking call is a real
thread waiting on an Event the test holds."""
from __future__ import annotations

import threading
import time

import pytest

from ketch.cache.storage.bounded_call import BoundedWorker, DeadlinePassed, WorkerBusy

TIMEOUT_S = 1.0  # also the bound of a call that must fail at once: a pause of this process stays under it
BOUND_S = TIMEOUT_S + 2.0  # slack for a loaded 2-core machine
DEADLINE_S = 10.0


def test_a_blocked_call_is_given_up_and_later_calls_fail_at_once_until_it_ends() -> None:
    worker = BoundedWorker(TIMEOUT_S, "test-worker")
    release, ran = threading.Event(), []
    start = time.monotonic()
    with pytest.raises(DeadlinePassed):
        worker.run(lambda: release.wait(DEADLINE_S))
    assert TIMEOUT_S <= time.monotonic() - start < BOUND_S and worker.busy
    start = time.monotonic()
    with pytest.raises(WorkerBusy):
        worker.run(lambda: ran.append("busy"))
    assert time.monotonic() - start < TIMEOUT_S  # no deadline spent: it was not even queued
    release.set()
    deadline = time.monotonic() + DEADLINE_S
    while worker.busy:  # the late call ends on the worker
        assert time.monotonic() < deadline, "the released call did not end"
        time.sleep(0.01)  # a poll interval
    assert worker.run(lambda: 41 + 1) == 42 and ran == []
    worker.close()
    with pytest.raises(WorkerBusy, match="closed"):
        worker.run(lambda: 0)


def test_a_queued_call_whose_caller_gave_up_never_runs() -> None:
    worker = BoundedWorker(TIMEOUT_S, "test-worker")
    release, started, ran, outcome = threading.Event(), threading.Event(), [], []

    def block() -> None:
        started.set()
        release.wait(DEADLINE_S)

    def first_caller() -> None:
        try:
            worker.run(block)
        except DeadlinePassed as e:
            outcome.append(e)

    first = threading.Thread(target=first_caller)
    first.start()
    assert started.wait(DEADLINE_S)
    with pytest.raises(DeadlinePassed):  # queued behind `block`, never started
        worker.run(lambda: ran.append("a write its caller was told had failed"))
    first.join(DEADLINE_S)
    assert len(outcome) == 1 and worker.busy  # `block` is the late one, still running
    release.set()
    deadline = time.monotonic() + DEADLINE_S
    while worker.busy:
        assert time.monotonic() < deadline, "the released call did not end"
        time.sleep(0.01)  # a poll interval
    assert worker.run(lambda: "after") == "after" and ran == []  # the given-up call was cancelled
    worker.close()


def test_the_calls_own_exception_reaches_the_caller() -> None:
    worker = BoundedWorker(TIMEOUT_S, "test-worker")

    def fail() -> None:
        raise KeyError("from the call")

    with pytest.raises(KeyError, match="from the call"):
        worker.run(fail)
    assert not worker.busy and worker.run(lambda: "still serving") == "still serving"
    with pytest.raises(ValueError, match="timeout_s"):
        BoundedWorker(0, "bad")
    worker.close()
