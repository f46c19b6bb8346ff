"""The outcome of one tool call, in domain terms (converted to ToolResult)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime

from registry_server.domain.models import ToolDefinition


class Status(enum.Enum):
    OK = "OK"
    TOOL_NOT_FOUND = "TOOL_NOT_FOUND"
    INVALID_ARGUMENTS = "INVALID_ARGUMENTS"
    APPROVAL_REQUIRED = "APPROVAL_REQUIRED"
    APPROVAL_DENIED = "APPROVAL_DENIED"
    TOOL_ERROR = "TOOL_ERROR"
    TIMEOUT = "TIMEOUT"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    SANDBOX_ERROR = "SANDBOX_ERROR"
    TOOL_DISABLED = "TOOL_DISABLED"  # an admin disabled the tool; error gives the reason
    POLICY_DENIED = "POLICY_DENIED"  # a deny rule refused the call; error names the rule
    CANCELLED = "CANCELLED"  # CancelExecution stopped it; error says who and why


@dataclass(frozen=True)
class ApprovalRequestView:
    id: str
    tool_name: str
    tool_digest: str
    arguments_json: str
    arguments_digest: str
    requested_by: str
    approvals_required: int
    approved_by: tuple[str, ...]
    state: str
    created_at: datetime
    expires_at: datetime
    audience: str = ""
    max_token_ttl_s: int = 0
    # The definition the request is for, with its owner (what an approver signs);
    # None for requests made before definitions were kept with them.
    tool: ToolDefinition | None = None
    approvals_missing: int = 0  # distinct approvers still needed, at least
    rejected_by: str = ""  # REJECTED: who refused it
    rejection_reason: str = ""  # REJECTED: why
    voided_reason: str = ""  # VOIDED: why (its tool was deleted or disabled)
    # The approval rules that apply to the call, as the policy states them now.
    applied_rules: tuple[AppliedRule, ...] = ()


@dataclass(frozen=True)
class AppliedRule:
    """One approval rule that applies to a request's call, and why."""

    name: str  # the rule's name, "rule N", or "default"
    match: str  # "tool deploy", "category prod", ...
    condition: str  # its `when` (CEL), "" when it has none
    approvals_required: int
    groups: tuple[str, ...]  # empty: any approver

    def describe(self) -> str:
        """'2 approval(s) from sre: rule sre-prod (args.env == "prod")'."""
        who = ", ".join(self.groups) or "any approver"
        why = f" ({self.condition})" if self.condition else f" ({self.match})"
        return f"{self.approvals_required} approval(s) from {who}: {self.name}{why}"


@dataclass(frozen=True)
class ApprovalEventView:
    """One item of a watch on approval requests (WatchApprovalRequests)."""

    type: str  # CURRENT, SYNCED, OPENED, APPROVAL_ADDED, APPROVED, REJECTED, CONSUMED,
    # EXPIRED, VOIDED
    request: ApprovalRequestView | None  # listed form; None for SYNCED
    actor: str = ""  # the approver who added an approval or rejected
    reason: str = ""  # REJECTED: why; VOIDED: why
    at: datetime | None = None
    seq: int = 0  # the event's place in the store's order (0 for CURRENT, SYNCED)


@dataclass(frozen=True)
class Outcome:
    status: Status
    content: str = ""
    data_json: str = ""
    error: str = ""
    exit_code: int = 0
    stderr: str = ""
    duration_ms: int = 0
    output_truncated: bool = False
    execution_id: str = ""
    approval_request: ApprovalRequestView | None = field(default=None)

    @property
    def success(self) -> bool:
        return self.status is Status.OK
