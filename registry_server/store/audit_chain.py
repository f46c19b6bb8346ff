"""The append-only, hash-chained audit log: hashing and verification,
independent of where the entries are stored.

Each entry holds the hash of the one before it, so editing, deleting or
reordering any entry breaks the chain at that point, and `toolreg audit
verify` names the first broken entry. Cutting entries off the end leaves a
valid, shorter chain, and whoever holds the database can rewrite the whole
chain: the signed checkpoints of the log's Merkle tree (store/audit_tree.py,
whose leaves are ``entry_bytes``) are what detect those, from outside.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import rfc8785

from registry_server.store.base import AuditEntry, Store, UnitOfWork

GENESIS_HASH = "0" * 64  # prev_hash of the first entry


def entry_bytes(seq: int, at: float, kind: str, record: str, prev_hash: str) -> bytes:
    """An entry's canonical bytes (RFC 8785 JSON of its fields): what its hash
    hashes, and its leaf in the Merkle tree."""
    entry: dict[str, Any] = {
        "seq": seq,
        "at": at,
        "kind": kind,
        "record": record,
        "prev_hash": prev_hash,
    }
    return rfc8785.dumps(entry)


def entry_hash(seq: int, at: float, kind: str, record: str, prev_hash: str) -> str:
    return hashlib.sha256(entry_bytes(seq, at, kind, record, prev_hash)).hexdigest()


def canonical(entry: AuditEntry) -> bytes:
    """``entry_bytes`` of a stored entry, from its fields as stored (never from
    its stored hash: an edited field changes them)."""
    return entry_bytes(entry.seq, entry.at, entry.kind, entry.record, entry.prev_hash)


def append(uow: UnitOfWork, kind: str, record: dict[str, Any]) -> int:
    """Append inside the caller's unit of work, so the record commits together
    with whatever it records. Returns its seq."""
    last = uow.audit_tail(1)
    seq, prev = (last[0].seq + 1, last[0].hash) if last else (1, GENESIS_HASH)
    at = round(time.time(), 6)
    text = rfc8785.dumps(record).decode()
    uow.add_audit_entry(
        AuditEntry(seq, at, kind, text, prev, entry_hash(seq, at, kind, text, prev))
    )
    return seq


@dataclass(frozen=True)
class Verdict:
    ok: bool
    records: int
    head: str  # hash of the last entry (GENESIS_HASH when empty)
    broken_seq: int | None = None
    reason: str = ""

    def __str__(self) -> str:
        if self.ok:
            return f"audit chain intact: {self.records} records, head {self.head[:16]}"
        return f"audit chain broken at record {self.broken_seq}: {self.reason}"


def verify_entries(
    entries: Sequence[AuditEntry], canonical_bytes: Sequence[bytes] | None = None
) -> Verdict:
    """``canonical_bytes``: each entry's ``canonical`` bytes when the caller
    has made them already (the start check hashes them into the tree too)."""
    prev = GENESIS_HASH
    for expected_seq, entry in enumerate(entries, start=1):
        if entry.seq != expected_seq:
            reason = f"expected record {expected_seq} here (deleted?)"
            return Verdict(False, len(entries), prev, entry.seq, reason)
        if entry.prev_hash != prev:
            reason = "does not link to the record before it"
            return Verdict(False, len(entries), prev, entry.seq, reason)
        data = canonical(entry) if canonical_bytes is None else canonical_bytes[expected_seq - 1]
        if hashlib.sha256(data).hexdigest() != entry.hash:
            reason = "content does not match its hash (edited?)"
            return Verdict(False, len(entries), prev, entry.seq, reason)
        prev = entry.hash
    return Verdict(True, len(entries), prev)


def verify(store: Store) -> Verdict:
    with store.reading() as reads:
        entries = reads.audit_entries()
    return verify_entries(entries)


def tail(store: Store, count: int = 20) -> list[dict[str, Any]]:
    with store.reading() as reads:
        entries = reads.audit_tail(count)
    return [
        {"seq": e.seq, "at": e.at, "kind": e.kind, "record": json.loads(e.record), "hash": e.hash}
        for e in entries
    ]
