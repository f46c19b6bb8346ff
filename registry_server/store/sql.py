"""The SQL both SQL stores share (SQLite and PostgreSQL speak the same
dialect for all of it): the queries behind ``StoreReads`` and ``UnitOfWork``
(store/base.py), over any DB-API connection whose ``execute`` returns a
cursor. A ``Dialect`` holds the few differences."""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from registry_server.domain.errors import StoreError
from registry_server.store.base import (
    APPROVED,
    CONSUMED,
    DELIVERED,
    DELIVERY_FAILED,
    DELIVERY_PENDING,
    EXPIRED,
    PENDING,
    REJECTED,
    VOIDED,
    ApprovalEventRecord,
    ApprovalRequestRecord,
    AuditEntry,
    CheckpointRecord,
    CosignatureRecord,
    ExportCursor,
    IdentityRecord,
    KeptCallRecord,
    StoredTool,
    WebhookBacklog,
    WebhookDeliveryRecord,
)

_OPEN = f"('{PENDING}', '{APPROVED}')"  # SQL list of the open states


class Connection(Protocol):
    def execute(self, sql: Any, params: Any = ..., /) -> Any: ...


@dataclass(frozen=True)
class Dialect:
    placeholder: str  # "?" (sqlite3) or "%s" (psycopg)
    # SQL that replaces a manifest's parameters with {"type":"object"} (listings)
    listed_manifest: str
    # run first by a unit of work that appends to the audit chain: one writer at a time
    lock_audit: str | None = None
    # run first by a unit of work that attaches a token: one submission per request at a time
    lock_request: str | None = None
    # run after an approval event is stored (PostgreSQL: NOTIFY the other servers)
    announce_event: str | None = None
    # asks the other servers to re-read their policy (PostgreSQL: NOTIFY), or nothing
    announce_policy: str | None = None
    # ends the select of rows to claim (PostgreSQL: FOR UPDATE SKIP LOCKED, so
    # servers claiming at once take different rows; SQLite has one writer)
    skip_locked: str = ""
    # run after a tool is stored, deleted, disabled or enabled, with its name
    # (PostgreSQL: NOTIFY the other servers, delivered on commit)
    announce_tool: str | None = None


_REQUEST_COLUMNS = (
    "id, tool_name, tool_digest, arguments_json, arguments_digest, requested_by,"
    " approvals_required, state, created_at, expires_at, tool_manifest, tool_owner,"
    " rejected_by, rejection_reason, voided_reason"
)


def _request(row: tuple[object, ...]) -> ApprovalRequestRecord:
    (rid, tool, tdig, args, adig, by, need, state, created, expires, manifest, owner,
     rejected_by, reason, voided) = row  # fmt: skip
    return ApprovalRequestRecord(
        id=str(rid), tool_name=str(tool), tool_digest=str(tdig), arguments_json=str(args),
        arguments_digest=str(adig), requested_by=str(by), approvals_required=int(str(need)),
        state=str(state), created_at=float(str(created)), expires_at=float(str(expires)),
        tool_manifest=str(manifest), tool_owner=str(owner), rejected_by=str(rejected_by),
        rejection_reason=str(reason), voided_reason=str(voided),
    )  # fmt: skip


_TOOL_COLUMNS = "name, manifest, digest, owner, disabled, disabled_reason, tokens_not_before"


def _tool(row: tuple[object, ...]) -> StoredTool:
    name, manifest, digest, owner, disabled, reason, not_before = row
    return StoredTool(
        str(name), str(manifest), str(digest), str(owner), bool(disabled), str(reason),
        float(str(not_before)),
    )  # fmt: skip


def _event(row: tuple[object, ...]) -> ApprovalEventRecord:
    seq, request_id, type_, actor, reason, at = row
    return ApprovalEventRecord(
        int(str(seq)), str(request_id), str(type_), str(actor), str(reason), float(str(at))
    )


