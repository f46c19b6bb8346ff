"""Tools' guards through a real server on loopback (issue 28): registered
over RegisterTool and from --tools, refused there when they do not compile,
checked at each call after the JSON Schema and before anything else (no
approval request, no container), absent from the exported schemas, and no
way for a registrant to loosen what the policy's approval rules ask."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest
import yaml
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.client.registry_client import RegistryClient, open_channel
from registry_server.domain.errors import InvalidDefinition
from registry_server.domain.models import Guard, parse_definition
from registry_server.domain.outcome import AppliedRule
from registry_server.signing.keys import generate_keypair
from registry_server.wire import convert
from tests.engine_events import Recording, of_label, recorded
from tests.factories import sha
from tests.integration.conftest import Running, StartServer

AUDIENCE = "toolreg-guards"
UNDER_WORK = {"condition": 'args.path.startsWith("/work/")', "message": "path must be under /work/"}
PATH_PARAMETERS = {
    "type": "object",
    "properties": {"path": {"type": "string"}},
    "required": ["path"],
    "additionalProperties": False,
}
CLIENTS: dict[str, dict[str, Any]] = {
    "admin": {"roles": ["admin", "register"]},
    # a team that registers tools, dangerous ones included: not an admin
    "team": {
        "roles": ["register"],
        "register": {"max_safety_level": "dangerous", "images": ["toolreg/*"]},
    },
    "agent": {"roles": ["execute"], "max_safety_level": "dangerous"},
    "alice": {"roles": ["approve"]},
}
S = pb.ExecutionStatus


def token_of(client: str) -> str:
    return f"{client}-guards-secret"


def tool_pb(name: str, level: str = "safe", **more: Any) -> pb.Tool:
    return convert.tool_to_pb(
        parse_definition(
            {
                "name": name,
                "description": f"reads the file at path ({name})",
                "parameters": PATH_PARAMETERS,
                "safety_level": level,
                "sandbox": {"image": "toolreg/base", "command": ["cat"]},
                **more,
            }
        )
    )


@dataclass
class Deployment:
    running: Running
    channels: list[grpc.Channel] = field(default_factory=list)
    started: list[str] = field(default_factory=list)  # the backend's container starts

    @functools.cached_property
    def engine(self) -> docker.DockerClient:
        return docker.from_env()

    def stub(self, who: str) -> pb_grpc.ToolRegistryStub:
        channel = open_channel(self.running.address, token=token_of(who))
        self.channels.append(channel)
        return pb_grpc.ToolRegistryStub(channel)

    def register(self, who: str, tool: pb.Tool, replace: bool = False) -> pb.Tool:
        request = pb.RegisterToolRequest(tool=tool, replace=replace)
        stored: pb.Tool = self.stub(who).RegisterTool(request, timeout=30)
        return stored

    def call(self, name: str, args: dict[str, Any]) -> pb.ToolResult:
        request = pb.ExecuteToolRequest(name=name, arguments_json=json.dumps(args))
        result: pb.ToolResult = self.stub("agent").ExecuteTool(request, timeout=60)
        return result


def write_policy(path: Path) -> None:
    approvers = [
        {"id": who, "public_key": generate_keypair()[1], "groups": ["security"]}
        for who in ("alice", "bob")
    ]
    policy = {
        "audience": AUDIENCE,
        "approvers": approvers,
        "approval_rules": [
            {"match": {"level": "dangerous"}, "approvals_required": 2, "groups": ["security"]}
        ],
        "clients": [
            {"id": cid, "token_sha256": sha(token_of(cid)), **fields}
            for cid, fields in CLIENTS.items()
        ],
    }
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


def spy_on_sandboxes(running: Running, monkeypatch: pytest.MonkeyPatch, seen: list[str]) -> None:
    """Record every container the backend is asked for (each call's is made
    by ``prepare``; ``run`` is the one-shot form)."""
    backend = running.app.backend
    for name in ("prepare", "run"):
        real = getattr(backend, name)

        def spy(*args: Any, _real: Callable[..., Any] = real, _name: str = name, **kw: Any) -> Any:
            seen.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(backend, name, spy)


@pytest.fixture
def deployment(
    start_server: StartServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Deployment]:
    policy = tmp_path / "policy.yaml"
    write_policy(policy)
    running = start_server(data_dir=tmp_path / "data", policy_file=policy)
    made = Deployment(running)
    spy_on_sandboxes(running, monkeypatch, made.started)
    yield made
    for channel in made.channels:
        channel.close()


def field_violations(err: grpc.RpcError) -> dict[str, str]:
    status = rpc_status.from_call(err)
    assert status is not None, "INVALID_ARGUMENT must carry google.rpc details"
    out: dict[str, str] = {}
    for detail in status.details:
        bad = error_details_pb2.BadRequest()
        assert detail.Unpack(bad)
        out.update({v.field: v.description for v in bad.field_violations})
    return out


def this_servers(running: Running, recording: Recording) -> list[dict[str, Any]]:
    """What the Docker engine did to this server's containers while recording."""
    instance = running.app.backend.instance_id  # type: ignore[attr-defined]
    containers = [e for e in recording.events if e.get("Type") == "container"]
    return of_label(containers, "io.toolreg.instance", instance)


