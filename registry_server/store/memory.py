"""An in-memory store for the unit tests of the decision logic: the same
interface as the SQLite store (store/base.py), nothing kept across restarts.

Not offered by ``TOOLREG_STORE_URL``: a server that forgets which approval
tokens it spent would accept them again after a restart.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from registry_server.domain.errors import StoreError
from registry_server.signing.passkeys import counter_advances
from registry_server.store.base import (
    APPROVED,
    CONSUMED,
    DELIVERED,
    DELIVERY_FAILED,
    DELIVERY_PENDING,
    EXPIRED,
    OPEN_STATES,
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


@dataclass
class _Data:
    tools: dict[str, StoredTool] = field(default_factory=dict)
    deleted: dict[str, float] = field(default_factory=dict)  # name -> when it was last deleted
    requests: dict[str, ApprovalRequestRecord] = field(default_factory=dict)
    tokens: dict[str, dict[str, str]] = field(default_factory=dict)  # request -> approver -> token
    spent: dict[str, str] = field(default_factory=dict)  # jti -> execution id
    counters: dict[str, int] = field(default_factory=dict)  # passkey credential id -> count
    secrets: dict[str, str] = field(default_factory=dict)  # name -> value (keep_secret)
    audit: list[AuditEntry] = field(default_factory=list)
    # (origin, size) -> a signed checkpoint of the audit log's tree
    checkpoints: dict[tuple[str, int], CheckpointRecord] = field(default_factory=dict)
    # (origin, witness, key ID, size) -> a witness's cosignature of a checkpoint
    cosignatures: dict[tuple[str, str, str, int], CosignatureRecord] = field(default_factory=dict)
    events: list[ApprovalEventRecord] = field(default_factory=list)
    exports: dict[str, ExportCursor] = field(default_factory=dict)  # sink -> its cursor
    # (event seq, endpoint) -> the outbox row
    deliveries: dict[tuple[int, str], WebhookDeliveryRecord] = field(default_factory=dict)
    kept_calls: dict[str, KeptCallRecord] = field(default_factory=dict)  # execution id -> call
    identities: dict[str, IdentityRecord] = field(default_factory=dict)  # client id -> record

    def draft(self) -> _Data:
        """A copy a unit of work may change: new containers, the same records.
        Every record is a frozen dataclass that writes replace, never change, so
        sharing them is safe, and far cheaper than a deep copy of the store."""
        return _Data(
            tools=dict(self.tools),
            deleted=dict(self.deleted),
            requests=dict(self.requests),
            tokens={request: dict(by) for request, by in self.tokens.items()},
            spent=dict(self.spent),
            counters=dict(self.counters),
            secrets=dict(self.secrets),
            audit=list(self.audit),
            checkpoints=dict(self.checkpoints),
            cosignatures=dict(self.cosignatures),
            events=list(self.events),
            exports=dict(self.exports),
            deliveries=dict(self.deliveries),
            kept_calls=dict(self.kept_calls),
            identities=dict(self.identities),
        )


class _Reads:
    def __init__(self, data: _Data) -> None:
        self._data = data

    def tools(self) -> list[StoredTool]:
        return [self._data.tools[name] for name in sorted(self._data.tools)]

    def tool(self, name: str) -> StoredTool | None:
        return self._data.tools.get(name)

    def jti_used(self, jti: str) -> bool:
        return jti in self._data.spent

    def passkey_counter(self, credential_id: str) -> int | None:
        return self._data.counters.get(credential_id)

    def request(self, request_id: str) -> ApprovalRequestRecord | None:
        return self._data.requests.get(request_id)

    def requests(
        self, *, state: str, now: float, limit: int, before: tuple[float, str] | None = None,
        requested_by: str | None = None,
    ) -> list[ApprovalRequestRecord]:  # fmt: skip
        found = [
            r for r in self._data.requests.values()
            if (not state or r.state_at(now) == state)
            and (requested_by is None or r.requested_by == requested_by)
            and (before is None or (r.created_at, r.id) < before)
        ]  # fmt: skip
        found.sort(key=lambda r: (r.created_at, r.id), reverse=True)
        return [r.listed() for r in found[:limit]]

    def open_request_for(
        self, *, tool_name: str, tool_digest: str, arguments_digest: str, requested_by: str,
        now: float,
    ) -> str | None:  # fmt: skip
        wanted = (tool_name, tool_digest, arguments_digest, requested_by)
        return self._newest_for(wanted, lambda r: r.state_at(now) in (PENDING, APPROVED))

    def _newest_for(
        self, call: tuple[str, str, str, str], keep: Callable[[ApprovalRequestRecord], bool]
    ) -> str | None:
        """The newest request for exactly this call (tool, digests, caller) that ``keep`` keeps."""
        found = [
            r for r in self._data.requests.values()
            if (r.tool_name, r.tool_digest, r.arguments_digest, r.requested_by) == call
            and keep(r)
        ]  # fmt: skip
        return max(found, key=lambda r: r.created_at).id if found else None

    def open_requests_of(self, requested_by: str, now: float) -> int:
        return sum(
            1
            for r in self._data.requests.values()
            if r.requested_by == requested_by and r.state_at(now) == PENDING
        )

    def rejected_request_for(
        self, *, tool_name: str, tool_digest: str, arguments_digest: str, requested_by: str,
        now: float,
    ) -> str | None:  # fmt: skip
        wanted = (tool_name, tool_digest, arguments_digest, requested_by)
        return self._newest_for(wanted, lambda r: r.state == REJECTED and r.expires_at > now)

    def open_requests_for_tool(self, tool_name: str, now: float) -> list[str]:
        found = [
            r for r in self._data.requests.values()
            if r.tool_name == tool_name and r.state_at(now) in OPEN_STATES
        ]  # fmt: skip
        return [r.id for r in sorted(found, key=lambda r: (r.created_at, r.id))]

    def expired_open_requests(self, now: float, limit: int) -> list[str]:
        found = [
            r for r in self._data.requests.values()
            if r.state in OPEN_STATES and r.expires_at <= now
        ]  # fmt: skip
        return [r.id for r in sorted(found, key=lambda r: r.expires_at)[:limit]]

    def events_after(self, seq: int, limit: int) -> list[ApprovalEventRecord]:
        return [e for e in self._data.events if e.seq > seq][:limit]

    def last_event_seq(self) -> int:
        return self._data.events[-1].seq if self._data.events else 0

    def approvers_of(self, request_id: str) -> list[str]:
        return sorted(self._data.tokens.get(request_id, {}))

    def tokens_of(self, request_id: str) -> list[str]:
        held = self._data.tokens.get(request_id, {})
        return [held[approver] for approver in sorted(held)]

    def audit_entries(self) -> list[AuditEntry]:
        return list(self._data.audit)

    def audit_tail(self, count: int) -> list[AuditEntry]:
        return self._data.audit[-count:] if count > 0 else []

    def audit_entries_after(self, seq: int, limit: int) -> list[AuditEntry]:
        return [e for e in self._data.audit if e.seq > seq][:limit]

    def latest_checkpoint(self, origin: str | None = None) -> CheckpointRecord | None:
        found = [c for c in self._data.checkpoints.values()
                 if origin is None or c.origin == origin]  # fmt: skip
        return max(found, key=lambda c: (c.size, c.made_at), default=None)

    def cosignatures(self, origin: str, size: int) -> list[CosignatureRecord]:
        found = [c for c in self._data.cosignatures.values()
                 if (c.origin, c.size) == (origin, size)]  # fmt: skip
        return sorted(found, key=lambda c: (c.witness, c.key_id))

    def latest_cosignatures(self, origin: str) -> list[CosignatureRecord]:
        latest: dict[tuple[str, str], CosignatureRecord] = {}
        for c in self._data.cosignatures.values():
            key = (c.witness, c.key_id)
            if c.origin == origin and (key not in latest or latest[key].size < c.size):
                latest[key] = c
        return [latest[key] for key in sorted(latest)]

    def export_cursor(self, sink: str) -> ExportCursor | None:
        return self._data.exports.get(sink)

    def webhook_delivery(self, event_seq: int, endpoint: str) -> WebhookDeliveryRecord | None:
        return self._data.deliveries.get((event_seq, endpoint))

    def kept_call(self, execution_id: str) -> KeptCallRecord | None:
        return self._data.kept_calls.get(execution_id)

    def identity(self, client_id: str) -> IdentityRecord | None:
        return self._data.identities.get(client_id)

    def identities(self, after: str, limit: int) -> list[IdentityRecord]:
        ids = sorted(i for i in self._data.identities if i > after)[: max(0, limit)]
        return [self._data.identities[i] for i in ids]

    def webhook_backlog(self) -> WebhookBacklog:
        due = [d.next_attempt_at for d in self._data.deliveries.values()
               if d.state == DELIVERY_PENDING]  # fmt: skip
        return WebhookBacklog(len(due), min(due, default=None))

    def webhook_claimants(self, now: float) -> list[str]:
        return sorted({d.claimed_by for d in self._data.deliveries.values()
                       if d.state == DELIVERY_PENDING and d.claim_until > now})  # fmt: skip


class _Writes(_Reads):
    def put_tool(self, tool: StoredTool, now: float) -> None:
        held = self._data.tools.get(tool.name)
        if held is None:  # created: enabled, tokens from before a deletion refused
            since = self._data.deleted.get(tool.name, 0.0)
            stored = replace(tool, disabled=False, disabled_reason="", tokens_not_before=since)
        else:  # replaced: the kill switch stays as stored
            stored = replace(
                tool, disabled=held.disabled, disabled_reason=held.disabled_reason,
                tokens_not_before=held.tokens_not_before,
            )  # fmt: skip
        self._data.tools[tool.name] = stored

    def delete_tool(self, name: str, now: float) -> bool:
        if self._data.tools.pop(name, None) is None:
            return False
        self._data.deleted[name] = now
        return True

    def set_tool_disabled(self, name: str, disabled: bool, reason: str, now: float) -> bool:
        held = self._data.tools.get(name)
        if held is None:
            return False
        if disabled:
            held = replace(held, disabled=True, disabled_reason=reason, tokens_not_before=now)
        else:
            held = replace(held, disabled=False, disabled_reason="")
        self._data.tools[name] = held
        return True

    def add_audit_entry(self, entry: AuditEntry) -> None:
        self._data.audit.append(entry)

    def add_checkpoint(self, checkpoint: CheckpointRecord) -> bool:
        key = (checkpoint.origin, checkpoint.size)
        if key in self._data.checkpoints:
            return False
        self._data.checkpoints[key] = checkpoint
        return True

    def add_cosignature(self, cosignature: CosignatureRecord) -> bool:
        c = cosignature
        key = (c.origin, c.witness, c.key_id, c.size)
        if key in self._data.cosignatures:
            return False
        self._data.cosignatures[key] = c
        return True

    def claim_export(self, sink: str, owner: str, now: float, until: float) -> ExportCursor | None:
        held = self._data.exports.get(sink) or ExportCursor(sink, 0, now, "", 0.0)
        if held.owner != owner and held.lease_until > now:
            return None
        held = replace(held, owner=owner, lease_until=until)
        self._data.exports[sink] = held
        return held

    def advance_export(self, sink: str, owner: str, seq: int, now: float, until: float) -> bool:
        held = self._data.exports.get(sink)
        if held is None or held.owner != owner:
            return False
        self._data.exports[sink] = replace(
            held, seq=max(held.seq, seq), updated_at=now, lease_until=until
        )
        return True

    def release_export(self, sink: str, owner: str) -> None:
        held = self._data.exports.get(sink)
        if held is not None and held.owner == owner:
            self._data.exports[sink] = replace(held, lease_until=0.0)

    def keep_secret(self, name: str, value: str, now: float) -> str:
        return self._data.secrets.setdefault(name, value)

    def use_jti(self, jti: str, approver: str, execution_id: str, now: float) -> bool:
        if jti in self._data.spent:
            return False
        self._data.spent[jti] = execution_id
        return True

    def advance_passkey_counter(
        self, credential_id: str, approver: str, sign_count: int, now: float
    ) -> bool:
        if not counter_advances(self._data.counters.get(credential_id), sign_count):
            return False
        self._data.counters[credential_id] = sign_count
        return True

    def add_request(self, request: ApprovalRequestRecord) -> None:
        if request.id in self._data.requests:
            raise StoreError(f"approval request {request.id} exists")  # a primary key
        self._data.requests[request.id] = request

    def consume_request(self, request_id: str, now: float) -> bool:
        request = self._data.requests.get(request_id)
        if request is None or request.state_at(now) not in (PENDING, APPROVED):
            return False
        self._data.requests[request_id] = replace(request, state=CONSUMED)
        return True

    def put_approval_token(
        self, request_id: str, approver: str, jti: str, token: str, expires_at: float
    ) -> None:
        self._data.tokens.setdefault(request_id, {})[approver] = token

    def mark_approved(self, request_id: str) -> None:
        request = self._data.requests.get(request_id)
        if request is not None and request.state == PENDING:
            self._data.requests[request_id] = replace(request, state=APPROVED)

    def reject_request(self, request_id: str, by: str, reason: str, now: float) -> bool:
        request = self._data.requests.get(request_id)
        if request is None or request.state_at(now) not in OPEN_STATES:
            return False
        self._data.requests[request_id] = replace(
            request, state=REJECTED, rejected_by=by, rejection_reason=reason
        )
        return True

    def void_request(self, request_id: str, reason: str, now: float) -> bool:
        request = self._data.requests.get(request_id)
        if request is None or request.state_at(now) not in OPEN_STATES:
            return False
        self._data.requests[request_id] = replace(request, state=VOIDED, voided_reason=reason)
        return True

    def expire_request(self, request_id: str, now: float) -> bool:
        request = self._data.requests.get(request_id)
        if request is None or request.state not in OPEN_STATES or request.expires_at > now:
            return False
        self._data.requests[request_id] = replace(request, state=EXPIRED)
        return True

    def add_event(self, event: ApprovalEventRecord) -> None:
        self._data.events.append(event)

    def announce_policy(self, digest: str) -> None:
        """One server: nobody to tell."""

    def add_webhook_delivery(self, delivery: WebhookDeliveryRecord) -> None:
        key = (delivery.event_seq, delivery.endpoint)
        if key in self._data.deliveries:
            raise StoreError(f"webhook delivery {key} exists")  # a primary key
        self._data.deliveries[key] = delivery

    def claim_webhook_deliveries(
        self, owner: str, now: float, until: float, limit: int
    ) -> list[WebhookDeliveryRecord]:
        due = sorted(
            (d for d in self._data.deliveries.values()
             if d.state == DELIVERY_PENDING and d.next_attempt_at <= now
             and d.claim_until <= now),
            key=lambda d: (d.next_attempt_at, d.event_seq),
        )[:limit]  # fmt: skip
        claimed = [replace(d, claimed_by=owner, claim_until=until) for d in due]
        for d in claimed:
            self._data.deliveries[(d.event_seq, d.endpoint)] = d
        return claimed

    def release_webhook_claims(self, owner: str) -> int:
        held = [d for d in self._data.deliveries.values()
                if d.claimed_by == owner and d.state == DELIVERY_PENDING]  # fmt: skip
        for d in held:
            self._data.deliveries[(d.event_seq, d.endpoint)] = replace(
                d, claimed_by="", claim_until=0.0
            )
        return len(held)

    def finish_webhook_delivery(self, delivery: WebhookDeliveryRecord, owner: str) -> bool:
        key = (delivery.event_seq, delivery.endpoint)
        held = self._data.deliveries.get(key)
        if held is None or held.claimed_by != owner or held.state != DELIVERY_PENDING:
            return False
        self._data.deliveries[key] = replace(
            held, state=delivery.state, attempts=delivery.attempts,
            next_attempt_at=delivery.next_attempt_at, last_error=delivery.last_error,
            delivered_at=delivery.delivered_at, claimed_by="", claim_until=0.0,
        )  # fmt: skip
        return True

    def put_kept_call(self, call: KeptCallRecord) -> None:
        held = self._data.kept_calls.get(call.execution_id)
        if held is None or held.server == call.server:
            self._data.kept_calls[call.execution_id] = call

    def prune_kept_calls(self, before: float, limit: int) -> int:
        def last(c: KeptCallRecord) -> float:
            return c.ended_at if c.ended_at is not None else c.beat_at

        old = [k for k, c in self._data.kept_calls.items() if last(c) < before][:limit]
        for key in old:
            del self._data.kept_calls[key]
        return len(old)

    def put_identity(self, record: IdentityRecord) -> None:
        held = self._data.identities.get(record.client_id)
        if held is None:
            self._data.identities[record.client_id] = record
            return
        newer = record if record.issued_at >= held.issued_at else held
        self._data.identities[record.client_id] = replace(
            newer, first_seen=held.first_seen, last_seen=max(held.last_seen, record.last_seen)
        )

    def forget_identity(self, client_id: str) -> bool:
        return self._data.identities.pop(client_id, None) is not None

    def prune_webhook_deliveries(self, before: float, limit: int) -> int:
        done = (DELIVERED, DELIVERY_FAILED)
        old = [k for k, d in self._data.deliveries.items()
               if d.state in done and d.created_at < before][:limit]  # fmt: skip
        for key in old:
            del self._data.deliveries[key]
        return len(old)


class MemoryStore:
    def __init__(self) -> None:
        self._data = _Data()
        self._lock = threading.RLock()
        self.units_of_work = 0  # committed ones; tests count writes with it

    @property
    def location(self) -> str:
        return "memory"

    def watch_approvals(self, on_change: Callable[[], None]) -> None:
        """One server: its own events are the only ones."""

    def watch_policy(self, on_reload: Callable[[], None]) -> None:
        """One server: no other server to hear from."""

    @contextmanager
    def reading(self) -> Iterator[_Reads]:
        with self._lock:
            yield _Reads(self._data)

    @contextmanager
    def unit_of_work(self) -> Iterator[_Writes]:
        """Works on a copy, published only when the block ends without an
        exception: all of it, or none of it."""
        with self._lock:
            draft = self._data.draft()
            yield _Writes(draft)
            self._data = draft
            self.units_of_work += 1

    def healthy(self) -> bool:
        return True

    def watch_tools(self, on_change: Callable[[str | None], None]) -> None:
        """One process: nobody else changes its tools."""

    def close(self) -> None:
        pass
