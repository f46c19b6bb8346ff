"""The OpenAI Agents SDK adapter against a real `toolreg serve` (policy, real
containers, gVisor for the dangerous tool), driven by the SDK's own Agent and
Runner with a scripted model (the SDK's ``agents.testing.ScriptedModel``, a
``Model`` that replays recorded outputs): no network, no LLM."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from agents import Agent, FunctionTool, RunConfig, Runner, RunResult
from agents.testing import ScriptedModel, assistant_message, function_call

from registry_server.client.adapters.openai_agents import (
    ToolregApprovals,
    toolreg_function_tools,
)
from registry_server.client.registry_client import RegistryClient
from registry_server.domain.models import SafetyLevel
from registry_server.domain.schemas import SchemaFormat
from tests.integration.adapter_server import (
    FILTERS,
    PolicyServer,
    recorded_turns,
    start_policy_server,
)

NO_TRACING = RunConfig(tracing_disabled=True)  # nothing leaves this machine
APPROVAL_WAIT_S = 60.0  # seconds resolve() may wait for an approver in these tests
FAST_POLL_S = 0.1  # seconds between GetApprovalRequest polls (only a server that cannot watch)
SLOW_POLL_S = 60.0  # a poll interval no test waits out: the wait must follow the watch


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PolicyServer]:
    running = start_policy_server(tmp_path_factory.mktemp("adapters-openai"))
    try:
        yield running
    finally:
        assert running.stop() == 0, "".join(running.process.log[-40:])


@pytest.fixture
def agent_client(server: PolicyServer) -> Iterator[RegistryClient]:
    with server.client("agent") as client:
        yield client


def function_tools(client: RegistryClient, **options: Any) -> list[FunctionTool]:
    tools = toolreg_function_tools(client, **options)
    assert all(isinstance(t, FunctionTool) for t in tools)
    return [t for t in tools if isinstance(t, FunctionTool)]


def run(agent: Agent[Any], start: Any) -> RunResult:
    return asyncio.run(Runner.run(agent, start, run_config=NO_TRACING))


def resolve(approvals: ToolregApprovals, result: RunResult, **options: Any) -> Any:
    state = result.to_state()
    resolutions = asyncio.run(approvals.resolve(state, **options))
    return state, resolutions


def approving_agent(
    client: RegistryClient, name: str, model: ScriptedModel, poll_s: float = FAST_POLL_S
) -> tuple[Agent[Any], ToolregApprovals]:
    """An Agent with the registry's tools whose pauses ``approvals`` resolves."""
    approvals = ToolregApprovals(client, poll_s=poll_s)
    tools = toolreg_function_tools(client, approvals=approvals)
    return Agent(name=name, model=model, tools=tools), approvals


def outputs_seen(model: ScriptedModel, turn: int) -> dict[str, str]:
    """The tool outputs the model received as input on its ``turn``-th call."""
    items = model.calls[turn].input
    return {i["call_id"]: i["output"] for i in items if i.get("type") == "function_call_output"}


def write_call(call_id: str, path: str, content: str) -> tuple[Any, dict[str, str]]:
    arguments = {"path": path, "content": content}
    return function_call("write_file", json.dumps(arguments), call_id=call_id), arguments


@pytest.mark.parametrize(("max_level", "categories"), FILTERS)
def test_tools_are_the_registry_filtered_as_get_tool_schemas_filters(
    agent_client: RegistryClient, max_level: Any, categories: tuple[str, ...]
) -> None:
    tools = toolreg_function_tools(agent_client, max_level=max_level, categories=categories)
    level = SafetyLevel.parse(max_level) if isinstance(max_level, str) else max_level
    expected = agent_client.tool_schemas(SchemaFormat.OPENAI, level, categories)
    assert [t.name for t in tools] == [s["function"]["name"] for s in expected]
    for tool, schema in zip(tools, expected, strict=True):
        assert isinstance(tool, FunctionTool)
        assert tool.description == schema["function"]["description"]
        assert tool.params_json_schema == schema["function"]["parameters"]
        assert tool.needs_approval is (tool.name == "write_file")  # the one dangerous tool


def test_strict_only_where_strict_mode_keeps_the_schema(agent_client: RegistryClient) -> None:
    strict = {t.name: t.strict_json_schema for t in function_tools(agent_client)}
    # word_count: closed, every property required. run_python has an optional
    # parameter, echo is open, write_file uses minLength.
    assert strict == {
        "echo": False,
        "run_python": False,
        "word_count": True,
        "write_file": False,
    }
    forced = function_tools(agent_client, strict=False, categories=["text"])
    assert [t.strict_json_schema for t in forced] == [False]


