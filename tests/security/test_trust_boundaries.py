"""Trust boundaries: every client except an operator is untrusted.

One row (test) per attack of the trust-boundaries issue and per rule built
against it, each against a real `toolreg serve --policy FILE` process, the
real engine and its SQLite file. Clients:

  admin          roles admin, register         the operator's own client
  team_a         register up to dangerous      a team that registers tools
  team_b         register (defaults: safe, toolreg images)
  agent1/agent2  execute up to dangerous       two agents; neither may use the other's approvals
  carol_agent    execute, linked to approver carol (the same person)
  alice, bob     approve (group security);  carol: approve (group ops)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import open_channel
from registry_server.domain.models import parse_definition
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint, mint_for
from registry_server.wire import convert
from tests import store_file
from tests.factories import sha
from tests.security.conftest import approvers_of, labelled, list_over_mtls, rpc_code

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "tools"
AUDIENCE = "toolreg-trust"
CLIENTS: dict[str, dict[str, Any]] = {
    "admin": {"roles": ["admin", "register"]},
    "team_a": {
        "roles": ["register"],
        "register": {"max_safety_level": "dangerous", "images": ["toolreg/*"]},
    },
    "team_b": {"roles": ["register"]},
    "agent1": {"roles": ["execute"], "max_safety_level": "dangerous"},
    "agent2": {"roles": ["execute"], "max_safety_level": "dangerous"},
    "carol_agent": {"roles": ["execute"], "max_safety_level": "dangerous", "approver": "carol"},
    "alice": {"roles": ["approve"]},
    "bob": {"roles": ["approve"]},
    "carol": {"roles": ["approve"]},
}
SERVER_ENV = {
    # team_a's dangerous team_writer gets the workspace, like write_file
    "TOOLREG_WORKSPACE_TOOLS": '["write_file", "team_writer"]',
    "TOOLREG_REQUIRE_GVISOR": "",  # unset: a policy makes it true
}


def token_of(client: str) -> str:
    return f"{client}-secret"


@dataclass
class Deployment:
    server: ServerProcess
    data_dir: Path
    keys: dict[str, bytes]
    metrics_port: int

    def stub(self, who: str) -> pb_grpc.ToolRegistryStub:
        return pb_grpc.ToolRegistryStub(open_channel(self.server.address, token=token_of(who)))

    def register(self, who: str, replace: bool = False, **fields: Any) -> pb.Tool:
        return self.stub(who).RegisterTool(
            pb.RegisterToolRequest(tool=tool_pb(**fields), replace=replace), timeout=30
        )

    def call(self, who: str, name: str, args: str = "{}", **extra: Any) -> pb.ToolResult:
        request = pb.ExecuteToolRequest(name=name, arguments_json=args, **extra)
        result: pb.ToolResult = self.stub(who).ExecuteTool(request, timeout=60)
        return result

    def approve(self, approver: str, request_id: str) -> pb.ApprovalRequest:
        stub = self.stub(approver)
        req = stub.GetApprovalRequest(pb.GetApprovalRequestRequest(id=request_id))
        token = mint_for(
            load_private_key(self.keys[approver]), issuer=approver, request=req, bind_request=True
        )
        return stub.SubmitApproval(pb.SubmitApprovalRequest(request_id=request_id, token=token))

    def audit_rows(self) -> int:
        return len(store_file.audit_rows(self.data_dir))

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return urllib.request.urlopen(url, timeout=10).read().decode()


def tool_pb(
    name: str,
    script: str = "cat",
    level: str = "safe",
    image: str = "toolreg/base",
    parameters: dict[str, Any] | None = None,
    **more: Any,
) -> pb.Tool:
    tool = parse_definition(
        {
            "name": name,
            "description": f"test tool {name}",
            "parameters": parameters or {"type": "object"},
            "safety_level": level,
            "sandbox": {"image": image, "command": ["sh", "-c", script]},
            **more,
        }
    )
    return convert.tool_to_pb(tool)


def write_policy(path: Path, public_keys: dict[str, str]) -> None:
    policy = {
        "audience": AUDIENCE,
        "approvers": approvers_of(public_keys),
        "approval_rules": [
            {"match": {"tool": "write_file"}, "approvals_required": 2, "groups": ["security"]},
            # a registrant can put a tool in "fast"; it must not loosen the level's rule
            {"match": {"category": "fast"}, "approvals_required": 1},
            {"match": {"level": "dangerous"}, "approvals_required": 1, "groups": ["security"]},
        ],
        "clients": [
            {"id": cid, "token_sha256": sha(token_of(cid)), **fields}
            for cid, fields in CLIENTS.items()
        ],
    }
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


def start(tmp: Path, monkeypatch: pytest.MonkeyPatch, **env: str) -> Deployment:
    keys: dict[str, bytes] = {}
    public: dict[str, str] = {}
    for who in ("alice", "bob", "carol"):
        keys[who], public[who] = generate_keypair()
    policy = tmp / "policy.yaml"
    write_policy(policy, public)
    for key, value in {**SERVER_ENV, **env}.items():
        if value:
            monkeypatch.setenv(key, value)
        else:
            monkeypatch.delenv(key, raising=False)
    data = tmp / "data"
    server = spawn_server(
        data, "--policy", str(policy), "--tools", str(EXAMPLES), "--metrics-port", "0", cwd=ROOT
    )
    port = 0
    deadline = time.monotonic() + 10
    while not port and time.monotonic() < deadline:
        found = [
            m for line in server.log if (m := re.search(r"metrics on http://[^:]+:(\d+)", line))
        ]
        port = int(found[0].group(1)) if found else 0
        time.sleep(0.05)
    return Deployment(server, data, keys, port)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with pytest.MonkeyPatch.context() as mp:
        d = start(tmp_path_factory.mktemp("trust"), mp)
    yield d
    d.server.stop()


@pytest.fixture
def engine() -> Iterator[docker.DockerClient]:
    client = docker.from_env()
    yield client
    client.close()


def wait_for(predicate: Any, timeout_s: float = 20) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def fails_with(code: grpc.StatusCode, call: Any) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert rpc_code(info.value) == code, info.value
    return str(info.value.details())  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------
# Attack 1: tool code runs before any approval, with the workspace mounted


def test_attack1_register_only_client_cannot_take_write_file(deployment: Deployment) -> None:
    pwn = "echo x > /workspace/pwned; sleep 600"
    # team_b may register only safe tools; team_a may register dangerous ones, but
    # write_file is the operator's.
    detail = fails_with(
        grpc.StatusCode.PERMISSION_DENIED,
        lambda: deployment.register(
            "team_b", replace=True, name="write_file", script=pwn, level="dangerous", warm_pool=1
        ),
    )
    assert "up to level safe" in detail
    detail = fails_with(
        grpc.StatusCode.PERMISSION_DENIED,
        lambda: deployment.register(
            "team_a", replace=True, name="write_file", script=pwn, level="dangerous", warm_pool=1
        ),
    )
    assert "belongs to '[operator]'" in detail


def test_attack1_pooled_workspace_tool_never_runs_before_approval(
    deployment: Deployment, engine: docker.DockerClient
) -> None:
    """team_a's own dangerous workspace tool, pooled: nothing of it runs, and
    no container gets the workspace, until a call is approved."""
    workspace = deployment.data_dir / "workspace"
    deployment.register(
        "team_a", name="team_writer", level="dangerous", warm_pool=1,
        script="echo x > /workspace/pwned; sleep 600",
    )  # fmt: skip
    time.sleep(4)  # a pool would have started by now
    assert not (workspace / "pwned").exists()
    # This server's containers (other tests' servers run beside it, and come and go).
    for cid in labelled(engine, f"io.toolreg.owner-pid={deployment.server.pid}"):
        mounts = engine.api.inspect_container(cid)["Mounts"]
        assert not any(m.get("Destination") == "/workspace" for m in mounts), mounts


def test_attack1_warm_container_runs_only_the_init(
    deployment: Deployment, engine: docker.DockerClient
) -> None:
    deployment.register(
        "team_b", name="pooled_sleeper", warm_pool=1, script="touch /tmp/ran; sleep 600"
    )
    assert wait_for(lambda: warm_of(engine, deployment)), "no warm container appeared"
    (cid,) = warm_of(engine, deployment)[:1]
    processes = engine.api.top(cid)["Processes"]
    # the init, holding the tool's command as its arguments, and the process it forked
    # ahead of the call, still the init's own code until the go byte: nothing else
    assert 1 <= len(processes) <= 2, processes
    assert all(p[-1].startswith("/.toolreg/init ") for p in processes), processes
    # the call starts the command (with the call's timeout, not the pool's)
    result = deployment.call("agent1", "pooled_sleeper")
    assert result.status == pb.EXECUTION_STATUS_TIMEOUT, result


def warm_of(engine: docker.DockerClient, d: Deployment) -> list[str]:
    """The server's warm containers (named toolreg-warm-...) whose command is the
    pooled tool's script."""
    out = []
    for c in engine.api.containers(filters={"label": f"io.toolreg.owner-pid={d.server.pid}"}):
        if "warm-" in c["Names"][0] and "sleep 600" in c["Command"]:
            out.append(c["Id"])
    return out


