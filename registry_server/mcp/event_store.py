"""The SSE events ``toolreg mcp --http`` keeps so that a client whose stream
dropped can resume it with ``Last-Event-ID`` (docs/how-to/mcp.md, "Resuming a call").

The MCP SDK's Streamable HTTP transport stores every message it sends on a
request's SSE stream through an ``EventStore`` and, on a GET with
``Last-Event-ID``, asks the store to replay what came after that id. The SDK
hands the store only the JSON-RPC request id as the stream's name ("1", "2",
... in every session) and looks a replay up by event id alone, whichever
session asks. So one store shared by all sessions would mix sessions' streams
and replay one client's calls to another. Here each session gets its own view
(``for_session``), made when the session is admitted and bound to the session
id and to the principal that opened it (the SDK's ``AuthorizationContext``);
a stream is found for a replay only through a view with the same session and
principal. Event ids carry 128 random bits per stream besides, so they are not
guessable either.

Bounds, all at once (``ResumeLimits``): events and bytes per stream (its oldest
events dropped first), streams and bytes overall (the least recently written
stream of the principal holding the most dropped first: one client's many
calls push out its own, not another's), and a time to live after a stream's last event. A
resume that would skip a dropped event is refused rather than replayed with a
gap (``can_resume`` says so before the SDK answers; ``resume.py``).

Priming events (the empty event the SDK sends first, so a client has an id
before any message) are not stored: their id names the last message stored
so far, so a resume from it replays everything after.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mcp.server.streamable_http import (
    EventCallback,
    EventId,
    EventMessage,
    EventStore,
    StreamId,
)
from mcp.types import JSONRPCError, JSONRPCMessage, JSONRPCResponse

from registry_server.mcp.http_settings import ResumeLimits

Owner = Any
"""Who opened a session: the SDK's ``AuthorizationContext`` (compared with
``==``), or None when the bridge runs without authentication."""

_ID_SEPARATOR = "."  # not in token_urlsafe's alphabet


@dataclass
class _Event:
    seq: int
    message: JSONRPCMessage
    size: int  # bytes of its JSON, as sent


@dataclass
class _Stream:
    """The stored messages of one request's SSE stream in one session."""

    key: str  # random, the first part of every event id of this stream
    session_id: str
    owner: Owner
    stream_id: StreamId  # the SDK's name for it (the JSON-RPC request id)
    last_at: float  # clock reading of its last event (or of its start)
    events: deque[_Event] = field(default_factory=deque)
    last_seq: int = 0  # seq of the newest event stored (0: none yet)
    bytes: int = 0
    complete: bool = False  # its response (or error) is stored: nothing follows
    broken: bool = False  # an event could not be kept: the stream cannot be resumed

    def event_id(self, seq: int) -> EventId:
        return f"{self.key}{_ID_SEPARATOR}{seq}"

    def first_seq(self) -> int:
        """The oldest seq still held (last_seq + 1 when none is)."""
        return self.events[0].seq if self.events else self.last_seq + 1

    def can_replay_after(self, seq: int) -> bool:
        # Every event after `seq` must still be here: no gap, and no id from the future.
        return not self.broken and self.first_seq() - 1 <= seq <= self.last_seq

    def after(self, seq: int) -> _Event | None:
        """The event right after ``seq``, if still held."""
        if not self.events:
            return None
        index = seq + 1 - self.events[0].seq
        return self.events[index] if 0 <= index < len(self.events) else None


def _parse(event_id: str) -> tuple[str, int] | None:
    key, sep, seq = event_id.rpartition(_ID_SEPARATOR)
    if not sep or not key or not seq.isdigit() or len(seq) > 18:
        return None
    return key, int(seq)


def _message_size(message: JSONRPCMessage) -> int:
    return len(message.model_dump_json(by_alias=True, exclude_unset=True))


