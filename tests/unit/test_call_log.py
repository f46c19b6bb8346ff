"""The call log (execution/call_log.py) and its relay across servers
(execution/call_relay.py): offsets, bounds, grace expiry, ownership, a dead
server's call, with a fake clock and the in-memory store."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from registry_server.domain.errors import AtCapacity, InvalidArgument, NotFound
from registry_server.domain.outcome import Outcome, Status
from registry_server.execution import call_relay
from registry_server.execution.call_log import CallEvent, CallLog, check_attach
from registry_server.execution.call_relay import (
    DEAD_AFTER_S,
    SERVER_GONE,
    Attachments,
    CallRelay,
    outcome_from_json,
    outcome_json,
)
from registry_server.store.memory import MemoryStore

ID = "a" * 32
OK = Outcome(Status.OK, content="one\nthree\n", execution_id=ID, duration_ms=5)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _all(events: Iterator[CallEvent]) -> list[tuple[str, bytes | Outcome | None]]:
    return [(e.stream, e.outcome or e.data) for e in events]


def test_a_follower_gets_the_output_after_its_offsets_then_the_outcome() -> None:
    log = CallLog()
    call = log.start(ID, "agent")
    log.append(call, "stdout", b"one\n")
    log.append(call, "stderr", b"two\n")
    log.append(call, "stdout", b"three\n")
    log.finish(call, OK)
    stopped = threading.Event()
    assert _all(log.follow(ID, "agent", 4, 0, stopped)) == [
        ("stdout", b"three\n"), ("stderr", b"two\n"), ("result", OK),
    ]  # fmt: skip
    # Offsets at or past the end: nothing more of that stream.
    assert _all(log.follow(ID, "agent", 10, 99, stopped)) == [("result", OK)]


def test_a_follower_waits_for_output_as_it_comes() -> None:
    log = CallLog()
    call = log.start(ID, "agent")
    got: list[tuple[str, bytes | Outcome | None]] = []
    follower = threading.Thread(
        target=lambda: got.extend(_all(log.follow(ID, "agent", 0, 0, threading.Event())))
    )
    follower.start()
    log.append(call, "stdout", b"x")
    log.finish(call, OK)
    follower.join(5)
    assert got[0] == ("stdout", b"x") and got[-1] == ("result", OK)


def test_a_stopped_follower_ends_without_an_outcome() -> None:
    log = CallLog()
    log.start(ID, "agent")
    stopped = threading.Event()
    stopped.set()
    assert _all(log.follow(ID, "agent", 0, 0, stopped)) == []


def test_only_the_calls_client_finds_it_and_unknown_ids_look_the_same() -> None:
    log = CallLog()
    log.start(ID, "agent")
    assert log.find(ID, "agent") is not None
    for who, execution_id in (("intruder", ID), ("agent", "b" * 32)):
        assert log.find(execution_id, who) is None
        with pytest.raises(NotFound) as info:
            list(log.follow(execution_id, who, 0, 0, threading.Event()))
        assert info.value.message == "no such call is kept for this client"


def test_ended_calls_expire_after_the_grace_period() -> None:
    clock = Clock()
    log = CallLog(grace_s=60, clock=clock)
    log.finish(log.start(ID, "agent"), OK)
    clock.now += 59
    assert log.find(ID, "agent") is not None
    clock.now += 2
    assert log.find(ID, "agent") is None


def test_running_calls_never_expire_and_ended_ones_are_bounded() -> None:
    clock = Clock()
    log = CallLog(grace_s=1, max_ended=2, max_ended_bytes=10, clock=clock)
    running = log.start("f" * 32, "agent")
    for i in range(3):
        call = log.start(str(i) * 32, "agent")
        log.append(call, "stdout", b"1234")
        log.finish(call, OK)
    assert log.find("0" * 32, "agent") is None  # more than two ended: the oldest went
    assert log.find("2" * 32, "agent") is not None
    log.append(log.start("9" * 32, "agent"), "stdout", b"x" * 9)
    log.finish(log.find("9" * 32, "agent"), OK)  # type: ignore[arg-type]
    assert log.find("1" * 32, "agent") is None  # bytes bound: 4 + 4 + 9 > 10
    clock.now += 100
    assert log.find(running.execution_id, "agent") is running


def test_close_stops_the_calls_still_running_and_waits_for_their_end() -> None:
    log = CallLog()
    cancel = threading.Event()
    call = log.start(ID, "agent", cancel)
    # The call's thread ends it once cancelled (its record written).
    threading.Thread(target=lambda: cancel.wait(5) and log.finish(call, OK)).start()
    log.close(wait_s=5)
    assert cancel.is_set() and log.running() == []
    stuck = log.start("b" * 32, "agent", threading.Event())
    log.close(wait_s=0.05)  # bounded: a call that does not end is not waited for long
    assert log.running() == [stuck]


@pytest.mark.parametrize(
    ("execution_id", "stdout", "stderr", "fields"),
    [
        ("A" * 32, 0, 0, ["execution_id"]),
        ("a" * 5000, 0, 0, ["execution_id"]),
        (ID, -1, 0, ["stdout_offset"]),
        ("", 0, -5, ["execution_id", "stderr_offset"]),
    ],
)
def test_malformed_attach_requests_are_refused(
    execution_id: str, stdout: int, stderr: int, fields: list[str]
) -> None:
    with pytest.raises(InvalidArgument) as info:
        check_attach(execution_id, stdout, stderr)
    assert [v.field for v in info.value.violations] == fields
    assert "a" * 100 not in info.value.message  # the id is never echoed


def test_outcomes_survive_the_store_form() -> None:
    assert outcome_from_json(outcome_json(OK)) == OK


def _relayed(clock: Clock) -> tuple[CallLog, CallRelay, CallRelay]:
    """A call log published by server A; the relay server B reads it through."""
    store = MemoryStore()
    log_a = CallLog(grace_s=60, clock=clock)
    relay_a = CallRelay(log_a, store, "server-a", clock=clock)
    relay_b = CallRelay(
        CallLog(grace_s=60, clock=clock), store, "server-b", clock=clock, appear_within_s=0
    )
    return log_a, relay_a, relay_b


def test_another_server_follows_a_published_call_to_its_result() -> None:
    clock = Clock()
    log_a, relay_a, relay_b = _relayed(clock)
    call = log_a.start(ID, "agent")
    log_a.append(call, "stdout", b"one\n")
    relay_a.publish_once()
    log_a.append(call, "stderr", b"two\n")
    log_a.finish(call, OK)
    relay_a.publish_once()
    stopped = threading.Event()
    assert _all(relay_b.follow(ID, "agent", 2, 0, stopped)) == [
        ("stdout", b"e\n"), ("stderr", b"two\n"), ("result", OK),
    ]  # fmt: skip
    with pytest.raises(NotFound):
        list(relay_b.follow(ID, "intruder", 0, 0, stopped))
    clock.now += 61
    with pytest.raises(NotFound):  # past the grace period
        list(relay_b.follow(ID, "agent", 0, 0, stopped))


def test_a_call_not_yet_published_is_looked_for_before_not_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client may re-attach through another server before the call's server
    has published it (every PUBLISH_INTERVAL_S): the follower looks again for
    up to APPEAR_WITHIN_S; an unknown or another client's id waits as long."""
    monkeypatch.setattr(call_relay, "POLL_S", 0.02)
    clock = Clock()
    store = MemoryStore()
    log_a = CallLog(grace_s=60, clock=clock)
    relay_a = CallRelay(log_a, store, "server-a", clock=clock)
    relay_b = CallRelay(CallLog(grace_s=60, clock=clock), store, "server-b", clock=clock,
                        appear_within_s=0.1)  # fmt: skip
    log_a.finish(log_a.start(ID, "agent"), OK)
    later = threading.Timer(0.03, relay_a.publish_once)
    later.start()
    assert _all(relay_b.follow(ID, "agent", 0, 0, threading.Event())) == [("result", OK)]
    later.join()
    for execution_id, who in ((ID, "intruder"), ("b" * 32, "agent")):
        looked = time.monotonic()
        with pytest.raises(NotFound):
            list(relay_b.follow(execution_id, who, 0, 0, threading.Event()))
        assert time.monotonic() - looked >= 0.09