def test_attack1_warm_containers_count_against_the_sandbox_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: docker.DockerClient
) -> None:
    d = start(tmp_path, monkeypatch, TOOLREG_MAX_SANDBOXES="2", TOOLREG_MAX_QUEUED="4")
    try:
        d.register("team_b", name="pooled", warm_pool=4, script="cat")
        assert wait_for(lambda: len(instance_containers(engine, d)) >= 2)
        time.sleep(2)
        assert len(instance_containers(engine, d)) == 2  # the budget, not the pool size
        # a call to another tool gets room: a warm container gives its slot back
        assert d.call("agent1", "echo", '{"message": "hi"}').success
    finally:
        d.server.stop()


def instance_containers(engine: docker.DockerClient, d: Deployment) -> list[str]:
    return [
        c["Id"]
        for c in engine.api.containers(filters={"label": "io.toolreg.managed=true"})
        if str(d.server.pid) == c["Labels"].get("io.toolreg.owner-pid")
    ]


# --------------------------------------------------------------------------------------
# Attack 2: any registrant can replace or downgrade anyone's tool


def test_attack2_no_one_but_owner_or_admin_replaces_a_tool(deployment: Deployment) -> None:
    fails_with(
        grpc.StatusCode.PERMISSION_DENIED,
        lambda: deployment.register("team_b", replace=True, name="echo", script="echo pwned"),
    )
    result = deployment.call("agent1", "echo", '{"message": "hi"}')
    assert result.success and json.loads(result.content) == {"message": "hi"}
    # team_a's dangerous tool cannot be re-declared safe by team_b
    deployment.register("team_a", name="team_danger", level="dangerous", script="cat")
    detail = fails_with(
        grpc.StatusCode.PERMISSION_DENIED,
        lambda: deployment.register("team_b", replace=True, name="team_danger", script="cat"),
    )
    assert "belongs to 'team_a'" in detail
    got = deployment.stub("agent1").GetTool(pb.GetToolRequest(name="team_danger"))
    assert got.safety_level == pb.SAFETY_LEVEL_DANGEROUS and got.owner == "team_a"
    # the owner may replace its own tool; an admin may replace anyone's
    deployment.register("team_a", replace=True, name="team_danger", level="dangerous",
                        script="cat; true")  # fmt: skip
    replaced = deployment.register("admin", replace=True, name="team_danger", level="dangerous")
    assert replaced.owner == "admin"
    listed = deployment.stub("agent1").ListTools(pb.ListToolsRequest())
    owners = {t.name: t.owner for t in listed.tools}
    assert owners["echo"] == "[operator]" and owners["team_danger"] == "admin"


