"""The agent-framework adapters mapped onto the frameworks' own objects
(the OpenAI Agents SDK's, LangChain's and LangGraph's, imported here): strict
schemas, approval items opened and run, and the ImportError that names the
extra. A fake client stands in for the server where a path cannot be reached
with the real one; no server, no engine. The pure mapping both adapters
share: tests/unit/test_adapters_mapping.py."""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from agents import Agent
from agents.items import ToolApprovalItem
from agents.testing import function_call
from openai.types.responses import ResponseFunctionToolCall

from registry_server.client.adapters.openai_agents import ToolregApprovals, strict_compatible
from registry_server.client.registry_client import CallResult, RegistryClient, Status
from tests.factories import approval_request, call_result

CLOSED = {
    "type": "object",
    "properties": {"text": {"type": "string", "description": "The text."}},
    "required": ["text"],
    "additionalProperties": False,
}


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
    fake = FakeClient([call_result(Status.OK, content='{"bytes": 2}')])
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
            call_result(Status.APPROVAL_REQUIRED, approval_request=approval_request(id="r7")),
            call_result(Status.OK, content="done"),
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
