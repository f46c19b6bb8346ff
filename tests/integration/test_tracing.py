"""Tracing against real parts: a `toolreg serve` process configured only by the
standard OTEL_* variables exports to the test's own OTLP receiver (an OTLP/gRPC
server built from opentelemetry-proto); calls run in real containers.

What is asserted is the tree an operator would follow: the caller's client span
-> the server's RPC span -> one child per step of the call, with the call's
facts as attributes and never its arguments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import RegistryClient, Status
from registry_server.client.trace_context import TraceContext
from registry_server.domain.models import parse_definition
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from tests.otlp_receiver import CLIENT, SERVER, OtlpReceiver, ReceivedSpan

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "examples" / "tools"
APPROVER = "tester"
EXECUTE = "/toolregistry.v1.ToolRegistry/ExecuteTool"
STREAM = "/toolregistry.v1.ToolRegistry/StreamExecuteTool"
STEPS_OF_A_COLD_CALL = [
    "toolreg.validate_arguments",
    "toolreg.admission",
    "toolreg.sandbox.start",
    "toolreg.tool.run",
    "toolreg.sandbox.remove",
]
CALL_TIMEOUT_S = 120  # a cold container plus the call, generously
LOG_WAIT_S = 30  # seconds for a line the server wrote to reach its log reader thread


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    collector = OtlpReceiver()
    yield collector
    collector.stop()


def otel_env(receiver: OtlpReceiver, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
        OTEL_EXPORTER_OTLP_INSECURE="true",
        OTEL_BSP_SCHEDULE_DELAY="100",  # ms: the test need not wait 5 s per batch
        **extra,
    )
    return env


@pytest.fixture(scope="module")
def approver_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    data = tmp_path_factory.mktemp("traced") / "data"
    private, public = generate_keypair()
    (data / "approvers").mkdir(parents=True)
    (data / "approvers" / f"{APPROVER}.pub").write_text(public)
    return data, private


@pytest.fixture(scope="module")
def served(receiver: OtlpReceiver, approver_key: tuple[Path, bytes]) -> Iterator[ServerProcess]:
    data, _ = approver_key
    server = spawn_server(
        data, "--tools", str(TOOLS), "--log-format", "json", cwd=ROOT, env=otel_env(receiver)
    )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(served: ServerProcess) -> Iterator[RegistryClient]:
    with RegistryClient(served.address) as registry:
        yield registry


@pytest.fixture(scope="module")
def agent(receiver: OtlpReceiver) -> Iterator[trace.Tracer]:
    """The test plays an agent with its own SDK (not the global one): its spans
    go to the same receiver under another service name."""
    provider = TracerProvider(resource=Resource.create({"service.name": "agent-under-test"}))
    exporter = OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("agent")
    provider.shutdown()


def in_trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.trace_id == trace_id]


def rpc_span(spans: list[ReceivedSpan], method: str, parent: str) -> ReceivedSpan | None:
    found = [s for s in spans if s.name == method and s.kind == SERVER and s.parent_id == parent]
    assert len(found) <= 1, f"{len(found)} server spans under one parent"
    return found[0] if found else None


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> dict[str, ReceivedSpan]:
    below = [s for s in spans if s.parent_id == parent.span_id]
    by_name = {s.name: s for s in below}
    assert len(by_name) == len(below), f"a step ran twice: {[s.name for s in below]}"
    return by_name


def traced_call(
    receiver: OtlpReceiver, agent: trace.Tracer, method: str, steps: list[str], run: Any
) -> tuple[Any, ReceivedSpan, dict[str, ReceivedSpan], list[ReceivedSpan]]:
    """Run ``run()`` under an agent's client span; wait for the server's RPC span
    under it and for ``steps`` under that. Returns (what run returned, the RPC
    span, its children by name, every span of the trace)."""
    with agent.start_as_current_span("agent.tool_call", kind=trace.SpanKind.CLIENT) as parent:
        returned = run()
    context = parent.get_span_context()
    trace_id, parent_id = f"{context.trace_id:032x}", f"{context.span_id:016x}"

    def arrived(spans: list[ReceivedSpan]) -> bool:
        mine = in_trace(spans, trace_id)
        server = rpc_span(mine, method, parent_id)
        return server is not None and set(steps) <= set(children(mine, server))

    mine = in_trace(receiver.wait_for(arrived), trace_id)
    server = rpc_span(mine, method, parent_id)
    assert server is not None
    return returned, server, children(mine, server), mine


def test_a_call_continues_the_callers_trace_with_a_span_per_step(
    receiver: OtlpReceiver, agent: trace.Tracer, client: RegistryClient
) -> None:
    canary = f"argument-canary-{uuid.uuid4().hex}"
    result, server, steps, whole = traced_call(
        receiver, agent, EXECUTE, [*STEPS_OF_A_COLD_CALL, "toolreg.audit.write"],
        lambda: client.execute_tool("word_count", {"text": f"one two {canary}"}),
    )  # fmt: skip
    assert result.status is Status.OK, result.error
    assert result.data["words"] == 3

    # The RPC span: the server's, a child of the agent's client span, with the call's facts.
    assert server.service == "toolreg"
    assert server.attributes["rpc.system"] == "grpc"
    assert server.attributes["toolreg.tool"] == "word_count"
    assert server.attributes["toolreg.safety_level"] == "safe"
    assert server.attributes["toolreg.status"] == "OK"
    assert server.attributes["toolreg.execution_id"] == result.execution_id
    assert server.attributes["toolreg.warm"] is False
    assert steps["toolreg.sandbox.start"].attributes["toolreg.warm"] is False
    assert "toolreg.approval" not in steps  # a safe tool has no approval decision

    # The steps happen in order, inside the RPC (removal may finish after the answer).
    starts = [steps[name].start_ns for name in STEPS_OF_A_COLD_CALL]
    assert starts == sorted(starts)
    assert steps["toolreg.tool.run"].end_ns <= steps["toolreg.sandbox.remove"].start_ns
    # The engine's work for the removal starts once the record is durable: its
    # writes would otherwise land on the record's fsync (sandbox_runner/after_call.py).
    assert steps["toolreg.audit.write"].end_ns <= steps["toolreg.sandbox.remove"].start_ns
    for name in STEPS_OF_A_COLD_CALL[:-1]:
        assert server.start_ns <= steps[name].start_ns <= steps[name].end_ns <= server.end_ns

    # Never the arguments: not in any span or resource the trace exported.
    assert len(whole) >= 2 + len(STEPS_OF_A_COLD_CALL)
    assert not [s.name for s in whole if canary.encode() in s.raw]


def test_a_stream_call_is_traced_from_its_own_thread(
    receiver: OtlpReceiver, agent: trace.Tracer, client: RegistryClient
) -> None:
    events, server, steps, _ = traced_call(
        receiver, agent, STREAM, STEPS_OF_A_COLD_CALL,
        lambda: list(client.stream_tool("word_count", {"text": "a b c d"})),
    )  # fmt: skip
    final = events[-1].result
    assert final is not None and final.status is Status.OK
    assert server.attributes["toolreg.execution_id"] == final.execution_id
    assert server.attributes["toolreg.status"] == "OK"
    assert steps["toolreg.tool.run"].parent_id == server.span_id


def test_a_dangerous_call_shows_the_approval_decision(
    receiver: OtlpReceiver,
    agent: trace.Tracer,
    client: RegistryClient,
    approver_key: tuple[Path, bytes],
) -> None:
    args = {"path": f"traced/{uuid.uuid4().hex}.txt", "content": "hello"}
    asked, server, steps, _ = traced_call(
        receiver, agent, EXECUTE, ["toolreg.validate_arguments", "toolreg.approval"],
        lambda: client.execute_tool("write_file", args),
    )  # fmt: skip
    assert asked.status is Status.APPROVAL_REQUIRED
    assert server.attributes["toolreg.status"] == "APPROVAL_REQUIRED"
    assert server.attributes["toolreg.safety_level"] == "dangerous"
    assert steps["toolreg.approval"].attributes["toolreg.approval.decision"] == "required"
    assert "toolreg.sandbox.start" not in steps  # nothing ran

    request = client.approval_request(asked.approval_request.id)
    token = mint_for(load_private_key(approver_key[1]), issuer=APPROVER, request=request)
    done, server, steps, _ = traced_call(
        receiver, agent, EXECUTE,
        ["toolreg.approval", "toolreg.approval.spend", *STEPS_OF_A_COLD_CALL],
        lambda: client.execute_tool("write_file", args, approval_tokens=[token]),
    )  # fmt: skip
    assert done.status is Status.OK, done.error
    assert steps["toolreg.approval"].attributes["toolreg.approval.decision"] == "approved"
    assert steps["toolreg.approval.spend"].start_ns < steps["toolreg.tool.run"].start_ns
    assert token.encode() not in b"".join(s.raw for s in receiver.spans())


def test_a_warm_start_is_marked_warm(
    receiver: OtlpReceiver, agent: trace.Tracer, client: RegistryClient
) -> None:
    tool = parse_definition({
        "name": "traced_warm", "description": "answers from a warm container",
        "parameters": {"type": "object"}, "safety_level": "safe", "warm_pool": 1,
        "sandbox": {"image": "toolreg/base", "command": ["sh", "-c", "cat >/dev/null; echo warm"]},
    })  # fmt: skip
    client.register_tool(tool, replace=True)
    deadline = time.monotonic() + 60
    while True:  # the pool fills in the background; a call before that runs cold
        result, server, steps, _ = traced_call(
            receiver, agent, EXECUTE, STEPS_OF_A_COLD_CALL,
            lambda: client.execute_tool("traced_warm", {}),
        )  # fmt: skip
        assert result.status is Status.OK, result.error
        if server.attributes["toolreg.warm"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert server.attributes["toolreg.warm"] is True
    assert steps["toolreg.sandbox.start"].attributes["toolreg.warm"] is True


def test_an_unknown_tool_is_not_named_and_a_long_user_agent_is_cut(
    receiver: OtlpReceiver, agent: trace.Tracer, served: ServerProcess
) -> None:
    agent_string = "agent/" + "x" * 5000
    channel = grpc.intercept_channel(
        grpc.insecure_channel(served.address, options=[("grpc.primary_user_agent", agent_string)]),
        TraceContext(),
    )
    with RegistryClient(served.address, channel=channel) as loud:
        result, server, steps, _ = traced_call(
            receiver, agent, EXECUTE, ["toolreg.validate_arguments"],
            lambda: loud.execute_tool("no_such_tool_here", {}),
        )  # fmt: skip
    assert result.status is Status.TOOL_NOT_FOUND
    assert server.attributes["toolreg.status"] == "TOOL_NOT_FOUND"
    assert "toolreg.tool" not in server.attributes  # the caller's word, not a fact
    assert set(steps) == {"toolreg.validate_arguments", "toolreg.audit.write"}  # no sandbox
    user_agent = server.attributes["rpc.user_agent"]
    assert user_agent.startswith("agent/x") and len(user_agent) <= 256


def test_json_log_lines_carry_the_execution_and_trace_ids(
    receiver: OtlpReceiver, agent: trace.Tracer, client: RegistryClient, served: ServerProcess
) -> None:
    result, server, _, _ = traced_call(
        receiver, agent, EXECUTE, STEPS_OF_A_COLD_CALL,
        lambda: client.execute_tool("word_count", {"text": "logged"}),
    )  # fmt: skip

    def mine_of() -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in list(served.log) if line.startswith("{")]
        return [line for line in lines if line.get("execution_id") == result.execution_id]

    # A thread reads the server's stderr: its lines reach served.log a moment later.
    deadline = time.monotonic() + LOG_WAIT_S
    mine = mine_of()
    while not any(line["event"] == "execution" for line in mine):
        assert time.monotonic() < deadline, f"no execution line names it: {mine}"
        time.sleep(0.05)
        mine = mine_of()
    assert mine, "no log line names the execution"
    assert {line["trace_id"] for line in mine} == {server.trace_id}
    assert any(line["event"] == "execution" for line in mine)


def test_the_cli_propagates_its_trace_into_the_server(
    receiver: OtlpReceiver, served: ServerProcess
) -> None:
    service = f"cli-{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [sys.executable, "-m", "registry_server.cli", "exec", "word_count",
         "--args", '{"text": "from the command line"}', "--address", served.address],
        env=otel_env(receiver, OTEL_SERVICE_NAME=service),
        capture_output=True, text=True, timeout=CALL_TIMEOUT_S, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr

    def arrived(spans: list[ReceivedSpan]) -> bool:
        command = [s for s in spans if s.service == service and s.name == "toolreg exec"]
        if not command:
            return False
        calls = [s for s in spans if s.parent_id == command[0].span_id and s.kind == CLIENT]
        return any(rpc_span(spans, EXECUTE, c.span_id) for c in calls)

    spans = receiver.wait_for(arrived)
    (command,) = [s for s in spans if s.service == service and s.name == "toolreg exec"]
    (call,) = [s for s in spans if s.parent_id == command.span_id and s.name == EXECUTE]
    assert call.kind == CLIENT and call.service == service
    server = rpc_span(spans, EXECUTE, call.span_id)
    assert server is not None and server.trace_id == command.trace_id
    assert server.attributes["toolreg.status"] == "OK"
    assert "toolreg.tool.run" in children(spans, server)


def test_a_traced_stream_is_grpcs_own_call_and_cancels_the_sandbox(
    receiver: OtlpReceiver, agent: trace.Tracer, client: RegistryClient
) -> None:
    tool = parse_definition({
        "name": "traced_slow", "description": "prints, then takes its time",
        "parameters": {"type": "object"}, "safety_level": "safe",
        "sandbox": {"image": "toolreg/base", "command": ["sh", "-c", "echo started; sleep 30"]},
    })  # fmt: skip
    client.register_tool(tool, replace=True)

    def cancel_after_first_chunk() -> float:
        stream = client.stub.StreamExecuteTool(
            pb.ExecuteToolRequest(name="traced_slow", arguments_json="{}"), timeout=CALL_TIMEOUT_S
        )
        assert next(stream).WhichOneof("event") == "started"
        assert next(stream).stdout == b"started\n"
        started = time.monotonic()
        stream.cancel()  # the call object itself, not a wrapper without cancel()
        with pytest.raises(grpc.RpcError) as ended:
            next(stream)
        assert ended.value.code() == grpc.StatusCode.CANCELLED
        return time.monotonic() - started

    waited, server, steps, _ = traced_call(
        receiver, agent, STREAM, ["toolreg.tool.run", "toolreg.sandbox.remove"],
        cancel_after_first_chunk,
    )  # fmt: skip
    assert waited < 5
    assert server.attributes["toolreg.status"] == "SANDBOX_ERROR", server.attributes
    run = steps["toolreg.tool.run"]
    assert (run.end_ns - run.start_ns) / 1e9 < 10  # killed, not slept out
