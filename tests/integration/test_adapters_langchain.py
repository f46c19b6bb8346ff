"""The LangChain/LangGraph adapter against a real `toolreg serve` (policy, real
containers, gVisor for the dangerous tool), with LangChain's own tools and
messages and LangGraph's own ToolNode, StateGraph and InMemorySaver, fed
recorded tool calls: no network, no LLM."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import StructuredTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode
from langgraph.types import Command

from registry_server.client.adapters.langchain import toolreg_structured_tools
from registry_server.client.registry_client import RegistryClient
from registry_server.domain.models import SafetyLevel
from registry_server.domain.schemas import SchemaFormat
from tests.factories import tool
from tests.integration.adapter_server import (
    FILTERS,
    PolicyServer,
    recorded_turns,
    start_policy_server,
)

FAST_POLL_S = 0.1  # seconds between GetApprovalRequest polls (only a server that cannot watch)
SLOW_POLL_S = 60.0  # a poll interval no test waits out: the wait must follow the watch


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PolicyServer]:
    running = start_policy_server(tmp_path_factory.mktemp("adapters-langchain"))
    try:
        yield running
    finally:
        assert running.stop() == 0, "".join(running.process.log[-40:])


@pytest.fixture
def agent_client(server: PolicyServer) -> Iterator[RegistryClient]:
    with server.client("agent") as client:
        yield client


def by_name(tools: list[StructuredTool]) -> dict[str, StructuredTool]:
    return {t.name: t for t in tools}


def recorded_call(call_id: str) -> dict[str, Any]:
    """A recorded OpenAI tool call as LangChain's ToolCall."""
    for turn in recorded_turns():
        for call in turn:
            if call["id"] == call_id:
                function = call["function"]
                args = json.loads(function["arguments"])
                return {"name": function["name"], "args": args, "id": call_id, "type": "tool_call"}
    raise KeyError(call_id)


def tool_graph(tools: list[StructuredTool]) -> CompiledStateGraph[Any, Any, Any, Any]:
    builder = StateGraph(MessagesState)
    builder.add_node("tools", ToolNode(tools))
    builder.add_edge(START, "tools")
    builder.add_edge("tools", END)
    return builder.compile(checkpointer=InMemorySaver())


def thread() -> RunnableConfig:
    return {"configurable": {"thread_id": uuid.uuid4().hex}}


def ran_containers(server: PolicyServer, name: str, arguments: dict[str, Any]) -> list[str]:
    """Containers that ran exactly this call, by the server's execution log."""
    return [r["container_id"] for r in server.executions(name, arguments) if r["container_id"]]


def tool_messages(out: dict[str, Any]) -> dict[str, ToolMessage]:
    return {m.tool_call_id: m for m in out["messages"] if isinstance(m, ToolMessage)}


@pytest.mark.parametrize(("max_level", "categories"), FILTERS)
def test_tools_are_the_registry_filtered_as_get_tool_schemas_filters(
    agent_client: RegistryClient, max_level: Any, categories: tuple[str, ...]
) -> None:
    tools = toolreg_structured_tools(agent_client, max_level=max_level, categories=categories)
    level = SafetyLevel.parse(max_level) if isinstance(max_level, str) else max_level
    expected = agent_client.tool_schemas(SchemaFormat.OPENAI, level, categories)
    # What a chat model's bind_tools sends is exactly what GetToolSchemas gives.
    assert [convert_to_openai_tool(t) for t in tools] == expected
    for t in tools:
        assert isinstance(t, StructuredTool)
        assert t.args_schema == agent_client.get_tool(t.name).parameters
        assert t.metadata is not None and "toolreg" in (t.tags or [])


def test_invoke_with_recorded_arguments_gives_content_artifact_or_an_error_message(
    agent_client: RegistryClient,
) -> None:
    tools = by_name(toolreg_structured_tools(agent_client))

    count = recorded_call("call_count_1")
    message = tools["word_count"].invoke(count)
    assert isinstance(message, ToolMessage) and message.status == "success"
    assert json.loads(str(message.content)) == {"words": 9, "lines": 2, "chars": 43}
    assert message.artifact["status"] == "OK" and message.artifact["execution_id"]
    assert message.artifact["data"] == {"words": 9, "lines": 2, "chars": 43}
    # Plain arguments (no tool call): the content alone, as LangChain tools answer.
    assert str(tools["run_python"].invoke(recorded_call("call_python_1")["args"])).strip() == "5050"
    assert asyncio.run(tools["echo"].ainvoke({"message": "async"})) == '{"message":"async"}'

    bad = tools["word_count"].invoke(recorded_call("call_count_bad"))
    assert isinstance(bad, ToolMessage) and bad.status == "error"
    assert str(bad.content).startswith("Error (INVALID_ARGUMENTS)") and "$.text" in str(bad.content)
    failed = tools["run_python"].invoke({"code": "import sys; sys.exit('no luck')"})
    assert failed.startswith("Error (TOOL_ERROR)") and "no luck" in failed


