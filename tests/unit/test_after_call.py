"""Engine work a call leaves behind waits for its answer, and background
engine work yields to calls in flight (sandbox_runner/after_call.py)."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Iterator

import pytest

from sandbox_runner import after_call


def test_outside_a_call_a_job_runs_at_once() -> None:
    ran: list[str] = []
    after_call.later(lambda: ran.append("job"))
    assert ran == ["job"]


def test_a_calls_jobs_run_when_it_ends_in_order() -> None:
    ran: list[str] = []
    with after_call.deferred():
        after_call.later(lambda: ran.append("removal"))
        after_call.later(lambda: ran.append("refill"))
        ran.append("answer")
    assert ran == ["answer", "removal", "refill"]


def test_a_call_that_fails_still_runs_its_jobs() -> None:
    ran: list[str] = []
    with pytest.raises(RuntimeError), after_call.deferred():
        after_call.later(lambda: ran.append("removal"))
        raise RuntimeError("the call failed")
    assert ran == ["removal"]


def test_a_job_handed_over_after_the_call_ended_is_not_dropped() -> None:
    ran: list[str] = []
    with after_call.deferred():
        context = contextvars.copy_context()  # a thread that outlives the call
    context.run(after_call.later, lambda: ran.append("late"))
    assert ran == ["late"]


def test_background_work_goes_at_once_when_no_call_is_in_flight() -> None:
    started = time.monotonic()
    after_call.yield_to_calls(started, max_wait_s=5)
    assert time.monotonic() - started < 1


@contextlib.contextmanager
def a_call_in_flight() -> Iterator[None]:
    """A call in its deferred block on another thread, for as long as the block lasts."""
    in_call, release = threading.Event(), threading.Event()

    def call() -> None:
        with after_call.deferred():
            in_call.set()
            release.wait(5)

    t = threading.Thread(target=call)
    t.start()
    assert in_call.wait(5)
    try:
        yield
    finally:
        release.set()
        t.join(5)


def test_background_work_waits_for_the_call_in_flight_to_end() -> None:
    waited: list[float] = []

    def background() -> None:
        asked = time.monotonic()
        after_call.yield_to_calls(asked, max_wait_s=5)
        waited.append(time.monotonic() - asked)

    b = threading.Thread(target=background)
    with a_call_in_flight():
        b.start()
        b.join(0.05)
        assert b.is_alive()  # still yielding to the call
    b.join(5)
    assert waited and 0.04 < waited[0] < 4


def test_background_work_waits_no_longer_than_its_bound() -> None:
    with a_call_in_flight():
        asked = time.monotonic()
        after_call.yield_to_calls(asked, max_wait_s=0.05)
        waited = time.monotonic() - asked
    assert 0.045 < waited < 2