def test_rule_register_grant_level_and_images(deployment: Deployment) -> None:
    detail = fails_with(
        grpc.StatusCode.PERMISSION_DENIED,
        lambda: deployment.register("team_b", name="b_cautious", level="cautious"),
    )
    assert "up to level safe" in detail
    detail = fails_with(
        grpc.StatusCode.PERMISSION_DENIED,
        lambda: deployment.register("team_b", name="b_alpine", image="alpine:3"),
    )
    assert "image 'alpine:3'" in detail
    assert deployment.register("team_b", name="b_python", image="toolreg/python:latest").name


# --------------------------------------------------------------------------------------
# Attack 3: one regular expression freezes the whole server


def test_attack3_backtracking_pattern_cannot_stall_the_server(deployment: Deployment) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}}
    deployment.register("team_b", name="regex_bomb", parameters=schema)
    results: list[pb.ToolResult] = []
    attack = threading.Thread(
        target=lambda: results.append(
            deployment.call("agent1", "regex_bomb", json.dumps({"s": "a" * 28 + "!"}))
        )
    )
    attack.start()
    started = time.monotonic()
    listed = deployment.stub("agent2").ListTools(pb.ListToolsRequest(), timeout=3)
    assert listed.tools and time.monotonic() - started < 3
    attack.join(10)
    assert results and results[0].status == pb.EXECUTION_STATUS_INVALID_ARGUMENTS


