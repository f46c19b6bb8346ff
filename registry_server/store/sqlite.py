"""The SQLite store (WAL), the embedded default: its connection, its schema
and its migrations; the queries are store/sql.py's (store/base.py says what
each method means).

One connection, serialised by a lock: writes are short and rare next to
container starts, and one writer is what SQLite wants anyway. Every change
runs inside a transaction, so a crash or a full disk never leaves a row
half-written.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from registry_server.domain.errors import StoreError
from registry_server.store.release import StoreState, StoreUnreachable, newer_store_error
from registry_server.store.sql import Dialect, SqlReads, SqlWrites, answers
from registry_server.version import version as release_version

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
    # 5: rejection with a reason; stored expiry; the approval events that
    # watches (and webhooks) follow, keyed by their audit entry's seq
    """
    ALTER TABLE approval_requests ADD COLUMN rejected_by TEXT NOT NULL DEFAULT '';
    ALTER TABLE approval_requests ADD COLUMN rejection_reason TEXT NOT NULL DEFAULT '';
    CREATE INDEX approval_requests_open ON approval_requests (state, expires_at);
    CREATE TABLE approval_events (
        seq         INTEGER PRIMARY KEY,  -- the seq of the audit entry recording it
        request_id  TEXT NOT NULL,
        type        TEXT NOT NULL,
        actor       TEXT NOT NULL,
        reason      TEXT NOT NULL,
        at          REAL NOT NULL
    );
    """,
    # 6: the webhook outbox (notify/outbox.py): one row per (event, endpoint),
    # inserted with the event, claimed and retried by the dispatcher
    """
    CREATE TABLE webhook_deliveries (
        event_seq        INTEGER NOT NULL,  -- approval_events.seq
        endpoint         TEXT NOT NULL,     -- the policy's webhook id
        webhook_id       TEXT NOT NULL,     -- the webhook-id header, the same on every attempt
        payload          TEXT NOT NULL,     -- the JSON body
        created_at       REAL NOT NULL,
        next_attempt_at  REAL NOT NULL,
        state            TEXT NOT NULL,     -- pending, delivered, failed
        attempts         INTEGER NOT NULL,
        last_error       TEXT NOT NULL,
        delivered_at     REAL,
        claimed_by       TEXT NOT NULL,     -- the dispatcher sending it ('' when none)
        claim_until      REAL NOT NULL,     -- when that claim lapses
        PRIMARY KEY (event_seq, endpoint)
    );
    CREATE INDEX webhook_deliveries_due ON webhook_deliveries (state, next_attempt_at);
    """,
    # 7: the kill switch (a disabled tool stays listed, its calls are refused);
    # when each name was last deleted (approval tokens issued before do not
    # count for a tool registered under it again); voided approval requests
    """
    ALTER TABLE tools ADD COLUMN disabled INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE tools ADD COLUMN disabled_reason TEXT NOT NULL DEFAULT '';
    ALTER TABLE tools ADD COLUMN tokens_not_before REAL NOT NULL DEFAULT 0;
    CREATE TABLE tool_deletions (
        name        TEXT PRIMARY KEY,
        deleted_at  REAL NOT NULL   -- time.time() of the last deletion of this name
    );
    ALTER TABLE approval_requests ADD COLUMN voided_reason TEXT NOT NULL DEFAULT '';
    CREATE INDEX approval_requests_tool ON approval_requests (tool_name, state);
    """,
    # 8: secrets every server on the store shares (the key of page tokens)
    """
    CREATE TABLE store_secrets (
        name        TEXT PRIMARY KEY,
        value       TEXT NOT NULL,   -- hex
        created_at  REAL NOT NULL
    );
    """,
    # 9: each passkey's last signature counter (a counter that goes back is a clone)
    """
    CREATE TABLE passkey_counters (
        credential_id  TEXT PRIMARY KEY,   -- base64url, as the policy lists it
        approver       TEXT NOT NULL,
        sign_count     INTEGER NOT NULL,
        updated_at     REAL NOT NULL
    );
    """,
    # 10: signed checkpoints of the audit log's Merkle tree (store/audit_tree.py)
    """
    CREATE TABLE audit_checkpoints (
        origin   TEXT NOT NULL,      -- the log's name (the note's first line)
        size     INTEGER NOT NULL,   -- entries covered: seq 1..size
        root     TEXT NOT NULL,      -- RFC 9162 root hash, hex
        note     TEXT NOT NULL,      -- the signed note (c2sp.org/tlog-checkpoint)
        made_at  REAL NOT NULL,
        PRIMARY KEY (origin, size)
    );
    """,
    # 11: how far each SIEM export destination has the audit log, and which
    # exporter holds it (notify/siem/exporter.py)
    """
    CREATE TABLE export_cursors (
        sink         TEXT PRIMARY KEY,   -- jsonl:<path>, syslog:<host>:<port>
        seq          INTEGER NOT NULL,   -- audit entries up to this seq are confirmed
        updated_at   REAL NOT NULL,
        owner        TEXT NOT NULL,      -- the exporter holding the lease ('' when none)
        lease_until  REAL NOT NULL       -- when that lease lapses
    );
    """,
    # 12: witnesses' cosignatures of the audit log's checkpoints (notify/witnesses.py)
    """
    CREATE TABLE audit_cosignatures (
        origin       TEXT NOT NULL,      -- the log's
        witness      TEXT NOT NULL,      -- the witness's key name
        key_id       TEXT NOT NULL,      -- the witness key's ID, hex
        size         INTEGER NOT NULL,   -- of the checkpoint cosigned
        root         TEXT NOT NULL,      -- its root hash, hex
        line         TEXT NOT NULL,      -- the signature line (c2sp.org/tlog-cosignature)
        cosigned_at  INTEGER NOT NULL,   -- the cosignature's time
        PRIMARY KEY (origin, witness, key_id, size)
    );
    CREATE INDEX audit_cosignatures_by_size ON audit_cosignatures (origin, size);
    """,
    # 13: streamed calls published for AttachExecution on other servers (execution/call_relay.py)
    """
    CREATE TABLE kept_calls (
        execution_id TEXT PRIMARY KEY,
        caller       TEXT NOT NULL,      -- the only client that may attach
        server       TEXT NOT NULL,      -- the publishing server's instance id
        stdout       BLOB NOT NULL,      -- the output so far, within the tool's caps
        stderr       BLOB NOT NULL,
        result_json  TEXT NOT NULL,      -- '' while the call runs
        beat_at      REAL NOT NULL,      -- last publication (stale: the server died)
        ended_at     REAL                -- NULL while the call runs
    );
    """,
    # 14 (0.2.0): the release that last opened the store, named when a newer store is
    # refused (store/release.py)
    """
    CREATE TABLE toolreg_release (
        id       INTEGER PRIMARY KEY CHECK (id = 1),
        version  TEXT NOT NULL,
        at       REAL NOT NULL
    );
    """,
    # 15 (0.2.0): group-mapped clients of identity providers, remembered across
    # restarts and servers (policy/seen.py); their roles are never stored
    """
    CREATE TABLE idp_clients (
        client_id    TEXT PRIMARY KEY,   -- the provider's prefix + subject (or its digest)
        provider     TEXT NOT NULL,      -- the policy's identity provider id
        subject      TEXT NOT NULL,      -- the token's subject claim
        groups_json  TEXT NOT NULL,      -- the token's groups, a sorted JSON list
        issued_at    REAL NOT NULL,      -- the token's iat
        expires_at   REAL NOT NULL,      -- the token's exp
        first_seen   REAL NOT NULL,
        last_seen    REAL NOT NULL
    );
    """,
]
# The release row: written at start when another release last opened the store.
_RELEASE_UPSERT = (
    "INSERT INTO toolreg_release (id, version, at) VALUES (1, ?, ?)"
    " ON CONFLICT (id) DO UPDATE SET version = excluded.version, at = excluded.at"
    " WHERE toolreg_release.version <> excluded.version"
)
_RELEASE_READ = "SELECT version FROM toolreg_release WHERE id = 1"


def _written_by(db: sqlite3.Connection) -> str | None:
    try:
        row = db.execute(_RELEASE_READ).fetchone()
    except sqlite3.OperationalError:  # no such table: written before 0.2.0
        return None
    return str(row[0]) if row else None


def inspect_sqlite(path: Path) -> StoreState:
    """The store's schema and release, read through a read-only connection: nothing
    is created, migrated or written (`toolreg doctor`)."""
    known = len(_MIGRATIONS)
    if not path.exists():
        return StoreState("sqlite", str(path), 0, known, None)
    try:
        db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
        try:
            (found,) = db.execute("PRAGMA user_version").fetchone()
            return StoreState("sqlite", str(path), int(found), known, _written_by(db))
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise StoreUnreachable(f"cannot read the store {path}: {exc}") from None


SQLITE = Dialect(
    placeholder="?",
    listed_manifest="json_set(tool_manifest, '$.parameters', json('{\"type\":\"object\"}'))",
)


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
            if version > len(_MIGRATIONS):  # refused before anything is written
                raise newer_store_error(str(self.path), version, len(_MIGRATIONS), _written_by(db))
            for number, sql in enumerate(_MIGRATIONS[version:], start=version + 1):
                # executescript() would COMMIT our transaction; run statements one by one.
                for statement in filter(str.strip, sql.split(";")):
                    db.execute(statement)
                db.execute(f"PRAGMA user_version = {number}")
            db.execute(_RELEASE_UPSERT, (release_version(), time.time()))

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
    def unit_of_work(self) -> Iterator[SqlWrites]:
        """One atomic unit of work: all of it is committed, or none of it.
        BEGIN IMMEDIATE takes the write lock at once: units of work line up."""
        with self._transaction() as db:
            yield SqlWrites(db, SQLITE)

    @contextmanager
    def reading(self) -> Iterator[SqlReads]:
        with self._lock:
            try:
                yield SqlReads(self._db, SQLITE)
            except sqlite3.Error as exc:
                raise StoreError(f"store {self.path}: {exc}") from exc

    def healthy(self) -> bool:
        return answers(self)

    def watch_tools(self, on_change: Callable[[str | None], None]) -> None:
        """One server per file: nobody else changes its tools."""

    def watch_approvals(self, on_change: Callable[[], None]) -> None:
        """One server per file: its own events are the only ones."""

    def watch_policy(self, on_reload: Callable[[], None]) -> None:
        """One server per file: no other server to hear from."""

    def close(self) -> None:
        with self._lock:
            self._db.close()