class ResumableEvents:
    """The bridge's one bounded, in-memory store of SSE events (not thread-safe:
    used from the event loop only, where nothing here awaits but ``replay``'s
    sends)."""

    def __init__(self, limits: ResumeLimits, clock: Callable[[], float] = time.monotonic) -> None:
        problems = limits.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.limits = limits
        self._clock = clock
        # least recently written first: the order of eviction, by cap or by age
        self._streams: OrderedDict[str, _Stream] = OrderedDict()
        self._by_name: dict[tuple[str, StreamId], str] = {}  # (session, SDK stream id) -> key
        self._sessions: dict[str, Owner] = {}  # open sessions and who opened them
        self.bytes = 0

    # ------------------------------------------------------------ sessions

    def for_session(self, session_id: str, owner: Owner) -> SessionEvents:
        """The SDK ``EventStore`` of one session, opened by ``owner``."""
        self._sessions[session_id] = owner
        return SessionEvents(self, session_id, owner)

    def forget_session(self, session_id: str) -> None:
        """The session ended: its streams can no longer be resumed (the SDK
        answers 404 for the session), so their memory is freed now."""
        self._sessions.pop(session_id, None)
        for key in [k for k, s in self._streams.items() if s.session_id == session_id]:
            self._drop(key)

    def knows_session(self, session_id: str, owner: Owner) -> bool:
        """Is ``session_id`` open and opened by ``owner``?"""
        return session_id in self._sessions and self._sessions[session_id] == owner

    @property
    def stream_count(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------- storing

    def store(self, session_id: str, owner: Owner, stream_id: StreamId,
              message: JSONRPCMessage | None) -> EventId:  # fmt: skip
        """Keep ``message`` (None: a priming event) and give its event id."""
        now = self._clock()
        self._expire(now)
        stream = self._stream_for(session_id, owner, stream_id, now)
        if message is None:
            return stream.event_id(stream.last_seq)
        stream.last_seq += 1
        stream.last_at = now
        self._streams.move_to_end(stream.key)
        if isinstance(message, JSONRPCResponse | JSONRPCError):
            stream.complete = True
        if not stream.broken:
            self._append(stream, _Event(stream.last_seq, message, _message_size(message)))
        return stream.event_id(stream.last_seq)

    def _stream_for(self, session_id: str, owner: Owner, stream_id: StreamId,
                    now: float) -> _Stream:  # fmt: skip
        key = self._by_name.get((session_id, stream_id))
        if key is not None and key in self._streams:
            return self._streams[key]
        key = secrets.token_urlsafe(16)  # 128 bits: not guessable, not derived from anything
        stream = _Stream(key, session_id, owner, stream_id, last_at=now)
        self._streams[key] = stream
        self._by_name[(session_id, stream_id)] = key
        self._enforce_totals(keep=key)
        return stream

    def _append(self, stream: _Stream, event: _Event) -> None:
        if event.size > self.limits.bytes_per_stream:
            # It cannot be kept, and a replay without it would be wrong: the
            # stream stays (counted against the caps) as a refusal, holding nothing.
            self.bytes -= stream.bytes
            stream.events.clear()
            stream.bytes = 0
            stream.broken = True
            return
        stream.events.append(event)
        stream.bytes += event.size
        self.bytes += event.size
        while (len(stream.events) > self.limits.events_per_stream
               or stream.bytes > self.limits.bytes_per_stream):  # fmt: skip
            oldest = stream.events.popleft()
            stream.bytes -= oldest.size
            self.bytes -= oldest.size
        self._enforce_totals(keep=stream.key)

    def _enforce_totals(self, keep: str) -> None:
        """Drop whole streams until the totals hold: each time the least
        recently written stream of the principal holding the most (bytes, or
        streams when only their number is over), so that one busy principal
        pushes out its own streams, not another's; ``keep`` (the stream just
        written) is never dropped (alone it is within the per-stream caps)."""
        while len(self._streams) > self.limits.streams or self.bytes > self.limits.total_bytes:
            victim = self._heaviest_owners_oldest(keep, self.bytes > self.limits.total_bytes)
            if victim is None:
                break
            self._drop(victim)

    def _heaviest_owners_oldest(self, keep: str, by_bytes: bool) -> str | None:
        # Owners are compared with == (an AuthorizationContext need not hash); at
        # most `streams` + 1 streams, and only when a total is over.
        usage: list[list[Any]] = []  # [owner, bytes, streams, its oldest key but keep]
        for key, stream in self._streams.items():  # least recently written first
            for entry in usage:
                if entry[0] == stream.owner:
                    entry[1] += stream.bytes
                    entry[2] += 1
                    entry[3] = entry[3] or (key if key != keep else "")
                    break
            else:
                usage.append([stream.owner, stream.bytes, 1, key if key != keep else ""])
        candidates = [entry for entry in usage if entry[3]]
        if not candidates:
            return None
        heaviest = max(candidates, key=lambda e: (e[1], e[2]) if by_bytes else (e[2], e[1]))
        return str(heaviest[3])

    def _expire(self, now: float) -> None:
        ttl = self.limits.ttl_s
        while self._streams:
            oldest = next(iter(self._streams.values()))
            if now - oldest.last_at <= ttl:
                break
            self._drop(oldest.key)

    def _drop(self, key: str) -> None:
        stream = self._streams.pop(key)
        self.bytes -= stream.bytes
        stream.events.clear()
        stream.bytes = 0
        stream.broken = True  # a replay under way stops at its next event
        if self._by_name.get((stream.session_id, stream.stream_id)) == key:
            del self._by_name[(stream.session_id, stream.stream_id)]

    # ----------------------------------------------------------- replaying

    def _find(self, session_id: str, owner: Owner, event_id: str) -> tuple[_Stream, int] | None:
        self._expire(self._clock())
        parsed = _parse(event_id)
        if parsed is None:
            return None
        stream = self._streams.get(parsed[0])
        # Another session's or another principal's stream is as unknown as none.
        if stream is None or stream.session_id != session_id or stream.owner != owner:
            return None
        return (stream, parsed[1]) if stream.can_replay_after(parsed[1]) else None

    def can_resume(self, session_id: str, owner: Owner, event_id: str) -> bool:
        """Would a replay after ``event_id`` in this session, for this owner,
        give every event that followed it?"""
        return self._find(session_id, owner, event_id) is not None

    async def replay(self, session_id: str, owner: Owner, event_id: str,
                     send: EventCallback) -> StreamId | None:  # fmt: skip
        """Send the events after ``event_id``; the SDK stream id to follow live
        afterwards, or None (nothing to resume, or the stream is complete)."""
        found = self._find(session_id, owner, event_id)
        if found is None:
            return None
        stream, seq = found
        # One event at a time, looked up afresh after each send: events stored
        # while a send waits are replayed too, and one dropped meanwhile ends it.
        while (event := stream.after(seq)) is not None:
            await send(EventMessage(event.message, stream.event_id(event.seq)))
            seq = event.seq
        if stream.broken or seq != stream.last_seq:
            return None  # dropped during the replay: the client resumes again and is refused
        return None if stream.complete else stream.stream_id


class SessionEvents(EventStore):
    """One session's view of ``ResumableEvents``: what the SDK's transport of
    that session stores and replays through."""

    def __init__(self, events: ResumableEvents, session_id: str, owner: Owner) -> None:
        self._events = events
        self.session_id = session_id
        self._owner = owner

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        return self._events.store(self.session_id, self._owner, stream_id, message)

    async def replay_events_after(
        self, last_event_id: EventId, send_callback: EventCallback
    ) -> StreamId | None:
        return await self._events.replay(self.session_id, self._owner, last_event_id, send_callback)
