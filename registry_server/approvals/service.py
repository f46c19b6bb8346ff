"""Approval of dangerous calls: requests, token checks, and the decision.

A dangerous call runs only when enough distinct approvers whom the policy
trusts for this tool have each signed a token for exactly this tool
definition, these arguments and this caller (docs/how-to/approvals.md). Every rule
that matches the tool applies at once. ``decide`` only checks; the tokens'
`jti`s are spent by ``spend`` in the same transaction as the audit record,
once the call holds a sandbox and right before its tool starts, so a token
works once, ever, across restarts, and an approval is never lost to a call
that did not run.

An approval request belongs to the client whose call caused it: only that
client may spend it, and a token bound to a request (`req`) works only with
that request. An approver eligible for the tool may reject a request instead,
with a reason the agent is told. Every change is an approval event
(approvals/events.py) that watches and webhooks follow; who sees which
request is ``Viewer``'s to say.

A tool deleted or disabled takes its open requests with it: they are VOIDED
in the unit of work that deletes or disables it (a registry retire hook), and
tokens issued before that moment never count for the tool again, so an old
approval cannot run a tool registered again under the same name, even with
an identical definition (docs/how-to/approvals.md, "Deleted and disabled tools").
"""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from registry_server.approvals import events
from registry_server.approvals.events import EventHook, EventHub
from registry_server.catalog.registry import Registry
from registry_server.domain import strict_json
from registry_server.domain.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
)
from registry_server.domain.models import ToolDefinition, parse_definition
from registry_server.domain.outcome import AppliedRule, ApprovalRequestView
from registry_server.domain.pages import Page, PageQuery, PageTokens, page_size
from registry_server.domain.text import checked_reason
from registry_server.policy.call_facts import request_rule, tool_facts
from registry_server.policy.conditions import CallFacts
from registry_server.policy.live import PolicySource, source_of
from registry_server.policy.model import EffectiveRule, Policy
from registry_server.signing import passkeys
from registry_server.signing.tokens import (
    MAX_REQUEST_ID_CHARS,
    MAX_TOKEN_CHARS,
    TokenRejected,
    VerifiedApproval,
    verify,
)
from registry_server.store import audit_chain as audit
from registry_server.store.base import (
    APPROVED,
    CONSUMED,
    EXPIRED,
    FINAL_STATES,
    PENDING,
    REJECTED,
    REQUEST_STATES,
    VOIDED,
    ApprovalRequestRecord,
    Store,
    UnitOfWork,
)

MAX_TOKENS_PER_CALL = 16  # approval tokens one call may carry; more is an attack, not a quorum
MAX_LISTED = 500  # approval requests one list_requests answer holds at most (watches)
DEFAULT_LISTED = 100
DEFAULT_REQUESTS_PAGE = 50  # approval requests per page when a request names no page_size
MAX_REQUESTS_PAGE = 500  # approval requests per page at most; a larger page_size is cut to it
# Rows one page reads at most to fill itself with requests its caller may see:
# an approver eligible for few tools gets a short page (with a token to go on
# from the last row read) instead of a call that reads the whole table.
MAX_REQUESTS_SCANNED = 2_000
SCAN_BATCH = 100  # rows read at a time while filling a page for an approver
RequestKey = tuple[float, str]  # (created_at, id): listings run newest first, by this key
# Pending requests one client may have open at once unless the policy's quota
# says otherwise: each holds up to 1 MiB of arguments, and a steered agent must
# not fill the store or the approvers' queue.
MAX_OPEN_REQUESTS_PER_CALLER = 32
MAX_CACHED_SNAPSHOTS = 256  # parsed tool snapshots kept (a page shows at most 500 requests)


@dataclass(frozen=True)
class Viewer:
    """Who reads approval requests, and so which ones it sees: every request
    (``sees_all``: an admin, development mode, or an approve-role client the
    policy names as no approver, a relay the operator set up), the requests
    ``approver`` is eligible to approve and did not make, and its own."""

    client_id: str
    sees_all: bool = False
    approver: str | None = None
    admin: bool = False  # may reject any request (with the approve role to ask)


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
    # passkey approvals given with the call (not stored with a request): their
    # counters advance when the call spends them
    fresh_passkeys: tuple[VerifiedApproval, ...] = ()


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
    # What the policy's conditions read (policy/call_facts.py); None: every
    # conditional rule counts as applying (the strictest reading).
    facts: CallFacts | None = None


