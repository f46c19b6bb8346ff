"""The PostgreSQL store: several registry servers on one database
(docs/how-to/scaling.md). The queries are store/sql.py's; this module holds the
connection pool, the schema and its migrations, and what makes N servers
agree:

* a spent token id is a primary key: of two servers spending one, the second
  inserts nothing (``use_jti``), so it is spent once across all of them;
* one audit chain: a unit of work that appends takes a transaction-level
  advisory lock first, so appends from every server line up;
* approvals submitted at once through two servers lock their request row;
* a changed tool (stored, deleted, disabled or enabled) is announced with
  NOTIFY in the transaction that changes it, and ``watch_tools`` LISTENs for
  it: every server reloads it at once;
* webhook deliveries are claimed with FOR UPDATE SKIP LOCKED and a lease:
  each is sent by one server at a time, and a dead server's are taken over.

Messages name the database by its URL without the password.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg_pool import ConnectionPool

from registry_server.domain.errors import StoreError
from registry_server.store.release import StoreState, StoreUnreachable, newer_store_error
from registry_server.store.sql import Dialect, SqlReads, SqlWrites, answers
from registry_server.version import version as release_version

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5  # seconds to reach the database before a call fails
POOL_TIMEOUT_S = 5.0  # seconds a call waits for a pooled connection
TOOLS_CHANNEL = "toolreg_tools"  # NOTIFY channel: payload = the changed tool's name
APPROVALS_CHANNEL = "toolreg_approvals"  # NOTIFY channel: payload = an approval event's seq
POLICY_CHANNEL = "toolreg_policy"  # NOTIFY channel: payload = "<announcing store>:<digest>"
LISTEN_RETRY_S = 1.0  # seconds between reconnects of the listener
_AUDIT_LOCK = 7_402_001  # advisory lock keys (any constants unique to toolreg)
_MIGRATION_LOCK = 7_402_002

POSTGRES = Dialect(
    placeholder="%s",
    listed_manifest=(
        "jsonb_set(tool_manifest::jsonb, '{parameters}', '{\"type\":\"object\"}'::jsonb)::text"
    ),
    lock_audit=f"SELECT pg_advisory_xact_lock({_AUDIT_LOCK})",
    lock_request="SELECT 1 FROM approval_requests WHERE id = %s FOR UPDATE",
    announce_event=f"SELECT pg_notify('{APPROVALS_CHANNEL}', %s)",
    # Delivered on commit only: no server reloads what was rolled back.
    announce_tool=f"SELECT pg_notify('{TOOLS_CHANNEL}', %s)",
    skip_locked=" FOR UPDATE SKIP LOCKED",
)

_MIGRATIONS: list[str] = [
    # 1: everything the SQLite store holds after its 4th migration
    """
    CREATE TABLE tools (
        name        TEXT PRIMARY KEY,
        manifest    TEXT NOT NULL,
        digest      TEXT NOT NULL,
        owner       TEXT NOT NULL,
        created_at  DOUBLE PRECISION NOT NULL,
        updated_at  DOUBLE PRECISION NOT NULL
    );
    CREATE TABLE audit (
        seq        BIGINT PRIMARY KEY,
        at         DOUBLE PRECISION NOT NULL,
        kind       TEXT NOT NULL,
        record     TEXT NOT NULL,
        prev_hash  TEXT NOT NULL,
        hash       TEXT NOT NULL
    );
    CREATE TABLE approval_requests (
        id                  TEXT PRIMARY KEY,
        tool_name           TEXT NOT NULL,
        tool_digest         TEXT NOT NULL,
        arguments_json      TEXT NOT NULL,
        arguments_digest    TEXT NOT NULL,
        requested_by        TEXT NOT NULL,
        approvals_required  INTEGER NOT NULL,
        state               TEXT NOT NULL,
        created_at          DOUBLE PRECISION NOT NULL,
        expires_at          DOUBLE PRECISION NOT NULL,
        tool_manifest       TEXT NOT NULL DEFAULT '',
        tool_owner          TEXT NOT NULL DEFAULT ''
    );
    CREATE INDEX approval_requests_created ON approval_requests (created_at);
    CREATE INDEX approval_requests_requester ON approval_requests (requested_by, state);
    CREATE TABLE approval_tokens (
        request_id  TEXT NOT NULL REFERENCES approval_requests (id),
        approver    TEXT NOT NULL,
        jti         TEXT NOT NULL,
        token       TEXT NOT NULL,
        expires_at  DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (request_id, approver)
    );
    CREATE TABLE used_nonces (
        jti           TEXT PRIMARY KEY,
        approver      TEXT NOT NULL,
        used_at       DOUBLE PRECISION NOT NULL,
        execution_id  TEXT NOT NULL
    );
    """,
    # 2: as the SQLite store's 5th: rejection, stored expiry, approval events
    """
    ALTER TABLE approval_requests ADD COLUMN rejected_by TEXT NOT NULL DEFAULT '';
    ALTER TABLE approval_requests ADD COLUMN rejection_reason TEXT NOT NULL DEFAULT '';
    CREATE INDEX approval_requests_open ON approval_requests (state, expires_at);
    CREATE TABLE approval_events (
        seq         BIGINT PRIMARY KEY,
        request_id  TEXT NOT NULL,
        type        TEXT NOT NULL,
        actor       TEXT NOT NULL,
        reason      TEXT NOT NULL,
        at          DOUBLE PRECISION NOT NULL
    );
    """,
    # 3: as the SQLite store's 6th: the webhook outbox
    """
    CREATE TABLE webhook_deliveries (
        event_seq        BIGINT NOT NULL,
        endpoint         TEXT NOT NULL,
        webhook_id       TEXT NOT NULL,
        payload          TEXT NOT NULL,
        created_at       DOUBLE PRECISION NOT NULL,
        next_attempt_at  DOUBLE PRECISION NOT NULL,
        state            TEXT NOT NULL,
        attempts         INTEGER NOT NULL,
        last_error       TEXT NOT NULL,
        delivered_at     DOUBLE PRECISION,
        claimed_by       TEXT NOT NULL,
        claim_until      DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (event_seq, endpoint)
    );
    CREATE INDEX webhook_deliveries_due ON webhook_deliveries (state, next_attempt_at);
    """,
    # 4: as the SQLite store's 7th: the kill switch, deleted names, voided requests
    """
    ALTER TABLE tools ADD COLUMN disabled BOOLEAN NOT NULL DEFAULT FALSE;
    ALTER TABLE tools ADD COLUMN disabled_reason TEXT NOT NULL DEFAULT '';
    ALTER TABLE tools ADD COLUMN tokens_not_before DOUBLE PRECISION NOT NULL DEFAULT 0;
    CREATE TABLE tool_deletions (
        name        TEXT PRIMARY KEY,
        deleted_at  DOUBLE PRECISION NOT NULL
    );
    ALTER TABLE approval_requests ADD COLUMN voided_reason TEXT NOT NULL DEFAULT '';
    CREATE INDEX approval_requests_tool ON approval_requests (tool_name, state);
    """,
    # 5: as the SQLite store's 8th: secrets every server shares (the page token key)
    """
    CREATE TABLE store_secrets (
        name        TEXT PRIMARY KEY,
        value       TEXT NOT NULL,
        created_at  DOUBLE PRECISION NOT NULL
    );
    """,
    # 6: as the SQLite store's 9th: each passkey's last signature counter
    """
    CREATE TABLE passkey_counters (
        credential_id  TEXT PRIMARY KEY,
        approver       TEXT NOT NULL,
        sign_count     BIGINT NOT NULL,
        updated_at     DOUBLE PRECISION NOT NULL
    );
    """,
    # 7: as the SQLite store's 10th: signed checkpoints of the audit log's tree
    """
    CREATE TABLE audit_checkpoints (
        origin   TEXT NOT NULL,
        size     BIGINT NOT NULL,
        root     TEXT NOT NULL,
        note     TEXT NOT NULL,
        made_at  DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (origin, size)
    );
    """,
    # 8: as the SQLite store's 11th: SIEM export cursors and their leases
    """
    CREATE TABLE export_cursors (
        sink         TEXT PRIMARY KEY,
        seq          BIGINT NOT NULL,
        updated_at   DOUBLE PRECISION NOT NULL,
        owner        TEXT NOT NULL,
        lease_until  DOUBLE PRECISION NOT NULL
    );
    """,
    # 9: as the SQLite store's 12th: witnesses' cosignatures of the checkpoints
    """
    CREATE TABLE audit_cosignatures (
        origin       TEXT NOT NULL,
        witness      TEXT NOT NULL,
        key_id       TEXT NOT NULL,
        size         BIGINT NOT NULL,
        root         TEXT NOT NULL,
        line         TEXT NOT NULL,
        cosigned_at  BIGINT NOT NULL,
        PRIMARY KEY (origin, witness, key_id, size)
    );
    CREATE INDEX audit_cosignatures_by_size ON audit_cosignatures (origin, size);
    """,
    # 13: streamed calls published for AttachExecution on other servers (execution/call_relay.py)
    """
    CREATE TABLE kept_calls (
        execution_id TEXT PRIMARY KEY,
        caller       TEXT NOT NULL,
        server       TEXT NOT NULL,
        stdout       BYTEA NOT NULL,
        stderr       BYTEA NOT NULL,
        result_json  TEXT NOT NULL,
        beat_at      DOUBLE PRECISION NOT NULL,
        ended_at     DOUBLE PRECISION
    );
    """,
    # 11 (0.2.0), as the SQLite store's 14th: the release that last opened the store
    """
    CREATE TABLE toolreg_release (
        id       INTEGER PRIMARY KEY CHECK (id = 1),
        version  TEXT NOT NULL,
        at       DOUBLE PRECISION NOT NULL
    );
    """,
    # 12 (0.2.0), as the SQLite store's 15th: group-mapped clients of identity providers
    """
    CREATE TABLE idp_clients (
        client_id    TEXT PRIMARY KEY,
        provider     TEXT NOT NULL,
        subject      TEXT NOT NULL,
        groups_json  TEXT NOT NULL,
        issued_at    DOUBLE PRECISION NOT NULL,
        expires_at   DOUBLE PRECISION NOT NULL,
        first_seen   DOUBLE PRECISION NOT NULL,
        last_seen    DOUBLE PRECISION NOT NULL
    );
    """,
]
_RELEASE_UPSERT = (
    "INSERT INTO toolreg_release (id, version, at) VALUES (1, %s, %s)"
    " ON CONFLICT (id) DO UPDATE SET version = excluded.version, at = excluded.at"
    " WHERE toolreg_release.version <> excluded.version"
)
_RELEASE_READ = "SELECT version FROM toolreg_release WHERE id = 1"
_SCHEMA_READ = "SELECT version FROM toolreg_schema"


def _schema_version(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    row = conn.execute(_SCHEMA_READ).fetchone()
    return int(str(row[0])) if row else 0


def _written_by(conn: psycopg.Connection[tuple[object, ...]]) -> str | None:
    exists = conn.execute("SELECT to_regclass('toolreg_release')").fetchone()
    if not exists or exists[0] is None:  # written before 0.2.0
        return None
    row = conn.execute(_RELEASE_READ).fetchone()
    return str(row[0]) if row else None


def inspect_postgres(url: str) -> StoreState:
    """The store's schema and release, read in a read-only transaction: nothing is
    created, migrated or written (`toolreg doctor`)."""
    shown, known = redacted(url), len(_MIGRATIONS)
    try:
        with psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True) as conn:
            conn.execute("SET default_transaction_read_only = on")
            with conn.transaction():
                exists = conn.execute("SELECT to_regclass('toolreg_schema')").fetchone()
                if not exists or exists[0] is None:
                    return StoreState("postgresql", shown, 0, known, None)
                found = _schema_version(conn)
                return StoreState("postgresql", shown, found, known, _written_by(conn))
    except psycopg.Error as exc:
        raise StoreUnreachable(f"cannot read the store {shown}: {_cause(url, exc)}") from None


def _cause(url: str, exc: BaseException) -> str:
    """One line: the driver's first line, never the password."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    password = _password(url)
    return text.replace(password, "***") if password else text