def test_recorded_calls_reach_the_next_model_turn_and_a_dangerous_call_waits_for_toolreg(
    server: PolicyServer, agent_client: RegistryClient
) -> None:
    turns = recorded_turns()
    # The SDK itself refuses a tool name the agent does not have (the run fails),
    # so the recorded call to an unknown tool is left out here.
    steps: list[Any] = [
        [
            function_call(c["function"]["name"], c["function"]["arguments"], call_id=c["id"])
            for c in turn
            if c["function"]["name"] != "send_email"
        ]
        for turn in turns
    ]
    model = ScriptedModel([*steps, [assistant_message("all done")]])
    agent, approvals = approving_agent(agent_client, "recorded", model)

    first = run(agent, "do the recorded things")

    # Turns 1-3 ran for real; each output is what the next model turn received.
    assert json.loads(outputs_seen(model, 1)["call_echo_1"]) == {"message": "hello from the agent"}
    assert json.loads(outputs_seen(model, 1)["call_count_1"]) == {
        "words": 9,
        "lines": 2,
        "chars": 43,
    }
    assert outputs_seen(model, 2)["call_python_1"].strip() == "5050"
    bad = outputs_seen(model, 3)["call_count_bad"]
    assert bad.startswith("Error (INVALID_ARGUMENTS)") and "$.text" in bad

    # Turn 4 asks for write_file: the run pauses with the SDK's approval item.
    assert [(i.tool_name, i.call_id) for i in first.interruptions] == [
        ("write_file", "call_write_1")
    ]
    assert first.final_output is None and model.remaining_steps == 1
    write_args = json.loads(turns[3][0]["function"]["arguments"])
    target = server.workspace / write_args["path"]
    assert not target.exists()

    # The toolreg request for exactly that call exists, pending, for approvers to sign.
    opened = asyncio.run(approvals.open(first.interruptions))
    request = opened["call_write_1"]
    assert approvals.request_ids == {"call_write_1": request.id}
    seen = server.request(request.id)
    assert (seen.state, seen.tool_name, seen.requested_by) == ("PENDING", "write_file", "agent")
    assert json.loads(seen.arguments_json) == write_args
    assert server.approve(request.id, "alice").state == "APPROVED"

    state, resolutions = resolve(approvals, first, timeout_s=APPROVAL_WAIT_S)
    assert [(r.call_id, r.decision, r.request_id, r.approved_by) for r in resolutions] == [
        ("call_write_1", "approved", request.id, ("alice",))
    ]
    final = run(agent, state)

    assert final.final_output == "all done" and final.interruptions == []
    written = json.loads(outputs_seen(model, 4)["call_write_1"])
    assert written == {"path": write_args["path"], "bytes": len(write_args["content"])}
    assert target.read_text() == write_args["content"]
    assert server.request(request.id).state == "CONSUMED"
    # One request for the call, however often it was asked about.
    assert [r.id for r in server.requests_for("write_file", write_args)] == [request.id]
    model.assert_complete()


def test_the_sdk_approval_alone_never_runs_a_dangerous_tool(
    server: PolicyServer, agent_client: RegistryClient
) -> None:
    call, arguments = write_call("call_sdk_only", "sdk/only.txt", "approved in the SDK only")
    model = ScriptedModel([[call], [assistant_message("ok")]])
    agent = Agent(name="sdk-only", model=model, tools=toolreg_function_tools(agent_client))

    first = run(agent, "write it")
    state = first.to_state()
    for item in first.interruptions:
        state.approve(item)  # what an app would do without toolreg
    final = run(agent, state)

    said = outputs_seen(model, 1)["call_sdk_only"]
    assert said.startswith("Not run: tool 'write_file' needs approval from toolreg approvers")
    (pending,) = server.requests_for("write_file", arguments)
    assert pending.id in said and pending.state == "PENDING"
    assert not (server.workspace / "sdk" / "only.txt").exists()
    assert final.final_output == "ok"


def test_invalid_arguments_are_answered_without_asking_approvers(
    server: PolicyServer, agent_client: RegistryClient
) -> None:
    call, arguments = write_call("call_bad_path", "", "no path")  # minLength 1
    model = ScriptedModel([[call], [assistant_message("ok")]])
    agent, approvals = approving_agent(agent_client, "bad-args", model)
    first = run(agent, "write it")

    state, resolutions = resolve(approvals, first, timeout_s=APPROVAL_WAIT_S)
    assert [(r.decision, r.request_id) for r in resolutions] == [("answered", None)]
    run(agent, state)
    said = outputs_seen(model, 1)["call_bad_path"]
    assert said.startswith("Error (INVALID_ARGUMENTS)") and "$.path" in said
    assert server.requests_for("write_file", arguments) == []  # nobody was asked