class Approvals:
    def __init__(
        self, store: Store, policy: Policy | PolicySource, registry: Registry,
        hub: EventHub | None = None,
    ) -> None:  # fmt: skip
        self._store = store
        self._policy = source_of(policy)
        self._registry = registry
        self.hub = hub if hub is not None else EventHub(store)
        # run inside the unit of work of every approval event (webhook outbox)
        self.hooks: list[EventHook] = []
        # A tool deleted or disabled: its open requests are voided with it, and
        # this server's watches hear of it once that is committed.
        registry.add_retire_hook(self.void_requests_for_tool)
        registry.add_listener(self._tool_changed)

    @property
    def policy(self) -> Policy:
        """The policy in force now (a reload changes it between calls)."""
        return self._policy()

    # -- token checks ------------------------------------------------------------

    def check_token(
        self, token: str, *, tool_name: str, tool_digest: str, args_digest: str, caller: str,
        rule: EffectiveRule, not_before: float = 0.0, fresh: bool = True,
    ) -> VerifiedApproval:  # fmt: skip
        """Every token rule (docs/how-to/approvals.md) except spending the jti; raises
        Denied. ``not_before``: the tool's ``tokens_not_before`` (a token
        issued before it was deleted or disabled does not count). A passkey
        approval (signing/passkeys.py) is checked by the same rules, and when
        ``fresh`` (not one a request already holds, whose counter was checked
        when it was attached) its signature counter must go up."""
        policy = self.policy
        try:
            if passkeys.is_envelope(token):
                approval = passkeys.verify(
                    token, credentials=policy.passkey_credentials(), webauthn=policy.webauthn,
                    audience=policy.audience, tool_name=tool_name, tool_digest=tool_digest,
                    args_digest=args_digest, requester=caller, max_ttl_s=rule.max_token_ttl_s,
                )  # fmt: skip
            else:
                approval = verify(
                    token, keys=policy.approver_keys(), audience=policy.audience,
                    tool_name=tool_name, tool_digest=tool_digest, args_digest=args_digest,
                    requester=caller, max_ttl_s=rule.max_token_ttl_s,
                )  # fmt: skip
        except TokenRejected as exc:
            raise Denied(exc.reason) from None
        if not self.policy.eligible(approval.approver, rule):
            raise Denied(
                f"approver '{approval.approver}' is not eligible for tool '{tool_name}'"
                f" (it needs {rule.describe()}: {rule.source})"
            )
        if self.policy.same_person(approval.approver, caller):
            raise Denied(f"approver '{approval.approver}' cannot approve their own call")
        if approval.issued_at < not_before:
            raise Denied(
                f"token of '{approval.approver}' was issued before tool '{tool_name}' was last"
                " deleted or disabled; ask for a new approval"
            )
        if self._jti_used(approval.jti):
            raise Replayed(f"token of '{approval.approver}' was already used (replayed jti)")
        if fresh and approval.passkey is not None:
            with self._store.reading() as reads:
                last = reads.passkey_counter(approval.passkey.credential_id)
            if not passkeys.counter_advances(last, approval.passkey.sign_count):
                raise Denied(_counter_went_back(approval, last))
        return approval

    def _jti_used(self, jti: str) -> bool:
        with self._store.reading() as reads:
            return reads.jti_used(jti)

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
        # Raises RuleNotEvaluable: a rule whose condition errs refuses the call.
        rule = self.policy.rule_for(
            tool_name=tool.name, categories=tool.categories, level=tool.safety_level,
            facts=call.facts, refuse_on_error=True,
        )  # fmt: skip
        request: ApprovalRequestView | None = None
        offered = list(tokens)
        if request_id:
            request = self.get(request_id)
            self._check_request_matches(request, call)
            offered += self._stored_tokens(request_id)
        approvals: dict[str, VerifiedApproval] = {}
        inline_jtis: set[str] = set()
        for index, token in enumerate(offered, start=1):
            inline = index <= len(tokens)
            which = f"approval token {index}" if inline else "a stored approval"
            try:
                approval = self.check_token(
                    token, tool_name=tool.name, tool_digest=tool.digest,
                    args_digest=call.arguments_digest, caller=call.caller, rule=rule,
                    not_before=tool.tokens_not_before, fresh=inline,
                )  # fmt: skip
            except Denied as exc:
                if not inline:
                    # A stored approval that no longer holds (expired, its approver no
                    # longer eligible) simply does not count; the others still do.
                    continue
                raise type(exc)(f"{which} rejected: {exc.reason}") from None
            if inline and approval.request_id not in (None, request_id):
                raise Denied(
                    f"{which} rejected: it is bound to approval request {approval.request_id};"
                    f" call with approval_request_id={approval.request_id}"
                )
            approvals.setdefault(approval.approver, approval)  # one approver counts once
            if inline:
                inline_jtis.add(approval.jti)
        if self._missing(rule, approvals) == 0:
            fresh = tuple(
                a for a in approvals.values() if a.passkey is not None and a.jti in inline_jtis
            )
            return Approved(tuple(approvals.values()), request_id or None, rule, fresh)
        if request is None:
            self._refuse_if_rejected(call)
            request = self._open_request(call, rule)
            if request.state == APPROVED:
                return Required(
                    request,
                    f"Tool '{tool.name}' is dangerous; approval request {request.id} for this"
                    f" exact call is approved: call again with approval_request_id={request.id}",
                )
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
        used = [
            {"approver": a.approver, **a.passkey.audit()}
            for a in approved.approvals
            if a.passkey is not None
        ]
        if used:
            audit_record = {**audit_record, "passkeys": used}
        with self._store.unit_of_work() as uow:
            _consume(uow, approved, execution_id)
            seq = audit.append(uow, "execution", audit_record)
            if approved.request_id:
                events.record(uow, events.CONSUMED, approved.request_id, None, self.hooks,
                              audit_seq=seq)  # fmt: skip
        if approved.request_id:
            self.hub.poke()

    # -- requests ----------------------------------------------------------------

    def _check_request_matches(self, request: ApprovalRequestView, call: Call) -> None:
        if request.requested_by != call.caller:
            # Not named: which client asked is none of this caller's business.
            raise Denied(
                f"approval request {request.id} was made by another client;"
                " only the client whose call caused it may use it"
            )
        if request.state == REJECTED:
            raise Denied(_rejected(request))
        if request.state == VOIDED:
            raise Denied(f"approval request {request.id} was voided: {request.voided_reason}")
        if request.state in (CONSUMED, EXPIRED):
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

    def _refuse_if_rejected(self, call: Call) -> None:
        """The same call an approver rejected stays refused, with the reason,
        until the rejected request would have expired: a steered agent does
        not get to ask the approvers again and again."""
        with self._store.reading() as reads:
            rejected = reads.rejected_request_for(
                tool_name=call.tool.name, tool_digest=call.tool.digest,
                arguments_digest=call.arguments_digest, requested_by=call.caller, now=time.time(),
            )  # fmt: skip
        if rejected is not None:
            raise Denied(_rejected(self.get(rejected)))

    def _open_request(self, call: Call, rule: EffectiveRule) -> ApprovalRequestView:
        """The caller's open request for exactly this call, or a new one."""
        now = time.time()
        with self._store.reading() as reads:
            existing = reads.open_request_for(
                tool_name=call.tool.name, tool_digest=call.tool.digest,
                arguments_digest=call.arguments_digest, requested_by=call.caller, now=now,
            )  # fmt: skip
        if existing is not None:
            return self.get(existing)
        request = ApprovalRequestRecord(
            id=uuid.uuid4().hex, tool_name=call.tool.name, tool_digest=call.tool.digest,
            arguments_json=call.arguments_json, arguments_digest=call.arguments_digest,
            requested_by=call.caller, approvals_required=rule.approvals_required, state=PENDING,
            created_at=now, expires_at=now + self.policy.approval_request_ttl_s,
            tool_manifest=strict_json.dumps(call.tool.as_manifest()), tool_owner=call.tool.owner,
        )  # fmt: skip
        with self._store.unit_of_work() as uow:
            open_now = uow.open_requests_of(call.caller, now)
            limit = self.policy.quota_for(call.caller).max_pending_approvals
            limit = MAX_OPEN_REQUESTS_PER_CALLER if limit is None else limit
            if open_now >= limit:
                raise QuotaExceeded(
                    f"client '{call.caller}' already has {open_now} open approval requests"
                    f" (at most {limit}); wait until some are approved or expire",
                    subject=f"client:{call.caller}", limit="max_pending_approvals",
                )  # fmt: skip
            uow.add_request(request)
            events.record(uow, events.OPENED, request.id, {
                "event": "requested", "request_id": request.id, "tool": call.tool.name,
                "tool_digest": call.tool.digest, "args_digest": call.arguments_digest,
                "requested_by": call.caller, "approvals_required": rule.approvals_required,
                # what the policy demands, rule by rule (docs/how-to/audit.md)
                "requirements": requirements_of(rule),
            }, self.hooks)  # fmt: skip
        self.hub.poke()
        return self.get(request.id)

    def get_for(self, request_id: str, viewer: Viewer) -> ApprovalRequestView:
        """A request as ``viewer`` may see it (``Viewer``): another's request
        outside its groups is none of its business, and NOT_FOUND does not
        even confirm the id."""
        request = self.get(request_id)
        if not self.visible(request, viewer):
            raise NotFound(f"approval request '{request_id}' not found")
        return request

    def visible(self, request: ApprovalRequestView, viewer: Viewer) -> bool:
        if viewer.sees_all or request.requested_by == viewer.client_id:
            return True
        return viewer.approver is not None and self._may_approve(viewer.approver, request)

    def _may_approve(self, approver: str, request: ApprovalRequestView) -> bool:
        """Eligible by policy for the tool as registered now (as the request's
        snapshot has it, once the tool is gone), and not the requester."""
        tool = self._registry.find(request.tool_name) or request.tool
        if tool is None or self.policy.same_person(approver, request.requested_by):
            return False
        rule = self._request_rule(
            tool, request.id, request.arguments_json, request.requested_by,
            request.created_at.timestamp(),
        )  # fmt: skip
        return self.policy.eligible(approver, rule)

    def reject(self, request_id: str, reason: str, viewer: Viewer) -> ApprovalRequestView:
        """Refuse a request for good, with a reason the agent is told and the
        audit log keeps. An admin may reject any request; an approver those it
        is eligible to approve (a rejection is cheap to make, so who may make
        it is as narrow as who may approve)."""
        reason = checked_reason(reason)
        request = self.get_for(request_id, viewer)
        actor = viewer.approver or viewer.client_id
        if not viewer.admin and not (
            viewer.approver is not None and self._may_approve(viewer.approver, request)
        ):
            raise PermissionDenied(
                f"client '{viewer.client_id}' is not an approver eligible for tool"
                f" '{request.tool_name}'; it may not reject this request"
            )
        if request.state in FINAL_STATES:
            raise FailedPrecondition(f"approval request {request_id} is {request.state.lower()}")
        with self._store.unit_of_work() as uow:
            if not uow.reject_request(request_id, actor, reason, time.time()):
                raise FailedPrecondition(f"approval request {request_id} is no longer open")
            events.record(uow, events.REJECTED, request_id, {
                "event": "rejected", "request_id": request_id, "rejected_by": actor,
                "reason": reason, "submitted_by": viewer.client_id,
            }, self.hooks, actor=actor, reason=reason)  # fmt: skip
        self.hub.poke()
        return self.get(request_id)

    def get(self, request_id: str) -> ApprovalRequestView:
        if not request_id:
            raise InvalidArgument("id: must not be empty")
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument(f"id: longer than {MAX_REQUEST_ID_CHARS} characters")
        with self._store.reading() as reads:
            record = reads.request(request_id)
            approvers = reads.approvers_of(request_id)
        if record is None:
            raise NotFound(f"approval request '{request_id}' not found")
        return self._view(record, approvers)

    def list_requests(
        self, state: str = "", limit: int = 0, viewer: Viewer | None = None
    ) -> list[ApprovalRequestView]:
        """Newest first, without the arguments or the tool's parameters (an
        answer of 500 requests must not carry 500 MiB): read one with ``get``.
        Only those ``viewer`` may see (all without one)."""
        size = min(limit or DEFAULT_LISTED, MAX_LISTED)
        found, _, _ = self._scan(_checked_state(state), size, None, viewer)
        return found

    def page_requests(
        self, state: str, requested_size: int, page_token: str, viewer: Viewer,
        tokens: PageTokens, *, limit: int = 0,
    ) -> Page[ApprovalRequestView]:  # fmt: skip
        """One page of ``list_requests`` (AIP-158): newest first, the next page
        starting after this one's last (created_at, id), so a request present
        throughout is listed once. ``limit`` (deprecated) is the page size when
        ``requested_size`` is 0. Raises InvalidArgument for an unknown state,
        a negative size, or a token not issued to ``viewer`` for ``state``."""
        state = _checked_state(state)
        if requested_size:
            size = page_size(requested_size, DEFAULT_REQUESTS_PAGE, MAX_REQUESTS_PAGE)
        else:
            size = page_size(limit, DEFAULT_REQUESTS_PAGE, MAX_REQUESTS_PAGE, "limit")
        query = PageQuery.of("approvals", state=state, viewer=viewer.client_id)
        after = tokens.read(page_token, query, (float, str))
        start = None if after is None else (float(after[0]), str(after[1]))
        found, last, more = self._scan(state, size, start, viewer)
        return Page(found, tokens.issue(query, last) if more and last else "")

    def _scan(
        self, state: str, size: int, after: RequestKey | None, viewer: Viewer | None
    ) -> tuple[list[ApprovalRequestView], RequestKey | None, bool]:
        """Up to ``size`` requests ``viewer`` may see, newest first, after
        ``after``; the key to go on after; whether more may follow. The store
        filters by state, key and (for a viewer who sees only its own) the
        requester; what an approver may see is the policy's to say, so its
        rows are read in batches until the page is full, at most
        MAX_REQUESTS_SCANNED of them."""
        own_only = viewer is not None and not viewer.sees_all and viewer.approver is None
        filtered = viewer is not None and not viewer.sees_all and not own_only
        requester = viewer.client_id if viewer is not None and own_only else None
        now = time.time()
        found: list[ApprovalRequestView] = []
        last: RequestKey | None = None  # of the last request in ``found``
        cursor, scanned = after, 0
        while True:
            # One row more than fits: whether another page follows.
            batch = size + 1 - len(found)
            if filtered:
                batch = min(max(batch, SCAN_BATCH), MAX_REQUESTS_SCANNED - scanned)
            with self._store.reading() as reads:
                records = reads.requests(
                    state=state, now=now, limit=batch, before=cursor, requested_by=requester
                )
                approvers = [reads.approvers_of(r.id) for r in records]
            scanned += len(records)
            for record, held in zip(records, approvers, strict=True):
                view = self._view(record, held, listed=True)
                cursor = (record.created_at, record.id)
                if viewer is None or self.visible(view, viewer):
                    if len(found) == size:
                        return found, last, True
                    found.append(view)
                    last = cursor
            if len(records) < batch:
                return found, None, False
            if scanned >= MAX_REQUESTS_SCANNED:
                return found, cursor, True

    def listed(self, request_id: str) -> ApprovalRequestView | None:
        """One request in its listed form (what watches send), or None."""
        with self._store.reading() as reads:
            record = reads.request(request_id)
            approvers = reads.approvers_of(request_id) if record else []
        # The rules read the stored arguments (at hand here); the view leaves them out.
        return None if record is None else self._view(record, approvers, listed=True)

    def submit(self, request_id: str, token: str, submitted_by: str) -> ApprovalRequestView:
        """Attach one approver's token to a request (verified now, spent later)."""
        if not token.strip():
            raise InvalidArgument("token: must not be empty")
        if len(token) > MAX_TOKEN_CHARS:
            raise InvalidArgument(f"token: longer than {MAX_TOKEN_CHARS} characters")
        request = self.get(request_id)
        if request.state in FINAL_STATES:
            raise FailedPrecondition(f"approval request {request_id} is {request.state.lower()}")
        tool, rule = self._rule_of(request)
        try:
            approval = self.check_token(
                token, tool_name=request.tool_name, tool_digest=request.tool_digest,
                args_digest=request.arguments_digest, caller=request.requested_by, rule=rule,
                not_before=tool.tokens_not_before,
            )  # fmt: skip
        except Denied as exc:
            raise PermissionDenied(f"approval rejected: {exc.reason}") from None
        if approval.request_id not in (None, request_id):
            raise PermissionDenied(
                f"approval rejected: token is for request {approval.request_id}, not {request_id}"
            )
        passkey = approval.passkey
        with self._store.unit_of_work() as uow:
            if passkey is not None and not uow.advance_passkey_counter(
                passkey.credential_id, approval.approver, passkey.sign_count, time.time()
            ):
                last = uow.passkey_counter(passkey.credential_id)
                raise PermissionDenied(f"approval rejected: {_counter_went_back(approval, last)}")
            uow.put_approval_token(
                request_id, approval.approver, approval.jti, token, approval.expires_at
            )
            events.record(uow, events.APPROVAL_ADDED, request_id, {
                "event": "approved", "request_id": request_id, "approver": approval.approver,
                "jti": approval.jti, "submitted_by": submitted_by,
                **({"passkey": passkey.audit()} if passkey is not None else {}),
            }, self.hooks, actor=approval.approver)  # fmt: skip
            stored = uow.request(request_id)
            if (
                stored is not None and stored.state == PENDING
                and self._missing(rule, uow.approvers_of(request_id)) == 0
            ):  # fmt: skip
                uow.mark_approved(request_id)
                events.record(uow, events.APPROVED, request_id, {
                    "event": "request_approved", "request_id": request_id,
                    # the rules it met, as the policy in force states them now
                    "requirements": requirements_of(rule),
                }, self.hooks)  # fmt: skip
        self.hub.poke()
        return self.get(request_id)

    def _rule_of(self, request: ApprovalRequestView) -> tuple[ToolDefinition, EffectiveRule]:
        """The tool as registered now, and the rule as the policy states it now
        for it (a redefined tool fails later, at execution, on its digest)."""
        tool = self._registry.find(request.tool_name)
        if tool is None:
            raise FailedPrecondition(f"tool '{request.tool_name}' is no longer registered")
        return tool, self._request_rule(
            tool, request.id, request.arguments_json, request.requested_by,
            request.created_at.timestamp(),
        )  # fmt: skip

    def _request_rule(
        self, tool: ToolDefinition, request_id: str, arguments_json: str, requested_by: str,
        at: float,
    ) -> EffectiveRule:  # fmt: skip
        """The rule for a stored request's call as the policy states it now.
        Listings and watches carry no arguments (a page of them must not hold
        500 MiB): when a conditional rule matches the tool, its arguments are
        read from the store, one request at a time, so that who sees a
        request and what it shows are what its own call decides."""
        if not arguments_json and self._conditional(tool):
            with self._store.reading() as reads:
                record = reads.request(request_id)
            arguments_json = "" if record is None else record.arguments_json
        return request_rule(self.policy, tool_facts(tool), arguments_json, requested_by, at)

    def _conditional(self, tool: ToolDefinition) -> bool:
        return any(
            r.when is not None and r.match.matches(tool.name, tool.categories, tool.safety_level)
            for r in self.policy.rules
        )

    # -- deleted and disabled tools ------------------------------------------------------

    def void_requests_for_tool(
        self, uow: UnitOfWork, tool: ToolDefinition, why: str, by: str
    ) -> list[str]:
        """Inside the unit of work that deletes or disables ``tool``: every open
        request for it becomes VOIDED for ``why``, each with its audit entry
        and event (hooks included). Returns their ids."""
        now = time.time()
        voided: list[str] = []
        for request_id in uow.open_requests_for_tool(tool.name, now):
            if not uow.void_request(request_id, why, now):
                continue
            events.record(uow, events.VOIDED, request_id, {
                "event": "voided", "request_id": request_id, "tool": tool.name,
                "reason": why, "by": by,
            }, self.hooks, reason=why)  # fmt: skip
            voided.append(request_id)
        return voided

    def _tool_changed(self, old: ToolDefinition | None, new: ToolDefinition | None) -> None:
        """Registry listener: requests voided with a tool reach watches now."""
        if old is not None and (new is None or (new.disabled and not old.disabled)):
            self.hub.poke()

    def _stored_tokens(self, request_id: str) -> list[str]:
        with self._store.reading() as reads:
            return reads.tokens_of(request_id)

    def _view(
        self, record: ApprovalRequestRecord, approvers: list[str], *, listed: bool = False
    ) -> ApprovalRequestView:
        r = record
        shown = _snapshot(r.tool_manifest, r.tool_owner, listed=listed)
        current = self._registry.find(r.tool_name)
        rule = (
            self._request_rule(current, r.id, r.arguments_json, r.requested_by, r.created_at)
            if current is not None
            else None
        )
        return ApprovalRequestView(
            audience=self.policy.audience,
            max_token_ttl_s=rule.max_token_ttl_s if rule else 0,
            id=r.id, tool_name=r.tool_name, tool_digest=r.tool_digest,
            arguments_json="" if listed else r.arguments_json,
            arguments_digest=r.arguments_digest, requested_by=r.requested_by,
            # As the policy in force states it now for the request's arguments,
            # like applied_rules and approvals_missing (a reload may have changed
            # it since the request was made); the number it was made with once
            # its tool is gone.
            approvals_required=(
                rule.approvals_required if rule is not None and rule.requirements
                else r.approvals_required
            ),
            approved_by=tuple(approvers), state=r.state_at(time.time()),
            created_at=datetime.fromtimestamp(r.created_at, UTC),
            expires_at=datetime.fromtimestamp(r.expires_at, UTC),
            tool=shown,
            approvals_missing=(
                self._missing(rule, approvers) if rule is not None
                else max(0, r.approvals_required - len(approvers))
            ),
            rejected_by=r.rejected_by, rejection_reason=r.rejection_reason,
            voided_reason=r.voided_reason,
            applied_rules=() if rule is None else tuple(
                AppliedRule(q.name, q.match, q.condition, q.approvals_required, q.groups)
                for q in rule.requirements
            ),
        )  # fmt: skip