# ------------------------------------------------------------------ calls


def test_a_call_that_fails_a_guard_is_invalid_arguments_and_starts_no_container(
    deployment: Deployment,
) -> None:
    stored = deployment.register("team", tool_pb("reader", guard=[UNDER_WORK]))
    assert [(g.condition, g.message) for g in stored.guards] == [
        (UNDER_WORK["condition"], UNDER_WORK["message"])
    ]

    with recorded(deployment.engine) as recording:
        refused = deployment.call("reader", {"path": "/etc/passwd"})
    assert refused.status == S.Value("EXECUTION_STATUS_INVALID_ARGUMENTS"), refused
    assert not refused.success
    assert refused.error == "guard failed: path must be under /work/"
    assert refused.execution_id  # audited
    assert deployment.started == [], "the backend was asked for a container"
    assert this_servers(deployment.running, recording) == []

    # The same tool, a call its guard lets through: it runs, in a container
    # (which both witnesses above would have seen).
    with recorded(deployment.engine) as recording:
        ran = deployment.call("reader", {"path": "/work/notes.txt"})
    assert ran.status == S.Value("EXECUTION_STATUS_OK"), ran.error
    assert json.loads(ran.data_json) == {"path": "/work/notes.txt"}
    assert deployment.started == ["prepare"]
    actions = {e.get("Action") for e in this_servers(deployment.running, recording)}
    assert {"create", "start"} <= actions, actions


def test_the_json_schema_comes_before_the_guards(deployment: Deployment) -> None:
    deployment.register("team", tool_pb("reader", guard=[UNDER_WORK]))
    result = deployment.call("reader", {"path": 5})
    assert result.status == S.Value("EXECUTION_STATUS_INVALID_ARGUMENTS")
    assert "guard failed" not in result.error  # the schema's refusal, not the guard's
    assert deployment.started == []


def test_a_streamed_call_that_fails_a_guard_is_refused_alike(deployment: Deployment) -> None:
    deployment.register("team", tool_pb("reader", guard=[UNDER_WORK]))
    request = pb.ExecuteToolRequest(name="reader", arguments_json='{"path": "/etc/shadow"}')
    (event,) = list(deployment.stub("agent").StreamExecuteTool(request, timeout=60))
    assert event.result.status == S.Value("EXECUTION_STATUS_INVALID_ARGUMENTS")
    assert "path must be under /work/" in event.result.error
    assert deployment.started == []


