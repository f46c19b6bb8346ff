"""The sandbox budget (execution/admission.py), beyond test_trust_logic.py:
slots and their release, the bounded waiting queue and its AtCapacity answer,
waiting for memory rather than a slot, reservations (reserve, claim, release)
and their counters, when ``on_pressure`` is asked to give room back (and when
not), and a waiting call cancelled by its client. Threads with short waits;
nothing here takes a second."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from registry_server.domain.errors import AtCapacity, QuotaExceeded
from registry_server.execution.admission import (
    CANCEL_CHECK_S,
    Admission,
    Cancelled,
    ClientLimits,
)
from registry_server.execution.quotas import Rate, RateLimits

JOIN_S = 5.0  # seconds: the longest any thread is waited for (a loaded machine is slow)
ENTERED: list[Caller] = []  # every Caller, in the order it got its slot


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + JOIN_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.002)


def counters(admission: Admission) -> tuple[int, int, int, int]:
    return admission.running, admission.waiting, admission.reserved, admission.memory_mb


class Caller:
    """One call in its own thread: takes a slot, holds it until told to leave."""

    def __init__(
        self, admission: Admission, memory_mb: int = 0, cancel: threading.Event | None = None,
        client: str = "",
    ) -> None:  # fmt: skip
        self._admission = admission
        self._memory_mb = memory_mb
        self.client = client
        self.cancel = cancel if cancel is not None else threading.Event()
        self.entered = threading.Event()
        self.leave = threading.Event()
        self.error: BaseException | None = None
        self.order: list[Caller] = ENTERED
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            with self._admission.slot(self.cancel, self._memory_mb, self.client):
                self.order.append(self)  # before entered is set: the test reads it then
                self.entered.set()
                self.leave.wait(JOIN_S)
        except BaseException as exc:  # handed to the test thread
            self.error = exc

    def start(self) -> Caller:
        self._thread.start()
        return self

    def finish(self) -> None:
        self.leave.set()
        self._thread.join(JOIN_S)
        assert not self._thread.is_alive()


def refused(admission: Admission, memory_mb: int = 0) -> AtCapacity:
    """The AtCapacity a call gets at once; a call that queues instead is
    cancelled after JOIN_S and fails the test with Cancelled, never hangs it."""
    cancel = threading.Event()
    timer = threading.Timer(JOIN_S, cancel.set)
    timer.start()
    try:
        with pytest.raises(AtCapacity) as info, admission.slot(cancel, memory_mb):
            pytest.fail("a call past capacity must not run")
    finally:
        timer.cancel()
    return info.value


def counting(asked: list[int], answer: bool = False) -> Callable[[], bool]:
    """An on_pressure callback that records each time it is asked."""

    def reclaim() -> bool:
        asked.append(1)
        return answer

    return reclaim


def queued(admission: Admission, count: int = 1) -> None:
    wait_until(lambda: admission.waiting == count, f"{count} call(s) wait")


# ----------------------------------------------------------------------- slots


def test_slots_are_counted_and_given_back_even_when_the_call_fails() -> None:
    admission = Admission(max_running=2, max_waiting=0, memory_budget_mb=1000)
    with admission.slot(memory_mb=100):
        with admission.slot(memory_mb=200):
            assert counters(admission) == (2, 0, 0, 300)
        assert counters(admission) == (1, 0, 0, 100)
    with pytest.raises(ValueError, match="tool broke"), admission.slot(memory_mb=100):
        raise ValueError("tool broke")
    assert counters(admission) == (0, 0, 0, 0)


def test_no_waiting_room_means_an_immediate_refusal_that_counts_everything() -> None:
    admission = Admission(max_running=2, max_waiting=0)
    warm = admission.reserve(0)
    assert warm is not None
    with admission.slot():
        started = time.monotonic()
        error = refused(admission)
        assert time.monotonic() - started < CANCEL_CHECK_S  # refused at once, no waiting
    assert error.message == (
        "server at capacity: 1 sandboxes running, 1 warm and 0 calls queued; retry later"
    )
    assert counters(admission) == (0, 0, 1, 0)


def test_the_queue_holds_max_waiting_calls_and_refuses_the_next() -> None:
    admission = Admission(max_running=1, max_waiting=2)
    holder = Caller(admission).start()
    assert holder.entered.wait(JOIN_S)
    first, second = Caller(admission).start(), Caller(admission).start()
    queued(admission, 2)
    assert refused(admission).message == (
        "server at capacity: 1 sandboxes running, 0 warm and 2 calls queued; retry later"
    )
    assert counters(admission) == (1, 2, 0, 0)

    holder.finish()  # one slot frees: exactly one waiter gets it
    wait_until(lambda: first.entered.is_set() or second.entered.is_set(), "a waiter runs")
    assert counters(admission)[:2] == (1, 1)
    runner, other = (first, second) if first.entered.is_set() else (second, first)
    runner.finish()
    assert other.entered.wait(JOIN_S)
    other.finish()
    assert counters(admission) == (0, 0, 0, 0)
    assert (holder.error, first.error, second.error) == (None, None, None)


def test_a_call_waits_for_memory_while_slots_are_free() -> None:
    admission = Admission(max_running=4, max_waiting=1, memory_budget_mb=100)
    big = Caller(admission, memory_mb=80).start()
    assert big.entered.wait(JOIN_S)
    waiting = Caller(admission, memory_mb=30).start()
    queued(admission)
    assert not waiting.entered.is_set()
    assert counters(admission) == (1, 1, 0, 80)
    big.finish()
    assert waiting.entered.wait(JOIN_S)
    assert counters(admission) == (1, 0, 0, 30)
    waiting.finish()
    assert (big.error, waiting.error) == (None, None)


# ----------------------------------------------------------------- reservations


def test_a_reservation_needs_memory_as_well_as_a_slot() -> None:
    admission = Admission(max_running=4, max_waiting=0, memory_budget_mb=100)
    first = admission.reserve(60)
    assert first is not None and (first.memory_mb, first.released) == (60, False)
    assert admission.reserve(50) is None  # 110 > 100
    second = admission.reserve(40)  # exactly the budget
    assert second is not None
    assert counters(admission) == (0, 0, 2, 100)
    assert refused(admission, memory_mb=1).message.startswith("server at capacity:")


def test_claiming_turns_the_reservation_into_the_calls_slot_without_waiting() -> None:
    admission = Admission(max_running=1, max_waiting=0, memory_budget_mb=100)
    warm = admission.reserve(70)
    assert warm is not None
    with admission.claim(warm):  # the server is full, yet the claim does not wait
        assert warm.released
        assert counters(admission) == (1, 0, 0, 70)
        admission.release(warm)  # the pool letting go of a claimed container: no effect
        assert counters(admission) == (1, 0, 0, 70)
    assert counters(admission) == (0, 0, 0, 0)


def test_a_reservation_is_claimed_at_most_once_and_never_after_release() -> None:
    admission = Admission(max_running=2, max_waiting=0)
    claimed = admission.reserve(10)
    released = admission.reserve(10)
    assert claimed is not None and released is not None
    with admission.claim(claimed):
        pass
    with (
        pytest.raises(RuntimeError, match="a released reservation cannot be claimed"),
        admission.claim(claimed),
    ):
        pass
    admission.release(released)
    with (
        pytest.raises(RuntimeError, match="a released reservation cannot be claimed"),
        admission.claim(released),
    ):
        pass
    assert counters(admission) == (0, 0, 0, 0)


def test_releasing_a_reservation_wakes_a_waiting_call() -> None:
    admission = Admission(max_running=1, max_waiting=1)  # no on_pressure registered
    warm = admission.reserve(0)
    assert warm is not None
    caller = Caller(admission).start()
    queued(admission)
    assert not caller.entered.is_set()
    admission.release(warm)
    assert caller.entered.wait(JOIN_S)
    assert counters(admission) == (1, 0, 0, 0)
    caller.finish()
    assert caller.error is None
    assert admission.reserve(0) is not None  # nobody waits: warm containers are welcome again


# ------------------------------------------------------------------ on_pressure


def test_pressure_is_not_applied_while_the_call_fits() -> None:
    admission = Admission(max_running=2, max_waiting=1)
    asked: list[int] = []
    admission.on_pressure(counting(asked))
    assert admission.reserve(0) is not None
    with admission.slot():
        assert counters(admission) == (1, 0, 1, 0)
    assert asked == []


def test_pressure_is_not_applied_when_calls_hold_the_room() -> None:
    """Reclaiming gives back warm containers only; running calls are never asked."""
    admission = Admission(max_running=1, max_waiting=1)
    asked: list[int] = []
    admission.on_pressure(counting(asked))
    holder = Caller(admission).start()
    assert holder.entered.wait(JOIN_S)
    waiter = Caller(admission).start()
    queued(admission)
    time.sleep(CANCEL_CHECK_S)  # at least one more turn of the waiting loop
    holder.finish()
    assert waiter.entered.wait(JOIN_S)
    waiter.finish()
    assert asked == []
    assert (holder.error, waiter.error) == (None, None)


def test_a_waiting_call_reclaims_memory_held_by_a_warm_container() -> None:
    admission = Admission(max_running=4, max_waiting=1, memory_budget_mb=100)
    warm = admission.reserve(80)
    assert warm is not None
    asked: list[str] = []

    def reclaim() -> bool:
        asked.append(threading.current_thread().name)
        admission.release(warm)  # the pool removes its container
        return True

    admission.on_pressure(reclaim)
    caller = Caller(admission, memory_mb=50).start()
    assert caller.entered.wait(JOIN_S)
    assert counters(admission) == (1, 0, 0, 50)
    assert len(asked) == 1 and asked[0] != threading.current_thread().name  # the caller asked
    caller.finish()
    assert caller.error is None


def test_a_pool_that_cannot_give_back_is_asked_again_while_the_call_waits() -> None:
    admission = Admission(max_running=1, max_waiting=1)
    warm = admission.reserve(0)
    assert warm is not None
    asked: list[int] = []
    admission.on_pressure(counting(asked, False))  # every warm container is busy
    caller = Caller(admission).start()
    wait_until(lambda: len(asked) >= 2, "the pool is asked twice")
    assert not caller.entered.is_set() and admission.waiting == 1
    caller.cancel.set()
    caller.finish()
    assert isinstance(caller.error, Cancelled)
    assert not caller.entered.is_set()
    assert counters(admission) == (0, 0, 1, 0)


# ------------------------------------------------------------------ cancellation


def test_a_call_cancelled_while_waiting_leaves_the_queue_without_running() -> None:
    admission = Admission(max_running=1, max_waiting=1)
    holder = Caller(admission).start()
    assert holder.entered.wait(JOIN_S)
    waiter = Caller(admission).start()
    queued(admission)
    started = time.monotonic()
    waiter.cancel.set()
    waiter.finish()
    assert time.monotonic() - started < 10 * CANCEL_CHECK_S  # noticed within a few checks
    assert isinstance(waiter.error, Cancelled)
    assert not waiter.entered.is_set()
    assert counters(admission) == (1, 0, 0, 0)  # its place in the queue is free again
    replacement = Caller(admission).start()
    queued(admission)
    holder.finish()
    assert replacement.entered.wait(JOIN_S)
    replacement.finish()
    assert (holder.error, replacement.error) == (None, None)
    assert counters(admission) == (0, 0, 0, 0)


def test_a_call_cancelled_before_it_waits_never_queues() -> None:
    admission = Admission(max_running=1, max_waiting=1)
    cancel = threading.Event()
    cancel.set()
    with admission.slot():
        with pytest.raises(Cancelled), admission.slot(cancel):
            pytest.fail("a cancelled call must not run")
        assert counters(admission) == (1, 0, 0, 0)


# ------------------------------------------------------------ fairness and quotas


def in_line(admission: Admission, client: str, count: int) -> list[Caller]:
    """``count`` calls of ``client``, each queued before the next starts."""
    callers = []
    for _ in range(count):
        before = admission.waiting
        callers.append(Caller(admission, client=client).start())
        queued(admission, before + 1)
    return callers


def test_a_freed_slot_goes_to_the_client_running_the_fewest_calls() -> None:
    admission = Admission(max_running=2, max_waiting=10)
    busy = [Caller(admission, client="flood").start() for _ in range(2)]
    for caller in busy:
        assert caller.entered.wait(JOIN_S)
    flood_waiting = in_line(admission, "flood", 3)
    quiet = Caller(admission, client="quiet").start()  # arrives last
    queued(admission, 4)
    ENTERED.clear()
    busy[0].finish()
    assert quiet.entered.wait(JOIN_S)  # flood runs 1, quiet 0: quiet goes first
    assert [quiet] == ENTERED
    busy[1].finish()
    assert flood_waiting[0].entered.wait(JOIN_S)
    # One slot at a time from here, so the order entered is the order granted:
    # within one client, first come, first served.
    quiet.finish()
    assert flood_waiting[1].entered.wait(JOIN_S)
    flood_waiting[0].finish()
    assert flood_waiting[2].entered.wait(JOIN_S)
    for caller in flood_waiting[1:]:
        caller.finish()
    assert [quiet, *flood_waiting] == ENTERED
    assert counters(admission) == (0, 0, 0, 0)


def test_a_client_at_its_cap_waits_while_others_run() -> None:
    limits = {"flood": ClientLimits(max_running=1)}
    admission = Admission(4, 10, limits_of=lambda c: limits.get(c, ClientLimits()))
    first = Caller(admission, client="flood").start()
    assert first.entered.wait(JOIN_S)
    second = Caller(admission, client="flood").start()
    queued(admission)  # three slots free, and still it waits
    other = Caller(admission, client="quiet").start()
    assert other.entered.wait(JOIN_S)
    assert admission.running_of("flood") == 1 and admission.waiting_of("flood") == 1
    first.finish()
    assert second.entered.wait(JOIN_S)
    second.finish()
    other.finish()
    assert counters(admission) == (0, 0, 0, 0)


def test_a_clients_queue_is_capped_and_the_refusal_names_the_quota() -> None:
    limits = {"flood": ClientLimits(max_queued=2)}
    admission = Admission(1, 10, limits_of=lambda c: limits.get(c, ClientLimits()))
    holder = Caller(admission, client="flood").start()
    assert holder.entered.wait(JOIN_S)
    waiting = in_line(admission, "flood", 2)
    with pytest.raises(QuotaExceeded) as info, admission.slot(client="flood"):
        pytest.fail("a call past its client's queue must not run")
    exc = info.value
    assert (exc.subject, exc.limit, exc.retry_after_s) == ("client:flood", "max_queued", 1.0)
    assert exc.message.startswith("client 'flood' already has 2 calls queued")
    assert admission.refused_by[("flood", "max_queued")] == 1
    quiet = Caller(admission, client="quiet").start()  # another client still queues
    queued(admission, 3)
    holder.finish()
    for caller in (*waiting, quiet):  # equal shares (none running): by arrival
        assert caller.entered.wait(JOIN_S)
        caller.finish()


def test_a_warm_container_is_not_taken_past_the_clients_cap() -> None:
    limits = {"flood": ClientLimits(max_running=1)}
    admission = Admission(4, 10, limits_of=lambda c: limits.get(c, ClientLimits()))
    warm = admission.reserve(10)
    assert warm is not None
    with admission.slot(client="flood"):
        assert not admission.may_take_warm("flood")
        assert admission.may_take_warm("quiet")
        with pytest.raises(QuotaExceeded), admission.claim(warm, "flood"):
            pytest.fail("past its cap")
        with admission.claim(warm, "quiet"):
            assert admission.running_of("quiet") == 1
    assert counters(admission) == (0, 0, 0, 0)


def test_a_rate_is_a_token_bucket_per_client() -> None:
    now = [0.0]
    rates = {"agent": Rate(per_s=2.0, burst=3)}
    limits = RateLimits(rates.get, clock=lambda: now[0])
    for _ in range(3):
        limits.check("agent")  # the burst
    with pytest.raises(QuotaExceeded) as info:
        limits.check("agent")
    assert (info.value.limit, info.value.retry_after_s) == ("rate", pytest.approx(0.5))
    assert "over its call rate (2/s, burst 3); retry in 500 ms" in info.value.message
    for _ in range(100):
        limits.check("other")  # no rate: never refused
    now[0] = 0.5
    limits.check("agent")  # one token back after 1/rate seconds
    with pytest.raises(QuotaExceeded):
        limits.check("agent")
    now[0] = 100.0
    for _ in range(3):
        limits.check("agent")  # refilled to the burst, never beyond
    with pytest.raises(QuotaExceeded):
        limits.check("agent")
    rates["agent"] = Rate(per_s=1.0, burst=1)  # a changed policy: a new bucket, full
    limits.check("agent")