def test_parameters_named_like_langchain_keywords_reach_the_tool(
    agent_client: RegistryClient,
) -> None:
    names = ("config", "callbacks", "run_manager", "tool_call_id")
    agent_client.register_tool(
        tool(
            name="keyword_echo",
            categories=["adapters"],
            parameters={
                "type": "object",
                "properties": {n: {"type": "string"} for n in names},
                "additionalProperties": False,
            },
        )
    )
    (echo,) = toolreg_structured_tools(agent_client, categories=["adapters"])
    arguments = {n: f"value of {n}" for n in names}
    message = echo.invoke(
        {"name": "keyword_echo", "args": arguments, "id": "c1", "type": "tool_call"}
    )
    assert json.loads(str(message.content)) == arguments


def test_outside_a_graph_approval_required_is_an_answer_and_the_approved_call_then_runs(
    server: PolicyServer, agent_client: RegistryClient
) -> None:
    write = by_name(toolreg_structured_tools(agent_client))["write_file"]
    arguments = {"path": "plain/invoke.txt", "content": "approved outside a graph"}

    said = write.invoke(arguments)  # no graph, nothing to pause: an answer, not a crash
    (request,) = server.requests_for("write_file", arguments)
    assert said.startswith("Not run: tool 'write_file' needs approval from toolreg approvers")
    assert request.id in said and request.state == "PENDING"
    assert write.invoke(arguments) == said  # asking again reuses the same request
    assert not (server.workspace / "plain").exists()

    server.approve(request.id, "bob")
    ran = write.invoke(
        {"name": "write_file", "args": arguments, "id": "retry", "type": "tool_call"}
    )
    assert ran.status == "success" and ran.artifact["approval_request_id"] == request.id
    assert json.loads(str(ran.content)) == {"path": "plain/invoke.txt", "bytes": 24}
    assert (server.workspace / "plain" / "invoke.txt").read_text() == arguments["content"]
    assert server.request(request.id).state == "CONSUMED"


def test_a_graph_pauses_for_approval_and_resumes_once_toolreg_approves(
    server: PolicyServer, agent_client: RegistryClient
) -> None:
    graph = tool_graph(toolreg_structured_tools(agent_client, poll_s=FAST_POLL_S))
    config = thread()
    count, write = recorded_call("call_count_1"), recorded_call("call_write_1")
    asked = AIMessage(content="", tool_calls=[count, write])
    target = server.workspace / write["args"]["path"]
    counted_before = len(ran_containers(server, "word_count", count["args"]))

    out = graph.invoke({"messages": [HumanMessage("count and write"), asked]}, config)

    (pause,) = out["__interrupt__"]
    payload = pause.value
    request_id = payload["request_id"]
    assert json.loads(json.dumps(payload)) == payload  # any checkpointer can store it
    assert payload["kind"] == "toolreg_approval" and payload["tool"] == "write_file"
    assert payload["tool_call_id"] == "call_write_1"
    assert (payload["approvals_required"], payload["approved_by"], payload["state"]) == (
        1,
        [],
        "PENDING",
    )
    assert json.loads(payload["arguments_preview"]) == write["args"]
    assert server.request(request_id).state == "PENDING"
    assert not target.exists()

    # Resumed as approved before any approver signed: toolreg has not approved, so
    # the graph pauses again on the same request, and nothing runs.
    out = graph.invoke(Command(resume={"approved": True}), config)
    (again,) = out["__interrupt__"]
    assert again.value["request_id"] == request_id and again.value["state"] == "PENDING"
    assert not target.exists()

    assert server.approve(request_id, "alice").state == "APPROVED"
    out = graph.invoke(Command(resume={"approved": True, "request_id": request_id}), config)

    assert "__interrupt__" not in out
    results = tool_messages(out)
    assert json.loads(str(results["call_count_1"].content))["words"] == 9
    assert results["call_write_1"].status == "success"
    assert json.loads(str(results["call_write_1"].content)) == {
        "path": write["args"]["path"],
        "bytes": len(write["args"]["content"]),
    }
    assert results["call_write_1"].artifact["approval_request_id"] == request_id
    assert target.read_text() == write["args"]["content"]
    assert server.request(request_id).state == "CONSUMED"
    # LangGraph re-ran the node on each resume; toolreg saw one request for the
    # write, and the word count ran once.
    assert [r.id for r in server.requests_for("write_file", write["args"])] == [request_id]
    ran = ran_containers(server, "word_count", count["args"])
    assert len(ran) == counted_before + 1


