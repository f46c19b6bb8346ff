"""The SQLite store (WAL): the only module that speaks SQL (store/base.py
says what each method means).

One connection, serialised by a lock: writes are short and rare next to
container starts, and one writer is what SQLite wants anyway. Every change
runs inside a transaction, so a crash or a full disk never leaves a row
half-written.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from registry_server.domain.errors import StoreError
from registry_server.store.base import (
    APPROVED,
    CONSUMED,
    EXPIRED,
    PENDING,
    ApprovalRequestRecord,
    AuditEntry,
    StoredTool,
)

BUSY_TIMEOUT_MS = 5_000  # milliseconds to wait for another process's write lock

_MIGRATIONS: list[str] = [
    # 1: tools
    """
    CREATE TABLE tools (
        name        TEXT PRIMARY KEY,
        manifest    TEXT NOT NULL,   -- the definition in manifest shape, JSON
        digest      TEXT NOT NULL,
        created_at  REAL NOT NULL,
        updated_at  REAL NOT NULL
    );
    """,
    # 2: one row per execution attempt (the execution log)
    """
    CREATE TABLE executions (
        id           TEXT PRIMARY KEY,
        at           REAL NOT NULL,
        tool         TEXT NOT NULL,
        tool_digest  TEXT NOT NULL,
        level        TEXT NOT NULL,
        caller       TEXT NOT NULL,
        args_digest  TEXT NOT NULL,
        status       TEXT NOT NULL,
        exit_code    INTEGER,
        duration_ms  INTEGER NOT NULL,
        runtime      TEXT NOT NULL,
        limits       TEXT NOT NULL     -- JSON of the limits applied
    );
    CREATE INDEX executions_at ON executions (at);
    """,
    # 3: the hash-chained audit log replaces the execution log; approvals
    """
    DROP TABLE executions;
    CREATE TABLE audit (
        seq        INTEGER PRIMARY KEY,  -- 1, 2, 3, ... in append order
        at         REAL NOT NULL,
        kind       TEXT NOT NULL,        -- execution, approval, registration
        record     TEXT NOT NULL,        -- the record, canonical JSON (RFC 8785)
        prev_hash  TEXT NOT NULL,        -- hash of record seq-1 (64 zeros for the first)
        hash       TEXT NOT NULL         -- sha256 of the canonical JSON of the fields above
    );
    CREATE TABLE approval_requests (
        id                  TEXT PRIMARY KEY,
        tool_name           TEXT NOT NULL,
        tool_digest         TEXT NOT NULL,
        arguments_json      TEXT NOT NULL,
        arguments_digest    TEXT NOT NULL,
        requested_by        TEXT NOT NULL,
        approvals_required  INTEGER NOT NULL,
        state               TEXT NOT NULL,   -- PENDING, APPROVED, CONSUMED (EXPIRED is derived)
        created_at          REAL NOT NULL,
        expires_at          REAL NOT NULL
    );
    CREATE INDEX approval_requests_created ON approval_requests (created_at);
    CREATE TABLE approval_tokens (
        request_id  TEXT NOT NULL REFERENCES approval_requests (id),
        approver    TEXT NOT NULL,
        jti         TEXT NOT NULL,
        token       TEXT NOT NULL,
        expires_at  REAL NOT NULL,
        PRIMARY KEY (request_id, approver)
    );
    CREATE TABLE used_nonces (
        jti           TEXT PRIMARY KEY,   -- a token's jti: used once, ever
        approver      TEXT NOT NULL,
        used_at       REAL NOT NULL,
        execution_id  TEXT NOT NULL
    );
    """,
    # 4: ownership of tools (older tools were the operator's: only an admin
    # may replace them); the definition an approval request is for, as shown
    # to approvers
    """
    ALTER TABLE tools ADD COLUMN owner TEXT NOT NULL DEFAULT '[operator]';
    ALTER TABLE approval_requests ADD COLUMN tool_manifest TEXT NOT NULL DEFAULT '';
    ALTER TABLE approval_requests ADD COLUMN tool_owner TEXT NOT NULL DEFAULT '';
    CREATE INDEX approval_requests_requester ON approval_requests (requested_by, state);
    """,
]


class SqliteStore:
    """One connection, serialised by a lock: writes are short and rare next to
    container starts, and one writer is what SQLite wants anyway."""

    def __init__(self, path: Path, *, busy_timeout_ms: int = BUSY_TIMEOUT_MS) -> None:
        self.path = path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(
                path,
                check_same_thread=False,
                isolation_level=None,
                timeout=busy_timeout_ms / 1000,
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            # FULL: a committed registration or spent approval token survives
            # power loss, not only a process crash.
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the store {path}: {exc}") from exc
        self._lock = threading.RLock()
        self._migrate()

    @property
    def location(self) -> str:
        return str(self.path)

    def _migrate(self) -> None:
        with self._transaction() as db:
            (version,) = db.execute("PRAGMA user_version").fetchone()
            if version > len(_MIGRATIONS):
                raise StoreError(
                    f"{self.path} was written by a newer toolreg (schema {version});"
                    " upgrade toolreg"
                )
            for number, sql in enumerate(_MIGRATIONS[version:], start=version + 1):
                # executescript() would COMMIT our transaction; run statements one by one.
                for statement in filter(str.strip, sql.split(";")):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {number}")

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except sqlite3.Error as exc:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise StoreError(f"store {self.path}: {exc}") from exc

    @contextmanager
    def unit_of_work(self) -> Iterator[_Writes]:
        """One atomic unit of work: all of it is committed, or none of it."""
        with self._transaction() as db:
            yield _Writes(db)

    @contextmanager
    def reading(self) -> Iterator[_Reads]:
        with self._lock:
            try:
                yield _Reads(self._db)
            except sqlite3.Error as exc:
                raise StoreError(f"store {self.path}: {exc}") from exc

    def close(self) -> None:
        with self._lock:
            self._db.close()


_REQUEST_COLUMNS = (
    "id, tool_name, tool_digest, arguments_json, arguments_digest, requested_by,"
    " approvals_required, state, created_at, expires_at, tool_manifest, tool_owner"
)
# Listings read neither the arguments nor the schema from disk.
_LISTED_COLUMNS = _REQUEST_COLUMNS.replace("arguments_json", "''").replace(
    "tool_manifest",
    "CASE tool_manifest WHEN '' THEN '' ELSE"
    " json_set(tool_manifest, '$.parameters', json('{\"type\":\"object\"}')) END",
)


def _request(row: tuple[object, ...]) -> ApprovalRequestRecord:
    (rid, tool, tdig, args, adig, by, need, state, created, expires, manifest, owner) = row
    return ApprovalRequestRecord(
        id=str(rid), tool_name=str(tool), tool_digest=str(tdig), arguments_json=str(args),
        arguments_digest=str(adig), requested_by=str(by), approvals_required=int(str(need)),
        state=str(state), created_at=float(str(created)), expires_at=float(str(expires)),
        tool_manifest=str(manifest), tool_owner=str(owner),
    )  # fmt: skip


def _audit_entry(row: tuple[object, ...]) -> AuditEntry:
    seq, at, kind, record, prev_hash, hash_ = row
    return AuditEntry(
        int(str(seq)), float(str(at)), str(kind), str(record), str(prev_hash), str(hash_)
    )


class _Reads:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def _all(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        return list(self._db.execute(sql, params).fetchall())

    def tools(self) -> list[StoredTool]:
        rows = self._all("SELECT name, manifest, digest, owner FROM tools ORDER BY name")
        return [StoredTool(str(n), str(m), str(d), str(o)) for n, m, d, o in rows]

    def jti_used(self, jti: str) -> bool:
        return bool(self._all("SELECT 1 FROM used_nonces WHERE jti = ?", (jti,)))

    def request(self, request_id: str) -> ApprovalRequestRecord | None:
        rows = self._all(
            f"SELECT {_REQUEST_COLUMNS} FROM approval_requests WHERE id = ?", (request_id,)
        )
        return _request(rows[0]) if rows else None

    def requests(self, *, state: str, now: float, limit: int) -> list[ApprovalRequestRecord]:
        where = ""
        params: tuple[object, ...] = ()
        if state == EXPIRED:
            where, params = f"WHERE state != '{CONSUMED}' AND expires_at <= ?", (now,)
        elif state in (PENDING, APPROVED):
            where, params = "WHERE state = ? AND expires_at > ?", (state, now)
        elif state == CONSUMED:
            where = f"WHERE state = '{CONSUMED}'"
        rows = self._all(
            f"SELECT {_LISTED_COLUMNS} FROM approval_requests {where}"
            " ORDER BY created_at DESC LIMIT ?",
            (*params, limit),
        )
        return [_request(r) for r in rows]

    def open_request_for(
        self, *, tool_name: str, tool_digest: str, arguments_digest: str, requested_by: str,
        now: float,
    ) -> str | None:  # fmt: skip
        rows = self._all(
            "SELECT id FROM approval_requests WHERE tool_name = ? AND tool_digest = ?"
            f" AND arguments_digest = ? AND requested_by = ? AND state = '{PENDING}'"
            " AND expires_at > ? ORDER BY created_at DESC LIMIT 1",
            (tool_name, tool_digest, arguments_digest, requested_by, now),
        )
        return str(rows[0][0]) if rows else None

    def open_requests_of(self, requested_by: str, now: float) -> int:
        ((count,),) = self._all(
            "SELECT COUNT(*) FROM approval_requests WHERE requested_by = ?"
            f" AND state = '{PENDING}' AND expires_at > ?",
            (requested_by, now),
        )
        return int(str(count))

    def approvers_of(self, request_id: str) -> list[str]:
        rows = self._all(
            "SELECT approver FROM approval_tokens WHERE request_id = ? ORDER BY approver",
            (request_id,),
        )
        return [str(r[0]) for r in rows]

    def tokens_of(self, request_id: str) -> list[str]:
        rows = self._all(
            "SELECT token FROM approval_tokens WHERE request_id = ? ORDER BY approver",
            (request_id,),
        )
        return [str(r[0]) for r in rows]

    def audit_entries(self) -> list[AuditEntry]:
        rows = self._all("SELECT seq, at, kind, record, prev_hash, hash FROM audit ORDER BY seq")
        return [_audit_entry(r) for r in rows]

    def audit_tail(self, count: int) -> list[AuditEntry]:
        rows = self._all(
            "SELECT seq, at, kind, record, prev_hash, hash FROM audit ORDER BY seq DESC LIMIT ?",
            (count,),
        )
        return [_audit_entry(r) for r in reversed(rows)]


class _Writes(_Reads):
    """Used only inside SqliteStore's transaction."""

    def put_tool(self, tool: StoredTool, now: float) -> None:
        self._db.execute(
            "INSERT INTO tools (name, manifest, digest, owner, created_at, updated_at)"
            " VALUES (?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(name) DO UPDATE SET manifest = excluded.manifest,"
            " digest = excluded.digest, owner = excluded.owner,"
            " updated_at = excluded.updated_at",
            (tool.name, tool.manifest_json, tool.digest, tool.owner, now, now),
        )

    def add_audit_entry(self, entry: AuditEntry) -> None:
        self._db.execute(
            "INSERT INTO audit (seq, at, kind, record, prev_hash, hash) VALUES (?, ?, ?, ?, ?, ?)",
            (entry.seq, entry.at, entry.kind, entry.record, entry.prev_hash, entry.hash),
        )

    def use_jti(self, jti: str, approver: str, execution_id: str, now: float) -> bool:
        if self.jti_used(jti):
            return False
        self._db.execute(
            "INSERT INTO used_nonces (jti, approver, used_at, execution_id) VALUES (?, ?, ?, ?)",
            (jti, approver, now, execution_id),
        )
        return True

    def add_request(self, request: ApprovalRequestRecord) -> None:
        r = request
        self._db.execute(
            f"INSERT INTO approval_requests ({_REQUEST_COLUMNS})"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                r.id, r.tool_name, r.tool_digest, r.arguments_json, r.arguments_digest,
                r.requested_by, r.approvals_required, r.state, r.created_at, r.expires_at,
                r.tool_manifest, r.tool_owner,
            ),
        )  # fmt: skip

    def consume_request(self, request_id: str, now: float) -> bool:
        changed = self._db.execute(
            f"UPDATE approval_requests SET state = '{CONSUMED}'"
            f" WHERE id = ? AND state IN ('{PENDING}', '{APPROVED}') AND expires_at > ?",
            (request_id, now),
        ).rowcount
        return changed == 1

    def put_approval_token(
        self, request_id: str, approver: str, jti: str, token: str, expires_at: float
    ) -> None:
        self._db.execute(
            "INSERT INTO approval_tokens (request_id, approver, jti, token, expires_at)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT (request_id, approver) DO UPDATE SET"
            " jti = excluded.jti, token = excluded.token, expires_at = excluded.expires_at",
            (request_id, approver, jti, token, expires_at),
        )

    def mark_approved(self, request_id: str) -> None:
        self._db.execute(
            f"UPDATE approval_requests SET state = '{APPROVED}'"
            f" WHERE id = ? AND state = '{PENDING}'",
            (request_id,),
        )