def test_a_wait_that_times_out_is_left_pending_or_rejected(
    server: PolicyServer, agent_client: RegistryClient
) -> None:
    call, arguments = write_call("call_slow", "slow/approval.txt", "approved late")
    model = ScriptedModel([[call], [assistant_message("ok")]])
    agent, approvals = approving_agent(agent_client, "slow", model)
    first = run(agent, "write it")

    # No approver yet: "leave" keeps the pause for a later resolve ...
    state, left = resolve(approvals, first, timeout_s=0.3, on_timeout="leave")
    assert [(r.decision, r.call_id) for r in left] == [("pending", "call_slow")]
    assert "still pending" in left[0].message
    assert [i.call_id for i in state.get_interruptions()] == ["call_slow"]

    # ... and "reject" (the default) gives the model the reason; nothing runs.
    state, rejected = resolve(approvals, first, timeout_s=0.3)
    assert [(r.decision, r.request_id) for r in rejected] == [("rejected", left[0].request_id)]
    final = run(agent, state)
    said = outputs_seen(model, 1)["call_slow"]
    assert said.startswith("Not run: the call to 'write_file' was not approved")
    assert "still pending" in said
    assert final.final_output == "ok"
    assert not (server.workspace / "slow").exists()
    (request,) = server.requests_for("write_file", arguments)
    assert request.state == "PENDING"  # toolreg's request is untouched; it expires unused


def test_an_approver_rejection_reaches_the_model_with_the_reason_at_once(
    server: PolicyServer, agent_client: RegistryClient
) -> None:
    call, arguments = write_call("call_refused", "refused/file.txt", "never written")
    model = ScriptedModel([[call], [assistant_message("ok")]])
    # The wait follows the watch stream: poll_s (for servers that cannot watch)
    # is far longer than the test may take.
    agent, approvals = approving_agent(agent_client, "refused", model, poll_s=SLOW_POLL_S)
    first = run(agent, "write it")
    request = asyncio.run(approvals.open(first.interruptions))["call_refused"]
    reason = "not on a Friday: file a change ticket first"

    def reject_soon() -> float:
        time.sleep(0.5)  # resolve() is waiting by now
        with server.client("alice") as alice:
            assert alice.reject_approval_request(request.id, reason).state == "REJECTED"
        return time.monotonic()

    with ThreadPoolExecutor(1) as pool:
        rejected_at = pool.submit(reject_soon)
        state, resolutions = resolve(approvals, first, timeout_s=APPROVAL_WAIT_S)
        lag = time.monotonic() - rejected_at.result()

    assert [(r.decision, r.request_id) for r in resolutions] == [("rejected", request.id)]
    assert lag < 2.0, f"resolve() answered {lag:.2f}s after the rejection"
    run(agent, state)
    said = outputs_seen(model, 1)["call_refused"]
    assert said == (
        "Not run: the call to 'write_file' was not approved:"
        f" approval request {request.id} was rejected by alice: {reason}"
    )
    assert not (server.workspace / "refused").exists()
    assert [r.state for r in server.requests_for("write_file", arguments)] == ["REJECTED"]


def test_an_expired_request_is_rejected(tmp_path: Path) -> None:
    server = start_policy_server(tmp_path, request_ttl_s=1)
    try:
        with server.client("agent") as client:
            call, _ = write_call("call_expiring", "late/file.txt", "too late")
            model = ScriptedModel([[call], [assistant_message("ok")]])
            agent, approvals = approving_agent(client, "expiring", model)
            first = run(agent, "write it")
            request = asyncio.run(approvals.open(first.interruptions))["call_expiring"]
            time.sleep(1.5)  # past the policy's approval_request_ttl_s

            state, resolutions = resolve(approvals, first, timeout_s=APPROVAL_WAIT_S)
            assert [(r.decision, r.request_id) for r in resolutions] == [("rejected", request.id)]
            assert "expired" in resolutions[0].message
            run(agent, state)
            assert "expired" in outputs_seen(model, 1)["call_expiring"]
            assert server.request(request.id).state == "EXPIRED"
            assert not (server.workspace / "late").exists()
    finally:
        assert server.stop() == 0
