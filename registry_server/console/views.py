"""The JSON the console's page receives: every client-supplied string in it is
already escaped (``terminal.escape``), and the page inserts it as text only.

Two shapes: a request's *summary* (from the watch's listed form, for the
live list) and its *detail* (from GetApprovalRequest, what `toolreg approvals
show` shows, checked, with the approval rules that apply and why). The
detail carries the claims to sign only when signing makes sense; the page
mints exactly those, so what it can sign is what this module checked.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.client import approval_view
from registry_server.client.terminal import escape
from registry_server.domain.outcome import ApprovalEventView, ApprovalRequestView
from registry_server.signing.tokens import DEFAULT_TTL_S

# Open requests the list keeps; the rest are shown once, as they end.
OPEN_STATES = frozenset({"PENDING", "APPROVED"})


def _when(moment: datetime | None) -> str:
    return moment.isoformat(timespec="seconds") if moment is not None else ""


def summary(req: ApprovalRequestView) -> dict[str, Any]:
    """A request as the live list shows it (no arguments: the detail has them)."""
    return {
        "id": escape(req.id),
        "state": escape(req.state),
        "tool_name": escape(req.tool_name),
        "requested_by": escape(req.requested_by),
        "approvals_required": req.approvals_required,
        "approved_by": [escape(a) for a in req.approved_by],
        "approvals_missing": req.approvals_missing,
        "created_at": _when(req.created_at),
        "expires_at": _when(req.expires_at),
        "rejected_by": escape(req.rejected_by),
        "rejection_reason": escape(req.rejection_reason),
    }


def event(item: ApprovalEventView) -> dict[str, Any] | None:
    """One change of the watch for the page; None for SYNCED (sent as its own kind)."""
    if item.request is None:
        return None
    return {
        "kind": "request",
        "event": escape(item.type),
        "actor": escape(item.actor),
        "reason": escape(item.reason),
        "at": _when(item.at),
        "request": summary(item.request),
    }


def detail(req: pb.ApprovalRequest, approver: str) -> dict[str, Any]:
    """Everything `toolreg approvals show` shows, both digest checks, and the
    claims the page signs (None, with the reason, when it must not sign)."""
    checks = checks_of(req)
    refusal = why_not_signable(req, approver, checks)
    return {
        "id": escape(req.id),
        "state": escape(req.state),
        "tool_name": escape(req.tool_name),
        "fields": [list(pair) for pair in approval_view.request_fields(req)],
        "applied_rules": [applied_rule(rule) for rule in req.applied_rules],
        "arguments_heading": escape(f"arguments (digest {req.arguments_digest})"),
        "arguments": approval_view.shown_arguments(req),
        "checks": checks,
        "signable": refusal is None,
        "not_signable": refusal or "",
        "claims": None if refusal is not None else claims(req, approver),
        "server_time": int(time.time()),  # the page mints iat/exp by this clock, not its own
    }


def applied_rule(rule: pb.AppliedRule) -> dict[str, Any]:
    """One approval rule that applies to the request's call, and why (policy
    text, escaped all the same: the page shows it as text only). ``default``:
    no rule of the policy matched, the server's own applies."""
    return {
        "name": escape(rule.name),
        "match": escape(rule.match),
        "condition": escape(rule.condition),
        "approvals_required": rule.approvals_required,
        "groups": [escape(g) for g in rule.groups],
        "default": approval_view.is_default_rule(rule),
    }


def checks_of(req: pb.ApprovalRequest) -> dict[str, bool]:
    """Whether the definition and the arguments shown hash to the digests signed."""
    return {
        "definition": req.HasField("tool") and approval_view.definition_matches(req),
        "arguments": approval_view.arguments_match(req),
    }


def why_not_signable(req: pb.ApprovalRequest, approver: str, checks: dict[str, bool]) -> str | None:
    """Why this approver must not sign this request now; None when it may."""
    if req.state != "PENDING":
        return f"the request is {req.state.lower()}; there is nothing to sign"
    if not req.HasField("tool"):
        return "the request carries no definition to check; sign it with the CLI if you must"
    if not checks["definition"]:
        return "the definition shown does not match tool_digest: signing is disabled"
    if not checks["arguments"]:
        return "the arguments shown do not match arguments_digest: signing is disabled"
    if approver in req.approved_by:
        return "you have approved this request already"
    return None


def claims(req: pb.ApprovalRequest, approver: str) -> dict[str, Any]:
    """The claims `tokens.mint_for` puts in a token bound to this request, less
    iat/exp/jti (the page sets those when it signs). Raw, not escaped: they
    are signed, never shown."""
    return {
        "iss": approver,
        "aud": req.audience,
        "sub": req.tool_name,
        "tool_digest": req.tool_digest,
        "args_digest": req.arguments_digest,
        "requester": req.requested_by,
        "req": req.id,
        "ttl_s": req.max_token_ttl_s or DEFAULT_TTL_S,
    }
