"""The bounded event store behind resumable MCP streams
(mcp/event_store.py), with the MCP SDK's own message types and a fake
clock: ids, replay, the binding of a stream to its session and principal, the
caps and their order of eviction, the time to live. Over real HTTP:
tests/integration/test_mcp_http.py. The limits' checks: tests/unit/test_mcp_http_settings.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import pytest
from mcp.server.streamable_http import EventMessage
from mcp.types import JSONRPCNotification, JSONRPCResponse

from registry_server.mcp.event_store import ResumableEvents, SessionEvents
from registry_server.mcp.http_settings import ResumeLimits
from registry_server.mcp.resume import ResumableSessionManager

AGENT = {"client_id": "agent", "issuer": None, "subject": None}
RIVAL = {"client_id": "rival", "issuer": None, "subject": None}
LIMITS = ResumeLimits(
    events_per_stream=100, bytes_per_stream=10_000, streams=10, total_bytes=50_000, ttl_s=60.0
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def note(n: int, pad: int = 0) -> JSONRPCNotification:
    params = {"progressToken": "t", "progress": n, "message": "x" * pad}
    return JSONRPCNotification(jsonrpc="2.0", method="notifications/progress", params=params)


def answer(request_id: int) -> JSONRPCResponse:
    return JSONRPCResponse(jsonrpc="2.0", id=request_id, result={"content": []})


def store(limits: ResumeLimits = LIMITS) -> tuple[ResumableEvents, Clock]:
    clock = Clock()
    return ResumableEvents(limits, clock=clock), clock


def put(view: SessionEvents, stream: str, message: Any) -> str:
    return anyio.run(view.store_event, stream, message)


def replay(view: SessionEvents, last_id: str) -> tuple[list[EventMessage], str | None]:
    sent: list[EventMessage] = []

    async def send(event: EventMessage) -> None:
        sent.append(event)

    async def run() -> str | None:
        return await view.replay_events_after(last_id, send)

    return sent, anyio.run(run)


def test_replays_what_followed_an_id_then_follows_the_stream_live() -> None:
    events, _ = store()
    view = events.for_session("s1", AGENT)
    priming = put(view, "7", None)
    ids = [put(view, "7", note(n)) for n in range(3)]
    assert len(set([priming, *ids])) == 4
    sent, live = replay(view, ids[0])
    assert [e.event_id for e in sent] == ids[1:]
    assert [e.message for e in sent] == [note(1), note(2)]
    assert live == "7"  # no response yet: the SDK follows the stream from here
    # A priming id names the position before the first event: everything follows.
    assert [e.event_id for e in replay(view, priming)[0]] == ids
    # Once the response is stored, a replay ends with it and nothing is followed.
    done = put(view, "7", answer(7))
    sent, live = replay(view, ids[2])
    assert [e.event_id for e in sent] == [done] and live is None


def test_ids_are_random_per_stream_and_streams_are_per_session() -> None:
    events, _ = store()
    one, two = events.for_session("s1", AGENT), events.for_session("s2", AGENT)
    # Both sessions' first request is "1" (the SDK names streams by request id).
    a, b = put(one, "1", note(0)), put(two, "1", note(1))
    key_a, key_b = a.rpartition(".")[0], b.rpartition(".")[0]
    assert key_a != key_b and len(key_a) >= 22  # 128 random bits
    assert [e.message for e in replay(one, f"{key_a}.0")[0]] == [note(0)]
    assert [e.message for e in replay(two, f"{key_b}.0")[0]] == [note(1)]


def test_a_stream_replays_only_to_its_session_and_owner() -> None:
    events, _ = store()
    view = events.for_session("s1", AGENT)
    first = put(view, "1", note(0))
    put(view, "1", note(1))
    same_session_other_owner = SessionEvents(events, "s1", RIVAL)
    other_session = events.for_session("s2", AGENT)
    rival_session = events.for_session("s3", RIVAL)
    for stranger in [same_session_other_owner, other_session, rival_session]:
        assert replay(stranger, first) == ([], None)
        assert not events.can_resume(stranger.session_id, RIVAL, first)
    assert events.can_resume("s1", AGENT, first)
    assert not events.can_resume("s1", RIVAL, first)
    assert events.knows_session("s1", AGENT) and not events.knows_session("s1", RIVAL)


@pytest.mark.parametrize("bad", ["", "nodot", ".1", "key.", "key.-1", "key.1e3", "x" * 30 + ".1"])
def test_malformed_or_unknown_ids_replay_nothing(bad: str) -> None:
    events, _ = store()
    view = events.for_session("s1", AGENT)
    put(view, "1", note(0))
    assert replay(view, bad) == ([], None)
    assert not events.can_resume("s1", AGENT, bad)


def test_an_id_from_the_future_is_refused() -> None:
    events, _ = store()
    view = events.for_session("s1", AGENT)
    key = put(view, "1", note(0)).rpartition(".")[0]
    assert not events.can_resume("s1", AGENT, f"{key}.2")


def test_oldest_events_go_first_and_a_resume_across_the_gap_is_refused() -> None:
    events, _ = store(dataclasses.replace(LIMITS, events_per_stream=3))
    view = events.for_session("s1", AGENT)
    priming = put(view, "1", None)
    ids = [put(view, "1", note(n)) for n in range(5)]  # 0 and 1 dropped
    assert not events.can_resume("s1", AGENT, priming)  # would miss 0 and 1
    assert not events.can_resume("s1", AGENT, ids[0])  # would miss 1
    assert events.can_resume("s1", AGENT, ids[1])  # 2, 3, 4 all held
    assert [e.message for e in replay(view, ids[1])[0]] == [note(2), note(3), note(4)]


def test_bytes_per_stream_bound_it_and_one_too_large_event_ends_resumption() -> None:
    events, _ = store(dataclasses.replace(LIMITS, bytes_per_stream=1000))
    view = events.for_session("s1", AGENT)
    ids = [put(view, "1", note(n, pad=300)) for n in range(5)]
    assert events.bytes <= 1000
    assert not events.can_resume("s1", AGENT, ids[0])
    assert events.can_resume("s1", AGENT, ids[-2])
    put(view, "1", note(9, pad=2000))  # larger than a stream may hold
    assert events.bytes == 0
    assert not events.can_resume("s1", AGENT, ids[-1])
    later = put(view, "1", answer(1))  # still given an id, still not resumable
    assert not events.can_resume("s1", AGENT, later)
    assert events.stream_count == 1  # the refusal itself is counted against the caps


def test_totals_drop_the_least_recently_written_stream_first() -> None:
    events, _ = store(dataclasses.replace(LIMITS, streams=3))
    view = events.for_session("s1", AGENT)
    first = {name: put(view, name, note(0)) for name in ["a", "b", "c"]}
    put(view, "a", note(1))  # "a" is now the most recent; "b" the least
    put(view, "d", note(0))
    assert events.stream_count == 3
    assert not events.can_resume("s1", AGENT, first["b"])
    assert all(events.can_resume("s1", AGENT, first[n]) for n in ["a", "c"])

    events, _ = store(dataclasses.replace(LIMITS, bytes_per_stream=1000, total_bytes=2500))
    view = events.for_session("s1", AGENT)
    held = {name: put(view, name, note(0, pad=700)) for name in ["a", "b", "c", "d"]}
    assert events.bytes <= 2500
    assert not events.can_resume("s1", AGENT, held["a"])
    assert events.can_resume("s1", AGENT, held["d"])


def test_a_busy_principal_pushes_out_its_own_streams_not_anothers() -> None:
    events, _ = store(dataclasses.replace(LIMITS, streams=4))
    rival = events.for_session("s2", RIVAL)
    theirs = put(rival, "r", note(0))  # the least recently written of all
    agent = events.for_session("s1", AGENT)
    mine = [put(agent, f"a{i}", note(0)) for i in range(6)]  # 3 over the cap
    assert events.stream_count == 4
    assert events.can_resume("s2", RIVAL, theirs)
    assert not any(events.can_resume("s1", AGENT, m) for m in mine[:3])  # its 3 oldest
    assert all(events.can_resume("s1", AGENT, m) for m in mine[3:])

    events, _ = store(dataclasses.replace(LIMITS, bytes_per_stream=1000, total_bytes=2500))
    rival = events.for_session("s2", RIVAL)
    theirs = put(rival, "r", note(0, pad=300))
    agent = events.for_session("s1", AGENT)
    mine = [put(agent, f"a{i}", note(0, pad=700)) for i in range(4)]
    assert events.bytes <= 2500
    assert events.can_resume("s2", RIVAL, theirs)  # the agent's bytes went, not the rival's
    assert events.can_resume("s1", AGENT, mine[-1]) and not events.can_resume("s1", AGENT, mine[0])


def test_streams_expire_after_their_last_event() -> None:
    events, clock = store()
    view = events.for_session("s1", AGENT)
    quiet = put(view, "1", note(0))
    busy = put(view, "2", note(0))
    clock.now += 50
    put(view, "2", note(1))  # keeps "2" alive
    clock.now += 20  # "1" silent for 70 s > 60 s
    assert not events.can_resume("s1", AGENT, quiet)
    assert events.can_resume("s1", AGENT, busy)
    clock.now += 61
    assert not events.can_resume("s1", AGENT, busy)
    assert events.stream_count == 0 and events.bytes == 0


def test_an_ended_session_frees_its_streams() -> None:
    events, _ = store()
    mine, other = events.for_session("s1", AGENT), events.for_session("s2", AGENT)
    gone, kept = put(mine, "1", note(0)), put(other, "1", note(0))
    events.forget_session("s1")
    assert not events.knows_session("s1", AGENT)
    assert not events.can_resume("s1", AGENT, gone)
    assert events.can_resume("s2", AGENT, kept) and events.stream_count == 1


def test_events_stored_during_a_replay_are_replayed_and_eviction_ends_it() -> None:
    events, _ = store(dataclasses.replace(LIMITS, events_per_stream=2))
    view = events.for_session("s1", AGENT)
    start = put(view, "1", None)
    put(view, "1", note(0))
    sent: list[EventMessage] = []

    async def send(event: EventMessage) -> None:
        sent.append(event)
        if len(sent) == 1:
            events.store("s1", AGENT, "1", note(1))  # arrives while the first is sent

    async def run() -> str | None:
        return await view.replay_events_after(start, send)

    assert anyio.run(run) == "1"
    assert [e.message for e in sent] == [note(0), note(1)]

    sent.clear()

    async def flood(event: EventMessage) -> None:
        sent.append(event)
        for n in range(5):  # the events after this one are dropped meanwhile
            events.store("s1", AGENT, "1", note(10 + n))

    async def run_flooded() -> str | None:
        return await view.replay_events_after(start.rpartition(".")[0] + ".1", flood)

    assert anyio.run(run_flooded) is None  # stopped at the gap: the client is then refused
    assert len(sent) == 1


def test_limits_are_checked_when_the_store_is_made() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        ResumableEvents(dataclasses.replace(LIMITS, ttl_s=0))


def test_each_session_of_the_sdk_manager_gets_its_own_bound_view() -> None:
    """The SDK hooks mcp_resume.py relies on (private to the SDK): pinned here,
    so an SDK that changes them fails this test, not a client's resume."""
    events, _ = store()
    manager = ResumableSessionManager(events=events, app=None)  # type: ignore[arg-type]
    first, second = manager._admit_session(AGENT), manager._admit_session(RIVAL)
    assert first is not None and second is not None
    views = [first._event_store, second._event_store]
    assert all(isinstance(v, SessionEvents) for v in views)
    assert [v.session_id for v in views] == [first.mcp_session_id, second.mcp_session_id]
    assert events.knows_session(first.mcp_session_id or "", AGENT)
    assert not events.knows_session(first.mcp_session_id or "", RIVAL)
    anyio.run(manager._discard_session, first.mcp_session_id or "", first)
    assert not events.knows_session(first.mcp_session_id or "", AGENT)
