"""The store interface: everything the server keeps across restarts.

Four kinds of data: tool definitions, approval requests (with the approvers'
tokens), the ids (`jti`) of spent approval tokens, and the hash-chained audit
log (with the signed checkpoints of its Merkle tree). Reads go through
``Store.reading()``; every change goes through ``Store.unit_of_work()``, one
atomic transaction: all of it is stored, or none of it. That is what lets a
call spend its approval tokens and write its audit record together
(docs/how-to/approvals.md), so a crash can never let the same tokens run a call
twice, nor leave a call that ran without its record.

Implementations: ``sqlite.SqliteStore`` (the server's store) and
``memory.MemoryStore`` (unit tests). Another database implements these two
protocols; ``api/app.py`` picks one from ``TOOLREG_STORE_URL``.
Implementations raise ``StoreError`` when the database fails.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any, Protocol

# Request states. A PENDING or APPROVED request whose expires_at has passed
# reads as EXPIRED before the expiry sweep stores it so (approvals/events.py).
PENDING, APPROVED, CONSUMED, EXPIRED = "PENDING", "APPROVED", "CONSUMED", "EXPIRED"
REJECTED = "REJECTED"
VOIDED = "VOIDED"  # its tool was deleted or disabled while it was open
REQUEST_STATES = (PENDING, APPROVED, CONSUMED, REJECTED, VOIDED, EXPIRED)
OPEN_STATES = (PENDING, APPROVED)  # still waiting to be used (unless expired)
FINAL_STATES = (CONSUMED, REJECTED, VOIDED, EXPIRED)  # never change again
# What a listing shows instead of a request's parameters schema.
LISTED_PARAMETERS: dict[str, Any] = {"type": "object"}
# Webhook delivery states (notify/outbox.py): pending until a 2xx, or until
# its attempts run out.
DELIVERY_PENDING, DELIVERED, DELIVERY_FAILED = "pending", "delivered", "failed"


@dataclass(frozen=True)
class StoredTool:
    name: str
    manifest_json: str  # the definition in manifest shape, JSON
    digest: str
    owner: str
    # The kill switch (SetToolEnabled): calls are refused while set. Only
    # ``set_tool_disabled`` changes these; ``put_tool`` leaves them as stored.
    disabled: bool = False
    disabled_reason: str = ""
    # Approval tokens issued (iat) before this time (time.time()) do not count
    # for this tool: when it was last disabled, or when its name was last
    # deleted before this registration (0: no such time).
    tokens_not_before: float = 0.0


@dataclass(frozen=True)
class ApprovalRequestRecord:
    id: str
    tool_name: str
    tool_digest: str
    arguments_json: str  # "" in listings
    arguments_digest: str
    requested_by: str
    approvals_required: int
    state: str  # PENDING, APPROVED or CONSUMED (EXPIRED is derived)
    created_at: float  # time.time()
    expires_at: float
    tool_manifest: str  # the definition it was made for; parameters left out in listings
    tool_owner: str
    rejected_by: str = ""  # REJECTED: the approver who refused it
    rejection_reason: str = ""  # REJECTED: why, in the approver's words
    voided_reason: str = ""  # VOIDED: why (its tool was deleted or disabled)

    def state_at(self, now: float) -> str:
        if self.state in OPEN_STATES and self.expires_at <= now:
            return EXPIRED
        return self.state

    def listed(self) -> ApprovalRequestRecord:
        """The form listings carry: without the arguments or the tool's parameters
        (an answer of 500 requests must not carry 500 MiB)."""
        manifest = self.tool_manifest
        if manifest:
            manifest = json.dumps({**json.loads(manifest), "parameters": LISTED_PARAMETERS})
        return replace(self, arguments_json="", tool_manifest=manifest)


@dataclass(frozen=True)
class ApprovalEventRecord:
    """One change of an approval request, stored with the audit entry that
    records it: ``seq`` is that entry's seq, so events are in commit order on
    every server (appends to the chain line up)."""

    seq: int
    request_id: str
    type: str  # OPENED, APPROVAL_ADDED, APPROVED, REJECTED, CONSUMED, EXPIRED, VOIDED
    actor: str  # the approver, for APPROVAL_ADDED and REJECTED
    reason: str  # REJECTED: the approver's reason; VOIDED: why
    at: float  # time.time()


@dataclass(frozen=True)
class WebhookDeliveryRecord:
    """One approval event to post to one webhook endpoint: a row of the
    outbox, inserted in the event's own transaction. The body is made then,
    so every attempt sends the same bytes, as the request was at that event."""

    event_seq: int  # the approval event's seq
    endpoint: str  # the policy's webhook id
    webhook_id: str  # the `webhook-id` header: the same on every attempt
    payload: str  # the JSON body
    created_at: float  # time.time()
    next_attempt_at: float
    state: str = DELIVERY_PENDING
    attempts: int = 0
    last_error: str = ""  # the last failed attempt's reason, capped
    delivered_at: float | None = None
    claimed_by: str = ""  # the dispatcher sending it now ("" when none)
    claim_until: float = 0.0  # when that claim lapses (a dead server's is taken over)


@dataclass(frozen=True)
class WebhookBacklog:
    pending: int  # deliveries not yet delivered nor given up
    next_due: float | None  # the earliest next_attempt_at among them


@dataclass(frozen=True)
class KeptCallRecord:
    """A running or recently ended streamed call as its server published it,
    for AttachExecution through another server (execution/call_relay.py): the
    output so far (within the tool's caps) and, once ended, the result."""

    execution_id: str
    caller: str  # the client that made the call: the only one who may attach
    server: str  # the publishing server's instance id
    stdout: bytes
    stderr: bytes
    result_json: str  # "" while the call runs
    beat_at: float  # time.time() of the last publication: a dead server's goes stale
    ended_at: float | None = None


@dataclass(frozen=True)
class IdentityRecord:
    """A group-mapped client of an identity provider (policy/identity.py), as
    its latest verified token showed it: who (provider and subject) and its
    groups, never its roles (those are the policy's, derived on each lookup
    from these groups: docs/how-to/identity.md, "Remembered clients").
    Stored only once the token was verified and mapped to a role."""

    client_id: str
    provider: str
    subject: str
    groups: tuple[str, ...]  # sorted, each once
    issued_at: float  # the token's iat: an older token never replaces a newer one's groups
    expires_at: float  # the token's exp: approver groups hold no longer
    first_seen: float  # time.time() of the first stored sighting
    last_seen: float  # of the latest written one (written at most once per interval)


@dataclass(frozen=True)
class AuditEntry:
    seq: int  # 1, 2, 3, ... in append order
    at: float
    kind: str  # execution, approval, registration (tools created, replaced, deleted, disabled)
    record: str  # the record, canonical JSON (RFC 8785)
    prev_hash: str  # hash of entry seq-1 (64 zeros for the first)
    hash: str  # audit_chain.entry_hash of the fields above


@dataclass(frozen=True)
class ExportCursor:
    """How far one SIEM export destination has the audit log
    (notify/siem/exporter.py), and which server exports to it now."""

    sink: str  # the destination: "jsonl:<path>", "syslog:<host>:<port>"
    seq: int  # every entry up to this seq is confirmed by the destination
    updated_at: float  # time.time() of the last change
    owner: str  # the exporter holding the lease ("" when none)
    lease_until: float  # when that lease lapses (a dead server's is taken over)


@dataclass(frozen=True)
class CheckpointRecord:
    """A signed checkpoint of the audit log's Merkle tree (store/audit_tree.py,
    docs/how-to/audit.md): the tree of its first ``size`` entries had root ``root``,
    as the log key signed in ``note``."""

    origin: str  # the log's name: the note's first line and its key name
    size: int  # entries covered: seq 1..size
    root: str  # RFC 9162 root hash, hex
    note: str  # the signed note (c2sp.org/tlog-checkpoint), as published
    made_at: float  # time.time()


@dataclass(frozen=True)
class CosignatureRecord:
    """A witness's cosignature (c2sp.org/tlog-cosignature) of one of the
    log's checkpoints, as its witness answered it (notify/witnesses.py,
    docs/how-to/audit.md "Witnesses")."""

    origin: str  # the log's
    size: int  # of the checkpoint it cosigns
    root: str  # that checkpoint's root hash, hex
    witness: str  # the witness's key name
    key_id: str  # the witness key's ID, hex
    line: str  # the signature line, "— <witness> <base64>", no newline
    cosigned_at: int  # the cosignature's own time (POSIX seconds)


class StoreReads(Protocol):
    def tools(self) -> list[StoredTool]:
        """Every stored tool, by name."""
        ...

    def tool(self, name: str) -> StoredTool | None: ...

    def jti_used(self, jti: str) -> bool: ...

    def passkey_counter(self, credential_id: str) -> int | None:
        """The last signature counter accepted for this passkey (None: never used)."""
        ...

    def request(self, request_id: str) -> ApprovalRequestRecord | None: ...

    def requests(
        self, *, state: str, now: float, limit: int, before: tuple[float, str] | None = None,
        requested_by: str | None = None,
    ) -> list[ApprovalRequestRecord]:  # fmt: skip
        """Up to ``limit``, newest first (by created_at, then id, both
        descending), in their listed form (``ApprovalRequestRecord.listed``);
        ``state``: "" for all, else one of REQUEST_STATES as ``state_at(now)``
        tells it. ``before``: only those whose (created_at, id) is below it (the
        next page of a listing, keyset); ``requested_by``: only that client's."""
        ...

    def open_request_for(
        self, *, tool_name: str, tool_digest: str, arguments_digest: str, requested_by: str,
        now: float,
    ) -> str | None:  # fmt: skip
        """The id of the newest unexpired, unused (PENDING or APPROVED) request for
        exactly this call: a client that asks again, having lost the id, is
        pointed at it instead of asking the approvers twice."""
        ...

    def open_requests_of(self, requested_by: str, now: float) -> int:
        """How many PENDING, unexpired requests this client has."""
        ...

    def rejected_request_for(
        self, *, tool_name: str, tool_digest: str, arguments_digest: str, requested_by: str,
        now: float,
    ) -> str | None:  # fmt: skip
        """The id of the newest REJECTED request for exactly this call that has
        not reached its expires_at: the same call asked again is refused with
        the approver's reason instead of asking the approvers again."""
        ...

    def open_requests_for_tool(self, tool_name: str, now: float) -> list[str]:
        """Ids of the unexpired PENDING or APPROVED requests for tool
        ``tool_name`` (any definition of it), oldest first."""
        ...

    def expired_open_requests(self, now: float, limit: int) -> list[str]:
        """Ids of PENDING or APPROVED requests whose expires_at has passed (the
        expiry sweep stores them EXPIRED, with an event)."""
        ...

    def events_after(self, seq: int, limit: int) -> list[ApprovalEventRecord]:
        """Approval events with a seq above ``seq``, oldest first."""
        ...

    def last_event_seq(self) -> int:
        """The highest approval event seq (0 when there is none)."""
        ...

    def approvers_of(self, request_id: str) -> list[str]:
        """Ids of the approvers whose tokens the request holds, sorted."""
        ...

    def tokens_of(self, request_id: str) -> list[str]:
        """The tokens the request holds, by approver id."""
        ...

    def audit_entries(self) -> list[AuditEntry]:
        """The whole audit log, by seq."""
        ...

    def audit_tail(self, count: int) -> list[AuditEntry]:
        """The last ``count`` entries, by seq."""
        ...

    def audit_entries_after(self, seq: int, limit: int) -> list[AuditEntry]:
        """Up to ``limit`` entries with a seq above ``seq``, by seq (the
        checkpointer reads the log as it grows)."""
        ...

    def latest_checkpoint(self, origin: str | None = None) -> CheckpointRecord | None:
        """The checkpoint of the largest size (of log ``origin``, or of any)."""
        ...

    def cosignatures(self, origin: str, size: int) -> list[CosignatureRecord]:
        """The witnesses' cosignatures of log ``origin``'s checkpoint of ``size``,
        by witness name and key ID."""
        ...

    def latest_cosignatures(self, origin: str) -> list[CosignatureRecord]:
        """Each witness key's cosignature of the largest checkpoint of log
        ``origin`` it cosigned, by witness name and key ID."""
        ...

    def export_cursor(self, sink: str) -> ExportCursor | None:
        """The SIEM export cursor of ``sink``; None before its first claim."""
        ...

    def webhook_delivery(self, event_seq: int, endpoint: str) -> WebhookDeliveryRecord | None: ...

    def kept_call(self, execution_id: str) -> KeptCallRecord | None:
        """A published call (any caller's: the reader checks whose it is)."""
        ...

    def identity(self, client_id: str) -> IdentityRecord | None:
        """The remembered group-mapped client of this id, if any."""
        ...

    def identities(self, after: str, limit: int) -> list[IdentityRecord]:
        """Up to ``limit`` remembered clients whose ids sort after ``after``, by id."""
        ...

    def webhook_backlog(self) -> WebhookBacklog:
        """How many deliveries are pending, and when the first is due."""
        ...

    def webhook_claimants(self, now: float) -> list[str]:
        """Who holds a claim that has not lapsed on a pending delivery (each once)."""
        ...


class UnitOfWork(StoreReads, Protocol):
    """Reads and writes inside one transaction."""

    def put_tool(self, tool: StoredTool, now: float) -> None:
        """Create or replace the tool of this name. A replacement keeps the
        stored ``disabled``, ``disabled_reason`` and ``tokens_not_before``
        (another server may have disabled it meanwhile); a creation starts
        enabled, with ``tokens_not_before`` the time the name was last
        deleted (0 when never). SQL stores announce the change on commit."""
        ...

    def delete_tool(self, name: str, now: float) -> bool:
        """Remove the tool of this name and remember when (the next tool of
        the name refuses tokens issued before); False when there was none.
        SQL stores announce the change on commit."""
        ...

    def set_tool_disabled(self, name: str, disabled: bool, reason: str, now: float) -> bool:
        """Disable (with ``reason``; ``tokens_not_before`` becomes ``now``) or
        enable (reason cleared) the tool; False when there is none. SQL stores
        announce the change on commit."""
        ...

    def add_audit_entry(self, entry: AuditEntry) -> None:
        """Append an entry (audit_chain.append makes it)."""
        ...

    def add_checkpoint(self, checkpoint: CheckpointRecord) -> bool:
        """Store a signed checkpoint; False, storing nothing, when the log has
        one of that size already (servers signing at once: the same tree and
        key sign the same note)."""
        ...

    def add_cosignature(self, cosignature: CosignatureRecord) -> bool:
        """Store a witness's cosignature; False, storing nothing, when that
        witness key's of that checkpoint is stored already (the first kept)."""
        ...

    def claim_export(self, sink: str, owner: str, now: float, until: float) -> ExportCursor | None:
        """Take (or renew) the lease on ``sink``'s export for ``owner`` until
        ``until``, creating its cursor at seq 0 when there is none; the cursor
        when ``owner`` holds it now, None when another exporter's lease has not
        lapsed. With several servers, one exports to a destination at a time."""
        ...

    def advance_export(self, sink: str, owner: str, seq: int, now: float, until: float) -> bool:
        """Move ``sink``'s cursor up to ``seq`` (never down) and renew the
        lease; False, changing nothing, when ``owner`` no longer holds it."""
        ...

    def release_export(self, sink: str, owner: str) -> None:
        """End ``owner``'s lease on ``sink`` (a stopping server's), so another
        server takes the export over at once."""
        ...

    def keep_secret(self, name: str, value: str, now: float) -> str:
        """The secret stored under ``name``, storing ``value`` first when there is
        none: every server on the store gets the one the first of them stored
        (the key of page tokens, domain/pages.py)."""
        ...

    def use_jti(self, jti: str, approver: str, execution_id: str, now: float) -> bool:
        """Mark a token spent; False when it already was."""
        ...

    def advance_passkey_counter(
        self, credential_id: str, approver: str, sign_count: int, now: float
    ) -> bool:
        """Store ``sign_count`` as the passkey's last counter when it goes up
        (or stays 0 for an authenticator that does not count,
        ``passkeys.counter_advances``); False, storing nothing, when it does
        not: a clone, or an assertion older than one already accepted."""
        ...

    def add_request(self, request: ApprovalRequestRecord) -> None: ...

    def consume_request(self, request_id: str, now: float) -> bool:
        """PENDING or APPROVED and unexpired -> CONSUMED; False when it was not usable."""
        ...

    def put_approval_token(
        self, request_id: str, approver: str, jti: str, token: str, expires_at: float
    ) -> None:
        """Attach an approver's token to a request, replacing that approver's earlier one."""
        ...

    def mark_approved(self, request_id: str) -> None:
        """PENDING -> APPROVED (no change in any other state)."""
        ...

    def reject_request(self, request_id: str, by: str, reason: str, now: float) -> bool:
        """PENDING or APPROVED and unexpired -> REJECTED by ``by`` for ``reason``;
        False when it was not open."""
        ...

    def expire_request(self, request_id: str, now: float) -> bool:
        """PENDING or APPROVED whose expires_at has passed -> EXPIRED; False when
        another server (or the call that used it) got there first."""
        ...

    def void_request(self, request_id: str, reason: str, now: float) -> bool:
        """PENDING or APPROVED and unexpired -> VOIDED for ``reason``; False
        when it was not open."""
        ...

    def announce_policy(self, digest: str) -> None:
        """Ask every other server on the store, on commit, to re-read its
        policy file (a store only one server uses does nothing)."""
        ...

    def add_event(self, event: ApprovalEventRecord) -> None:
        """Store an approval event (approvals/events.py makes it, after the
        audit entry whose seq it takes). SQL stores announce it to the other
        servers on commit."""
        ...

    def add_webhook_delivery(self, delivery: WebhookDeliveryRecord) -> None:
        """Queue one delivery (a hook does, in the transaction of its event)."""
        ...

    def claim_webhook_deliveries(
        self, owner: str, now: float, until: float, limit: int
    ) -> list[WebhookDeliveryRecord]:
        """Claim up to ``limit`` pending deliveries that are due and not claimed
        (or whose claim lapsed) for ``owner`` until ``until``, earliest due
        first. Claims of concurrent transactions never overlap (PostgreSQL:
        locked rows are skipped), so each is sent by one server at a time."""
        ...

    def release_webhook_claims(self, owner: str) -> int:
        """Give back every claim ``owner`` holds on a pending delivery, lapsed
        or not (its process is provably gone), so any server claims them
        now; how many."""
        ...

    def finish_webhook_delivery(self, delivery: WebhookDeliveryRecord, owner: str) -> bool:
        """Store the outcome of an attempt (state, attempts, next_attempt_at,
        last_error, delivered_at as ``delivery`` has them) and release the
        claim; False when ``owner`` no longer holds it (it lapsed and another
        server took it over)."""
        ...

    def put_kept_call(self, call: KeptCallRecord) -> None:
        """Insert or replace a call's published state (its server only)."""
        ...

    def prune_kept_calls(self, before: float, limit: int) -> int:
        """Delete up to ``limit`` calls that ended, or were last published (a
        dead server's), before ``before``; returns how many."""
        ...

    def prune_webhook_deliveries(self, before: float, limit: int) -> int:
        """Delete up to ``limit`` delivered or failed deliveries created before
        ``before``; returns how many."""
        ...

    def put_identity(self, record: IdentityRecord) -> None:
        """Remember a group-mapped client. A new one is stored whole; a known
        one keeps its first_seen, takes the provider, subject, groups and
        times of ``record`` only when its token is not older (issued_at) than
        the stored one's, and its last_seen only moves forward."""
        ...

    def forget_identity(self, client_id: str) -> bool:
        """Delete a remembered client (an operator's forget); whether one was."""
        ...


class Store(Protocol):
    @property
    def location(self) -> str:
        """Where the data lives, for messages (a path, or a URL without secrets)."""
        ...

    def reading(self) -> AbstractContextManager[StoreReads]: ...

    def unit_of_work(self) -> AbstractContextManager[UnitOfWork]: ...

    def healthy(self) -> bool:
        """True when the database answers (the server's health check asks)."""
        ...

    def watch_tools(self, on_change: Callable[[str | None], None]) -> None:
        """Call ``on_change(name)`` when another server stores, deletes, disables
        or enables tool ``name``, and
        ``on_change(None)`` when everything must be re-read. A store only one
        server uses never calls it."""
        ...

    def watch_approvals(self, on_change: Callable[[], None]) -> None:
        """Call ``on_change()`` when another server stores an approval event
        (and after a reconnect, when some may have been missed). A store only
        one server uses never calls it."""
        ...

    def watch_policy(self, on_reload: Callable[[], None]) -> None:
        """Call ``on_reload()`` when another server announces a policy reload
        (``UnitOfWork.announce_policy``). A store only one server uses never
        calls it."""
        ...

    def close(self) -> None: ...