_DELIVERY_COLUMNS = (
    "event_seq, endpoint, webhook_id, payload, created_at, next_attempt_at, state, attempts,"
    " last_error, delivered_at, claimed_by, claim_until"
)


def _delivery(row: tuple[object, ...]) -> WebhookDeliveryRecord:
    (seq, endpoint, webhook_id, payload, created, due, state, attempts, error, delivered,
     owner, until) = row  # fmt: skip
    return WebhookDeliveryRecord(
        event_seq=int(str(seq)), endpoint=str(endpoint), webhook_id=str(webhook_id),
        payload=str(payload), created_at=float(str(created)), next_attempt_at=float(str(due)),
        state=str(state), attempts=int(str(attempts)), last_error=str(error),
        delivered_at=None if delivered is None else float(str(delivered)),
        claimed_by=str(owner), claim_until=float(str(until)),
    )  # fmt: skip


def _audit_entry(row: tuple[object, ...]) -> AuditEntry:
    seq, at, kind, record, prev_hash, hash_ = row
    return AuditEntry(
        int(str(seq)), float(str(at)), str(kind), str(record), str(prev_hash), str(hash_)
    )


_CHECKPOINT_COLUMNS = "origin, size, root, note, made_at"


def _checkpoint(row: tuple[object, ...]) -> CheckpointRecord:
    origin, size, root, note, made_at = row
    return CheckpointRecord(str(origin), int(str(size)), str(root), str(note), float(str(made_at)))


_COSIGNATURE_COLUMNS = "origin, size, root, witness, key_id, line, cosigned_at"


def _cosignature(row: tuple[object, ...]) -> CosignatureRecord:
    origin, size, root, witness, key_id, line, cosigned_at = row
    return CosignatureRecord(
        str(origin), int(str(size)), str(root), str(witness), str(key_id), str(line),
        int(str(cosigned_at)),
    )  # fmt: skip


_EXPORT_COLUMNS = "sink, seq, updated_at, owner, lease_until"


def _export_cursor(row: tuple[object, ...]) -> ExportCursor:
    sink, seq, updated_at, owner, until = row
    return ExportCursor(
        str(sink), int(str(seq)), float(str(updated_at)), str(owner), float(str(until))
    )


_KEPT_CALL_COLUMNS = "execution_id, caller, server, stdout, stderr, result_json, beat_at, ended_at"


def _kept_call(row: tuple[object, ...]) -> KeptCallRecord:
    eid, caller, server, stdout, stderr, result, beat, ended = row
    return KeptCallRecord(
        execution_id=str(eid), caller=str(caller), server=str(server),
        stdout=bytes(stdout), stderr=bytes(stderr),  # type: ignore[call-overload]
        result_json=str(result), beat_at=float(str(beat)),
        ended_at=None if ended is None else float(str(ended)),
    )  # fmt: skip


_IDENTITY_COLUMNS = (
    "client_id, provider, subject, groups_json, issued_at, expires_at, first_seen, last_seen"
)


def _identity(row: tuple[object, ...]) -> IdentityRecord:
    client_id, provider, subject, groups, issued, expires, first, last = row
    return IdentityRecord(
        str(client_id), str(provider), str(subject), tuple(json.loads(str(groups))),
        float(str(issued)), float(str(expires)), float(str(first)), float(str(last)),
    )  # fmt: skip


class _SqlStore(Protocol):
    def reading(self) -> AbstractContextManager[SqlReads]: ...


def answers(store: _SqlStore) -> bool:
    """A store's health check: one trivial query."""
    try:
        with store.reading() as reads:
            reads.ping()
    except StoreError:
        return False
    return True


