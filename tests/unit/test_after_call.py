"""Engine work a call leaves behind waits for its answer, and background
engine work yields to calls in flight (sandbox_runner/after_call.py), the egress
network pool's refiller among it."""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Iterator

import pytest

from sandbox_runner import after_call
from sandbox_runner.egress.gateway import CallNetwork, NetworkPool


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


# -- the egress network pool's refiller yields like the warm pools' -----------------------------


class _Gateway:
    """What NetworkPool asks of its gateway, with the engine's work recorded."""

    def __init__(self) -> None:
        self.made: list[float] = []  # monotonic time of each network made
        self.removed: list[str] = []

    def _make_pooled_network(self, api: object) -> CallNetwork:
        self.made.append(time.monotonic())
        return CallNetwork(f"net-{len(self.made)}", "proxy-1", "10.0.0.2", "holder", 2**62)

    def _remove_network(self, api: object, name: str, proxy_id: str | None, holder: str) -> None:
        self.removed.append(name)


def _filled(pool: NetworkPool, gateway: _Gateway, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(pool.ready()) < count:
        assert time.monotonic() < deadline, f"the pool never reached {count}: {pool.ready()}"
        time.sleep(0.005)


def test_the_network_pool_refills_after_the_call_that_took_from_it_answers() -> None:
    gateway = _Gateway()
    pool = NetworkPool(gateway, 2)  # type: ignore[arg-type]
    try:
        assert pool.take(None, "proxy-1", 0) is None  # the first take starts the refiller
        _filled(pool, gateway, 2)
        with a_call_in_flight():
            taken_at = time.monotonic()
            assert pool.take(None, "proxy-1", 0) is not None
            time.sleep(0.1)
            assert len(gateway.made) == 2  # no engine work while the call runs
        _filled(pool, gateway, 2)
        assert gateway.made[2] - taken_at >= 0.1
    finally:
        pool.close()


def test_the_network_pool_yields_to_calls_no_longer_than_its_bound() -> None:
    """Under calls that never stop, a refill still comes, YIELD_S after the first take."""
    gateway = _Gateway()
    pool = NetworkPool(gateway, 1)  # type: ignore[arg-type]
    try:
        pool.take(None, "proxy-1", 0)
        _filled(pool, gateway, 1)
        with a_call_in_flight():
            taken_at = time.monotonic()
            assert pool.take(None, "proxy-1", 0) is not None
            _filled(pool, gateway, 1)
            waited = gateway.made[1] - taken_at
        assert after_call.YIELD_S * 0.9 < waited < after_call.YIELD_S + 2
    finally:
        pool.close()