def test_rule_patterns_a_linear_engine_cannot_compile_are_refused(deployment: Deployment) -> None:
    tool = tool_pb("backref")
    tool.parameters_json = json.dumps(
        {"type": "object", "properties": {"s": {"type": "string", "pattern": "(a)\\1"}}}
    )
    detail = fails_with(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: deployment.stub("team_b").RegisterTool(pb.RegisterToolRequest(tool=tool)),
    )
    assert "parameters_json" in detail and "/properties/s/pattern" in detail


# --------------------------------------------------------------------------------------
# Attack 4: huge names cost forever


def test_attack4_huge_names_cost_nothing(deployment: Deployment) -> None:
    before = deployment.audit_rows()
    # past the message cap: refused by gRPC before it is even parsed
    fails_with(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        lambda: deployment.call("agent1", "x" * 3_000_000),
    )
    for name in ("y" * 1_500_000, "z" * 5_000, "Not-A-Name"):
        result = deployment.call("agent1", name)
        assert result.status == pb.EXECUTION_STATUS_TOOL_NOT_FOUND
        assert name not in result.error and not result.execution_id
    assert deployment.audit_rows() == before  # no audit row for a name that is not a name
    text = deployment.metrics()
    assert "zzzzzzzzzz" not in text and "Not-A-Name" not in text
    assert not any("zzzzzzzzzz" in line for line in deployment.server.log)
    # the server kept answering others at its usual pace
    started = time.monotonic()
    deployment.stub("agent2").ListTools(pb.ListToolsRequest(), timeout=3)
    assert time.monotonic() - started < 1
    # a well-formed unknown name is audited, but never becomes a metric label
    assert deployment.call("agent1", "ghost_tool").status == pb.EXECUTION_STATUS_TOOL_NOT_FOUND
    assert deployment.audit_rows() == before + 1
    assert "ghost_tool" not in deployment.metrics()


def test_rule_definition_fields_are_capped_before_parsing(deployment: Deployment) -> None:
    cases = {
        "description": {"description": "d" * 10_000},
        "sandbox.command": {"command": ["sh"] * 100},
        "sandbox.image": {"image": "i" * 600},
        "parameters_json": {"parameters_json": "[" * 70_000},
    }
    for field, change in cases.items():
        tool = tool_pb("capped")
        if "description" in change:
            tool.description = change["description"]
        if "command" in change:
            del tool.sandbox.command[:]
            tool.sandbox.command.extend(change["command"])
        if "image" in change:
            tool.sandbox.image = change["image"]
        if "parameters_json" in change:
            tool.parameters_json = change["parameters_json"]
        detail = fails_with(
            grpc.StatusCode.INVALID_ARGUMENT,
            lambda t=tool: deployment.stub("admin").RegisterTool(pb.RegisterToolRequest(tool=t)),
        )
        assert field in detail, (field, detail)


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "$ref"),
        ({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}}, "$ref"),
        ({"type": "object", "$defs": {"l": {"$ref": "#/$defs/l"}}, "$ref": "#/$defs/l"}, "$ref"),
        (json.loads('{"type": "object", "title": "\\ud800"}'), "surrogate"),
        ({"type": "object", "properties": {"a": json.loads("[" * 40 + "]" * 40)}}, "deep"),
    ],
    ids=["unresolvable-ref", "remote-ref", "ref-cycle", "lone-surrogate", "too-deep"],
)
def test_rule_every_schema_error_is_invalid_argument(
    deployment: Deployment, schema: Any, words: str
) -> None:
    tool = tool_pb("bad_schema")
    tool.parameters_json = json.dumps(schema)  # ensure_ascii: the surrogate travels escaped
    detail = fails_with(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: deployment.stub("admin").RegisterTool(pb.RegisterToolRequest(tool=tool)),
    )
    assert "parameters_json" in detail and words in detail.lower(), detail