class SqlReads:
    def __init__(self, db: Connection, dialect: Dialect) -> None:
        self._db = db
        self._dialect = dialect

    def _run(self, sql: str, params: tuple[object, ...] = ()) -> Any:
        if self._dialect.placeholder != "?":
            sql = sql.replace("?", self._dialect.placeholder)
        return self._db.execute(sql, params)

    def _all(self, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
        return list(self._run(sql, params).fetchall())

    def ping(self) -> None:
        self._all("SELECT 1")

    def tools(self) -> list[StoredTool]:
        return [_tool(r) for r in self._all(f"SELECT {_TOOL_COLUMNS} FROM tools ORDER BY name")]

    def tool(self, name: str) -> StoredTool | None:
        rows = self._all(f"SELECT {_TOOL_COLUMNS} FROM tools WHERE name = ?", (name,))
        return _tool(rows[0]) if rows else None

    def jti_used(self, jti: str) -> bool:
        return bool(self._all("SELECT 1 FROM used_nonces WHERE jti = ?", (jti,)))

    def passkey_counter(self, credential_id: str) -> int | None:
        rows = self._all(
            "SELECT sign_count FROM passkey_counters WHERE credential_id = ?", (credential_id,)
        )
        return int(str(rows[0][0])) if rows else None

    def request(self, request_id: str) -> ApprovalRequestRecord | None:
        rows = self._all(
            f"SELECT {_REQUEST_COLUMNS} FROM approval_requests WHERE id = ?", (request_id,)
        )
        return _request(rows[0]) if rows else None

    def requests(
        self, *, state: str, now: float, limit: int, before: tuple[float, str] | None = None,
        requested_by: str | None = None,
    ) -> list[ApprovalRequestRecord]:  # fmt: skip
        conditions: list[str] = []
        params: list[object] = []
        if state == EXPIRED:
            conditions.append(f"(state = '{EXPIRED}' OR (state IN {_OPEN} AND expires_at <= ?))")
            params.append(now)
        elif state in (PENDING, APPROVED):
            conditions.append("state = ? AND expires_at > ?")
            params += [state, now]
        elif state:
            conditions.append("state = ?")
            params.append(state)
        if requested_by is not None:
            conditions.append("requested_by = ?")
            params.append(requested_by)
        if before is not None:
            # (created_at, id) < before, spelled so the created_at index bounds the scan
            conditions.append("created_at <= ? AND (created_at < ? OR id < ?)")
            params += [before[0], before[0], before[1]]
        where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
        # Listings read neither the arguments nor the schema from disk.
        listed = _REQUEST_COLUMNS.replace("arguments_json", "''").replace(
            "tool_manifest",
            f"CASE tool_manifest WHEN '' THEN '' ELSE {self._dialect.listed_manifest} END",
        )
        rows = self._all(
            f"SELECT {listed} FROM approval_requests {where}"
            " ORDER BY created_at DESC, id DESC LIMIT ?",
            (*params, limit),
        )
        return [_request(r) for r in rows]

    def open_request_for(
        self, *, tool_name: str, tool_digest: str, arguments_digest: str, requested_by: str,
        now: float,
    ) -> str | None:  # fmt: skip
        rows = self._all(
            "SELECT id FROM approval_requests WHERE tool_name = ? AND tool_digest = ?"
            " AND arguments_digest = ? AND requested_by = ?"
            f" AND state IN {_OPEN}"
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

    def rejected_request_for(
        self, *, tool_name: str, tool_digest: str, arguments_digest: str, requested_by: str,
        now: float,
    ) -> str | None:  # fmt: skip
        rows = self._all(
            "SELECT id FROM approval_requests WHERE tool_name = ? AND tool_digest = ?"
            f" AND arguments_digest = ? AND requested_by = ? AND state = '{REJECTED}'"
            " AND expires_at > ? ORDER BY created_at DESC LIMIT 1",
            (tool_name, tool_digest, arguments_digest, requested_by, now),
        )
        return str(rows[0][0]) if rows else None

    def open_requests_for_tool(self, tool_name: str, now: float) -> list[str]:
        rows = self._all(
            f"SELECT id FROM approval_requests WHERE tool_name = ? AND state IN {_OPEN}"
            " AND expires_at > ? ORDER BY created_at, id",
            (tool_name, now),
        )
        return [str(r[0]) for r in rows]

    def expired_open_requests(self, now: float, limit: int) -> list[str]:
        rows = self._all(
            f"SELECT id FROM approval_requests WHERE state IN {_OPEN} AND expires_at <= ?"
            " ORDER BY expires_at LIMIT ?",
            (now, limit),
        )
        return [str(r[0]) for r in rows]

    def events_after(self, seq: int, limit: int) -> list[ApprovalEventRecord]:
        rows = self._all(
            "SELECT seq, request_id, type, actor, reason, at FROM approval_events"
            " WHERE seq > ? ORDER BY seq LIMIT ?",
            (seq, limit),
        )
        return [_event(r) for r in rows]

    def last_event_seq(self) -> int:
        ((seq,),) = self._all("SELECT COALESCE(MAX(seq), 0) FROM approval_events")
        return int(str(seq))

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

    def audit_entries_after(self, seq: int, limit: int) -> list[AuditEntry]:
        rows = self._all(
            "SELECT seq, at, kind, record, prev_hash, hash FROM audit WHERE seq > ?"
            " ORDER BY seq LIMIT ?",
            (seq, limit),
        )
        return [_audit_entry(r) for r in rows]

    def latest_checkpoint(self, origin: str | None = None) -> CheckpointRecord | None:
        where, params = ("WHERE origin = ?", (origin,)) if origin is not None else ("", ())
        rows = self._all(
            f"SELECT {_CHECKPOINT_COLUMNS} FROM audit_checkpoints {where}"
            " ORDER BY size DESC, made_at DESC LIMIT 1",
            params,
        )
        return _checkpoint(rows[0]) if rows else None

    def cosignatures(self, origin: str, size: int) -> list[CosignatureRecord]:
        rows = self._all(
            f"SELECT {_COSIGNATURE_COLUMNS} FROM audit_cosignatures WHERE origin = ? AND size = ?"
            " ORDER BY witness, key_id",
            (origin, size),
        )
        return [_cosignature(r) for r in rows]

    def latest_cosignatures(self, origin: str) -> list[CosignatureRecord]:
        rows = self._all(
            f"SELECT {_COSIGNATURE_COLUMNS} FROM audit_cosignatures c WHERE origin = ?"
            " AND size = (SELECT MAX(size) FROM audit_cosignatures d WHERE d.origin = c.origin"
            " AND d.witness = c.witness AND d.key_id = c.key_id) ORDER BY witness, key_id",
            (origin,),
        )
        return [_cosignature(r) for r in rows]

    def export_cursor(self, sink: str) -> ExportCursor | None:
        rows = self._all(f"SELECT {_EXPORT_COLUMNS} FROM export_cursors WHERE sink = ?", (sink,))
        return _export_cursor(rows[0]) if rows else None

    def webhook_delivery(self, event_seq: int, endpoint: str) -> WebhookDeliveryRecord | None:
        rows = self._all(
            f"SELECT {_DELIVERY_COLUMNS} FROM webhook_deliveries"
            " WHERE event_seq = ? AND endpoint = ?",
            (event_seq, endpoint),
        )
        return _delivery(rows[0]) if rows else None

    def kept_call(self, execution_id: str) -> KeptCallRecord | None:
        rows = self._all(
            f"SELECT {_KEPT_CALL_COLUMNS} FROM kept_calls WHERE execution_id = ?", (execution_id,)
        )
        return _kept_call(rows[0]) if rows else None

    def identity(self, client_id: str) -> IdentityRecord | None:
        rows = self._all(
            f"SELECT {_IDENTITY_COLUMNS} FROM idp_clients WHERE client_id = ?", (client_id,)
        )
        return _identity(rows[0]) if rows else None

    def identities(self, after: str, limit: int) -> list[IdentityRecord]:
        rows = self._all(
            f"SELECT {_IDENTITY_COLUMNS} FROM idp_clients WHERE client_id > ?"
            " ORDER BY client_id LIMIT ?",
            (after, limit),
        )
        return [_identity(r) for r in rows]

    def webhook_backlog(self) -> WebhookBacklog:
        ((count, due),) = self._all(
            "SELECT COUNT(*), MIN(next_attempt_at) FROM webhook_deliveries WHERE state = ?",
            (DELIVERY_PENDING,),
        )
        return WebhookBacklog(int(str(count)), None if due is None else float(str(due)))

    def webhook_claimants(self, now: float) -> list[str]:
        rows = self._all(
            "SELECT DISTINCT claimed_by FROM webhook_deliveries"
            " WHERE state = ? AND claim_until > ? ORDER BY claimed_by",
            (DELIVERY_PENDING, now),
        )
        return [str(owner) for (owner,) in rows]


class SqlWrites(SqlReads):
    """Used only inside a store's transaction."""

    def audit_tail(self, count: int) -> list[AuditEntry]:
        # Appending reads the head first: lock it, so concurrent appends line up.
        if self._dialect.lock_audit:
            self._run(self._dialect.lock_audit)
        return super().audit_tail(count)

    def put_tool(self, tool: StoredTool, now: float) -> None:
        # A replacement leaves the kill switch as stored: another server may
        # have disabled the tool since this one read it.
        self._run(
            "INSERT INTO tools (name, manifest, digest, owner, created_at, updated_at,"
            " tokens_not_before) VALUES (?, ?, ?, ?, ?, ?, COALESCE((SELECT deleted_at"
            " FROM tool_deletions WHERE name = ?), 0))"
            " ON CONFLICT(name) DO UPDATE SET manifest = excluded.manifest,"
            " digest = excluded.digest, owner = excluded.owner,"
            " updated_at = excluded.updated_at",
            (tool.name, tool.manifest_json, tool.digest, tool.owner, now, now, tool.name),
        )
        self._announce_tool(tool.name)

    def delete_tool(self, name: str, now: float) -> bool:
        deleted = self._run("DELETE FROM tools WHERE name = ?", (name,)).rowcount
        if deleted != 1:
            return False
        self._run(
            "INSERT INTO tool_deletions (name, deleted_at) VALUES (?, ?)"
            " ON CONFLICT (name) DO UPDATE SET deleted_at = excluded.deleted_at",
            (name, now),
        )
        self._announce_tool(name)
        return True

    def set_tool_disabled(self, name: str, disabled: bool, reason: str, now: float) -> bool:
        if disabled:
            changed = self._run(
                "UPDATE tools SET disabled = ?, disabled_reason = ?, tokens_not_before = ?,"
                " updated_at = ? WHERE name = ?",
                (True, reason, now, now, name),
            ).rowcount
        else:
            changed = self._run(
                "UPDATE tools SET disabled = ?, disabled_reason = '', updated_at = ?"
                " WHERE name = ?",
                (False, now, name),
            ).rowcount
        if changed != 1:
            return False
        self._announce_tool(name)
        return True

    def _announce_tool(self, name: str) -> None:
        if self._dialect.announce_tool:
            self._run(self._dialect.announce_tool, (name,))

    def add_audit_entry(self, entry: AuditEntry) -> None:
        self._run(
            "INSERT INTO audit (seq, at, kind, record, prev_hash, hash) VALUES (?, ?, ?, ?, ?, ?)",
            (entry.seq, entry.at, entry.kind, entry.record, entry.prev_hash, entry.hash),
        )

    def add_checkpoint(self, checkpoint: CheckpointRecord) -> bool:
        # The key (origin, size) decides: of servers signing one size at once,
        # the second inserts nothing.
        c = checkpoint
        inserted = self._run(
            f"INSERT INTO audit_checkpoints ({_CHECKPOINT_COLUMNS}) VALUES (?, ?, ?, ?, ?)"
            " ON CONFLICT (origin, size) DO NOTHING",
            (c.origin, c.size, c.root, c.note, c.made_at),
        ).rowcount
        return bool(inserted == 1)

    def add_cosignature(self, cosignature: CosignatureRecord) -> bool:
        c = cosignature
        inserted = self._run(
            f"INSERT INTO audit_cosignatures ({_COSIGNATURE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (origin, witness, key_id, size) DO NOTHING",
            (c.origin, c.size, c.root, c.witness, c.key_id, c.line, c.cosigned_at),
        ).rowcount
        return bool(inserted == 1)

    def claim_export(self, sink: str, owner: str, now: float, until: float) -> ExportCursor | None:
        # One conditional upsert: of servers claiming at once, one holds the
        # row afterwards; the others' WHERE is false and they change nothing.
        self._run(
            f"INSERT INTO export_cursors ({_EXPORT_COLUMNS}) VALUES (?, 0, ?, ?, ?)"
            " ON CONFLICT (sink) DO UPDATE SET owner = excluded.owner,"
            " lease_until = excluded.lease_until"
            " WHERE export_cursors.owner = excluded.owner OR export_cursors.lease_until <= ?",
            (sink, now, owner, until, now),
        )
        held = self.export_cursor(sink)
        return held if held is not None and held.owner == owner else None

    def advance_export(self, sink: str, owner: str, seq: int, now: float, until: float) -> bool:
        changed = self._run(
            "UPDATE export_cursors SET seq = CASE WHEN seq < ? THEN ? ELSE seq END,"
            " updated_at = ?, lease_until = ? WHERE sink = ? AND owner = ?",
            (seq, seq, now, until, sink, owner),
        ).rowcount
        return bool(changed == 1)

    def release_export(self, sink: str, owner: str) -> None:
        self._run(
            "UPDATE export_cursors SET lease_until = 0 WHERE sink = ? AND owner = ?",
            (sink, owner),
        )

    def keep_secret(self, name: str, value: str, now: float) -> str:
        # Of servers storing one at once, the first commits and the others insert nothing.
        self._run(
            "INSERT INTO store_secrets (name, value, created_at) VALUES (?, ?, ?)"
            " ON CONFLICT (name) DO NOTHING",
            (name, value, now),
        )
        ((stored,),) = self._all("SELECT value FROM store_secrets WHERE name = ?", (name,))
        return str(stored)

    def use_jti(self, jti: str, approver: str, execution_id: str, now: float) -> bool:
        # The primary key decides: of two transactions spending one jti, on any
        # number of servers, the second inserts nothing.
        inserted = self._run(
            "INSERT INTO used_nonces (jti, approver, used_at, execution_id) VALUES (?, ?, ?, ?)"
            " ON CONFLICT (jti) DO NOTHING",
            (jti, approver, now, execution_id),
        ).rowcount
        return bool(inserted == 1)

    def advance_passkey_counter(
        self, credential_id: str, approver: str, sign_count: int, now: float
    ) -> bool:
        # One conditional upsert: of two transactions advancing one passkey to
        # the same count, on any number of servers, the second changes nothing.
        changed = self._run(
            "INSERT INTO passkey_counters (credential_id, approver, sign_count, updated_at)"
            " VALUES (?, ?, ?, ?) ON CONFLICT (credential_id) DO UPDATE SET"
            " approver = excluded.approver, sign_count = excluded.sign_count,"
            " updated_at = excluded.updated_at"
            " WHERE passkey_counters.sign_count < excluded.sign_count"
            " OR (passkey_counters.sign_count = 0 AND excluded.sign_count = 0)",
            (credential_id, approver, sign_count, now),
        ).rowcount
        return bool(changed == 1)

    def add_request(self, request: ApprovalRequestRecord) -> None:
        r = request
        self._run(
            f"INSERT INTO approval_requests ({_REQUEST_COLUMNS})"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                r.id, r.tool_name, r.tool_digest, r.arguments_json, r.arguments_digest,
                r.requested_by, r.approvals_required, r.state, r.created_at, r.expires_at,
                r.tool_manifest, r.tool_owner, r.rejected_by, r.rejection_reason,
                r.voided_reason,
            ),
        )  # fmt: skip

    def consume_request(self, request_id: str, now: float) -> bool:
        changed = self._run(
            f"UPDATE approval_requests SET state = '{CONSUMED}'"
            f" WHERE id = ? AND state IN {_OPEN} AND expires_at > ?",
            (request_id, now),
        ).rowcount
        return bool(changed == 1)

    def reject_request(self, request_id: str, by: str, reason: str, now: float) -> bool:
        changed = self._run(
            f"UPDATE approval_requests SET state = '{REJECTED}', rejected_by = ?,"
            f" rejection_reason = ? WHERE id = ? AND state IN {_OPEN} AND expires_at > ?",
            (by, reason, request_id, now),
        ).rowcount
        return bool(changed == 1)

    def void_request(self, request_id: str, reason: str, now: float) -> bool:
        changed = self._run(
            f"UPDATE approval_requests SET state = '{VOIDED}', voided_reason = ?"
            f" WHERE id = ? AND state IN {_OPEN} AND expires_at > ?",
            (reason, request_id, now),
        ).rowcount
        return bool(changed == 1)

    def expire_request(self, request_id: str, now: float) -> bool:
        changed = self._run(
            f"UPDATE approval_requests SET state = '{EXPIRED}'"
            f" WHERE id = ? AND state IN {_OPEN} AND expires_at <= ?",
            (request_id, now),
        ).rowcount
        return bool(changed == 1)

    def announce_policy(self, digest: str) -> None:
        if self._dialect.announce_policy:
            self._run(self._dialect.announce_policy, (digest,))

    def add_event(self, event: ApprovalEventRecord) -> None:
        e = event
        self._run(
            "INSERT INTO approval_events (seq, request_id, type, actor, reason, at)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (e.seq, e.request_id, e.type, e.actor, e.reason, e.at),
        )
        if self._dialect.announce_event:
            self._run(self._dialect.announce_event, (str(e.seq),))

    def put_approval_token(
        self, request_id: str, approver: str, jti: str, token: str, expires_at: float
    ) -> None:
        if self._dialect.lock_request:
            self._run(self._dialect.lock_request, (request_id,))
        self._run(
            "INSERT INTO approval_tokens (request_id, approver, jti, token, expires_at)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT (request_id, approver) DO UPDATE SET"
            " jti = excluded.jti, token = excluded.token, expires_at = excluded.expires_at",
            (request_id, approver, jti, token, expires_at),
        )

    def mark_approved(self, request_id: str) -> None:
        self._run(
            f"UPDATE approval_requests SET state = '{APPROVED}'"
            f" WHERE id = ? AND state = '{PENDING}'",
            (request_id,),
        )

    def add_webhook_delivery(self, delivery: WebhookDeliveryRecord) -> None:
        d = delivery
        self._run(
            f"INSERT INTO webhook_deliveries ({_DELIVERY_COLUMNS})"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                d.event_seq, d.endpoint, d.webhook_id, d.payload, d.created_at,
                d.next_attempt_at, d.state, d.attempts, d.last_error, d.delivered_at,
                d.claimed_by, d.claim_until,
            ),
        )  # fmt: skip

    def claim_webhook_deliveries(
        self, owner: str, now: float, until: float, limit: int
    ) -> list[WebhookDeliveryRecord]:
        rows = self._all(
            "UPDATE webhook_deliveries SET claimed_by = ?, claim_until = ?"
            " WHERE (event_seq, endpoint) IN (SELECT event_seq, endpoint FROM webhook_deliveries"
            " WHERE state = ? AND next_attempt_at <= ? AND claim_until <= ?"
            f" ORDER BY next_attempt_at, event_seq LIMIT ?{self._dialect.skip_locked})"
            f" RETURNING {_DELIVERY_COLUMNS}",
            (owner, until, DELIVERY_PENDING, now, now, limit),
        )
        # RETURNING promises no order
        return sorted(map(_delivery, rows), key=lambda d: (d.next_attempt_at, d.event_seq))

    def release_webhook_claims(self, owner: str) -> int:
        changed = self._run(
            "UPDATE webhook_deliveries SET claimed_by = '', claim_until = 0"
            " WHERE claimed_by = ? AND state = ?",
            (owner, DELIVERY_PENDING),
        ).rowcount
        return int(changed)

    def finish_webhook_delivery(self, delivery: WebhookDeliveryRecord, owner: str) -> bool:
        d = delivery
        changed = self._run(
            "UPDATE webhook_deliveries SET state = ?, attempts = ?, next_attempt_at = ?,"
            " last_error = ?, delivered_at = ?, claimed_by = '', claim_until = 0"
            " WHERE event_seq = ? AND endpoint = ? AND claimed_by = ? AND state = ?",
            (
                d.state, d.attempts, d.next_attempt_at, d.last_error, d.delivered_at,
                d.event_seq, d.endpoint, owner, DELIVERY_PENDING,
            ),
        ).rowcount  # fmt: skip
        return bool(changed == 1)

    def put_kept_call(self, call: KeptCallRecord) -> None:
        c = call
        self._run(
            f"INSERT INTO kept_calls ({_KEPT_CALL_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(execution_id) DO UPDATE SET stdout = excluded.stdout,"
            " stderr = excluded.stderr, result_json = excluded.result_json,"
            " beat_at = excluded.beat_at, ended_at = excluded.ended_at"
            " WHERE kept_calls.server = excluded.server",
            (c.execution_id, c.caller, c.server, c.stdout, c.stderr, c.result_json,
             c.beat_at, c.ended_at),
        )  # fmt: skip

    def prune_kept_calls(self, before: float, limit: int) -> int:
        deleted = self._run(
            "DELETE FROM kept_calls WHERE execution_id IN (SELECT execution_id FROM kept_calls"
            " WHERE ended_at < ? OR (ended_at IS NULL AND beat_at < ?) LIMIT ?)",
            (before, before, limit),
        ).rowcount
        return int(deleted)

    def prune_webhook_deliveries(self, before: float, limit: int) -> int:
        deleted = self._run(
            "DELETE FROM webhook_deliveries WHERE (event_seq, endpoint) IN (SELECT event_seq,"
            " endpoint FROM webhook_deliveries WHERE state IN (?, ?) AND created_at < ? LIMIT ?)",
            (DELIVERED, DELIVERY_FAILED, before, limit),
        ).rowcount
        return int(deleted)

    def put_identity(self, record: IdentityRecord) -> None:
        r = record
        # Who and which groups: only from a token not older than the stored one's.
        self._run(
            f"INSERT INTO idp_clients ({_IDENTITY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(client_id) DO UPDATE SET provider = excluded.provider,"
            " subject = excluded.subject, groups_json = excluded.groups_json,"
            " issued_at = excluded.issued_at, expires_at = excluded.expires_at"
            " WHERE idp_clients.issued_at <= excluded.issued_at",
            (r.client_id, r.provider, r.subject, json.dumps(list(r.groups)), r.issued_at,
             r.expires_at, r.first_seen, r.last_seen),
        )  # fmt: skip
        # When it was last seen: forward only (two servers may write out of order).
        self._run(
            "UPDATE idp_clients SET last_seen = ? WHERE client_id = ? AND last_seen < ?",
            (r.last_seen, r.client_id, r.last_seen),
        )

    def forget_identity(self, client_id: str) -> bool:
        deleted = self._run("DELETE FROM idp_clients WHERE client_id = ?", (client_id,)).rowcount
        return bool(deleted == 1)
