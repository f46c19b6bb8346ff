"""The kill switch end to end (issue 22): a real server with a policy file,
real SQLite and the real engine. Deleting and disabling a tool with warm
containers and a call running, its open approval requests voided with the
reason (as a watch sees it), the audit log, who may do what, a name
registered again that no earlier approval runs, and the CLI."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.client.registry_client import RegistryClient
from registry_server.domain.models import ToolDefinition, parse_definition
from registry_server.domain.outcome import Status
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint, mint_for
from tests import store_file
from tests.factories import sha
from tests.integration.conftest import Running, StartServer
from tests.security.conftest import approvers_of, containers_of, rpc_code, wait_until_gone

ROOT = Path(__file__).resolve().parents[2]
AUDIENCE = "toolreg-kill-switch"
TOKENS = {who: f"{who}-secret" for who in ("agent", "team-a", "team-b", "ops", "alice", "bob")}
WAIT_S = 30.0  # seconds a warm pool may take to fill, or a container to go, on this machine
EVENT = pb.ApprovalEventType


@dataclass
class Deployment:
    running: Running
    keys: dict[str, bytes]  # approver id -> private key PEM
    data_dir: Path
    engine: docker.DockerClient

    def client(self, who: str) -> RegistryClient:
        return RegistryClient(self.running.address, token=TOKENS[who])

    def sign(self, approver: str, request: Any) -> str:
        """A token bound to ``request`` (as `toolreg approvals approve` makes them)."""
        return mint_for(load_private_key(self.keys[approver]), issuer=approver, request=request,
                        ttl_s=300)  # fmt: skip

    def audit(self, kind: str) -> list[dict[str, Any]]:
        return [json.loads(r) for _, _, r in store_file.audit_rows(self.data_dir, kind)]

    def warm(self, name: str) -> int:
        assert self.running.app.pools is not None
        return self.running.app.pools.stats().warm.get(name, 0)

    def wait_warm(self, name: str, count: int) -> None:
        wait_for(f"{count} warm containers of {name}", lambda: self.warm(name) >= count)


def wait_for(what: str, check: Any, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def write_policy(path: Path, public: dict[str, str]) -> None:
    policy = {
        "audience": AUDIENCE,
        "approvers": approvers_of(public),  # alice, bob: security; carol: ops
        "approval_rules": [
            {"match": {"level": "dangerous"}, "approvals_required": 1, "groups": ["security"],
             "max_token_ttl_s": 600},
        ],
        "clients": [
            {"id": "agent", "token_sha256": sha(TOKENS["agent"]), "roles": ["execute"],
             "max_safety_level": "dangerous"},
            {"id": "team-a", "token_sha256": sha(TOKENS["team-a"]), "roles": ["register"],
             "register": {"max_safety_level": "dangerous", "images": ["toolreg/base"]}},
            {"id": "team-b", "token_sha256": sha(TOKENS["team-b"]), "roles": ["register"]},
            {"id": "ops", "token_sha256": sha(TOKENS["ops"]), "roles": ["admin"]},
            {"id": "alice", "token_sha256": sha(TOKENS["alice"]), "roles": ["approve"]},
            {"id": "bob", "token_sha256": sha(TOKENS["bob"]), "roles": ["approve"]},
        ],
    }  # fmt: skip
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


@pytest.fixture
def deployment(
    start_server: StartServer, tmp_path: Path, engine: docker.DockerClient
) -> Iterator[Deployment]:
    pairs = {who: generate_keypair() for who in ("alice", "bob", "carol")}
    write_policy(tmp_path / "policy.yaml", {who: pair[1] for who, pair in pairs.items()})
    data_dir = tmp_path / "data"
    running = start_server(data_dir=data_dir, policy_file=tmp_path / "policy.yaml", max_warm=8,
                           warm_max_age_s=120)  # fmt: skip
    yield Deployment(running, {who: pair[0] for who, pair in pairs.items()}, data_dir, engine)
    running.stop()
    assert wait_until_gone(engine, running) == [], "containers left behind"


def shell_tool(name: str, script: str, *, level: str = "safe", pool: int = 0) -> ToolDefinition:
    return parse_definition({
        "name": name, "description": f"test tool {name}", "parameters": {"type": "object"},
        "safety_level": level, "warm_pool": pool,
        "sandbox": {"image": "toolreg/base", "command": ["sh", "-c", script]},
    })  # fmt: skip


SLOW = shell_tool("slow", "echo started; sleep 2; echo done", pool=2)
DANGER = shell_tool("danger", "cat", level="dangerous")
GREET = shell_tool("greet", "echo hello", pool=1)


class Watcher:
    """One WatchApprovalRequests, read on its own thread."""

    def __init__(self, client: RegistryClient) -> None:
        self.call = client.stub.WatchApprovalRequests(pb.WatchApprovalRequestsRequest(), timeout=60)
        self.events: queue.Queue[pb.ApprovalEvent | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for event in self.call:
                self.events.put(event)
        except grpc.RpcError:
            pass
        self.events.put(None)

    def next(self, timeout_s: float = 10) -> pb.ApprovalEvent:
        item = self.events.get(timeout=timeout_s)
        assert item is not None, "the watch ended"
        return item

    def until_synced(self) -> list[pb.ApprovalEvent]:
        current = []
        while (event := self.next()).type != EVENT.APPROVAL_EVENT_TYPE_SYNCED:
            current.append(event)
        return current


def next_second() -> None:
    """Approval tokens carry iat in whole seconds: one signed in the second of
    a deletion counts as signed before it. Wait for the next second."""
    time.sleep(1.02 - time.time() % 1)


def test_deleting_a_tool_with_warm_containers_a_running_call_and_open_requests(
    deployment: Deployment,
) -> None:
    d = deployment
    owner, agent, alice = d.client("team-a"), d.client("agent"), d.client("alice")
    owner.register_tool(SLOW)
    first_danger = owner.register_tool(DANGER)
    d.wait_warm("slow", 2)

    # Two open requests for the dangerous tool, one of them approved already,
    # and an unbound token for a third call that nobody has presented yet.
    approved = agent.execute_tool("danger", {"n": 1}).approval_request
    pending = agent.execute_tool("danger", {"n": 2}).approval_request
    assert approved is not None and pending is not None
    assert alice.submit_approval_token(approved.id, d.sign("alice", approved)).state == "APPROVED"
    third = agent.execute_tool("danger", {"n": 3}).approval_request
    assert third is not None
    unbound = mint(
        load_private_key(d.keys["bob"]), issuer="bob", audience=AUDIENCE, tool_name="danger",
        tool_digest=third.tool_digest, args_digest=third.arguments_digest, requester="agent",
        ttl_s=300,
    )  # fmt: skip
    watch = Watcher(alice)
    assert {e.request.id for e in watch.until_synced()} == {approved.id, pending.id, third.id}

    # A call of the pooled tool that has started (it printed) when the tool goes.
    stream = agent.stream_tool("slow", {})
    first = next(stream)
    assert first.stdout == b"started\n"

    owner.delete_tool("slow", "replaced by slow2")

    assert d.warm("slow") == 0  # its pool is drained at once
    rest = list(stream)
    result = rest[-1].result
    assert result is not None and result.success, result  # the running call finished
    assert b"".join(e.stdout for e in rest) == b"done\n"
    assert agent.execute_tool("slow", {}).status is Status.TOOL_NOT_FOUND
    assert [t.name for t in agent.list_tool_definitions()] == ["danger"]
    # Nothing of it is left on the engine (the dangerous tool keeps no warm ones).
    wait_for("the containers of slow to go", lambda: containers_of(d.engine, d.running) == [])

    owner.delete_tool("danger", "compromised image")

    why = "tool 'danger' was deleted: compromised image"
    voided = [watch.next() for _ in range(3)]
    assert [EVENT.Name(e.type) for e in voided] == ["APPROVAL_EVENT_TYPE_VOIDED"] * 3
    assert sorted(e.request.id for e in voided) == sorted([approved.id, pending.id, third.id])
    assert {(e.reason, e.request.state, e.request.voided_reason) for e in voided} == {
        (why, "VOIDED", why)
    }
    seen = agent.get_approval_request(approved.id)
    assert (seen.state, seen.voided_reason) == ("VOIDED", why)
    assert {r.id for r in alice.list_approval_requests("VOIDED")} == {
        approved.id, pending.id, third.id,
    }  # fmt: skip
    assert agent.execute_tool("danger", {"n": 1}).status is Status.TOOL_NOT_FOUND

    # The name is free again: a new tool with the very same definition and digest.
    again = owner.register_tool(DANGER)
    assert again.digest == first_danger.digest
    denied = agent.execute_tool("danger", {"n": 1}, approval_request_id=approved.id)
    assert denied.status is Status.APPROVAL_DENIED
    assert denied.error == (f"approval denied: approval request {approved.id} was voided: {why}")
    old = agent.execute_tool("danger", {"n": 3}, approval_tokens=[unbound])
    assert old.status is Status.APPROVAL_DENIED
    assert "was issued before tool 'danger' was last deleted or disabled" in old.error
    # Asked again, the call opens a new request, which a new approval runs.
    next_second()
    fresh = agent.execute_tool("danger", {"n": 1})
    assert fresh.status is Status.APPROVAL_REQUIRED and fresh.approval_request is not None
    assert fresh.approval_request.id not in (approved.id, pending.id, third.id)
    alice.submit_approval_token(fresh.approval_request.id, d.sign("alice", fresh.approval_request))
    ran = agent.execute_tool("danger", {"n": 1}, approval_request_id=fresh.approval_request.id)
    assert ran.success and json.loads(ran.content) == {"n": 1}

    registrations = [
        (r["event"], r["tool"], r.get("by"), r.get("reason")) for r in d.audit("registration")
    ]
    assert registrations == [
        ("created", "slow", "team-a", None),
        ("created", "danger", "team-a", None),
        ("deleted", "slow", "team-a", "replaced by slow2"),
        ("deleted", "danger", "team-a", "compromised image"),
        ("created", "danger", "team-a", None),
    ]
    voids = [r for r in d.audit("approval") if r["event"] == "voided"]
    assert sorted(r["request_id"] for r in voids) == sorted([approved.id, pending.id, third.id])
    assert {(r["tool"], r["reason"], r["by"]) for r in voids} == {("danger", why, "team-a")}
    for c in (owner, agent, alice):
        c.close()


def test_disabling_a_tool_refuses_its_calls_until_it_is_enabled(deployment: Deployment) -> None:
    d = deployment
    owner, agent, ops = d.client("team-a"), d.client("agent"), d.client("ops")
    owner.register_tool(GREET)
    owner.register_tool(DANGER)
    d.wait_warm("greet", 1)
    request = agent.execute_tool("danger", {"n": 1}).approval_request
    assert request is not None
    assert agent.execute_tool("greet", {}).content == "hello\n"
    d.wait_warm("greet", 1)

    off = ops.set_tool_enabled("greet", False, "prints customer data")
    ops.set_tool_enabled("danger", False, "under review")

    assert (off.disabled, off.disabled_reason) == (True, "prints customer data")
    assert d.warm("greet") == 0
    wait_for("the warm container to go", lambda: containers_of(d.engine, d.running) == [])
    listed = {t.name: (t.disabled, t.disabled_reason) for t in agent.list_tool_definitions()}
    assert listed == {"danger": (True, "under review"), "greet": (True, "prints customer data")}
    assert agent.get_tool("greet").disabled
    assert agent.tool_schemas() == []  # models are not offered either
    refused = agent.execute_tool("greet", {})
    assert (refused.status, refused.success) == (Status.TOOL_DISABLED, False)
    assert refused.error == "Tool 'greet' is disabled: prints customer data"
    streamed = list(agent.stream_tool("greet", {}))
    assert [e.result.status for e in streamed if e.result] == [Status.TOOL_DISABLED]
    assert agent.execute_tool("danger", {"n": 2}).status is Status.TOOL_DISABLED
    voided = agent.get_approval_request(request.id)
    assert (voided.state, voided.voided_reason) == (
        "VOIDED",
        "tool 'danger' was disabled: under review",
    )
    executions = d.audit("execution")
    assert [(r["tool"], r["status"]) for r in executions[-3:]] == [
        ("greet", "TOOL_DISABLED"), ("greet", "TOOL_DISABLED"), ("danger", "TOOL_DISABLED"),
    ]  # fmt: skip

    on = ops.set_tool_enabled("greet", True)
    ops.set_tool_enabled("danger", True)

    assert (on.disabled, on.disabled_reason) == (False, "")
    assert agent.execute_tool("greet", {}).content == "hello\n"
    d.wait_warm("greet", 1)  # refilled
    assert [s["function"]["name"] for s in agent.tool_schemas()] == ["danger", "greet"]
    # The voided request stays voided; the call asks for a new approval.
    denied = agent.execute_tool("danger", {"n": 1}, approval_request_id=request.id)
    assert denied.status is Status.APPROVAL_DENIED and "under review" in denied.error
    assert agent.execute_tool("danger", {"n": 1}).status is Status.APPROVAL_REQUIRED
    switches = [
        (r["event"], r["tool"], r["by"], r["reason"])
        for r in d.audit("registration") if r["event"] in ("disabled", "enabled")
    ]  # fmt: skip
    assert switches == [
        ("disabled", "greet", "ops", "prints customer data"),
        ("disabled", "danger", "ops", "under review"),
        ("enabled", "greet", "ops", ""),
        ("enabled", "danger", "ops", ""),
    ]
    for c in (owner, agent, ops):
        c.close()


def code_of(call: Any) -> grpc.StatusCode | None:
    try:
        call()
    except grpc.RpcError as exc:
        return rpc_code(exc)
    return grpc.StatusCode.OK


def test_who_may_delete_disable_and_enable(deployment: Deployment) -> None:
    d = deployment
    owner, other, agent, ops = (d.client(w) for w in ("team-a", "team-b", "agent", "ops"))
    owner.register_tool(GREET)

    with pytest.raises(grpc.RpcError) as info:
        other.delete_tool("greet", "mine now")
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "belongs to 'team-a'" in info.value.details()
    assert code_of(lambda: agent.delete_tool("greet")) == grpc.StatusCode.PERMISSION_DENIED
    for who in (owner, other, agent):  # disabling is the operator's
        with pytest.raises(grpc.RpcError) as info:
            who.set_tool_enabled("greet", False, "stop")
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: ops.set_tool_enabled("greet", False, "")) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )  # a disabling says why
    for bad in ("x" * 1001, "line\nbreak"):
        with pytest.raises(grpc.RpcError) as info:
            owner.delete_tool("greet", bad)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: owner.delete_tool("Not A Name")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: owner.delete_tool("nope")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: ops.set_tool_enabled("nope", True)) == grpc.StatusCode.NOT_FOUND
    assert not agent.get_tool("greet").disabled

    ops.set_tool_enabled("greet", False, "incident 7")
    with pytest.raises(grpc.RpcError) as info:  # deleting would switch it back on
        owner.delete_tool("greet")
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "only an admin may delete it" in info.value.details()
    ops.delete_tool("greet", "incident 7: removed")
    assert code_of(lambda: agent.get_tool("greet")) == grpc.StatusCode.NOT_FOUND
    # registered again, by anyone with the register role: a new, enabled tool
    assert not other.register_tool(GREET).disabled
    for c in (owner, other, agent, ops):
        c.close()


def cli(d: Deployment, who: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TOOLREG_TOKEN": TOKENS[who], "TOOLREG_ADDRESS": d.running.address}
    return subprocess.run(
        [sys.executable, "-m", "registry_server.cli", *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=env,
    )  # fmt: skip


def test_the_cli_disables_enables_and_deletes(deployment: Deployment) -> None:
    d = deployment
    owner = d.client("team-a")
    owner.register_tool(GREET)

    off = cli(d, "ops", "tools", "disable", "greet", "--reason", "leaks data")
    assert (off.returncode, off.stdout) == (0, "disabled greet: leaks data\n"), off.stderr
    listed = cli(d, "agent", "tools", "list")
    assert "[DISABLED: leaks data]" in listed.stdout
    shown = json.loads(cli(d, "agent", "tools", "get", "greet").stdout)
    assert (shown["disabled"], shown["disabled_reason"]) == (True, "leaks data")
    ran = cli(d, "agent", "exec", "greet")
    assert ran.returncode == 1 and "TOOL_DISABLED" in ran.stderr and "leaks data" in ran.stderr
    missing = cli(d, "ops", "tools", "disable", "greet")
    assert missing.returncode == 2 and "--reason" in missing.stderr  # the reason is required
    refused = cli(d, "team-a", "tools", "enable", "greet")
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr

    on = cli(d, "ops", "tools", "enable", "greet")
    assert (on.returncode, on.stdout) == (0, "enabled greet\n"), on.stderr
    assert cli(d, "agent", "exec", "greet").stdout == "hello\n"
    gone = cli(d, "team-a", "tools", "delete", "greet", "--reason", "retired")
    assert (gone.returncode, gone.stdout) == (0, "deleted greet\n"), gone.stderr
    after = cli(d, "agent", "tools", "get", "greet")
    assert after.returncode == 1 and "NOT_FOUND" in after.stderr
    owner.close()
