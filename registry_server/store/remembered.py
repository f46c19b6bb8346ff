"""Group-mapped clients remembered in the store (policy/seen.py ``Remembered``):
a sighting is a row of ``idp_clients`` (store/base.py ``IdentityRecord``), so a
restarted server and every server on the same database know the client
(docs/how-to/identity.md, "Remembered clients")."""

from __future__ import annotations

from registry_server.policy.seen import Sighting
from registry_server.store.base import IdentityRecord, Store


class StoredIdentities:
    def __init__(self, store: Store) -> None:
        self._store = store

    def load(self, client_id: str) -> Sighting | None:
        with self._store.reading() as reads:
            record = reads.identity(client_id)
        if record is None:
            return None
        return Sighting(
            record.provider, record.subject, frozenset(record.groups),
            record.issued_at, record.expires_at,
        )  # fmt: skip

    def save(self, client_id: str, sighting: Sighting, now: float) -> None:
        record = IdentityRecord(
            client_id, sighting.provider, sighting.subject, tuple(sorted(sighting.groups)),
            float(sighting.issued_at), _finite(sighting.expires_at), now, now,
        )  # fmt: skip
        with self._store.unit_of_work() as work:
            work.put_identity(record)


def _finite(value: float) -> float:
    """A token always has exp; a sighting made without one (tests) stores 0, no time."""
    return value if value != float("inf") else 0.0