def _checked_state(state: str) -> str:
    state = state.strip().upper()
    if state and state not in REQUEST_STATES:
        raise InvalidArgument(f"state: unknown state; use {', '.join(REQUEST_STATES)}")
    return state


def _rejected(request: ApprovalRequestView) -> str:
    return (
        f"approval request {request.id} was rejected by {request.rejected_by}:"
        f" {request.rejection_reason}"
    )


def _snapshot(manifest: str, owner: str, *, listed: bool) -> ToolDefinition | None:
    """The definition the request was made for (None for requests older than
    snapshots). Listings leave its parameters schema out, as they do arguments."""
    if not manifest:
        return None
    try:
        tool = _parsed_snapshot(manifest)
    except InvalidArgument:  # InvalidDefinition included: shown as missing, never guessed
        return None
    tool = dataclasses.replace(tool, owner=owner)
    return dataclasses.replace(tool, parameters_json="") if listed else tool


@functools.lru_cache(maxsize=MAX_CACHED_SNAPSHOTS)
def _parsed_snapshot(manifest: str) -> ToolDefinition:
    """Requests of one tool share its stored text: a listing of a page of them,
    or a watch, parses it once (a definition is frozen; failures are not kept)."""
    return parse_definition(strict_json.loads(manifest, "tool_manifest"))