def test_a_dangerous_call_that_fails_a_guard_opens_no_approval_request(
    deployment: Deployment,
) -> None:
    deployment.register("team", tool_pb("writer", "dangerous", guard=[UNDER_WORK]))
    refused = deployment.call("writer", {"path": "/etc/passwd"})
    assert refused.status == S.Value("EXECUTION_STATUS_INVALID_ARGUMENTS")
    assert not refused.HasField("approval_request")
    listed = deployment.stub("alice").ListApprovalRequests(pb.ListApprovalRequestsRequest())
    assert [r.tool_name for r in listed.requests] == []
    assert deployment.started == []


def test_a_guard_cannot_loosen_the_approval_rules(deployment: Deployment) -> None:
    """Guards only add refusals: a registrant's always-true guard on a
    dangerous tool leaves it needing exactly what the policy asks."""
    plain = deployment.register("team", tool_pb("writer", "dangerous"))
    asked_plain = deployment.call("writer", {"path": "/work/a"})
    deployment.register(
        "team",
        tool_pb("writer", "dangerous", guard=[{"condition": "true", "message": "never fails"}]),
        replace=True,
    )
    asked = deployment.call("writer", {"path": "/work/a"})
    assert asked.status == S.Value("EXECUTION_STATUS_APPROVAL_REQUIRED"), asked.error
    request = asked.approval_request
    assert request.approvals_required == asked_plain.approval_request.approvals_required == 2
    assert request.tool_digest != plain.digest  # the guard is in what approvers sign
    assert [g.message for g in request.tool.guards] == ["never fails"]
    (rule,) = request.applied_rules
    assert (rule.match, rule.approvals_required, list(rule.groups)) == (
        "level dangerous",
        2,
        ["security"],
    )
    assert deployment.started == []  # nothing runs before the approvals
    # The Python client reads the same back, guards and applied rules included.
    with RegistryClient(deployment.running.address, token=token_of("agent")) as agent:
        result = agent.execute_tool("writer", {"path": "/work/a"})
    view = result.approval_request
    assert view is not None and view.tool is not None
    assert view.tool.guards == (Guard("true", "never fails"),)
    assert view.applied_rules == (AppliedRule(rule.name, "level dangerous", "", 2, ("security",)),)


# ------------------------------------------------------------------ registration