def test_a_call_published_only_at_its_end_is_followed_too() -> None:
    clock = Clock()
    log_a, relay_a, relay_b = _relayed(clock)
    log_a.finish(log_a.start(ID, "agent"), OK)
    relay_a.publish_once()
    assert _all(relay_b.follow(ID, "agent", 0, 0, threading.Event())) == [("result", OK)]


def test_a_call_whose_server_went_silent_ends_with_a_clear_status() -> None:
    clock = Clock()
    log_a, relay_a, relay_b = _relayed(clock)
    log_a.start(ID, "agent")
    relay_a.publish_once()
    clock.now += DEAD_AFTER_S + 1  # server A published nothing since
    (event,) = list(relay_b.follow(ID, "agent", 0, 0, threading.Event()))
    assert event.outcome is not None and event.outcome.status is Status.SANDBOX_ERROR
    assert event.outcome.error == SERVER_GONE


def test_a_quiet_running_call_is_republished_as_a_heartbeat_only_when_due() -> None:
    clock = Clock()
    log_a, relay_a, _ = _relayed(clock)
    writes: list[str] = []
    store = relay_a._store
    original = store.unit_of_work

    def counting():  # type: ignore[no-untyped-def]
        writes.append("w")
        return original()

    store.unit_of_work = counting  # type: ignore[method-assign]
    log_a.start(ID, "agent")
    relay_a.publish_once()  # new: published (and the first pruning)
    relay_a.publish_once()  # unchanged, beat not due: no write
    clock.now += 2.5
    relay_a.publish_once()  # the beat
    assert len(writes) == 3