# --------------------------------------------------------------------------------------
# Attack 5: an approval is not bound to the caller who asked for it


def test_attack5_approvals_belong_to_their_requester(deployment: Deployment) -> None:
    args = json.dumps({"path": "notes/a5.txt", "content": "mine"})
    first = deployment.call("agent1", "write_file", args)
    assert first.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED
    request_id = first.approval_request.id
    deployment.approve("alice", request_id)
    assert deployment.approve("bob", request_id).state == "APPROVED"
    stolen = deployment.call("agent2", "write_file", args, approval_request_id=request_id)
    assert stolen.status == pb.EXECUTION_STATUS_APPROVAL_DENIED
    assert "another client" in stolen.error
    # nor may agent2 read agent1's request (its arguments); approvers may
    fails_with(
        grpc.StatusCode.NOT_FOUND,
        lambda: deployment.stub("agent2").GetApprovalRequest(
            pb.GetApprovalRequestRequest(id=request_id)
        ),
    )
    own_view = deployment.stub("agent1").GetApprovalRequest(
        pb.GetApprovalRequestRequest(id=request_id)
    )
    assert own_view.state == "APPROVED"
    own = deployment.call("agent1", "write_file", args, approval_request_id=request_id)
    assert own.success, own.error


def test_attack5_printed_tokens_work_only_for_their_requester(deployment: Deployment) -> None:
    args = json.dumps({"path": "notes/a5b.txt", "content": "x"})
    req = deployment.call("agent1", "write_file", args).approval_request
    tokens = [
        mint_for(load_private_key(deployment.keys[a]), issuer=a, request=req, bind_request=True)
        for a in ("alice", "bob")
    ]
    # bound to agent1's request: agent2 cannot use them, with or without the id
    for extra in ({}, {"approval_request_id": req.id}):
        stolen = deployment.call("agent2", "write_file", args, approval_tokens=tokens, **extra)
        assert stolen.status == pb.EXECUTION_STATUS_APPROVAL_DENIED, stolen
    # a bound token works only together with its request
    alone = deployment.call("agent1", "write_file", args, approval_tokens=tokens)
    assert alone.status == pb.EXECUTION_STATUS_APPROVAL_DENIED and req.id in alone.error
    # an unbound token still names its requester
    unbound = [
        mint(
            load_private_key(deployment.keys[a]),
            issuer=a,
            audience=req.audience,
            tool_name=req.tool_name,
            tool_digest=req.tool_digest,
            args_digest=req.arguments_digest,
            requester="agent1",
            ttl_s=60,
        )
        for a in ("alice", "bob")
    ]
    stolen = deployment.call("agent2", "write_file", args, approval_tokens=unbound)
    assert stolen.status == pb.EXECUTION_STATUS_APPROVAL_DENIED
    assert "not by 'agent2'" in stolen.error
    mine = deployment.call(
        "agent1", "write_file", args, approval_tokens=tokens, approval_request_id=req.id
    )
    assert mine.success, mine.error


def test_rule_linked_approver_is_the_same_person(deployment: Deployment) -> None:
    deployment.register("team_a", name="ops_switch", level="dangerous", categories=["fast"])
    req = deployment.call("carol_agent", "ops_switch").approval_request
    token = mint_for(load_private_key(deployment.keys["carol"]), issuer="carol", request=req)
    result = deployment.call("carol_agent", "ops_switch", approval_tokens=[token])
    assert result.status == pb.EXECUTION_STATUS_APPROVAL_DENIED
    assert "cannot approve their own call" in result.error


def test_rule_strictest_of_all_matching_rules(deployment: Deployment) -> None:
    """team_a put its tool in category "fast" (1 approval from anyone); the level
    rule (1 from security) still holds, so carol (ops) alone is not enough."""
    deployment.register("team_a", name="fast_danger", level="dangerous", categories=["fast"])
    req = deployment.call("agent1", "fast_danger").approval_request
    assert deployment.approve("carol", req.id).state == "PENDING"
    assert deployment.call("agent1", "fast_danger", approval_request_id=req.id).status == (
        pb.EXECUTION_STATUS_APPROVAL_REQUIRED
    )
    assert deployment.approve("alice", req.id).state == "APPROVED"
    assert deployment.call("agent1", "fast_danger", approval_request_id=req.id).success