def redacted(url: str) -> str:
    """The URL without its password (for every message and log line)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "postgresql://(unparseable URL)"
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def _password(url: str) -> str | None:
    try:
        return urlsplit(url).password
    except ValueError:
        return None


class PostgresStore:
    def __init__(self, url: str, *, max_connections: int = 16, must_exist: bool = False) -> None:
        self.url = url
        self._shown = redacted(url)
        # Who announces a policy reload: this server hears its own NOTIFY too.
        self._instance = uuid.uuid4().hex
        self._dialect = dataclasses.replace(
            POSTGRES,
            announce_policy=f"SELECT pg_notify('{POLICY_CHANNEL}', '{self._instance}:' || %s)",
        )
        self._closed = threading.Event()
        self._watchers: list[threading.Thread] = []
        try:
            # One plain connection first: a wrong URL, password or database is
            # reported at once with libpq's reason (a pool would retry it).
            psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT_S).close()
        except psycopg.Error as exc:
            raise StoreError(f"cannot open the store {self._shown}: {self._cause(exc)}") from None
        try:
            self._pool = ConnectionPool(
                url,
                min_size=1,
                max_size=max_connections,
                kwargs={"autocommit": True, "connect_timeout": CONNECT_TIMEOUT_S},
                # a connection broken by a database restart is replaced, not handed out
                check=ConnectionPool.check_connection,
                timeout=POOL_TIMEOUT_S,
                open=False,
                name="toolreg-store",
            )
            self._pool.open(wait=True, timeout=CONNECT_TIMEOUT_S + 1)
        except Exception as exc:  # psycopg.Error, PoolTimeout, a malformed URL
            self._pool.close()
            raise StoreError(f"cannot open the store {self._shown}: {self._cause(exc)}") from None
        try:
            self._migrate(must_exist)
        except BaseException:
            self._pool.close()
            raise

    @property
    def location(self) -> str:
        return self._shown

    def _migrate(self, must_exist: bool) -> None:
        with self._connection() as conn, conn.transaction():
            # Servers starting together migrate one at a time.
            conn.execute(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})")
            conn.execute("CREATE TABLE IF NOT EXISTS toolreg_schema (version INTEGER NOT NULL)")
            version = _schema_version(conn)
            if must_exist and version == 0:
                raise StoreError(f"no toolreg store at {self._shown}")
            if version > len(_MIGRATIONS):  # refused; the transaction rolls back
                raise newer_store_error(self._shown, version, len(_MIGRATIONS), _written_by(conn))
            for number, sql in enumerate(_MIGRATIONS[version:], start=version + 1):
                conn.execute(sql.encode())
                conn.execute("DELETE FROM toolreg_schema")
                conn.execute("INSERT INTO toolreg_schema (version) VALUES (%s)", (number,))
                log.info("store %s: schema migrated to version %d", self._shown, number)
            conn.execute(_RELEASE_UPSERT, (release_version(), time.time()))

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
        try:
            with self._pool.connection() as conn:
                yield conn
        except psycopg.Error as exc:
            raise StoreError(f"store {self._shown}: {self._cause(exc)}") from None

    @contextmanager
    def reading(self) -> Iterator[SqlReads]:
        with self._connection() as conn:
            yield SqlReads(conn, self._dialect)

    @contextmanager
    def unit_of_work(self) -> Iterator[SqlWrites]:
        """One transaction: all of it is committed, or none of it."""
        with self._connection() as conn, conn.transaction():
            yield SqlWrites(conn, self._dialect)

    def healthy(self) -> bool:
        return answers(self)

    def watch_tools(self, on_change: Callable[[str | None], None]) -> None:
        """Call ``on_change(name)`` when any server stores tool ``name``, and
        ``on_change(None)`` after every (re)connect: notifications sent while
        the listener was away are lost, so reload everything then."""
        self._watch(TOOLS_CHANNEL, on_change)

    def watch_approvals(self, on_change: Callable[[], None]) -> None:
        """Call ``on_change()`` when any server stores an approval event, and
        after every (re)connect (the watcher re-reads from its last seq)."""
        self._watch(APPROVALS_CHANNEL, lambda _seq: on_change())

    def watch_policy(self, on_reload: Callable[[], None]) -> None:
        """Call ``on_reload()`` when another server announces a policy reload
        (not on reconnects: a server keeps the policy it has)."""

        def heard(payload: str | None) -> None:
            if payload is not None and payload.partition(":")[0] != self._instance:
                on_reload()

        self._watch(POLICY_CHANNEL, heard)

    def _watch(self, channel: str, on_change: Callable[[str | None], None]) -> None:
        thread = threading.Thread(
            target=self._listen, args=(channel, on_change), name=f"listen-{channel}", daemon=True
        )
        self._watchers.append(thread)
        thread.start()

    def _listen(self, channel: str, on_change: Callable[[str | None], None]) -> None:
        while not self._closed.is_set():
            try:
                with psycopg.connect(
                    self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S
                ) as conn:
                    conn.execute(f"LISTEN {channel}")
                    on_change(None)
                    while not self._closed.is_set():
                        # Wakes at least once a second to see close() and a dead socket.
                        for note in conn.notifies(timeout=1.0):
                            on_change(note.payload)
                        conn.execute("SELECT 1")  # raises when the database went away
            except psycopg.Error as exc:
                if not self._closed.is_set():
                    log.warning("store %s: listener lost (%s); reconnecting", self._shown,
                                self._cause(exc))  # fmt: skip
                    time.sleep(LISTEN_RETRY_S)
            except Exception:
                log.exception("store %s: %s change handler failed", self._shown, channel)
                time.sleep(LISTEN_RETRY_S)

    def _cause(self, exc: BaseException) -> str:
        return _cause(self.url, exc)

    def close(self) -> None:
        self._closed.set()
        for thread in self._watchers:
            thread.join(timeout=5)
        self._pool.close()
