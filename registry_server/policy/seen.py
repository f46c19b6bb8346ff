"""The group-mapped clients a server has seen (policy/identity.py): kept per
server, shared by every policy it loads, so that lookups by client id see the
client its latest verified token made."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

MAX_SEEN_IDENTITIES = 10_000  # group-mapped clients a server remembers (least recent dropped)


@dataclass(frozen=True)
class Sighting:
    provider: str
    subject: str
    groups: frozenset[str]
    issued_at: float = 0.0  # the token's iat: an older token never replaces a newer one
    expires_at: float = float("inf")  # its exp: approver groups hold no longer (model.py)


@dataclass(eq=False)
class SeenIdentities:
    """The subject and groups of each group-mapped client a server has seen
    (the latest verified token's), least recently seen dropped beyond the cap.
    Shared by every policy a server loads, so a reload keeps what it saw."""

    capacity: int = MAX_SEEN_IDENTITIES
    _by_id: OrderedDict[str, Sighting] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def saw(self, client_id: str, sighting: Sighting) -> None:
        """Keep the sighting unless one of a newer token is kept already: a
        still-valid old token (with groups the IdP has since taken away) must
        not win over the IdP's latest word."""
        with self._lock:
            kept = self._by_id.get(client_id)
            if kept is None or sighting.issued_at >= kept.issued_at:
                self._by_id[client_id] = sighting
            self._by_id.move_to_end(client_id)
            while len(self._by_id) > self.capacity:
                self._by_id.popitem(last=False)

    def get(self, client_id: str) -> Sighting | None:
        with self._lock:
            return self._by_id.get(client_id)

    def __len__(self) -> int:
        return len(self._by_id)