def _counter_went_back(approval: VerifiedApproval, last: int | None) -> str:
    count = approval.passkey.sign_count if approval.passkey else 0
    return (
        f"passkey of '{approval.approver}' signed with counter {count}, not above {last}"
        " already seen: its signature counter went back (a cloned authenticator, or an"
        " assertion older than one already used)"
    )


def _consume(uow: UnitOfWork, approved: Approved, execution_id: str) -> None:
    now = time.time()
    for approval in approved.approvals:
        if not uow.use_jti(approval.jti, approval.approver, execution_id, now):
            raise Replayed(f"token of '{approval.approver}' was already used (replayed jti)")
    for approval in approved.fresh_passkeys:
        assert approval.passkey is not None  # fresh_passkeys holds passkey approvals only
        if not uow.advance_passkey_counter(
            approval.passkey.credential_id, approval.approver, approval.passkey.sign_count, now
        ):
            raise Denied(
                _counter_went_back(approval, uow.passkey_counter(approval.passkey.credential_id))
            )
    if approved.request_id and not uow.consume_request(approved.request_id, now):
        raise Denied(f"approval request {approved.request_id} is no longer usable")


def requirements_of(rule: EffectiveRule) -> list[dict[str, object]]:
    """Each approval rule that applies, for the request's audit record: its
    name, how many approvers and from which groups (empty: any approver)."""
    return [
        {
            "rule": r.name or r.source,
            "approvals_required": r.approvals_required,
            "groups": list(r.groups),
        }
        for r in rule.requirements
    ]