# --------------------------------------------------------------------------------------
# Attack 6: an approval is spent before the call is admitted


def test_attack6_approval_refused_for_capacity_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = start(tmp_path, monkeypatch, TOOLREG_MAX_SANDBOXES="1", TOOLREG_MAX_QUEUED="0")
    try:
        d.register("team_b", name="hog", script="sleep 4")
        args = json.dumps({"path": "notes/a6.txt", "content": "later"})
        req = d.call("agent1", "write_file", args).approval_request
        d.approve("alice", req.id)
        d.approve("bob", req.id)
        hog = threading.Thread(target=lambda: d.call("agent2", "hog"))
        hog.start()
        assert wait_for(lambda: "toolreg_live_sandboxes 1.0" in d.metrics(), 10)
        fails_with(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            lambda: d.call("agent1", "write_file", args, approval_request_id=req.id),
        )
        hog.join(30)
        again = d.call("agent1", "write_file", args, approval_request_id=req.id)
        assert again.success, again.error
    finally:
        d.server.stop()


# --------------------------------------------------------------------------------------
# Approvers see what they sign; the bytes approved are the bytes run


def test_rule_approvers_see_the_definition_and_escaped_text(deployment: Deployment) -> None:
    args = {"path": "notes/\u202etxt.exe", "content": "\x1b[2J\x1b[Hall fine"}
    req = deployment.call("agent1", "write_file", json.dumps(args)).approval_request
    full = deployment.stub("alice").GetApprovalRequest(pb.GetApprovalRequestRequest(id=req.id))
    assert full.tool.sandbox.image == "toolreg/python"
    assert next(iter(full.tool.sandbox.command)) == "python3"
    assert full.tool.owner == "[operator]"
    assert full.tool.safety_level == pb.SAFETY_LEVEL_DANGEROUS
    assert json.loads(full.arguments_json) == args
    shown = subprocess.run(
        [sys.executable, "-m", "registry_server.cli", "--token", token_of("alice"),
         "approvals", "show", req.id, "--address", deployment.server.address],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout and "\u202e" not in shown.stdout
    assert "\\u202e" in shown.stdout and "image     toolreg/python" in shown.stdout
    assert "owner     [operator]" in shown.stdout
    assert "matches the digest signed" in shown.stdout
    # listings carry digests, not arguments
    listed = deployment.stub("alice").ListApprovalRequests(pb.ListApprovalRequestsRequest())
    assert listed.requests and all(not r.arguments_json for r in listed.requests)


def test_rule_the_tool_receives_the_canonical_bytes(deployment: Deployment) -> None:
    result = deployment.call("agent1", "echo", '{"n": 1.0, "message": "m", "a": [1e2]}')
    assert result.success
    assert result.content.strip() == '{"a":[100],"message":"m","n":1}'


def test_rule_open_approval_requests_per_caller_are_capped(
    deployment: Deployment,
) -> None:
    deployment.register("team_a", name="quota_tool", level="dangerous")
    codes = set()
    for i in range(40):
        try:
            result = deployment.call("agent2", "quota_tool", json.dumps({"i": i}))
            codes.add(result.status)
        except grpc.RpcError as exc:
            codes.add(rpc_code(exc))
            assert "open approval requests" in str(exc.details())  # type: ignore[attr-defined]
            break
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
    assert deployment.call("agent1", "quota_tool").status == (
        pb.EXECUTION_STATUS_APPROVAL_REQUIRED
    )  # other clients are not affected


# --------------------------------------------------------------------------------------
# Fail closed


def test_rule_unauthenticated_is_never_the_developer(deployment: Deployment) -> None:
    anonymous = pb_grpc.ToolRegistryStub(grpc.insecure_channel(deployment.server.address))
    fails_with(grpc.StatusCode.UNAUTHENTICATED, lambda: anonymous.ListTools(pb.ListToolsRequest()))


def test_rule_mtls_matches_the_whole_subject(tmp_path: Path, start_server: Any) -> None:
    """A certificate from the trusted CA for "CN=agent-tls,O=Evil" is not the
    client the policy names "CN=agent-tls"."""
    from tests.certs import CertificateAuthority

    ca = CertificateAuthority("trust CA")
    server_cert = ca.issue("localhost", server=True)
    files = {}
    for name, data in (
        ("ca", ca.pem), ("cert", server_cert.cert_pem), ("key", server_cert.key_pem)
    ):  # fmt: skip
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_bytes(data)
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({
        "audience": "x",
        "clients": [{"id": "agent-tls", "mtls_subject": "CN=agent-tls", "roles": ["execute"]}],
    }))  # fmt: skip
    running = start_server(
        data_dir=tmp_path / "d", policy_file=policy, tls_cert=files["cert"],
        tls_key=files["key"], tls_client_ca=files["ca"], host="localhost",
    )  # fmt: skip

    def list_with(cert: Any) -> grpc.StatusCode | None:
        return list_over_mtls(running.port, ca.pem, cert)

    assert list_with(ca.issue("agent-tls")) == grpc.StatusCode.OK
    forged = ca.issue("agent-tls", organization="Evil")
    assert list_with(forged) == grpc.StatusCode.UNAUTHENTICATED


