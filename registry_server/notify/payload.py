"""What a webhook delivery says: the approval event and the request as it was
right after it, as JSON (``standard``) or as a Slack message (``slack``).

A payload goes to a chat or a ticket system that people read, outside the
server's trust boundary, so it carries only what an approver needs to go
and look: ids, the tool, its level, who asked, how many approvals are
missing, the state, the rejecting approver's reason, and a link to the
approval console. Never a token, a secret, the tool's env or its arguments
in full; at most a short preview of the arguments when the endpoint asks.
Everything a client chose is shown with invisible and control characters
escaped (domain/text.py), and, for Slack, with mrkdwn's &, < and > escaped
so that a reason cannot become a link or an @channel.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from registry_server.domain.text import escape

PREVIEW_CHARS = 200  # characters of the arguments' JSON in a preview
EVENT_PREFIX = "approval."  # payload type: approval.opened, approval.rejected, ...
TITLES = {
    "OPENED": "Approval requested",
    "APPROVAL_ADDED": "Approval added",
    "APPROVED": "Approved",
    "REJECTED": "Rejected",
    "CONSUMED": "Approved call run",
    "EXPIRED": "Expired unused",
    "VOIDED": "Voided (its tool was deleted or disabled)",
}


@dataclass(frozen=True)
class Facts:
    """One event and its request, as the outbox read them in the event's transaction."""

    event_type: str  # OPENED, APPROVAL_ADDED, ... (approvals/events.py)
    event_seq: int
    at: float  # the event's time.time()
    request_id: str
    tool: str
    level: str
    requested_by: str
    approvals_required: int
    approvals_missing: int
    approved_by: Sequence[str]
    state: str
    actor: str  # the approver who added an approval or rejected
    reason: str  # REJECTED: the approver's words; VOIDED: why
    created_at: float
    expires_at: float
    arguments_json: str  # compact JSON; only ever shown as a capped preview
    console_url: str = ""  # the console's base URL, "" when the policy names none


def webhook_type(event_type: str) -> str:
    return EVENT_PREFIX + event_type.lower()


def link(facts: Facts) -> str:
    """The request's page in the approval console ("" without a console)."""
    return f"{facts.console_url}/#/requests/{facts.request_id}" if facts.console_url else ""


def preview(arguments_json: str) -> str:
    """The first PREVIEW_CHARS characters of the arguments, escaped, with an
    ellipsis when cut (the escapes may lengthen it: at most 10 characters
    each, so the preview stays bounded)."""
    cut = arguments_json[:PREVIEW_CHARS]
    return escape(cut) + ("…" if len(arguments_json) > PREVIEW_CHARS else "")


def render(facts: Facts, fmt: str, *, include_arguments: bool = False) -> str:
    """The body to send, as compact JSON text (the bytes signed and posted)."""
    if fmt == "slack":
        body = slack(facts, include_arguments=include_arguments)
    else:
        body = standard(facts, include_arguments=include_arguments)
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def standard(facts: Facts, *, include_arguments: bool = False) -> dict[str, Any]:
    """Standard Webhooks' recommended shape: type, timestamp, data."""
    f = facts
    data: dict[str, Any] = {
        "request_id": f.request_id,
        "event_seq": f.event_seq,
        "tool": escape(f.tool),
        "level": escape(f.level),
        "requested_by": escape(f.requested_by),
        "approvals_required": f.approvals_required,
        "approvals_missing": f.approvals_missing,
        "approved_by": [escape(a) for a in f.approved_by],
        "state": f.state,
        "actor": escape(f.actor),
        "reason": escape(f.reason),
        "created_at": _iso(f.created_at),
        "expires_at": _iso(f.expires_at),
    }
    if f.console_url:
        data["console_url"] = link(f)
    if include_arguments:
        data["arguments_preview"] = preview(f.arguments_json)
    return {"type": webhook_type(f.event_type), "timestamp": _iso(f.at), "data": data}


def slack(facts: Facts, *, include_arguments: bool = False) -> dict[str, Any]:
    """A Slack incoming-webhook message: ``text`` for notifications, ``blocks`` to show."""
    f = facts
    title = TITLES.get(f.event_type, f.event_type.title())
    headline = f"{title}: `{_mrkdwn(f.tool)}` ({_mrkdwn(f.level)}) for {_mrkdwn(f.requested_by)}"
    lines = [f"*{headline}*"]
    if f.actor:
        lines.append(f"by {_mrkdwn(f.actor)}")
    if f.reason:
        lines.append(f"> {_mrkdwn(f.reason)}")
    approvals = f.approvals_required - f.approvals_missing
    lines.append(
        f"State {f.state}: {approvals} of {f.approvals_required} approvals"
        + (f" (signed: {', '.join(_mrkdwn(a) for a in f.approved_by)})" if f.approved_by else "")
        + f"; expires {_iso(f.expires_at)}"
    )
    if include_arguments:
        shown = _mrkdwn(preview(f.arguments_json)).replace("`", "'")  # stays one code span
        lines.append(f"Arguments: `{shown}`")
    blocks: list[dict[str, Any]] = [
        {"type": "section", "text": {"type": "mrkdwn", "text": "\n".join(lines)}}
    ]
    context = f"Request {f.request_id}"
    if f.console_url:
        # Our own URL (validated in the policy) and a hex id: nothing a client chose.
        context += f" · <{_mrkdwn(link(f))}|Open in the approval console>"
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": context}]})
    return {"text": f"{headline} (request {f.request_id})", "blocks": blocks}


def _mrkdwn(text: str) -> str:
    """Slack's three control characters escaped, after the invisible ones."""
    return escape(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
