"""What the audit log says about one execution attempt, refused or run."""

from __future__ import annotations

import dataclasses

from registry_server.approvals.service import Approved
from registry_server.domain.models import ToolDefinition
from registry_server.domain.outcome import Outcome, Status
from registry_server.execution.call_request import CallRequest
from sandbox_runner import Limits


class AuditRecord:
    """What the audit log says about one execution attempt."""

    def __init__(self, execution_id: str, call: CallRequest) -> None:
        self.execution_id = execution_id
        self.call = call
        self.tool: ToolDefinition | None = None
        self.args_digest = ""
        self.approved: Approved | None = None
        self.runtime = ""
        self.limits: Limits | None = None
        self.container_id = ""
        self.warm = False

    def as_dict(
        self, *, decision: str, status: str = "", outcome: Outcome | None = None
    ) -> dict[str, object]:
        approvals = self.approved.approvals if self.approved else ()
        return {
            "execution_id": self.execution_id,
            "caller": self.call.caller,
            "tool": self.tool.name if self.tool else self.call.name,
            "tool_digest": self.tool.digest if self.tool else "",
            "level": self.tool.safety_level.value if self.tool else "",
            "args_digest": self.args_digest,
            "decision": decision,
            "approvers": [a.approver for a in approvals],
            "jtis": [a.jti for a in approvals],
            "approval_request_id": (self.approved.request_id if self.approved else None)
            or self.call.approval_request_id
            or None,
            "status": outcome.status.value if outcome else status,
            "exit_code": outcome.exit_code
            if outcome and outcome.status in (Status.OK, Status.TOOL_ERROR)
            else None,
            "duration_ms": outcome.duration_ms if outcome else 0,
            "runtime": self.runtime,
            "container_id": self.container_id,
            "warm": self.warm,
            "limits": dataclasses.asdict(self.limits) if self.limits else {},
        }


def decision_of(outcome: Outcome, record: AuditRecord) -> str:
    refused = {
        Status.TOOL_NOT_FOUND: "not_found",
        Status.INVALID_ARGUMENTS: "invalid_arguments",
        Status.APPROVAL_REQUIRED: "approval_required",
        Status.APPROVAL_DENIED: "approval_denied",
    }
    if outcome.status in refused:
        return refused[outcome.status]
    return "approved" if record.approved else "allowed"
