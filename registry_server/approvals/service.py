"""Approval of dangerous calls: requests, token checks, and the decision.

A dangerous call runs only when enough distinct approvers whom the policy
trusts for this tool have each signed a token for exactly this tool
definition, these arguments and this caller (docs/approvals.md). Every rule
that matches the tool applies at once. ``decide`` only checks; the tokens'
`jti`s are spent by ``spend`` in the same transaction as the audit record,
once the call holds a sandbox and right before its tool starts, so a token
works once, ever, across restarts, and an approval is never lost to a call
that did not run.

An approval request belongs to the client whose call caused it: only that
client may spend it, and a token bound to a request (`req`) works only with
that request.
"""

from __future__ import annotations

import dataclasses
import sqlite3
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from registry_server.catalog.registry import Registry
from registry_server.domain import strict_json
from registry_server.domain.errors import (
    AtCapacity,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from registry_server.domain.models import ToolDefinition, parse_definition
from registry_server.domain.outcome import ApprovalRequestView
from registry_server.policy.model import EffectiveRule, Policy
from registry_server.signing.tokens import (
    MAX_REQUEST_ID_CHARS,
    MAX_TOKEN_CHARS,
    TokenRejected,
    VerifiedApproval,
    verify,
)
from registry_server.store import audit_chain as audit
from registry_server.store.sqlite import Store

STATES = ("PENDING", "APPROVED", "CONSUMED", "EXPIRED")
MAX_TOKENS_PER_CALL = 16  # approval tokens one call may carry; more is an attack, not a quorum
MAX_LISTED = 500  # approval requests per ListApprovalRequests answer
DEFAULT_LISTED = 100
# Pending requests one client may have open at once: each holds up to 1 MiB of
# arguments, and a steered agent must not fill the store or the approvers' queue.
MAX_OPEN_REQUESTS_PER_CALLER = 32


class Denied(Exception):
    """A token or request does not approve this call; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Replayed(Denied):
    pass


@dataclass(frozen=True)
class Approved:
    approvals: tuple[VerifiedApproval, ...]
    request_id: str | None
    rule: EffectiveRule


@dataclass(frozen=True)
class Required:
    request: ApprovalRequestView
    message: str


Decision = Approved | Required


@dataclass(frozen=True)
class Call:
    """What is being approved: one tool definition with one argument object."""

    tool: ToolDefinition
    arguments_json: str  # compact JSON as the tool will receive it
    arguments_digest: str
    caller: str


class Approvals:
    def __init__(self, store: Store, policy: Policy, registry: Registry) -> None:
        self._store = store
        self.policy = policy
        self._registry = registry

    # -- token checks ------------------------------------------------------------

    def check_token(
        self, token: str, *, tool_name: str, tool_digest: str, args_digest: str, caller: str,
        rule: EffectiveRule,
    ) -> VerifiedApproval:  # fmt: skip
        """Every token rule (docs/approvals.md) except spending the jti; raises Denied."""
        try:
            approval = verify(
                token,
                keys=self.policy.approver_keys(),
                audience=self.policy.audience,
                tool_name=tool_name,
                tool_digest=tool_digest,
                args_digest=args_digest,
                requester=caller,
                max_ttl_s=rule.max_token_ttl_s,
            )
        except TokenRejected as exc:
            raise Denied(exc.reason) from None
        if not self.policy.eligible(approval.approver, rule):
            raise Denied(
                f"approver '{approval.approver}' is not eligible for tool '{tool_name}'"
                f" (it needs {rule.describe()}: {rule.source})"
            )
        if self.policy.same_person(approval.approver, caller):
            raise Denied(f"approver '{approval.approver}' cannot approve their own call")
        if self._jti_used(approval.jti):
            raise Replayed(f"token of '{approval.approver}' was already used (replayed jti)")
        return approval

    def _jti_used(self, jti: str) -> bool:
        return bool(self._store.read("SELECT 1 FROM used_nonces WHERE jti = ?", (jti,)))

    # -- the decision for one call -----------------------------------------------------

    def decide(self, call: Call, tokens: tuple[str, ...], request_id: str) -> Decision:
        """Approved when enough valid approvals exist; Required (with a stored
        request) when not enough; raises Denied when any token is wrong."""
        if len(tokens) > MAX_TOKENS_PER_CALL or any(len(t) > MAX_TOKEN_CHARS for t in tokens):
            raise Denied(
                f"at most {MAX_TOKENS_PER_CALL} approval tokens of at most {MAX_TOKEN_CHARS}"
                " characters each"
            )
        tool = call.tool
        rule = self.policy.rule_for(
            tool_name=tool.name, categories=tool.categories, level=tool.safety_level
        )
        request: ApprovalRequestView | None = None
        offered = list(tokens)
        if request_id:
            request = self.get(request_id)
            self._check_request_matches(request, call)
            offered += self._stored_tokens(request_id)
        approvals: dict[str, VerifiedApproval] = {}
        for index, token in enumerate(offered, start=1):
            inline = index <= len(tokens)
            which = f"approval token {index}" if inline else "a stored approval"
            try:
                approval = self.check_token(
                    token, tool_name=tool.name, tool_digest=tool.digest,
                    args_digest=call.arguments_digest, caller=call.caller, rule=rule,
                )  # fmt: skip
            except Denied as exc:
                raise type(exc)(f"{which} rejected: {exc.reason}") from None
            if inline and approval.request_id not in (None, request_id):
                raise Denied(
                    f"{which} rejected: it is bound to approval request {approval.request_id};"
                    f" call with approval_request_id={approval.request_id}"
                )
            approvals.setdefault(approval.approver, approval)  # one approver counts once
        if self._missing(rule, approvals) == 0:
            return Approved(tuple(approvals.values()), request_id or None, rule)
        if request is None:
            request = self._open_request(call, rule)
        return Required(
            request,
            f"Tool '{tool.name}' is dangerous: it needs {rule.describe()};"
            f" {len(approvals)} valid so far."
            f" Ask an approver to approve request {request.id}, then call again with"
            f" approval_request_id={request.id}",
        )

    def _missing(self, rule: EffectiveRule, approver_ids: Iterable[str]) -> int:
        """Distinct approvers still needed (at least), given these approvers' ids."""
        known = [a for a in map(self.policy.approver, approver_ids) if a is not None]
        return rule.missing(known)

    def spend(self, approved: Approved, execution_id: str, audit_record: dict[str, Any]) -> None:
        """Spend the approval and write the call's audit record, in one
        transaction: a crash after this can never let the same tokens run the
        call twice. Raises Denied when another call spent them first."""
        with self._store.transaction() as db:
            self._consume(db, approved, execution_id)
            audit.append(db, "execution", audit_record)

    def _consume(self, db: sqlite3.Connection, approved: Approved, execution_id: str) -> None:
        now = time.time()
        for approval in approved.approvals:
            if db.execute("SELECT 1 FROM used_nonces WHERE jti = ?", (approval.jti,)).fetchone():
                raise Replayed(f"token of '{approval.approver}' was already used (replayed jti)")
            db.execute(
                "INSERT INTO used_nonces (jti, approver, used_at, execution_id)"
                " VALUES (?, ?, ?, ?)",
                (approval.jti, approval.approver, now, execution_id),
            )
        if approved.request_id:
            changed = db.execute(
                "UPDATE approval_requests SET state = 'CONSUMED'"
                " WHERE id = ? AND state IN ('PENDING', 'APPROVED') AND expires_at > ?",
                (approved.request_id, now),
            ).rowcount
            if changed != 1:
                raise Denied(f"approval request {approved.request_id} is no longer usable")

    # -- requests ----------------------------------------------------------------

    def _check_request_matches(self, request: ApprovalRequestView, call: Call) -> None:
        if request.requested_by != call.caller:
            # Not named: which client asked is none of this caller's business.
            raise Denied(
                f"approval request {request.id} was made by another client;"
                " only the client whose call caused it may use it"
            )
        if request.state in ("CONSUMED", "EXPIRED"):
            raise Denied(f"approval request {request.id} is {request.state.lower()}")
        if request.tool_name != call.tool.name:
            raise Denied(f"approval request {request.id} is for tool '{request.tool_name}'")
        if request.tool_digest != call.tool.digest:
            raise Denied(
                f"tool '{call.tool.name}' was redefined after approval request {request.id}"
                " was made (tool_digest changed)"
            )
        if request.arguments_digest != call.arguments_digest:
            raise Denied(f"arguments differ from those of approval request {request.id}")

    def _open_request(self, call: Call, rule: EffectiveRule) -> ApprovalRequestView:
        """The caller's open request for exactly this call, or a new one."""
        now = time.time()
        rows = self._store.read(
            "SELECT id FROM approval_requests WHERE tool_name = ? AND tool_digest = ?"
            " AND arguments_digest = ? AND requested_by = ? AND state = 'PENDING'"
            " AND expires_at > ? ORDER BY created_at DESC LIMIT 1",
            (call.tool.name, call.tool.digest, call.arguments_digest, call.caller, now),
        )
        if rows:
            return self.get(str(rows[0][0]))
        request_id = uuid.uuid4().hex
        manifest = strict_json.dumps(call.tool.as_manifest())
        with self._store.transaction() as db:
            (open_now,) = db.execute(
                "SELECT COUNT(*) FROM approval_requests WHERE requested_by = ?"
                " AND state = 'PENDING' AND expires_at > ?",
                (call.caller, now),
            ).fetchone()
            if open_now >= MAX_OPEN_REQUESTS_PER_CALLER:
                raise AtCapacity(
                    f"client '{call.caller}' already has {open_now} open approval requests"
                    f" (at most {MAX_OPEN_REQUESTS_PER_CALLER}); wait until some are approved"
                    " or expire"
                )
            db.execute(
                "INSERT INTO approval_requests (id, tool_name, tool_digest, arguments_json,"
                " arguments_digest, requested_by, approvals_required, state, created_at,"
                " expires_at, tool_manifest, tool_owner)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, 'PENDING', ?, ?, ?, ?)",
                (
                    request_id, call.tool.name, call.tool.digest, call.arguments_json,
                    call.arguments_digest, call.caller, rule.approvals_required, now,
                    now + self.policy.approval_request_ttl_s, manifest, call.tool.owner,
                ),
            )  # fmt: skip
            audit.append(db, "approval", {
                "event": "requested", "request_id": request_id, "tool": call.tool.name,
                "tool_digest": call.tool.digest, "args_digest": call.arguments_digest,
                "requested_by": call.caller, "approvals_required": rule.approvals_required,
            })  # fmt: skip
        return self.get(request_id)

    def get_for(self, request_id: str, reader: str, *, approver: bool) -> ApprovalRequestView:
        """A request as ``reader`` may see it: approvers see every request; any
        other client only its own (another's arguments are none of its business,
        and NOT_FOUND does not even confirm the id)."""
        request = self.get(request_id)
        if not approver and request.requested_by != reader:
            raise NotFound(f"approval request '{request_id}' not found")
        return request

    def get(self, request_id: str) -> ApprovalRequestView:
        if not request_id:
            raise InvalidArgument("id: must not be empty")
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument(f"id: longer than {MAX_REQUEST_ID_CHARS} characters")
        rows = self._store.read(
            f"SELECT {_COLUMNS} FROM approval_requests WHERE id = ?", (request_id,)
        )
        if not rows:
            raise NotFound(f"approval request '{request_id}' not found")
        return self._view(rows[0])

    def list_requests(self, state: str = "", limit: int = 0) -> list[ApprovalRequestView]:
        """Newest first, without the arguments or the tool's parameters (an
        answer of 500 requests must not carry 500 MiB): read one with ``get``."""
        state = state.strip().upper()
        if state and state not in STATES:
            raise InvalidArgument(f"state: unknown state; use {', '.join(STATES)}")
        limit = min(limit or DEFAULT_LISTED, MAX_LISTED)
        now = time.time()
        where = ""
        params: tuple[object, ...] = ()
        if state == "EXPIRED":
            where, params = "WHERE state != 'CONSUMED' AND expires_at <= ?", (now,)
        elif state in ("PENDING", "APPROVED"):
            where, params = "WHERE state = ? AND expires_at > ?", (state, now)
        elif state == "CONSUMED":
            where, params = "WHERE state = 'CONSUMED'", ()
        rows = self._store.read(
            f"SELECT {_LISTED_COLUMNS} FROM approval_requests {where}"
            " ORDER BY created_at DESC LIMIT ?",
            (*params, limit),
        )
        return [self._view(r, listed=True) for r in rows]

    def submit(self, request_id: str, token: str, submitted_by: str) -> ApprovalRequestView:
        """Attach one approver's token to a request (verified now, spent later)."""
        if not token.strip():
            raise InvalidArgument("token: must not be empty")
        if len(token) > MAX_TOKEN_CHARS:
            raise InvalidArgument(f"token: longer than {MAX_TOKEN_CHARS} characters")
        request = self.get(request_id)
        if request.state in ("CONSUMED", "EXPIRED"):
            raise FailedPrecondition(f"approval request {request_id} is {request.state.lower()}")
        rule = self._rule_of(request)
        try:
            approval = self.check_token(
                token, tool_name=request.tool_name, tool_digest=request.tool_digest,
                args_digest=request.arguments_digest, caller=request.requested_by, rule=rule,
            )  # fmt: skip
        except Denied as exc:
            raise PermissionDenied(f"approval rejected: {exc.reason}") from None
        if approval.request_id not in (None, request_id):
            raise PermissionDenied(
                f"approval rejected: token is for request {approval.request_id}, not {request_id}"
            )
        with self._store.transaction() as db:
            db.execute(
                "INSERT INTO approval_tokens (request_id, approver, jti, token, expires_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (request_id, approver) DO UPDATE SET"
                " jti = excluded.jti, token = excluded.token, expires_at = excluded.expires_at",
                (request_id, approval.approver, approval.jti, token, approval.expires_at),
            )
            approvers = [
                str(a) for (a,) in db.execute(
                    "SELECT approver FROM approval_tokens WHERE request_id = ?", (request_id,)
                )
            ]  # fmt: skip
            if self._missing(rule, approvers) == 0:
                db.execute(
                    "UPDATE approval_requests SET state = 'APPROVED'"
                    " WHERE id = ? AND state = 'PENDING'",
                    (request_id,),
                )
            audit.append(db, "approval", {
                "event": "approved", "request_id": request_id, "approver": approval.approver,
                "jti": approval.jti, "submitted_by": submitted_by,
            })  # fmt: skip
        return self.get(request_id)

    def _rule_of(self, request: ApprovalRequestView) -> EffectiveRule:
        """The rule as the policy states it now, for the tool as registered now
        (a redefined tool fails later, at execution, on its digest)."""
        tool = self._registry.find(request.tool_name)
        if tool is None:
            raise FailedPrecondition(f"tool '{request.tool_name}' is no longer registered")
        return self.policy.rule_for(
            tool_name=tool.name, categories=tool.categories, level=tool.safety_level
        )

    def _stored_tokens(self, request_id: str) -> list[str]:
        rows = self._store.read(
            "SELECT token FROM approval_tokens WHERE request_id = ? ORDER BY approver",
            (request_id,),
        )
        return [str(r[0]) for r in rows]

    def _view(self, row: tuple[object, ...], *, listed: bool = False) -> ApprovalRequestView:
        (rid, tool, tdig, args, adig, by, need, state, created, expires, manifest, owner) = row
        approvers = [
            str(a[0])
            for a in self._store.read(
                "SELECT approver FROM approval_tokens WHERE request_id = ? ORDER BY approver",
                (rid,),
            )
        ]
        state = str(state)
        if state != "CONSUMED" and float(str(expires)) <= time.time():
            state = "EXPIRED"
        shown = _snapshot(str(manifest), str(owner), listed=listed)
        current = self._registry.find(str(tool))
        rule = (
            self.policy.rule_for(
                tool_name=current.name, categories=current.categories, level=current.safety_level
            )
            if current is not None
            else None
        )
        return ApprovalRequestView(
            audience=self.policy.audience,
            max_token_ttl_s=rule.max_token_ttl_s if rule else 0,
            id=str(rid), tool_name=str(tool), tool_digest=str(tdig),
            arguments_json="" if listed else str(args),
            arguments_digest=str(adig), requested_by=str(by), approvals_required=int(str(need)),
            approved_by=tuple(approvers), state=state,
            created_at=datetime.fromtimestamp(float(str(created)), UTC),
            expires_at=datetime.fromtimestamp(float(str(expires)), UTC),
            tool=shown,
            approvals_missing=(
                self._missing(rule, approvers) if rule is not None
                else max(0, int(str(need)) - len(approvers))
            ),
        )  # fmt: skip


def _snapshot(manifest: str, owner: str, *, listed: bool) -> ToolDefinition | None:
    """The definition the request was made for (None for requests older than
    snapshots). Listings leave its parameters schema out, as they do arguments."""
    if not manifest:
        return None
    try:
        tool = parse_definition(strict_json.loads(manifest, "tool_manifest"))
    except InvalidArgument:  # InvalidDefinition included: shown as missing, never guessed
        return None
    tool = dataclasses.replace(tool, owner=owner)
    return dataclasses.replace(tool, parameters_json="") if listed else tool


_COLUMNS = (
    "id, tool_name, tool_digest, arguments_json, arguments_digest, requested_by,"
    " approvals_required, state, created_at, expires_at, tool_manifest, tool_owner"
)
# Listings read neither the arguments nor the schema from disk.
_LISTED_COLUMNS = _COLUMNS.replace("arguments_json", "''").replace(
    "tool_manifest",
    "CASE tool_manifest WHEN '' THEN '' ELSE"
    " json_set(tool_manifest, '$.parameters', json('{\"type\":\"object\"}')) END",
)
