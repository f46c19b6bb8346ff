"""The agent-framework adapters' pure mapping: strict schemas, what the model
reads for each outcome, the approval payload, how a human's answer is read,
and the ImportError that names the extra. A fake client stands in for the
server where a path cannot be reached with the real one."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, cast

import pytest
from agents import Agent
from agents.items import ToolApprovalItem
from agents.testing import function_call
from openai.types.responses import ResponseFunctionToolCall

from registry_server.client.adapters._common import (
    MAX_ERROR_CHARS,
    BoundedMap,
    Decision,
    approval_payload,
    model_text,
    parse_resume,
)
from registry_server.client.adapters.openai_agents import ToolregApprovals, strict_compatible
from registry_server.client.registry_client import CallResult, RegistryClient, Status
from registry_server.domain.outcome import ApprovalRequestView

CLOSED = {
    "type": "object",
    "properties": {"text": {"type": "string", "description": "The text."}},
    "required": ["text"],
    "additionalProperties": False,
}


def request(**overrides: Any) -> ApprovalRequestView:
    base = ApprovalRequestView(
        id="r1",
        tool_name="write_file",
        tool_digest="t" * 64,
        arguments_json='{"content":"hi","path":"a.txt"}',
        arguments_digest="a" * 64,
        requested_by="agent",
        approvals_required=2,
        approved_by=("alice",),
        state="PENDING",
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        expires_at=datetime(2026, 1, 1, 1, tzinfo=UTC),
    )
    return replace(base, **overrides)


def result(status: Status, **overrides: Any) -> CallResult:
    base = CallResult(
        success=status is Status.OK, status=status, content="", data=None, error="",
        exit_code=0, stderr="", duration_ms=1, output_truncated=False, execution_id="e1",
        approval_request=None,
    )  # fmt: skip
    return replace(base, **overrides)


@pytest.mark.parametrize(
    ("schema", "strict"),
    [
        (CLOSED, True),
        ({**CLOSED, "required": []}, False),  # optional: strict would make it required
        ({**CLOSED, "additionalProperties": True}, False),  # open object
        ({**CLOSED, "additionalProperties": {}}, False),
        ({k: v for k, v in CLOSED.items() if k != "additionalProperties"}, False),
        (
            {**CLOSED, "properties": {"text": {"type": "string", "minLength": 1}}},
            False,  # a keyword not every strict mode accepts
        ),
        ({**CLOSED, "$schema": "https://json-schema.org/draft/2020-12/schema"}, False),
        (
            {
                "type": "object",
                "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
                "required": ["a", "b"],  # another order than the properties': same meaning
                "additionalProperties": False,
            },
            True,
        ),
        (
            {
                "type": "object",
                "properties": {
                    "item": {
                        "type": "object",
                        "properties": {"x": {"type": "number"}},
                        "required": ["x"],
                        "additionalProperties": False,
                    },
                    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
                },
                "required": ["item", "tags"],
                "additionalProperties": False,
            },
            True,
        ),
        (
            {
                "type": "object",
                "properties": {"item": {"type": "object", "properties": {"x": {"type": "number"}}}},
                "required": ["item"],
                "additionalProperties": False,
            },
            False,  # the nested object is open
        ),
    ],
)
def test_strict_only_where_strict_mode_changes_nothing(
    schema: dict[str, Any], strict: bool
) -> None:
    original = json.dumps(schema)
    assert strict_compatible(schema) is strict
    assert json.dumps(schema) == original  # the check never edits the schema


def test_the_model_reads_output_or_a_readable_reason() -> None:
    assert model_text(result(Status.OK, content="45\n")) == "45\n"
    truncated = model_text(result(Status.OK, content="aaa", output_truncated=True))
    assert truncated == "aaa\n[output truncated by toolreg]"
    error = model_text(result(Status.INVALID_ARGUMENTS, error="$.text: 42 is not of type 'string'"))
    assert error == "Error (INVALID_ARGUMENTS): $.text: 42 is not of type 'string'"
    flood = model_text(result(Status.TOOL_ERROR, error="x" * 10_000))
    assert len(flood) == MAX_ERROR_CHARS and flood.startswith("Error (TOOL_ERROR): xxx")
    needs = model_text(result(Status.APPROVAL_REQUIRED, approval_request=request()))
    assert needs == (
        "Not run: tool 'write_file' needs approval from toolreg approvers"
        " (approval request r1: 1 of 2 approvals, pending). It runs only once they have"
        " approved it."
    )


def test_the_approval_payload_is_json_and_cuts_long_arguments() -> None:
    payload = approval_payload(request(), tool_call_id="call_1")
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
    long = approval_payload(request(arguments_json=json.dumps({"content": "y" * 5000})))
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


@pytest.mark.parametrize(
    ("module", "framework", "extra"),
    [
        ("registry_server.client.adapters.openai_agents", "agents", "toolreg[openai-agents]"),
        ("registry_server.client.adapters.langchain", "langchain_core.tools", "toolreg[langchain]"),
        ("registry_server.client.adapters.langchain", "langgraph.types", "toolreg[langchain]"),
    ],
)
def test_a_missing_framework_names_the_extra_to_install(
    monkeypatch: pytest.MonkeyPatch, module: str, framework: str, extra: str
) -> None:
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setitem(sys.modules, framework, None)  # what an absent package looks like
    with pytest.raises(ImportError, match=rf"pip install '{extra}'".replace("[", r"\[")):
        importlib.import_module(module)


@dataclass
class FakeClient:
    """ExecuteTool answers from a script; records what was asked."""

    answers: list[CallResult]
    executed: list[tuple[str, str, str]] = field(default_factory=list)

    def execute_tool(
        self, name: str, arguments: str, *, approval_request_id: str = "", timeout: Any = None
    ) -> CallResult:
        self.executed.append((name, arguments, approval_request_id))
        return self.answers.pop(0)


def approval_item(call_id: str, arguments: str) -> ToolApprovalItem:
    raw = cast(ResponseFunctionToolCall, function_call("write_file", arguments, call_id=call_id))
    return ToolApprovalItem(agent=Agent(name="a"), raw_item=raw, tool_name="write_file")


def test_an_answer_toolreg_gave_while_opening_is_handed_over_without_a_second_call() -> None:
    # The tool was listed dangerous, but toolreg no longer asks for approval
    # (redefined meanwhile): its one answer reaches the model, nothing runs twice.
    fake = FakeClient([result(Status.OK, content='{"bytes": 2}')])
    approvals = ToolregApprovals(client=fake)  # type: ignore[arg-type]
    approvals._tools.add("write_file")
    opened = asyncio.run(approvals.open([approval_item("c1", '{"path":"a","content":"hi"}')]))
    assert opened == {} and approvals.request_ids == {}
    said = approvals._run_call("write_file", "c1", '{"path":"a","content":"hi"}', None)
    assert said == '{"bytes": 2}'
    assert fake.executed == [("write_file", '{"path":"a","content":"hi"}', "")]


def test_an_approval_request_is_remembered_by_call_id_and_used_by_the_run() -> None:
    fake = FakeClient(
        [
            result(Status.APPROVAL_REQUIRED, approval_request=request(id="r7")),
            result(Status.OK, content="done"),
        ]
    )
    approvals = ToolregApprovals(client=fake)  # type: ignore[arg-type]
    approvals._tools.add("write_file")
    opened = asyncio.run(approvals.open([approval_item("c2", "{}")]))
    assert list(opened) == ["c2"] and approvals.request_ids == {"c2": "r7"}
    assert approvals._run_call("write_file", "c2", "{}", None) == "done"
    assert fake.executed[-1] == ("write_file", "{}", "r7")
    assert approvals.request_ids == {}  # spent


def test_approvals_made_for_another_client_are_refused() -> None:
    from registry_server.client.adapters.openai_agents import toolreg_function_tools

    one, other = RegistryClient("127.0.0.1:1"), RegistryClient("127.0.0.1:2")
    try:
        with pytest.raises(ValueError, match="another RegistryClient"):
            toolreg_function_tools(one, approvals=ToolregApprovals(other))
    finally:
        one.close()
        other.close()
