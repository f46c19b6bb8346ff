"""Long calls as MCP tasks (registry_server/mcp/tasks.py), with the Python
`mcp` SDK client over Streamable HTTP against `toolreg mcp --http` and a real
`toolreg serve` with real containers: a client that declares the
`io.modelcontextprotocol/tasks` extension gets a task for a long tool, polls
tasks/get to the result, finds the task again after reconnecting, and another
client cannot see it; a second task is cancelled and its container is gone,
the audit saying who cancelled it; a short tool answers as a plain call."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import anyio
import httpx2
import mcp.types as types
import pytest
import yaml
from mcp import ClientSession
from mcp.client.extension import ResultClaim
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from pydantic import ConfigDict

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import RegistryClient
from registry_server.mcp.tasks import TASKS_EXTENSION
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from tests import store_file
from tests.factories import sha
from tests.integration.test_mcp_http import BridgeProcess, spawn_bridge

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[2]
TOKENS = {
    "agent": "mcp-tasks-agent-4b1e7c",
    "rival": "mcp-tasks-rival-e9a05d",
    "alice": "mcp-tasks-alice-07c2aa",
}
EXECUTION_LABEL = "io.toolreg.execution-id"
CONTAINER_WAIT_S = 30.0  # seconds for a started call's container to appear on a busy machine
RUNNING = re.compile(r"running as execution ([0-9a-f]{32})")
TOOLS = {
    "slow": ["sh", "-c", "echo working; sleep 3; echo done"],
    "long": ["sh", "-c", "echo started; sleep 60; echo never"],
}


class TaskView(types.Result):
    """A task as the bridge answers it (CreateTaskResult, tasks/get)."""

    model_config = ConfigDict(extra="allow")
    task_id: str
    status: str
    status_message: str | None = None
    result: dict[str, Any] | None = None


class CreatedTask(TaskView):
    """CreateTaskResult: a tools/call answered with a task."""

    result_type: Literal["task"] = "task"


class TaskIdParams(types.RequestParams):
    task_id: str


class TasksGet(types.Request[TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    name_param: ClassVar[str | None] = "taskId"


class RoutedParams(TaskIdParams):
    route: str  # sent as the Mcp-Name header instead of the taskId


class TasksGetRouted(types.Request[RoutedParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    name_param: ClassVar[str | None] = "route"


class TasksCancel(types.Request[TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    name_param: ClassVar[str | None] = "taskId"


async def _unused(claimed: CreatedTask, ctx: Any) -> types.CallToolResult:
    raise AssertionError("the test reads tasks itself")


TASK_CLAIM = ResultClaim(result_type="task", model=CreatedTask, resolve=_unused)


@dataclass
class Served:
    server: ServerProcess
    data_dir: Path
    policy: Path
    alice_key: bytes


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("mcp-tasks")
    tools = base / "tools"
    tools.mkdir()
    for name, command in TOOLS.items():
        manifest = {
            "name": name, "description": f"The {name} tool.", "safety_level": "safe",
            "parameters": {"type": "object"},
            "sandbox": {"image": "toolreg/base", "command": command,
                        "limits": {"timeout_ms": 90_000}},
        }  # fmt: skip
        (tools / f"{name}.yaml").write_text(yaml.safe_dump(manifest))
    quick = {
        "name": "quick", "description": "Says hello.", "safety_level": "safe",
        "parameters": {"type": "object"},
        "sandbox": {"image": "toolreg/base", "command": ["echo", "hello"]},
    }  # fmt: skip
    (tools / "quick.yaml").write_text(yaml.safe_dump(quick))
    deploy = {
        "name": "deploy", "description": "Deploys (needs approval).",
        "safety_level": "dangerous", "parameters": {"type": "object"},
        "sandbox": {"image": "toolreg/base", "command": ["echo", "deployed"],
                    "limits": {"timeout_ms": 30_000}},
    }  # fmt: skip
    (tools / "deploy.yaml").write_text(yaml.safe_dump(deploy))
    alice_key, alice_public = generate_keypair()
    clients = [
        {"id": who, "token_sha256": sha(TOKENS[who]), "roles": ["execute"],
         "max_safety_level": "dangerous"}
        for who in ("agent", "rival")
    ] + [{"id": "alice", "token_sha256": sha(TOKENS["alice"]), "roles": ["approve"]}]  # fmt: skip
    policy = base / "policy.yaml"
    policy.write_text(yaml.safe_dump({
        "audience": "toolreg-mcp-tasks",
        "approvers": [{"id": "alice", "public_key": alice_public, "groups": ["ops"]}],
        "approval_rules": [{"match": {"level": "dangerous"}, "approvals_required": 1}],
        "clients": clients,
    }))  # fmt: skip
    server = spawn_server(base / "data", "--tools", str(tools), "--policy", str(policy), cwd=ROOT)
    yield Served(server, base / "data", policy, alice_key)
    server.kill()


@pytest.fixture(scope="module")
def bridge(served: Served) -> Iterator[BridgeProcess]:
    process = spawn_bridge(served.server.address, "--policy", str(served.policy))
    yield process
    process.stop()


def in_modern_session(url: str, token: str, body: Any) -> Any:
    """An MCP session on 2026-07-28 (server/discover) declaring the tasks extension."""

    async def run() -> Any:
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
        assert isinstance(http, httpx2.AsyncClient)
        with anyio.fail_after(180):
            async with (
                http,
                streamable_http_client(url, http_client=http) as (read, write),
                ClientSession(
                    read, write, extensions={TASKS_EXTENSION: {}},
                    result_claims={TASKS_EXTENSION: [TASK_CLAIM]},
                ) as session,
            ):  # fmt: skip
                found = await session.discover()
                assert found.capabilities.extensions is not None
                assert TASKS_EXTENSION in found.capabilities.extensions
                return await body(session)

    return anyio.run(run)


def in_plain_session(url: str, token: str, body: Any) -> Any:
    """An MCP session on 2026-07-28 that does not declare the tasks extension."""

    async def run() -> Any:
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
        with anyio.fail_after(60):
            async with (
                http,
                streamable_http_client(url, http_client=http) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.discover()
                return await body(session)

    return anyio.run(run)


async def get(session: ClientSession, task_id: str) -> TaskView:
    request = TasksGet(params=TaskIdParams(task_id=task_id))
    return await session.send_request(request, TaskView)


async def poll(session: ClientSession, task_id: str, until: set[str], within_s: float) -> TaskView:
    deadline = time.monotonic() + within_s
    while True:
        task = await get(session, task_id)
        if task.status in until or time.monotonic() > deadline:
            return task
        await anyio.sleep(0.2)


def containers_of(execution_id: str) -> list[str]:
    out = subprocess.run(
        ["docker", "ps", "-a", "-q", "--filter", f"label={EXECUTION_LABEL}={execution_id}"],
        check=True, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return out.stdout.split()


def audit_of(data_dir: Path, execution_id: str, within_s: float = 10.0) -> dict[str, Any]:
    until = time.monotonic() + within_s
    while True:
        for _seq, _kind, record in store_file.audit_rows(data_dir, "execution"):
            entry: dict[str, Any] = json.loads(record)
            if entry.get("execution_id") == execution_id:
                return entry
        if time.monotonic() > until:
            raise AssertionError(f"no audit record for execution {execution_id}")
        time.sleep(0.2)


def test_a_long_call_runs_as_a_task_polled_to_its_result(bridge: BridgeProcess) -> None:
    async def start(session: ClientSession) -> tuple[TaskView, TaskView]:
        created = await session.call_tool("slow", {}, allow_claimed=True)
        assert isinstance(created, CreatedTask), created
        assert created.status == "working"
        extra = created.model_extra or {}
        assert isinstance(extra.get("ttlMs"), int) and isinstance(extra.get("pollIntervalMs"), int)
        now = await get(session, created.task_id)  # at once: the task is there
        assert now.task_id == created.task_id and now.status == "working"
        # A short tool answers as a plain call.
        plain = await session.call_tool("quick", {})
        assert isinstance(plain, types.CallToolResult) and not plain.is_error
        return created, now

    created, _ = in_modern_session(bridge.url, TOKENS["agent"], start)

    async def reconnect(session: ClientSession) -> TaskView:
        """Another MCP session of the same client: its task is still there."""
        return await poll(session, created.task_id, {"completed", "failed"}, 120)

    done = in_modern_session(bridge.url, TOKENS["agent"], reconnect)
    assert done.status == "completed", done
    assert done.result is not None and not done.result.get("isError")
    assert done.result["content"][0]["text"] == "working\ndone\n"

    async def rival(session: ClientSession) -> int:
        with pytest.raises(MCPError) as info:
            await get(session, created.task_id)
        return info.value.error.code

    assert in_modern_session(bridge.url, TOKENS["rival"], rival) == types.INVALID_PARAMS

    async def misrouted(session: ClientSession) -> int:
        """The Mcp-Name header names another task than the body (SEP-2243)."""
        params = RoutedParams(task_id=created.task_id, route="f" * 32)
        with pytest.raises(MCPError) as info:
            await session.send_request(TasksGetRouted(params=params), TaskView)
        return info.value.error.code

    assert in_modern_session(bridge.url, TOKENS["agent"], misrouted) == -32020

    async def undeclared(session: ClientSession) -> int:
        """A request whose client capabilities do not name the extension."""
        with pytest.raises(MCPError) as info:
            await get(session, created.task_id)
        return info.value.error.code

    assert in_plain_session(bridge.url, TOKENS["agent"], undeclared) == -32021


def test_cancelling_a_task_stops_its_sandbox(bridge: BridgeProcess, served: Served) -> None:
    async def body(session: ClientSession) -> tuple[str, TaskView, int]:
        created = await session.call_tool("long", {}, allow_claimed=True)
        assert isinstance(created, CreatedTask), created
        deadline = time.monotonic() + 120
        while True:  # until the call has started (its execution id is told)
            task = await get(session, created.task_id)
            found = RUNNING.search(task.status_message or "")
            if found or time.monotonic() > deadline:
                break
            await anyio.sleep(0.2)
        assert found, task
        execution_id = found.group(1)
        await anyio.sleep(1.0)  # the tool runs
        # Its id is told before it waits for a sandbox: the container comes after,
        # later still on a busy machine.
        deadline = time.monotonic() + CONTAINER_WAIT_S
        while not containers_of(execution_id) and time.monotonic() < deadline:
            await anyio.sleep(0.2)
        assert containers_of(execution_id), "the call's container runs"
        cancel = TasksCancel(params=TaskIdParams(task_id=created.task_id))
        ack = await session.send_request(cancel, types.EmptyResult)
        assert isinstance(ack, types.EmptyResult)
        after = await get(session, created.task_id)
        # Already ended: acknowledged again (idempotent), and it stays cancelled.
        await session.send_request(cancel, types.EmptyResult)
        again = await get(session, created.task_id)
        return execution_id, after, again.status

    execution_id, after, again = in_modern_session(bridge.url, TOKENS["agent"], body)
    assert after.status == "cancelled" and after.result is None
    assert again == "cancelled"
    deadline = time.monotonic() + 20
    while containers_of(execution_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert containers_of(execution_id) == []
    record = audit_of(served.data_dir, execution_id)
    assert record["status"] == "CANCELLED" and record["cancelled_by"] == "agent", record
    assert record["cancel_reason"].startswith("MCP task ") and record["duration_ms"] < 30_000


def approval_request_of(task: TaskView) -> str:
    found = re.search(r"\b[0-9a-f]{32}\b", task.status_message or "")
    assert found, task
    return found.group(0)


def test_a_task_waits_for_approvers_then_runs_once(bridge: BridgeProcess, served: Served) -> None:
    """A dangerous call's task is input_required until the approver approves
    in the registry; the next tasks/get runs the call, once. A rejected
    request completes its task with the approver's reason."""

    async def ask(session: ClientSession) -> tuple[str, str]:
        approved = await session.call_tool("deploy", {}, allow_claimed=True)
        rejected = await session.call_tool("deploy", {"why": "other"}, allow_claimed=True)
        assert isinstance(approved, CreatedTask) and isinstance(rejected, CreatedTask)
        for task in (approved, rejected):
            waiting = await poll(session, task.task_id, {"input_required", "completed"}, 60)
            assert waiting.status == "input_required", waiting
        return approved.task_id, rejected.task_id

    approved_id, rejected_id = in_modern_session(bridge.url, TOKENS["agent"], ask)

    async def request_ids(session: ClientSession) -> list[str]:
        return [approval_request_of(await get(session, t)) for t in (approved_id, rejected_id)]

    to_approve, to_reject = in_modern_session(bridge.url, TOKENS["agent"], request_ids)
    with RegistryClient.connect(served.server.address, token=TOKENS["alice"]) as alice:
        request = alice.stub.GetApprovalRequest(pb.GetApprovalRequestRequest(id=to_approve))
        token = mint_for(load_private_key(served.alice_key), issuer="alice", request=request,
                         bind_request=True)  # fmt: skip
        alice.stub.SubmitApproval(pb.SubmitApprovalRequest(request_id=to_approve, token=token))
        alice.stub.RejectApprovalRequest(
            pb.RejectApprovalRequestRequest(request_id=to_reject, reason="not this week")
        )

    async def finish(session: ClientSession) -> tuple[TaskView, TaskView]:
        done = await poll(session, approved_id, {"completed", "failed"}, 120)
        refused = await poll(session, rejected_id, {"completed", "failed"}, 30)
        return done, refused

    done, refused = in_modern_session(bridge.url, TOKENS["agent"], finish)
    assert done.status == "completed" and done.result is not None, done
    assert not done.result.get("isError") and done.result["content"][0]["text"] == "deployed\n"
    assert refused.status == "completed" and refused.result is not None, refused
    assert refused.result["isError"] is True
    assert "rejected by alice: not this week" in refused.result["content"][0]["text"]
    runs = [json.loads(r) for _s, _k, r in store_file.audit_rows(served.data_dir, "execution")]
    ran = [r for r in runs if r["tool"] == "deploy" and r["status"] == "OK"]
    assert len(ran) == 1 and ran[0]["approval_request_id"] == to_approve, ran
