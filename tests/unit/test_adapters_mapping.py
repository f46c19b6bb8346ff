"""The agent-framework adapters' pure mapping, shared by both adapters
(adapters/_common.py): what the model reads for each outcome, the approval
payload, how a human's answer is read. The mapping onto the frameworks' own
objects (strict schemas, approval items, the ImportError that names the
extra) needs the frameworks installed: tests/adapters/."""

from __future__ import annotations

import json
from typing import Any

import pytest

from registry_server.client.adapters._common import (
    MAX_ERROR_CHARS,
    BoundedMap,
    Decision,
    approval_payload,
    model_text,
    parse_resume,
)
from registry_server.client.registry_client import Status
from tests.factories import approval_request, call_result


def test_the_model_reads_output_or_a_readable_reason() -> None:
    assert model_text(call_result(Status.OK, content="45\n")) == "45\n"
    truncated = model_text(call_result(Status.OK, content="aaa", output_truncated=True))
    assert truncated == "aaa\n[output truncated by toolreg]"
    error = model_text(
        call_result(Status.INVALID_ARGUMENTS, error="$.text: 42 is not of type 'string'")
    )
    assert error == "Error (INVALID_ARGUMENTS): $.text: 42 is not of type 'string'"
    flood = model_text(call_result(Status.TOOL_ERROR, error="x" * 10_000))
    assert len(flood) == MAX_ERROR_CHARS and flood.startswith("Error (TOOL_ERROR): xxx")
    needs = model_text(call_result(Status.APPROVAL_REQUIRED, approval_request=approval_request()))
    assert needs == (
        "Not run: tool 'write_file' needs approval from toolreg approvers"
        " (approval request r1: 1 of 2 approvals, pending). It runs only once they have"
        " approved it."
    )


def test_the_approval_payload_is_json_and_cuts_long_arguments() -> None:
    payload = approval_payload(approval_request(), tool_call_id="call_1")
    assert json.loads(json.dumps(payload)) == payload
    assert payload == {
        "kind": "toolreg_approval",
        "request_id": "r1",
        "tool": "write_file",
        "tool_call_id": "call_1",
        "arguments_digest": "a" * 64,
        "arguments_preview": '{"content":"hi","path":"a.txt"}',
        "approvals_required": 2,
        "approved_by": ["alice"],
        "state": "PENDING",
        "expires_at": "2026-01-01T01:00:00+00:00",
        "approve_with": "toolreg approvals approve r1 --key KEY",
    }
    long = approval_payload(approval_request(arguments_json=json.dumps({"content": "y" * 5000})))
    assert len(long["arguments_preview"]) == 503 and long["arguments_preview"].endswith("...")


@pytest.mark.parametrize(
    ("value", "decision"),
    [
        (True, Decision(approved=True)),
        (False, Decision(approved=False)),
        ({"approved": True}, Decision(approved=True)),
        ({"approved": True, "request_id": "r9"}, Decision(approved=True, request_id="r9")),
        (
            {"approved": False, "message": "not today"},
            Decision(approved=False, message="not today"),
        ),
        ({"approved": True, "request_id": "", "message": 3}, Decision(approved=True)),
    ],
)
def test_resume_values_that_are_understood(value: Any, decision: Decision) -> None:
    assert parse_resume(value) == decision


@pytest.mark.parametrize("value", ["yes", 1, None, {"approved": "true"}, {"ok": True}, [True]])
def test_any_other_resume_value_is_a_rejection(value: Any) -> None:
    decision = parse_resume(value)
    assert decision.approved is False and decision.message and "not understood" in decision.message


def test_bounded_map_forgets_the_oldest() -> None:
    seen: BoundedMap[str, int] = BoundedMap(2)
    seen.put("a", 1)
    seen.put("b", 2)
    seen.put("a", 3)  # refreshed: now the newest
    seen.put("c", 4)
    assert seen.snapshot() == {"a": 3, "c": 4}
    assert seen.pop("a") == 3 and seen.pop("a") is None and len(seen) == 1