@pytest.mark.parametrize(
    ("condition", "rule"),
    [
        ("args.path +", "line 1, column"),
        ('tool.name == "reader"', "undeclared reference to 'tool"),
        ('caller.id == "team"', "undeclared reference to 'caller"),
        ("args.path", "must be a bool"),
        ("args.path.matches(args.pattern)", "must be a string literal"),
    ],
)
def test_a_guard_that_does_not_compile_is_refused_naming_its_field(
    deployment: Deployment, condition: str, rule: str
) -> None:
    bad = tool_pb("reader", guard=[UNDER_WORK, {"condition": condition, "message": "m"}])
    with pytest.raises(grpc.RpcError) as info:
        deployment.register("team", bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    found = field_violations(info.value)
    assert list(found) == ["guards.1.condition"]
    assert rule in found["guards.1.condition"]
    assert "guards.1.condition: " in (info.value.details() or "")
    listed = deployment.stub("admin").ListTools(pb.ListToolsRequest())
    assert [t.name for t in listed.tools] == []


def test_sixteen_refused_guards_come_back_as_invalid_argument_not_a_header_error(
    deployment: Deployment,
) -> None:
    """The issue's own costly guard sixteen times over: each refused with a long
    reason. The answer, listing them, must still reach the client as itself (gRPC
    refuses response headers over 8 to 16 KiB), with the first violations and a
    count of the rest."""
    costly = {"condition": '!args.path.matches("[\\\\p{L}]{0,7}b")', "message": "no"}
    bad = tool_pb("reader", guard=[costly] * 16)
    with pytest.raises(grpc.RpcError) as info:
        deployment.register("team", bad)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    found = field_violations(info.value)
    assert "guards.0.condition" in found and "cost" in found["guards.0.condition"]
    assert len(found) < 17 and "" in found and "more violations not shown" in found[""]
    assert len(info.value.details() or "") <= 1_024
    listed = deployment.stub("admin").ListTools(pb.ListToolsRequest())
    assert [t.name for t in listed.tools] == []


def test_a_bad_guard_message_is_refused_naming_its_field(deployment: Deployment) -> None:
    msg = tool_pb("reader")
    msg.guards.add(condition="true", message="two\nlines")
    with pytest.raises(grpc.RpcError) as info:
        deployment.register("team", msg)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "control" in field_violations(info.value)["guards.0.message"]


def test_guards_come_back_from_get_tool_and_survive_a_restart(
    start_server: StartServer, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    first = start_server(data_dir=data)
    stored = first.stub.RegisterTool(
        pb.RegisterToolRequest(tool=tool_pb("reader", guard=[UNDER_WORK]))
    )
    definition = parse_definition(
        {
            "name": "reader",
            "description": "reads the file at path (reader)",
            "parameters": PATH_PARAMETERS,
            "sandbox": {"image": "toolreg/base", "command": ["cat"]},
            "guard": [UNDER_WORK],
        }
    )
    assert stored.digest == definition.digest
    assert first.stub.GetTool(pb.GetToolRequest(name="reader")) == stored
    first.stop()
    again = start_server(data_dir=data)
    assert again.stub.GetTool(pb.GetToolRequest(name="reader")) == stored
    refused = again.stub.ExecuteTool(
        pb.ExecuteToolRequest(name="reader", arguments_json='{"path": "/etc/passwd"}'), timeout=60
    )
    assert refused.error == "guard failed: path must be under /work/"


GUARDED_MANIFEST = """\
name: {name}
description: reads the file at path
parameters:
  type: object
  properties: {{path: {{type: string}}}}
  required: [path]
sandbox: {{image: toolreg/base, command: [cat]}}
guard:
  - condition: {condition}
    message: path must be under /work/
"""


def test_operator_manifests_with_guards_are_served(
    start_server: StartServer, tmp_path: Path
) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "reader.yaml").write_text(
        GUARDED_MANIFEST.format(name="reader", condition="args.path.startsWith('/work/')")
    )
    running = start_server(tools_dir=tools)
    got = running.stub.GetTool(pb.GetToolRequest(name="reader"))
    assert [g.message for g in got.guards] == ["path must be under /work/"]
    assert got.owner == "[operator]"


def test_an_operator_manifest_whose_guard_does_not_compile_stops_the_start(
    start_server: StartServer, tmp_path: Path
) -> None:
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "reader.yaml").write_text(
        GUARDED_MANIFEST.format(name="reader", condition="tool.name == 'reader'")
    )
    with pytest.raises(InvalidDefinition) as info:
        start_server(tools_dir=tools)
    assert "tool 'reader': guard.0.condition: line 1, column" in info.value.message


# ------------------------------------------------------------------ exported schemas


@pytest.mark.parametrize(
    "fmt", [pb.SCHEMA_FORMAT_OPENAI, pb.SCHEMA_FORMAT_ANTHROPIC, pb.SCHEMA_FORMAT_MCP]
)
def test_exported_schemas_leave_the_guards_out(deployment: Deployment, fmt: int) -> None:
    admin = deployment.stub("admin")

    def schemas() -> str:
        request = pb.GetToolSchemasRequest(format=fmt)  # type: ignore[arg-type]
        text: str = admin.GetToolSchemas(request).schemas_json
        return text

    deployment.register("team", tool_pb("reader"))
    without = schemas()
    deployment.register("team", tool_pb("reader", guard=[UNDER_WORK]), replace=True)
    with_guards = schemas()
    assert with_guards == without
    assert "guard" not in with_guards and "/work/" not in with_guards
