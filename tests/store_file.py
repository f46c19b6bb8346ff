"""The SQLite store's file as another process sees it: for tests that read
what a server wrote, and for attacks that edit or lock it behind the
server's back. The only SQL in the tests."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from registry_server.api.config import DB_FILENAME


def connect(data_dir: Path) -> sqlite3.Connection:
    """A raw connection to the data directory's store, outside any server."""
    return sqlite3.connect(data_dir / DB_FILENAME, isolation_level=None)


def audit_rows(data_dir: Path, kind: str | None = None) -> list[tuple[int, str, str]]:
    """(seq, kind, record JSON) of every audit entry, or of one kind, by seq."""
    db = connect(data_dir)
    try:
        rows = db.execute("SELECT seq, kind, record FROM audit ORDER BY seq").fetchall()
    finally:
        db.close()
    return [(int(s), str(k), str(r)) for s, k, r in rows if kind is None or k == kind]


def set_request_manifest(data_dir: Path, request_id: str, manifest: str) -> None:
    """Replace the definition an approval request keeps (its ``tool_digest``
    stays): what an attacker with the file would do to show approvers a
    harmless tool while the digest they sign stands for another."""
    db = connect(data_dir)
    try:
        changed = db.execute(
            "UPDATE approval_requests SET tool_manifest = ? WHERE id = ?", (manifest, request_id)
        ).rowcount
    finally:
        db.close()
    assert changed == 1, f"no approval request {request_id}"


def request_manifest(data_dir: Path, request_id: str) -> str:
    db = connect(data_dir)
    try:
        row = db.execute(
            "SELECT tool_manifest FROM approval_requests WHERE id = ?", (request_id,)
        ).fetchone()
    finally:
        db.close()
    return str(row[0])
