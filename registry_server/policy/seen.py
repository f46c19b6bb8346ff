"""The group-mapped clients a server has seen (policy/identity.py): kept per
server, shared by every policy it loads, so that lookups by client id see the
client its latest verified token made.

With a store (``remember_in``), they are also remembered there
(docs/how-to/identity.md, "Remembered clients"): a restarted server, and every
other server on the same database, knows a client whose token it never saw,
so a tool it registered keeps being served. Only who the client is (provider,
subject) and its groups are kept: its roles are derived from the groups by
the policy in force at each lookup, never stored. A client is written when
first seen by this server, when its groups change, and otherwise at most once
per REMEMBER_EVERY_S (its last_seen); a lookup trusts this server's copy for
RECHECK_S, then reads the store again (another server may have seen a newer
token, or an operator forgotten the client).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from registry_server.policy.identity import MAX_SUBJECT_CLAIM_CHARS

log = logging.getLogger(__name__)

MAX_SEEN_IDENTITIES = 10_000  # group-mapped clients a server remembers (least recent dropped)
REMEMBER_EVERY_S = 300.0  # seconds: at most one last_seen write per client per interval
RECHECK_S = 30.0  # seconds a lookup trusts this server's copy before reading the store again
MAX_CLIENT_ID_CHARS = 64  # characters of a client id (policy/clients.py ID_PATTERN)
MAX_REMEMBERED_GROUPS = 256  # groups of one client the store keeps (more: not remembered)
MAX_GROUP_CHARS = MAX_SUBJECT_CLAIM_CHARS  # characters of one group (a mapping's group name cap)
MAX_REMEMBERED_GROUP_CHARS = 16_384  # characters of all of one client's groups together


@dataclass(frozen=True)
class Sighting:
    provider: str
    subject: str
    groups: frozenset[str]
    issued_at: float = 0.0  # the token's iat: an older token never replaces a newer one
    expires_at: float = float("inf")  # its exp: approver groups hold no longer (model.py)


class Remembered(Protocol):
    """Where sightings outlive the server (store/remembered.py: the store)."""

    def load(self, client_id: str) -> Sighting | None: ...

    def save(self, client_id: str, sighting: Sighting, now: float) -> None: ...


def rememberable(client_id: str, sighting: Sighting) -> str | None:
    """Why this sighting may not be stored (a cap it is over), or None."""
    if len(client_id) > MAX_CLIENT_ID_CHARS:
        return f"client id over {MAX_CLIENT_ID_CHARS} characters"
    if not sighting.subject or len(sighting.subject) > MAX_SUBJECT_CLAIM_CHARS:
        return f"subject empty or over {MAX_SUBJECT_CLAIM_CHARS} characters"
    if len(sighting.groups) > MAX_REMEMBERED_GROUPS:
        return f"more than {MAX_REMEMBERED_GROUPS} groups"
    if any(len(g) > MAX_GROUP_CHARS for g in sighting.groups):
        return f"a group over {MAX_GROUP_CHARS} characters"
    if sum(len(g) for g in sighting.groups) > MAX_REMEMBERED_GROUP_CHARS:
        return f"groups over {MAX_REMEMBERED_GROUP_CHARS} characters in all"
    return None


def _who(sighting: Sighting) -> tuple[str, str, frozenset[str]]:
    """What a write must not wait for the interval to change."""
    return sighting.provider, sighting.subject, sighting.groups


@dataclass
class _Entry:
    sighting: Sighting | None  # None: the store said it knows no such client
    checked: float  # when the store was last read or written for it (-inf: never)
    written: float = float("-inf")  # when this server last wrote it
    written_as: tuple[str, str, frozenset[str]] | None = None  # what it wrote then
    in_store: bool = False  # the sighting is the store's too (written here, or read from it)


@dataclass(eq=False)
class SeenIdentities:
    """The subject and groups of each group-mapped client a server has seen
    (the latest verified token's), least recently seen dropped beyond the cap.
    Shared by every policy a server loads, so a reload keeps what it saw."""

    capacity: int = MAX_SEEN_IDENTITIES
    clock: Callable[[], float] = time.time
    _by_id: OrderedDict[str, _Entry] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _store: Remembered | None = None

    def remember_in(self, store: Remembered) -> None:
        """Keep sightings in ``store`` too, and look there for clients not seen here."""
        self._store = store

    def saw(self, client_id: str, sighting: Sighting, *, remember: bool = False) -> None:
        """Keep the sighting unless one of a newer token is kept already: a
        still-valid old token (with groups the IdP has since taken away) must
        not win over the IdP's latest word. ``remember``: the caller has
        verified the token and the policy maps it to a role, so it may be
        stored (what was not mapped to anything never reaches the store)."""
        now = self.clock()
        with self._lock:
            entry = self._by_id.get(client_id)
            if entry is None:
                entry = self._by_id[client_id] = _Entry(None, float("-inf"))
            kept = entry.sighting
            newest = sighting if kept is None or sighting.issued_at >= kept.issued_at else kept
            entry.sighting = newest
            self._by_id.move_to_end(client_id)
            while len(self._by_id) > self.capacity:
                self._by_id.popitem(last=False)
            write = remember and self._store is not None and self._due(entry, newest, now)
            refused = rememberable(client_id, newest) if write else None
            if write:
                # Claimed under the lock: of many calls at once, one writes (or
                # logs a refusal, once per interval).
                entry.written, entry.written_as = now, _who(newest)
                if refused is None:
                    entry.checked, entry.in_store = now, True
        if refused is not None:
            # Still known here (as before the store kept clients); not stored.
            log.warning("a group-mapped client is not remembered in the store: %s", refused)
            return
        if write and self._store is not None:
            self._write(client_id, newest, now)

    @staticmethod
    def _due(entry: _Entry, newest: Sighting, now: float) -> bool:
        return entry.written_as != _who(newest) or now - entry.written >= REMEMBER_EVERY_S

    def _write(self, client_id: str, sighting: Sighting, now: float) -> None:
        assert self._store is not None
        try:
            self._store.save(client_id, sighting, now)
        except Exception as exc:  # the call goes on; the next sighting writes again
            with self._lock:
                entry = self._by_id.get(client_id)
                if entry is not None:
                    entry.written_as, entry.in_store = None, False
            log.warning("remembering a group-mapped client failed: %s", exc)

    def get(self, client_id: str) -> Sighting | None:
        now = self.clock()
        with self._lock:
            entry = self._by_id.get(client_id)
            if self._store is None or (entry is not None and now - entry.checked < RECHECK_S):
                return None if entry is None else entry.sighting
        try:
            stored = self._store.load(client_id)
        except Exception as exc:
            # Unreadable store: what this server verified itself, else nobody (fail closed).
            log.warning("reading a remembered client failed: %s", exc)
            return None if entry is None else entry.sighting
        with self._lock:
            entry = self._by_id.get(client_id)
            if entry is None:
                entry = self._by_id[client_id] = _Entry(None, now)
            mine = entry.sighting
            if stored is None and entry.in_store:
                # It was stored and is no longer: an operator forgot it.
                entry.sighting, entry.written_as, entry.in_store = None, None, False
            elif stored is not None and (mine is None or stored.issued_at >= mine.issued_at):
                entry.sighting, entry.in_store = stored, True
            entry.checked = now
            self._by_id.move_to_end(client_id)
            while len(self._by_id) > self.capacity:
                self._by_id.popitem(last=False)
            return entry.sighting

    def __len__(self) -> int:
        return len(self._by_id)
