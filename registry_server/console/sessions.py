"""Signed-in approvers of the console: capped in number, ended when idle.

A session is what a browser holds after proving a policy client's bearer
token: an unguessable id in an ``HttpOnly; SameSite=Strict`` cookie, and a
CSRF token the page keeps in memory and sends back in a header on every
change. The bearer token itself is never part of a session, and the session
id is kept only as its sha256, so the table answers look-ups without holding
what a browser presents.

Everything here runs on the server's one event loop, so no locks.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

SESSION_ID_BYTES = 32  # random bytes of a session id (and of its CSRF token)

EndStreams = Callable[[str], None]  # ends one open page's event stream, with a reason


@dataclass
class Session:
    client_id: str
    approver: str  # the approver id this client signs as (its tokens' iss)
    csrf: str
    last_used: float
    # The event streams this session has open, each with the call that ends it.
    streams: dict[int, EndStreams] = field(default_factory=dict)

    def csrf_matches(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(
            presented.encode("utf-8", "surrogatepass"), self.csrf.encode()
        )


class SessionsFull(Exception):
    """Every session slot is taken by a session that is not idle."""


class Sessions:
    def __init__(
        self,
        *,
        max_sessions: int,
        idle_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_end: Callable[[Session], None] = lambda session: None,
    ) -> None:
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self._clock = clock
        self._on_end = on_end  # told after a session ended (its client's credential may go)
        self._by_digest: dict[bytes, Session] = {}

    def __len__(self) -> int:
        return len(self._by_digest)

    def open(self, client_id: str, approver: str) -> tuple[str, Session]:
        """A new session: its id (for the cookie) and itself. SessionsFull
        when every slot is taken once idle sessions are gone."""
        self.expire_idle()
        if len(self._by_digest) >= self.max_sessions:
            raise SessionsFull(f"{self.max_sessions} sessions are open (the console's maximum)")
        session_id = secrets.token_urlsafe(SESSION_ID_BYTES)
        session = Session(
            client_id=client_id,
            approver=approver,
            csrf=secrets.token_urlsafe(SESSION_ID_BYTES),
            last_used=self._clock(),
        )
        self._by_digest[_digest(session_id)] = session
        return session_id, session

    def use(self, session_id: str | None) -> Session | None:
        """The live session with this id, now marked as used; None for an
        unknown, ended or idle one."""
        if not session_id:
            return None
        digest = _digest(session_id)
        session = self._by_digest.get(digest)
        if session is None:
            return None
        if self._idle(session):
            self._end(digest, "your session was idle too long; sign in again")
            return None
        session.last_used = self._clock()
        return session

    def end(self, session_id: str | None, reason: str = "signed out") -> None:
        if session_id:
            self._end(_digest(session_id), reason)

    def expire_idle(self) -> int:
        """End every idle session (its open pages are told); how many ended."""
        idle = [d for d, s in self._by_digest.items() if self._idle(s)]
        for digest in idle:
            self._end(digest, "your session was idle too long; sign in again")
        return len(idle)

    def end_all(self, reason: str) -> None:
        for digest in list(self._by_digest):
            self._end(digest, reason)

    def end_client(self, client_id: str, reason: str) -> None:
        """End every session of one client (its credential is gone)."""
        for digest in [d for d, s in self._by_digest.items() if s.client_id == client_id]:
            self._end(digest, reason)

    def of_client(self, client_id: str) -> int:
        return sum(1 for s in self._by_digest.values() if s.client_id == client_id)

    def _idle(self, session: Session) -> bool:
        return self._clock() - session.last_used > self.idle_s

    def _end(self, digest: bytes, reason: str) -> None:
        session = self._by_digest.pop(digest, None)
        if session is None:
            return
        for end_stream in list(session.streams.values()):
            end_stream(reason)
        session.streams.clear()
        self._on_end(session)


def _digest(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).digest()
