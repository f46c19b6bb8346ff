"""What the audit log says about one execution attempt, refused or run."""

from __future__ import annotations

import dataclasses

from registry_server.approvals.service import Approved
from registry_server.domain.models import ToolDefinition
from registry_server.domain.outcome import Outcome, Status
from registry_server.execution.call_request import CallRequest
from registry_server.execution.redaction import Redactor
from sandbox_runner import EgressConnection, Limits
from sandbox_runner.egress import rules


class AuditRecord:
    """What the audit log says about one execution attempt."""

    def __init__(self, execution_id: str, call: CallRequest) -> None:
        self.execution_id = execution_id
        self.call = call
        self.tool: ToolDefinition | None = None
        self.args_digest = ""
        self.approved: Approved | None = None
        # Whether the call got past every check up to its level's approval gate
        # (included): a call refused earlier is never "allowed" or "approved".
        # What fails after it (its secrets, the engine, the tool) keeps that decision.
        self.passed_gate = False
        self.runtime = ""
        self.gvisor_network = ""  # runsc-net only: netstack or hostinet (sandbox_plan.Runtime)
        self.limits: Limits | None = None
        self.container_id = ""
        self.warm = False
        self.redactor = Redactor({})  # the call's secret values, kept out of what it returns
        self.egress: tuple[EgressConnection, ...] = ()
        self.egress_unrecorded = 0
        self.cancelled_by = ""  # CancelExecution: the client (or admin) who stopped the call
        self.cancel_reason = ""
        # A refusal by a policy rule (a deny rule; an approval rule whose condition
        # could not be evaluated) names the rule and its reason; the kill switch
        # gives the admin's reason (rule ""). Never the call's argument values.
        self.rule = ""
        self.reason = ""

    def as_dict(
        self, *, decision: str, status: str = "", outcome: Outcome | None = None
    ) -> dict[str, object]:
        approvals = self.approved.approvals if self.approved else ()
        return {
            "execution_id": self.execution_id,
            "caller": self.call.caller,
            **({"actor": self.call.actor} if self.call.actor else {}),
            "tool": self.tool.name if self.tool else self.call.name,
            "tool_digest": self.tool.digest if self.tool else "",
            "level": self.tool.safety_level.value if self.tool else "",
            "args_digest": self.args_digest,
            "decision": decision,
            "approvers": [a.approver for a in approvals],
            "jtis": [a.jti for a in approvals],
            # the request the call used, or the one its refusal opened (an auditor
            # follows an approval_required record to the request and its approvals)
            "approval_request_id": (self.approved.request_id if self.approved else None)
            or self.call.approval_request_id
            or (outcome.approval_request.id if outcome and outcome.approval_request else None),
            "status": outcome.status.value if outcome else status,
            "exit_code": outcome.exit_code
            if outcome and outcome.status in (Status.OK, Status.TOOL_ERROR)
            else None,
            "duration_ms": outcome.duration_ms if outcome else 0,
            "runtime": self.runtime,
            **({"gvisor_network": self.gvisor_network} if self.gvisor_network else {}),
            "container_id": self.container_id,
            "warm": self.warm,
            "limits": dataclasses.asdict(self.limits) if self.limits else {},
            **(self._egress_fields() if self.tool is not None and self.tool.egress else {}),
            **(
                {"cancelled_by": self.cancelled_by, "cancel_reason": self.cancel_reason}
                if self.cancelled_by
                else {}
            ),
            **({"rule": self.rule} if self.rule else {}),
            **({"reason": self.reason} if self.reason else {}),
        }

    def _egress_fields(self) -> dict[str, object]:
        """Every connection the call asked the proxy for, with the allow-list
        entry it fell under ("" when none): what metrics label by, since the
        host a tool asks for is the tool's to choose."""
        assert self.tool is not None
        entries = rules.parse_entries(self.tool.egress)
        connections = []
        for c in self.egress:
            matched = rules.first_match(entries, c.host, c.port)
            connections.append(
                {
                    "host": c.host, "port": c.port, "entry": str(matched) if matched else "",
                    "address": c.address, "allowed": c.allowed, "reason": c.reason,
                    "bytes_up": c.bytes_up, "bytes_down": c.bytes_down,
                    "duration_ms": c.duration_ms, "injected": c.injected,
                }
            )  # fmt: skip
        return {"egress": connections, "egress_unrecorded": self.egress_unrecorded}


def decision_of(outcome: Outcome, record: AuditRecord) -> str:
    """The record's ``decision``; tests/unit/test_audit_decisions.py makes each
    value happen, and fails when a value is added here without a test."""
    refused = {
        Status.TOOL_NOT_FOUND: "not_found",
        Status.INVALID_ARGUMENTS: "invalid_arguments",
        Status.APPROVAL_REQUIRED: "approval_required",
        Status.APPROVAL_DENIED: "approval_denied",
        Status.TOOL_DISABLED: "disabled",  # before or after the gate: it never ran
        # A deny rule, or an approval rule whose condition errs: before any request or sandbox.
        Status.POLICY_DENIED: "policy_denied",
    }
    if outcome.status in refused:
        return refused[outcome.status]
    if not record.passed_gate:
        return "refused"  # SANDBOX_ERROR before the gate: no runtime for it, its owner's grant gone
    return "approved" if record.approved else "allowed"
