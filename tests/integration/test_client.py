"""The typed Python client and the agent-loop example, against a real server
process in development mode (real engine, local sandbox images)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import (
    ApprovalRequestView,
    ApprovalWaitError,
    CallResult,
    RegistryClient,
    Status,
    StreamEvent,
    describe_rpc_error,
)
from registry_server.domain.models import SafetyLevel, ToolDefinition
from registry_server.domain.schemas import SchemaFormat
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from tests.factories import tool

ROOT = Path(__file__).resolve().parents[2]
APPROVER = "tester"
EXECUTION_TIMEOUT_S = 120.0  # seconds for one sandboxed call (first image start is slow)


@pytest.fixture(scope="module")
def dev_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    base = tmp_path_factory.mktemp("client")
    data = base / "data"
    (data / "approvers").mkdir(parents=True)
    private, public = generate_keypair()
    (data / "approvers" / f"{APPROVER}.pub").write_text(public)
    key_file = base / f"{APPROVER}.key"
    key_file.write_bytes(private)
    key_file.chmod(0o600)
    server = spawn_server(data, "--tools", str(ROOT / "examples" / "tools"), cwd=ROOT)
    try:
        yield server, key_file
    finally:
        assert server.stop() == 0


def sign(key_file: Path, req: ApprovalRequestView) -> str:
    key = load_private_key(key_file.read_bytes())
    return mint_for(key, issuer=APPROVER, request=req, bind_request=True)


def got_description(client: RegistryClient, name: str) -> str:
    return client.get_tool(name).description


def test_every_typed_method_returns_domain_objects(
    dev_server: tuple[ServerProcess, Path],
) -> None:
    server, key_file = dev_server
    with RegistryClient.connect(server.address) as client:
        # register / get / list / schemas
        stored = client.register_tool(tool(name="client_echo", categories=["client"]))
        assert isinstance(stored, ToolDefinition) and stored.name == "client_echo"
        assert len(stored.digest) == 64
        assert client.register_tool(tool(name="client_echo", categories=["client"])) == stored
        with pytest.raises(grpc.RpcError) as exists:
            client.register_tool(tool(name="client_echo", description="Different."))
        assert exists.value.code() is grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(grpc.RpcError) as bad:
            client.stub.RegisterTool(pb.RegisterToolRequest(tool=pb.Tool(name="Bad Name")))
        assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "name" in describe_rpc_error(bad.value)

        got = client.get_tool("write_file")
        assert isinstance(got, ToolDefinition) and got.safety_level is SafetyLevel.DANGEROUS
        with pytest.raises(grpc.RpcError) as missing:
            client.get_tool("no_such_tool")
        assert missing.value.code() is grpc.StatusCode.NOT_FOUND

        every = {t.name for t in client.list_tool_definitions()}
        assert {"echo", "word_count", "run_python", "write_file", "client_echo"} <= every
        safe = client.list_tool_definitions(max_level=SafetyLevel.SAFE)
        assert all(t.safety_level is SafetyLevel.SAFE for t in safe)
        assert [t.name for t in client.list_tool_definitions(categories=["client"])] == [
            "client_echo"
        ]
        openai = client.tool_schemas(SchemaFormat.OPENAI, categories=["text"])
        assert openai == [
            {
                "type": "function",
                "function": {
                    "name": "word_count",
                    "description": got_description(client, "word_count"),
                    "parameters": client.get_tool("word_count").parameters,
                },
            }
        ]
        mcp = client.tool_schemas(SchemaFormat.MCP, max_level=SafetyLevel.SAFE)
        assert all("inputSchema" in s for s in mcp)

        # execute
        ok = client.execute_tool("echo", {"message": "hi"}, timeout=EXECUTION_TIMEOUT_S)
        assert isinstance(ok, CallResult)
        assert ok.success and ok.status is Status.OK, ok
        assert ok.data == {"message": "hi"} and json.loads(ok.content) == {"message": "hi"}
        assert ok.execution_id and ok.approval_request is None
        unknown = client.execute_tool("nope", "{}")
        assert unknown.status is Status.TOOL_NOT_FOUND and not unknown.success
        assert "not found" in unknown.error
        invalid = client.execute_tool("word_count", '{"text": 5}')
        assert invalid.status is Status.INVALID_ARGUMENTS and "$.text" in invalid.error

        # stream
        events = list(
            client.stream_tool(
                "run_python",
                {"code": "import sys; print('out'); print('err', file=sys.stderr)"},
                timeout=EXECUTION_TIMEOUT_S,
            )
        )
        assert all(isinstance(e, StreamEvent) for e in events)
        assert events[-1].result is not None and events[-1].result.status is Status.OK
        assert all(e.result is None for e in events[:-1])
        assert b"".join(e.stdout for e in events).decode() == "out\n"
        assert b"".join(e.stderr for e in events).decode() == "err\n"

        # approvals: required -> list/get -> wait (times out) -> submit -> wait -> run
        args = {"path": "client/typed.txt", "content": "typed client"}
        asked = client.execute_tool("write_file", args, timeout=EXECUTION_TIMEOUT_S)
        assert asked.status is Status.APPROVAL_REQUIRED and asked.needs_approval
        req = asked.approval_request
        assert isinstance(req, ApprovalRequestView) and req.state == "PENDING"
        assert isinstance(req.created_at, datetime) and req.expires_at > req.created_at
        assert req.audience and req.tool_name == "write_file"
        pending = client.list_approval_requests("PENDING")
        assert req.id in {r.id for r in pending}
        assert all(isinstance(r, ApprovalRequestView) for r in pending)
        assert client.get_approval_request(req.id) == req
        with pytest.raises(ApprovalWaitError, match="still pending") as waited:
            client.wait_for_approval(req.id, timeout_s=0.3, poll_s=0.1)
        assert waited.value.request is not None and waited.value.request.state == "PENDING"

        updated = client.submit_approval_token(req.id, sign(key_file, req))
        assert isinstance(updated, ApprovalRequestView)
        assert updated.state == "APPROVED" and updated.approved_by == (APPROVER,)
        assert client.wait_for_approval(req.id, timeout_s=5, poll_s=0.1).state == "APPROVED"
        ran = client.execute_tool(
            "write_file", args, approval_request_id=req.id, timeout=EXECUTION_TIMEOUT_S
        )
        assert ran.status is Status.OK, ran
        with pytest.raises(ApprovalWaitError, match="consumed"):
            client.wait_for_approval(req.id, timeout_s=5, poll_s=0.1)


def test_wait_for_approval_returns_when_another_party_approves(
    dev_server: tuple[ServerProcess, Path],
) -> None:
    server, key_file = dev_server
    with RegistryClient.connect(server.address) as client:
        asked = client.execute_tool(
            "write_file", {"path": "client/waited.txt", "content": "x"}, timeout=30
        )
        req = asked.approval_request
        assert req is not None

        def approve() -> None:
            with RegistryClient.connect(server.address) as other:
                other.submit_approval_token(req.id, sign(key_file, req))

        timer = threading.Timer(0.5, approve)
        timer.start()
        try:
            approved = client.wait_for_approval(req.id, timeout_s=30, poll_s=0.2)
        finally:
            timer.join()
        assert approved.state == "APPROVED" and approved.approved_by == (APPROVER,)


def test_agent_loop_example_runs_recorded_calls(dev_server: tuple[ServerProcess, Path]) -> None:
    server, key_file = dev_server
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "agent_loop.py"),
            "--address",
            server.address,
            "--approval-timeout",
            "60",
            "--approver-key",
            str(key_file),
            "--approver-id",
            APPROVER,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records: list[dict[str, Any]] = [json.loads(line) for line in out.stdout.splitlines()]
    results = {r["tool_call_id"]: r for r in records if r["event"] == "tool_result"}
    recorded = json.loads((ROOT / "examples" / "recorded_tool_calls.json").read_text())
    call_ids = [c["id"] for turn in recorded for c in turn["tool_calls"]]
    assert list(results) == call_ids  # one tool message per call, in order
    for call_id, result in results.items():
        message = result["message"]
        assert message["role"] == "tool" and message["tool_call_id"] == call_id
        assert isinstance(message["content"], str) and message["content"]

    assert results["call_echo_1"]["status"] == "OK"
    assert json.loads(results["call_echo_1"]["message"]["content"]) == {
        "message": "hello from the agent"
    }
    assert results["call_count_1"]["status"] == "OK"
    assert results["call_python_1"]["status"] == "OK"
    assert results["call_python_1"]["message"]["content"].strip() == "5050"
    bad = results["call_count_bad"]
    assert bad["status"] == "INVALID_ARGUMENTS"
    assert bad["message"]["content"].startswith("Error") and "$.text" in bad["message"]["content"]
    unknown = results["call_unknown"]
    assert unknown["status"] == "TOOL_NOT_FOUND" and "not found" in unknown["message"]["content"]

    write = results["call_write_1"]
    assert write["status"] == "OK", write
    asked = [r for r in records if r["event"] == "approval_required"]
    assert [r["tool_call_id"] for r in asked] == ["call_write_1"]
    approved = [r for r in records if r["event"] == "approved"]
    assert approved and approved[0]["request_id"] == asked[0]["request_id"]
    assert approved[0]["approved_by"] == [APPROVER]
    assert records[-1] == {"event": "done", "tool_messages": len(call_ids)}