def test_several_dangerous_calls_in_one_message_each_wait_for_their_own_approval(
    server: PolicyServer, agent_client: RegistryClient
) -> None:
    # ToolNode runs one message's calls concurrently in one task, and LangGraph
    # matches answers to that task's pauses by order: an answer naming another
    # call's request is not taken, so every call ends up asked about its own.
    graph = tool_graph(toolreg_structured_tools(agent_client, poll_s=FAST_POLL_S))
    config = thread()
    calls = [
        {
            "name": "write_file",
            "args": {"path": f"several/{i}.txt", "content": f"file {i}"},
            "id": f"call_several_{i}",
            "type": "tool_call",
        }
        for i in range(3)
    ]
    out = graph.invoke({"messages": [AIMessage(content="", tool_calls=calls)]}, config)
    asked: list[tuple[str, str]] = []
    while out.get("__interrupt__"):
        (pause,) = out["__interrupt__"]
        request_id = pause.value["request_id"]
        asked.append((pause.value["tool_call_id"], request_id))
        if server.request(request_id).state == "PENDING":
            server.approve(request_id, "alice")
        out = graph.invoke(Command(resume={"approved": True, "request_id": request_id}), config)
        assert len(asked) <= 2 * len(calls), asked  # converges

    results = tool_messages(out)
    for call in calls:
        (request,) = server.requests_for("write_file", call["args"])  # one each
        assert (call["id"], request.id) in asked and request.state == "CONSUMED"
        assert results[call["id"]].artifact["approval_request_id"] == request.id
        written = server.workspace / call["args"]["path"]
        assert written.read_text() == call["args"]["content"]


def test_a_rejected_call_gives_the_model_a_refusal_async(
    server: PolicyServer, agent_client: RegistryClient
) -> None:
    graph = tool_graph(toolreg_structured_tools(agent_client, poll_s=FAST_POLL_S))
    config = thread()
    arguments = {"path": "rejected/file.txt", "content": "never written"}
    asked = AIMessage(
        content="",
        tool_calls=[
            {"name": "write_file", "args": arguments, "id": "call_no", "type": "tool_call"}
        ],
    )

    async def scenario() -> tuple[dict[str, Any], dict[str, Any]]:
        paused = await graph.ainvoke({"messages": [asked]}, config)
        resumed = await graph.ainvoke(
            Command(resume={"approved": False, "message": "not on a Friday"}), config
        )
        return paused, resumed

    paused, resumed = asyncio.run(scenario())
    (pause,) = paused["__interrupt__"]
    refusal = tool_messages(resumed)["call_no"]
    assert refusal.status == "error"
    assert refusal.content == "Not run: the call to 'write_file' was not approved: not on a Friday"
    assert not (server.workspace / "rejected").exists()
    assert server.request(pause.value["request_id"]).state == "PENDING"  # never spent


def test_an_approver_rejection_while_a_resumed_call_waits_reaches_the_model_with_the_reason(
    server: PolicyServer, agent_client: RegistryClient
) -> None:
    # A resumed call waits up to approval_wait_s for toolreg, following the watch
    # stream (poll_s, for servers that cannot watch, is never waited out here).
    tools = toolreg_structured_tools(agent_client, approval_wait_s=60.0, poll_s=SLOW_POLL_S)
    graph = tool_graph(tools)
    config = thread()
    arguments = {"path": "refused/file.txt", "content": "never written"}
    call = {"name": "write_file", "args": arguments, "id": "call_refused", "type": "tool_call"}
    out = graph.invoke({"messages": [AIMessage(content="", tool_calls=[call])]}, config)
    (pause,) = out["__interrupt__"]
    request_id = pause.value["request_id"]
    reason = "not on a Friday: file a change ticket first"

    def reject_soon() -> float:
        time.sleep(0.5)  # the resumed call is waiting by now
        with server.client("alice") as alice:
            assert alice.reject_approval_request(request_id, reason).state == "REJECTED"
        return time.monotonic()

    with ThreadPoolExecutor(1) as pool:
        rejected_at = pool.submit(reject_soon)
        out = graph.invoke(Command(resume={"approved": True, "request_id": request_id}), config)
        lag = time.monotonic() - rejected_at.result()

    assert "__interrupt__" not in out
    assert lag < 2.0, f"the call answered {lag:.2f}s after the rejection"
    refusal = tool_messages(out)["call_refused"]
    assert refusal.status == "error"
    assert refusal.content == (
        "Not run: the call to 'write_file' was not approved:"
        f" approval request {request_id} was rejected by alice: {reason}"
    )
    assert not (server.workspace / "refused").exists()
    assert server.request(request_id).state == "REJECTED"


def test_an_unreadable_resume_value_is_a_refusal(
    server: PolicyServer, agent_client: RegistryClient
) -> None:
    graph = tool_graph(toolreg_structured_tools(agent_client))
    config = thread()
    arguments = {"path": "typo/file.txt", "content": "never written"}
    call = {"name": "write_file", "args": arguments, "id": "call_typo", "type": "tool_call"}
    graph.invoke({"messages": [AIMessage(content="", tool_calls=[call])]}, config)

    out = graph.invoke(Command(resume="yes please"), config)

    refusal = tool_messages(out)["call_typo"]
    assert refusal.status == "error" and "not understood" in str(refusal.content)
    assert not (server.workspace / "typo").exists()
