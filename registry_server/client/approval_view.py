"""What an approver reads before signing one approval request, for every place
that shows it (`toolreg approvals show`, the approval console's page).

One definition, so the terminal and the page can never disagree about what a
signature covers: the request's id, state, tool and digest, who asked and
when, the approvals so far and missing, the tool's level, owner, image,
command, env, limits, egress hosts, secrets and guards, the approval rules
that apply and why, and the arguments in full.
Every value is client-supplied text and comes back escaped (control
characters and bidi marks as ``\\uXXXX``), never to be obeyed by whatever
shows it. Two checks decide whether signing makes sense: the definition shown
hashes to the ``tool_digest`` a token signs, and the arguments shown hash to
the ``arguments_digest``.
"""

from __future__ import annotations

import json

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.client.terminal import escape
from registry_server.domain import strict_json
from registry_server.domain.arguments import arguments_digest
from registry_server.domain.egress import describe_reach
from registry_server.domain.errors import ToolregError
from registry_server.domain.models import LIMIT_FIELDS
from registry_server.wire import convert

TIME_FORMAT = "%Y-%m-%d %H:%M:%S"  # UTC, as `approvals show` has always printed it
DEFINITION_MATCHES = "matches the digest signed"
DEFINITION_DIFFERS = "DOES NOT match tool_digest"
NO_DEFINITION = "not recorded with this request (made by an older server)"
# The server's own rule when no rule of the policy matches a dangerous tool
# (policy/model.py rule_for): its `match` is this text, which no rule's is.
DEFAULT_RULE = "default for dangerous tools"


def is_default_rule(rule: pb.AppliedRule) -> bool:
    return rule.match == DEFAULT_RULE and not rule.condition


def rule_line(rule: pb.AppliedRule) -> str:
    """One approval rule that applies to the request's call, and why (escaped):
    '2 approval(s) from sre — rule sre-prod (when args.env == "prod")',
    '1 approval(s) from any approver — default for dangerous tools'."""
    who = ", ".join(rule.groups) or "any approver"
    needs = f"{rule.approvals_required} approval(s) from {who}"
    if is_default_rule(rule):
        return escape(f"{needs} — {DEFAULT_RULE}")
    # The policy's name for it, or "rule N" (its place in the file) when it gives none.
    name = rule.name if rule.name.startswith("rule ") else f"rule {rule.name or '(unnamed)'}"
    why = f"when {rule.condition}" if rule.condition else rule.match
    return escape(f"{needs} — {name} ({why})")


def request_fields(req: pb.ApprovalRequest) -> list[tuple[str, str]]:
    """(label, escaped value) pairs, in the order `approvals show` prints them."""
    created = req.created_at.ToDatetime().strftime(TIME_FORMAT)
    expires = req.expires_at.ToDatetime().strftime(TIME_FORMAT)
    approved = ", ".join(req.approved_by) or "nobody yet"
    rejected = [("rejected", f"by {req.rejected_by}: {req.rejection_reason}")]
    voided = [("voided", req.voided_reason)]  # its tool was deleted or disabled
    fields = [
        ("request", req.id),
        ("state", req.state),
        ("tool", f"{req.tool_name} (digest {req.tool_digest})"),
        ("asked by", f"{req.requested_by} at {created} UTC; expires {expires} UTC"),
        (
            "approvals",
            f"{len(req.approved_by)} of {req.approvals_required} ({approved});"
            f" {req.approvals_missing} more needed",
        ),
        *(rejected if req.rejected_by else []),
        *(voided if req.voided_reason else []),
        *_tool_fields(req),
    ]
    return [(label, escape(value)) for label, value in fields]


def shown_arguments(req: pb.ApprovalRequest) -> str:
    """The arguments in full, indented, escaped (newlines kept for the layout)."""
    try:
        shown = json.dumps(json.loads(req.arguments_json), indent=2, ensure_ascii=False)
    except ValueError:
        shown = req.arguments_json  # shown as sent; arguments_match says it cannot be signed
    return escape(shown, keep_newlines=True)


def definition_matches(req: pb.ApprovalRequest) -> bool:
    """Whether the definition shown hashes to the digest a token would sign."""
    try:
        return bool(convert.stored_tool_from_pb(req.tool).digest == req.tool_digest)
    except ToolregError:
        return False


def arguments_match(req: pb.ApprovalRequest) -> bool:
    """Whether the arguments shown hash to the digest a token would sign
    (sha256 of their RFC 8785 canonical JSON, as the server computes it)."""
    try:
        parsed = strict_json.loads_object(req.arguments_json, "arguments_json", empty_is={})
        return arguments_digest(parsed) == req.arguments_digest
    except (ToolregError, ValueError, TypeError):
        return False


def _tool_fields(req: pb.ApprovalRequest) -> list[tuple[str, str]]:
    """The definition the request is for, checked against the digest signed."""
    if not req.HasField("tool"):
        return [("definition", NO_DEFINITION)]
    tool = req.tool
    limits = tool.sandbox.limits
    asked = ", ".join(f"{name} {getattr(limits, name) or 'level default'}" for name in LIMIT_FIELDS)
    env = ", ".join(f"{k}={v!r}" for k, v in sorted(tool.sandbox.env.items())) or "none"
    try:
        shown = convert.stored_tool_from_pb(tool)
        reach, secrets = describe_reach(shown.egress, shown.secrets)
    except ToolregError:
        reach, secrets = ", ".join(tool.network.egress) or "none", "(unreadable)"
    return [
        ("level", convert.level_name(tool.safety_level)),
        ("owner", tool.owner),
        ("image", tool.sandbox.image),
        ("command", json.dumps(list(tool.sandbox.command), ensure_ascii=False)),
        ("env", env),
        ("limits", asked),
        ("egress", reach),
        ("secrets", secrets),
        # The registrant's preconditions on the arguments: part of the digest signed.
        ("guards", "; ".join(f"{g.condition} ({g.message})" for g in tool.guards) or "none"),
        ("definition", DEFINITION_MATCHES if definition_matches(req) else DEFINITION_DIFFERS),
    ]