def test_a_call_with_much_output_is_published_less_often() -> None:
    """Each publication rewrites the call's row: one with ~1 MiB published waits
    about a second before the next, a small one only PUBLISH_INTERVAL_S; the
    result goes out at once whatever the size."""
    clock = Clock()
    log_a, relay_a, _ = _relayed(clock)
    puts: list[int] = []
    store = relay_a._store
    original = store.unit_of_work

    class Counting:
        def __enter__(self):  # type: ignore[no-untyped-def]
            self._uow = original()
            uow = self._uow.__enter__()
            put = uow.put_kept_call
            uow.put_kept_call = lambda record: (puts.append(len(record.stdout)), put(record))
            return uow

        def __exit__(self, *exc):  # type: ignore[no-untyped-def]
            return self._uow.__exit__(*exc)

    store.unit_of_work = Counting  # type: ignore[method-assign,assignment]
    call = log_a.start(ID, "agent")
    log_a.append(call, "stdout", b"x" * call_relay.MAX_PUBLISHED_BYTES)
    relay_a.publish_once()
    assert puts == [call_relay.MAX_PUBLISHED_BYTES]
    log_a.append(call, "stdout", b"more")
    clock.now += call_relay.PUBLISH_INTERVAL_S
    relay_a.publish_once()  # new output, but the last row was 1 MiB: not yet
    assert len(puts) == 1
    clock.now += 1.0
    relay_a.publish_once()
    assert len(puts) == 2
    log_a.finish(call, OK)
    relay_a.publish_once()  # the result: at once
    assert len(puts) == 3


def test_attachments_prefer_this_servers_own_calls() -> None:
    clock = Clock()
    log_a, relay_a, _ = _relayed(clock)
    call = log_a.start(ID, "agent")
    log_a.append(call, "stdout", b"x")
    log_a.finish(call, OK)
    attach = Attachments(log_a, relay_a)  # nothing published: served from memory
    assert _all(attach.follow(ID, "agent", 0, 0, threading.Event()))[-1] == ("result", OK)
    with pytest.raises(NotFound):
        list(Attachments(CallLog(), None).follow(ID, "agent", 0, 0, threading.Event()))


def test_attachments_are_capped_per_client_and_per_server() -> None:
    """Each open attachment holds a gRPC thread while its call runs: one client
    opening many to its own running call must not take every thread."""
    log = CallLog()
    call = log.start(ID, "agent")
    log.append(call, "stdout", b"x")
    attach = Attachments(log, None, max_open=3, max_per_client=2)
    stopped = threading.Event()
    held = [attach.follow(ID, "agent", 0, 0, stopped) for _ in range(2)]
    for events in held:
        assert next(events) == CallEvent("stdout", b"x")  # open, waiting for more
    with pytest.raises(AtCapacity, match="client 'agent' already has 2"):
        next(attach.follow(ID, "agent", 0, 0, stopped))
    other = log.start("b" * 32, "other")
    log.append(other, "stdout", b"y")
    third = attach.follow("b" * 32, "other", 0, 0, stopped)
    assert next(third) == CallEvent("stdout", b"y")  # another client is not starved
    with pytest.raises(AtCapacity, match="this server has 3"):
        next(attach.follow("b" * 32, "other", 0, 0, stopped))
    held.pop().close()  # a closed attachment gives its place back
    assert next(attach.follow(ID, "agent", 0, 0, stopped)) == CallEvent("stdout", b"x")