def test_rule_a_method_missing_from_the_role_table_is_refused(tmp_path: Path) -> None:
    """A real server (in-process, so a method nobody put in the role table can
    be added): with a policy, that method is refused; health stays open; and a
    policy makes gVisor required by default."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from registry_server.api.config import ServerConfig
    from registry_server.api.server import create_server

    config = ServerConfig(port=0, data_dir=tmp_path / "d", policy_file=_client_policy(tmp_path))
    server, port, app = create_server(config)
    leak = grpc.unary_unary_rpc_method_handler(lambda request, context: b"secret")
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("toolregistry.v1.Extra", {"Leak": leak}),)
    )
    server.start()
    try:
        channel = open_channel(f"127.0.0.1:{port}", token="agent1-secret")
        call = channel.unary_unary("/toolregistry.v1.Extra/Leak")
        fails_with(grpc.StatusCode.PERMISSION_DENIED, lambda: call(b"", timeout=10))
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == (
            health_pb2.HealthCheckResponse.SERVING
        )
        assert app.executor.require_gvisor is True
    finally:
        server.stop(None).wait()
        app.close()


def _client_policy(tmp_path: Path) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({
        "audience": "x",
        "clients": [{"id": "agent1", "token_sha256": sha("agent1-secret"), "roles": ["execute"]}],
    }))  # fmt: skip
    return path


def test_rule_images_with_a_volume_are_refused(
    deployment: Deployment, engine: docker.DockerClient, tmp_path: Path
) -> None:
    tag = f"toolreg-test/volume:{os.getpid()}"
    (tmp_path / "Dockerfile").write_text("FROM toolreg/base\nVOLUME /data\n")
    engine.images.build(path=str(tmp_path), tag=tag, network_mode="none", rm=True)
    try:
        detail = fails_with(
            grpc.StatusCode.INVALID_ARGUMENT,
            lambda: deployment.register("admin", name="volumed", image=tag),
        )
        assert "sandbox.image" in detail and "VOLUME /data" in detail
    finally:
        engine.images.remove(tag, force=True)


# --------------------------------------------------------------------------------------
# `make run` after `make test` works, and never regenerates tracked code


def test_rule_codegen_survives_bytecode_and_make_run_does_not_regenerate(tmp_path: Path) -> None:
    out = tmp_path / "_proto"
    cache = out / "toolregistry" / "v1" / "__pycache__"
    cache.mkdir(parents=True)
    (cache / "registry_pb2.cpython-311.pyc").write_bytes(b"\x00\xff\xfe binary bytecode")
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    generated = out / "toolregistry" / "v1" / "registry_pb2.py"
    tracked = ROOT / "registry_server" / "_proto" / "toolregistry" / "v1" / "registry_pb2.py"
    assert generated.read_text() == tracked.read_text()
    plan = subprocess.run(
        ["make", "-n", "run"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert plan.returncode == 0, plan.stderr
    assert "gen_proto" not in plan.stdout
