"""The append-only, hash-chained audit log.

Each record holds the hash of the one before it, so editing, deleting or
reordering any record breaks the chain at that point, and `toolreg audit
verify` names the first broken record. (Cutting records off the end leaves a
valid, shorter chain: ship records elsewhere, or compare the head hash with
a copy kept elsewhere, where that matters.)
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import rfc8785

if TYPE_CHECKING:  # store.py imports this module
    from registry_server.store.sqlite import Store

GENESIS_HASH = "0" * 64  # prev_hash of the first record


def entry_hash(seq: int, at: float, kind: str, record: str, prev_hash: str) -> str:
    entry: dict[str, Any] = {
        "seq": seq,
        "at": at,
        "kind": kind,
        "record": record,
        "prev_hash": prev_hash,
    }
    return hashlib.sha256(rfc8785.dumps(entry)).hexdigest()


def append(db: sqlite3.Connection, kind: str, record: dict[str, Any]) -> int:
    """Append inside the caller's transaction (Store.transaction), so the
    record commits together with whatever it records. Returns its seq."""
    row = db.execute("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1").fetchone()
    seq, prev = (row[0] + 1, row[1]) if row else (1, GENESIS_HASH)
    at = round(time.time(), 6)
    text = rfc8785.dumps(record).decode()
    db.execute(
        "INSERT INTO audit (seq, at, kind, record, prev_hash, hash) VALUES (?, ?, ?, ?, ?, ?)",
        (seq, at, kind, text, prev, entry_hash(seq, at, kind, text, prev)),
    )
    return int(seq)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    records: int
    head: str  # hash of the last record (GENESIS_HASH when empty)
    broken_seq: int | None = None
    reason: str = ""

    def __str__(self) -> str:
        if self.ok:
            return f"audit chain intact: {self.records} records, head {self.head[:16]}"
        return f"audit chain broken at record {self.broken_seq}: {self.reason}"


def verify(store: Store) -> Verdict:
    rows = store.read("SELECT seq, at, kind, record, prev_hash, hash FROM audit ORDER BY seq")
    prev = GENESIS_HASH
    expected_seq = 1
    for seq, at, kind, record, prev_hash, stored in rows:
        if seq != expected_seq:
            return Verdict(
                False,
                len(rows),
                prev,
                int(str(seq)),
                f"expected record {expected_seq} here (deleted?)",
            )
        if prev_hash != prev:
            return Verdict(
                False, len(rows), prev, int(str(seq)), "does not link to the record before it"
            )
        actual = entry_hash(int(str(seq)), float(str(at)), str(kind), str(record), str(prev_hash))
        if actual != stored:
            return Verdict(
                False, len(rows), prev, int(str(seq)), "content does not match its hash (edited?)"
            )
        prev = str(stored)
        expected_seq += 1
    return Verdict(True, len(rows), prev)


def tail(store: Store, count: int = 20) -> list[dict[str, Any]]:
    rows = store.read(
        "SELECT seq, at, kind, record, hash FROM audit ORDER BY seq DESC LIMIT ?", (count,)
    )
    return [
        {"seq": seq, "at": at, "kind": kind, "record": json.loads(str(record)), "hash": h}
        for seq, at, kind, record, h in reversed(rows)
    ]