def test_the_relay_prunes_a_backlog_at_once_and_forgets_calls_gone_from_the_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Short calls can end faster than one pruning batch per PRUNE_EVERY_S: a
    full batch is followed by another at the next look, so the table does not
    grow without bound. A call that left the log before the relay saw it end
    is not remembered forever either."""
    monkeypatch.setattr(call_relay, "PRUNE_BATCH", 2)
    clock = Clock()
    log_a, relay_a, _ = _relayed(clock)
    ids = [f"{i:032x}" for i in range(5)]
    for execution_id in ids:
        log_a.finish(log_a.start(execution_id, "agent"), OK)
    relay_a.publish_once()
    store = relay_a._store

    def kept() -> int:
        with store.reading() as reads:
            return sum(reads.kept_call(i) is not None for i in ids)

    assert kept() == 5
    clock.now += 61  # past the grace and the pruning interval
    for _ in range(3):
        relay_a.publish_once()
        clock.now += 0.25
    assert kept() == 0

    quick = CallLog(max_ended=0, clock=clock)  # an ended call leaves it at once
    relay = CallRelay(quick, MemoryStore(), "server-q", clock=clock)
    call = quick.start(ID, "agent")
    relay.publish_once()
    quick.finish(call, OK)
    relay.publish_once()
    assert relay._published == {}


def test_one_clients_ended_calls_never_push_out_anothers() -> None:
    """A busy client's short calls evict its own oldest kept call, not another
    client's result still within its grace."""
    log = CallLog(max_ended=10, max_ended_per_client=3)
    log.finish(log.start(ID, "quiet"), OK)
    busy = [f"{i:032x}" for i in range(1, 21)]
    for execution_id in busy:
        log.finish(log.start(execution_id, "busy"), OK)
    assert log.find(ID, "quiet") is not None
    assert [log.find(i, "busy") is not None for i in busy] == [False] * 17 + [True] * 3


# -- CancelExecution ----------------------------------------------------------------------


def test_only_the_caller_or_an_admin_cancels_a_running_call() -> None:
    from registry_server.domain.errors import FailedPrecondition
    from registry_server.execution.call_log import NOT_RUNNING, CallCancel

    log = CallLog()
    cancel = CallCancel()
    kept = log.start(ID, "agent", cancel)
    for caller, unknown in (("other", ID), ("agent", "b" * 32)):
        with pytest.raises(NotFound) as info:
            log.cancel(unknown, caller, admin=False, reason="")
        assert info.value.message == NOT_RUNNING
    assert not cancel.is_set()
    assert log.cancel(ID, "ops", admin=True, reason="runaway") is kept
    assert cancel.is_set() and (cancel.by, cancel.reason) == ("ops", "runaway")
    log.cancel(ID, "agent", admin=False, reason="again")  # still stopping: a no-op
    assert (cancel.by, cancel.reason) == ("ops", "runaway")  # the first ask stands
    log.finish(kept, OK)
    with pytest.raises(FailedPrecondition):
        log.cancel(ID, "agent", admin=False, reason="")
    with pytest.raises(NotFound):  # ended, and another's: still not told apart
        log.cancel(ID, "other", admin=False, reason="")


@pytest.mark.parametrize(
    ("execution_id", "reason", "field"),
    [
        ("not-an-id", "", "execution_id"),
        ("A" * 32, "", "execution_id"),
        (ID, "r" * 1001, "reason"),
        (ID, "two\nlines", "reason"),
        (ID, "bell\x07", "reason"),
        (ID, "c1\x85", "reason"),
    ],
)
def test_check_cancel_refuses_malformed_requests(
    execution_id: str, reason: str, field: str
) -> None:
    from registry_server.execution.call_log import check_cancel

    with pytest.raises(InvalidArgument) as info:
        check_cancel(execution_id, reason)
    assert [v.field for v in info.value.violations] == [field]
    check_cancel(ID, "r" * 1000)  # the longest reason, accepted
    check_cancel(ID, "")
