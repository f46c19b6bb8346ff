"""Conditions in the policy (issue 28), end to end: a real `toolreg serve
--policy FILE` process, its SQLite file, the real engine, and the CLI.

The deployment's policy (``policy_of``):

  approvers   alice, bob (group sre); carol (no group)
  sre-prod    tool deploy, when args.env == "prod": 2 from sre
              (a staging deploy matches no rule: the default, 1 from anyone)
  team-tools  level dangerous, when tool.owner != "[operator]": 2 from sre
  fast-lane   category fast: 1 from anyone
  never       category lenient, when false: 1 from anyone
  no-drop     deny: tool run_sql, when args.sql matches DROP TABLE
  no-tmp      deny: tool purge, when args.table.startsWith("tmp_")
  too-deep    deny: tool lookup, when args.q == "deep" and 10^4 loop steps

Clients: agent (execute up to dangerous), admin, team (register up to
dangerous on toolreg/base), and alice, bob, carol (approve). The tools
(deploy, run_sql, purge, lookup) are the operator's, from a tools directory;
each echoes its arguments (``cat``).

Whether a container existed for a call is what the engine says: its events
for containers labelled with the call's execution id."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
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
from registry_server.signing.tokens import mint_for
from registry_server.wire import convert
from tests import store_file
from tests.engine_events import Recording, of_label, recorded
from tests.factories import sha
from tests.security.conftest import rpc_code

ROOT = Path(__file__).resolve().parents[2]
AUDIENCE = "toolreg-conditions"
EXECUTION_LABEL = "io.toolreg.execution-id"
OWNER_PID_LABEL = "io.toolreg.owner-pid"
# Bearer tokens, random per run: the log check looks for these exact strings.
TOKENS = {
    who: f"{who}-{secrets.token_urlsafe(18)}"
    for who in ("agent", "admin", "team", "alice", "bob", "carol")
}
GROUPS = {"alice": ["sre"], "bob": ["sre"], "carol": []}
TEN = "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]"
# Accepted at load (its lists are literals of 10), 10^4 steps at run time:
# over cel-cpp's iteration budget.
DEEP_LOOP = f"{TEN}.all(a, {TEN}.all(b, {TEN}.all(c, {TEN}.all(d, a + b + c + d >= 0))))"
DROP_TABLE = r"(?i)\bdrop\s+table\b"


def policy_of(public: dict[str, str]) -> dict[str, Any]:
    """The deployment's policy (see the module's docstring)."""
    clients: list[dict[str, Any]] = [
        {"id": "agent", "roles": ["execute"], "max_safety_level": "dangerous"},
        {"id": "admin", "roles": ["admin", "register", "approve"]},
        {"id": "team", "roles": ["register"],
         "register": {"max_safety_level": "dangerous", "images": ["toolreg/base"]}},
        *({"id": who, "roles": ["approve"]} for who in GROUPS),
    ]  # fmt: skip
    return {
        "audience": AUDIENCE,
        "approvers": [
            {"id": who, "public_key": public[who], "groups": groups}
            for who, groups in GROUPS.items()
        ],
        "approval_rules": [
            {
                "name": "sre-prod",
                "match": {"tool": "deploy"},
                "when": 'args.env == "prod"',
                "approvals_required": 2,
                "groups": ["sre"],
            },
            {
                "name": "team-tools",
                "match": {"level": "dangerous"},
                "when": 'tool.owner != "[operator]"',
                "approvals_required": 2,
                "groups": ["sre"],
            },
            {"name": "fast-lane", "match": {"category": "fast"}, "approvals_required": 1},
            {
                "name": "never",
                "match": {"category": "lenient"},
                "when": "false",
                "approvals_required": 1,
            },
        ],
        "deny_rules": [
            {
                "name": "no-drop",
                "match": {"tool": "run_sql"},
                "when": f"args.sql.matches({json.dumps(DROP_TABLE)})",
                "reason": "dropping tables is for the DBAs, not for agents",
            },
            {
                "name": "no-tmp",
                "match": {"tool": "purge"},
                "when": 'args.table.startsWith("tmp_")',
                "reason": "temporary tables are the janitor's",
            },
            {
                "name": "too-deep",
                "match": {"tool": "lookup"},
                "when": f'args.q == "deep" && {DEEP_LOOP}',
                "reason": "too deep",
            },
        ],
        "clients": [{**c, "token_sha256": sha(TOKENS[c["id"]])} for c in clients],
    }


def manifest(name: str, level: str, properties: dict[str, Any], **more: Any) -> dict[str, Any]:
    """A tool on toolreg/base that echoes its arguments."""
    return {
        "name": name,
        "description": f"test tool {name}",
        "safety_level": level,
        "parameters": {"type": "object", "properties": properties, "additionalProperties": False},
        "sandbox": {"image": "toolreg/base", "command": ["sh", "-c", "cat"]},
        **more,
    }


TEXT = {"type": "string", "maxLength": 200}
OPERATOR_TOOLS = [
    manifest("deploy", "dangerous", {"env": TEXT, "version": TEXT}),
    manifest("run_sql", "dangerous", {"sql": TEXT}, categories=["db"]),
    manifest("purge", "safe", {"table": TEXT}),
    manifest("lookup", "safe", {"q": TEXT}),
]


@dataclass
class Deployment:
    server: ServerProcess
    data_dir: Path
    policy_file: Path
    keys: dict[str, bytes]  # approver -> private key PEM (the approvers', never the server's)
    channels: dict[str, grpc.Channel] = field(default_factory=dict)
    # Every approval token made for this server: none may reach its log.
    tokens_made: list[str] = field(default_factory=list)

    def stub(self, who: str) -> pb_grpc.ToolRegistryStub:
        if who not in self.channels:
            self.channels[who] = open_channel(self.server.address, token=TOKENS[who])
        return pb_grpc.ToolRegistryStub(self.channels[who])

    def call(self, name: str, args: dict[str, Any], **extra: Any) -> pb.ToolResult:
        """The agent calls ``name``."""
        request = pb.ExecuteToolRequest(name=name, arguments_json=json.dumps(args), **extra)
        result: pb.ToolResult = self.stub("agent").ExecuteTool(request, timeout=60)
        return result

    def sign(self, approver: str, request: pb.ApprovalRequest) -> str:
        token = mint_for(
            load_private_key(self.keys[approver]), issuer=approver, request=request, ttl_s=300
        )
        self.tokens_made.append(token)
        return token

    def approved_with(self, name: str, args: dict[str, Any], *approvers: str) -> pb.ToolResult:
        """Ask, then call again with a token of each of ``approvers``."""
        asked = self.call(name, args)
        assert asked.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, asked
        tokens = [self.sign(who, asked.approval_request) for who in approvers]
        return self.call(name, args, approval_tokens=tokens)

    def audit(self, execution_id: str) -> dict[str, Any]:
        for _seq, _kind, record in store_file.audit_rows(self.data_dir, "execution"):
            entry: dict[str, Any] = json.loads(record)
            if entry.get("execution_id") == execution_id:
                return entry
        raise AssertionError(f"no audit record for execution {execution_id}")

    def requests_for(self, tool: str) -> list[pb.ApprovalRequest]:
        listed = self.stub("admin").ListApprovalRequests(pb.ListApprovalRequestsRequest())
        return [r for r in listed.requests if r.tool_name == tool]

    def log(self) -> str:
        return "".join(self.server.log)

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()


def keypairs() -> tuple[dict[str, bytes], dict[str, str]]:
    private: dict[str, bytes] = {}
    public: dict[str, str] = {}
    for who in GROUPS:
        private[who], public[who] = generate_keypair()
    return private, public


def write_yaml(path: Path, data: Any) -> None:
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def serve(tmp: Path, policy: dict[str, Any], keys: dict[str, bytes]) -> Deployment:
    """`toolreg serve --policy FILE --tools DIR --log-level DEBUG`, started."""
    tools = tmp / "tools"
    tools.mkdir()
    for tool in OPERATOR_TOOLS:
        write_yaml(tools / f"{tool['name']}.yaml", tool)
    policy_file = tmp / "policy.yaml"
    write_yaml(policy_file, policy)
    data_dir = tmp / "data"
    server = spawn_server(
        data_dir, "--policy", str(policy_file), "--tools", str(tools),
        "--log-level", "DEBUG", cwd=ROOT,
    )  # fmt: skip
    return Deployment(server, data_dir, policy_file, keys)


def stop(d: Deployment, engine: docker.DockerClient) -> None:
    d.close()
    assert d.server.stop() == 0, d.log()[-3000:]
    mine = {"label": f"{OWNER_PID_LABEL}={d.server.pid}"}
    deadline = time.monotonic() + 15
    while left := engine.api.containers(all=True, filters=mine):
        assert time.monotonic() < deadline, f"containers left behind: {left}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def deployment(
    tmp_path_factory: pytest.TempPathFactory, engine: docker.DockerClient
) -> Iterator[Deployment]:
    private, public = keypairs()
    d = serve(tmp_path_factory.mktemp("conditions"), policy_of(public), private)
    yield d
    stop(d, engine)


class Window:
    """What the engine did from the window's start to each ``containers_for``,
    recorded live: asking the engine afterwards (events --since --until) replays
    only its last 256 events, which other test files' containers push out when
    files run in parallel (tests/engine_events.py), and a run's ``create`` would
    then be missing, or a refused call's pass on nothing."""

    def __init__(self, engine: docker.DockerClient) -> None:
        self.engine = engine
        self.events: list[dict[str, Any]] = []
        self._start()

    def _start(self) -> None:
        self._stack = contextlib.ExitStack()
        self._recording = self._stack.enter_context(recorded(self.engine))

    def close(self) -> None:
        """Ends the recording at its marker: every event before now is in ``events``."""
        self._stack.close()
        self.events += self._recording.events
        self._recording = Recording()

    def containers_for(self, execution_id: str) -> list[str]:
        """The containers the engine created for this execution (by its label)."""
        assert execution_id
        self.close()
        self._start()
        created = [
            e for e in self.events if e.get("Type") == "container" and e.get("Action") == "create"
        ]
        return [e["Actor"]["ID"] for e in of_label(created, EXECUTION_LABEL, execution_id)]


@pytest.fixture
def window(engine: docker.DockerClient) -> Iterator[Window]:
    recording = Window(engine)
    try:
        yield recording
    finally:
        recording.close()


# ------------------------------------------------------------------ 1. prod and staging


def test_prod_needs_two_from_sre_and_staging_one_from_anyone(
    deployment: Deployment, window: Window
) -> None:
    d = deployment
    prod = {"env": "prod", "version": "1.2.0"}
    asked = d.call("deploy", prod)
    assert asked.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, asked.error
    request = asked.approval_request
    assert request.approvals_required == 2 and request.approvals_missing == 2
    assert "it needs 2 approval(s) from sre;" in asked.error
    stored = d.stub("alice").GetApprovalRequest(pb.GetApprovalRequestRequest(id=request.id))
    assert stored.approvals_required == 2 and stored.state == "PENDING"
    assert applied(stored) == [("sre-prod", "tool deploy", 'args.env == "prod"', 2, ["sre"])]
    assert applied(request) == applied(stored)  # what the call was told

    # carol is in no group: not eligible for sre-prod, the only rule for this call.
    carols = d.call("deploy", prod, approval_tokens=[d.sign("carol", request)])
    assert carols.status == pb.EXECUTION_STATUS_APPROVAL_DENIED
    assert carols.error == (
        "approval denied: approval token 1 rejected: approver 'carol' is not eligible for tool"
        " 'deploy' (it needs 2 approval(s) from sre:"
        ' sre-prod (tool deploy, when args.env == "prod"))'
    )
    with pytest.raises(grpc.RpcError) as refused:
        d.stub("carol").SubmitApproval(
            pb.SubmitApprovalRequest(request_id=request.id, token=d.sign("carol", request))
        )
    assert rpc_code(refused.value) == grpc.StatusCode.PERMISSION_DENIED
    assert "sre-prod (tool deploy" in str(refused.value.details())

    # One from sre is not enough; two are.
    one = d.call("deploy", prod, approval_tokens=[d.sign("alice", request)])
    assert one.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED and "1 valid so far" in one.error
    two = d.call("deploy", prod, approval_tokens=[d.sign("alice", request), d.sign("bob", request)])
    assert two.status == pb.EXECUTION_STATUS_OK, two.error
    assert json.loads(two.content) == prod  # the tool ran, with the call's arguments
    assert len(window.containers_for(two.execution_id)) == 1
    record = d.audit(two.execution_id)
    assert record["decision"] == "approved" and sorted(record["approvers"]) == ["alice", "bob"]
    assert record["runtime"] in ("runsc", "runc") and record["container_id"]

    # Staging: no rule's condition holds, so the default (1 from anyone) applies.
    staging = {"env": "staging", "version": "1.2.0"}
    watch = d.stub("carol").WatchApprovalRequests(pb.WatchApprovalRequestsRequest(), timeout=20)
    try:
        events = iter(watch)
        while next(events).type != pb.APPROVAL_EVENT_TYPE_SYNCED:
            pass
        asked = d.call("deploy", staging)
        opened = next(events)  # carol may approve it: her watch shows it
    finally:
        watch.cancel()
    assert asked.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, asked.error
    assert asked.approval_request.approvals_required == 1
    stored = d.stub("carol").GetApprovalRequest(
        pb.GetApprovalRequestRequest(id=asked.approval_request.id)
    )
    assert applied(stored) == [("default", "default for dangerous tools", "", 1, [])]
    assert opened.type == pb.APPROVAL_EVENT_TYPE_OPENED
    assert opened.request.id == stored.id and not opened.request.arguments_json
    assert applied(opened.request) == applied(stored)
    # ... and her list, and a new watch's first answer (which read no arguments).
    listed = d.stub("carol").ListApprovalRequests(pb.ListApprovalRequestsRequest(state="PENDING"))
    assert stored.id in [r.id for r in listed.requests]
    first_answer = current_requests(d.stub("carol"))
    assert stored.id in first_answer
    assert applied(first_answer[stored.id]) == applied(stored)
    # The prod request is not hers to approve: neither listed to her nor in her
    # watch, as its own arguments decide (read from the store for listings).
    prod_request = d.call("deploy", prod).approval_request
    listed = d.stub("carol").ListApprovalRequests(pb.ListApprovalRequestsRequest(state="PENDING"))
    assert prod_request.id not in [r.id for r in listed.requests]
    assert prod_request.id not in current_requests(d.stub("carol"))
    alice_sees = d.stub("alice").ListApprovalRequests(pb.ListApprovalRequestsRequest())
    (shown,) = [r for r in alice_sees.requests if r.id == prod_request.id]
    assert shown.approvals_required == 2 and [a[0] for a in applied(shown)] == ["sre-prod"]
    ran = d.call("deploy", staging, approval_tokens=[d.sign("carol", asked.approval_request)])
    assert ran.status == pb.EXECUTION_STATUS_OK, ran.error
    assert json.loads(ran.content) == staging
    assert d.audit(ran.execution_id)["approvers"] == ["carol"]


def current_requests(stub: pb_grpc.ToolRegistryStub) -> dict[str, pb.ApprovalRequest]:
    """What a watch sends before SYNCED: the open requests its caller may see."""
    watch = stub.WatchApprovalRequests(pb.WatchApprovalRequestsRequest(), timeout=30)
    current: dict[str, pb.ApprovalRequest] = {}
    try:
        for event in watch:
            if event.type == pb.APPROVAL_EVENT_TYPE_SYNCED:
                return current
            current[event.request.id] = event.request
    finally:
        watch.cancel()
    raise AssertionError("the watch ended before SYNCED")


def applied(request: pb.ApprovalRequest) -> list[tuple[str, str, str, int, list[str]]]:
    """The rules a request says apply: (name, match, condition, approvals, groups)."""
    return [
        (r.name, r.match, r.condition, r.approvals_required, list(r.groups))
        for r in request.applied_rules
    ]


# ------------------------------------------------------------------ 2. DROP TABLE


def test_a_deny_rule_refuses_drop_table_before_any_request_or_container(
    deployment: Deployment, window: Window
) -> None:
    d = deployment
    drop = {"sql": "select 1; Drop  TABLE users"}
    denied = d.call("run_sql", drop)
    assert denied.status == pb.EXECUTION_STATUS_POLICY_DENIED
    assert denied.error == (
        "denied by policy rule no-drop: dropping tables is for the DBAs, not for agents"
    )
    assert denied.execution_id and not denied.HasField("approval_request")
    # No approval request was opened, no container was made for it.
    assert d.requests_for("run_sql") == []
    assert window.containers_for(denied.execution_id) == []
    record = d.audit(denied.execution_id)
    assert (record["decision"], record["status"]) == ("policy_denied", "POLICY_DENIED")
    assert record["tool"] == "run_sql" and record["container_id"] == ""
    assert "users" not in json.dumps(record)  # the arguments' digest only, never their text
    # Approvals cannot buy it: the deny rule comes first.
    again = d.call("run_sql", drop, approval_tokens=["not-even-a-token"])
    assert again.status == pb.EXECUTION_STATUS_POLICY_DENIED

    # A query without DROP TABLE goes the usual way: a request, an approval, a run.
    select = {"sql": "select 1 -- dropping nothing"}
    ran = d.approved_with("run_sql", select, "carol")
    assert ran.status == pb.EXECUTION_STATUS_OK, ran.error
    assert json.loads(ran.content) == select
    assert len(window.containers_for(ran.execution_id)) == 1  # what the engine shows for a run
    assert len(d.requests_for("run_sql")) == 1


# ------------------------------------------------------------------ 3. fail closed


def test_a_condition_that_errs_at_run_time_refuses_the_call(deployment: Deployment) -> None:
    d = deployment
    # A deny rule whose condition reads a field the call lacks: denied, naming it.
    missing = d.call("purge", {})
    assert missing.status == pb.EXECUTION_STATUS_POLICY_DENIED
    assert missing.error.startswith(
        "denied by policy rule no-tmp: temporary tables are the janitor's"
        " (its condition could not be evaluated: "
    ), missing.error
    assert d.audit(missing.execution_id)["decision"] == "policy_denied"
    assert d.call("purge", {"table": "tmp_orders"}).error == (
        "denied by policy rule no-tmp: temporary tables are the janitor's"
    )

    # An approval rule whose condition errs (deploy without env): refused,
    # naming the rule, before any approval request.
    before = len(d.requests_for("deploy"))
    unreadable = d.call("deploy", {"version": "1.2.0"})
    assert unreadable.status == pb.EXECUTION_STATUS_POLICY_DENIED
    assert unreadable.error.startswith(
        "policy rule sre-prod: its condition could not be evaluated: "
    ), unreadable.error
    assert "env" in unreadable.error
    assert len(d.requests_for("deploy")) == before
    assert d.audit(unreadable.execution_id)["decision"] == "policy_denied"

    # The server keeps serving: the same tools with readable calls work.
    ok = d.call("purge", {"table": "orders"})
    assert ok.status == pb.EXECUTION_STATUS_OK and json.loads(ok.content) == {"table": "orders"}
    asked = d.call("deploy", {"env": "dev", "version": "1.2.0"})
    assert asked.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED
    assert asked.approval_request.approvals_required == 1


# ------------------------------------------------------------------ 4. expensive expressions

EXPENSIVE = {
    # a loop over the arguments inside a loop over them
    "nested": "args.items.all(x, args.items.all(y, x == y))",
    # a loop that builds strings out of whole arguments
    "strings": 'args.items.map(x, args.text + args.text).exists(s, s == "x")',
}


def test_expressions_that_could_loop_or_build_huge_strings_are_refused_at_load(
    tmp_path: Path,
) -> None:
    public = keypairs()[1]
    policy = policy_of(public)
    policy["approval_rules"].append(
        {"name": "nested", "match": {"tool": "deploy"}, "when": EXPENSIVE["nested"],
         "approvals_required": 1}
    )  # fmt: skip
    policy["deny_rules"].append(
        {"name": "strings", "match": {"tool": "lookup"}, "when": EXPENSIVE["strings"],
         "reason": "never loads"}
    )  # fmt: skip
    path = tmp_path / "expensive.yaml"
    write_yaml(path, policy)
    lines = path.read_text().splitlines()
    nested_line = 1 + next(i for i, text in enumerate(lines) if "args.items.all" in text)
    strings_line = 1 + next(i for i, text in enumerate(lines) if "args.items.map" in text)
    rules = len(policy["approval_rules"]) - 1, len(policy["deny_rules"]) - 1

    check = subprocess.run(
        [sys.executable, "-m", "registry_server.cli", "policy", "check", str(path)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert check.returncode == 2, check.stdout
    nested = f"{path} line {nested_line}: approval_rules[{rules[0]}].when: (rule nested) CEL:"
    assert f"{nested} may cost up to" in check.stderr, check.stderr
    strings = f"{path} line {strings_line}: deny_rules[{rules[1]}].when: (rule strings) CEL:"
    assert f"{strings} may cost up to" in check.stderr, check.stderr
    assert "over the limit of" in check.stderr

    # The server refuses to start on it, with the same lines. (Run to its end
    # rather than through spawn_server, whose error keeps only the last 20
    # reads of stderr: empty ones, at times, between EOF and the exit.)
    serve = subprocess.run(
        [sys.executable, "-m", "registry_server.cli", "serve", "--port", "0",
         "--data-dir", str(tmp_path / "data"), "--policy", str(path)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert serve.returncode == 1, serve.stderr
    assert f"{path} line {nested_line}: approval_rules[{rules[0]}].when" in serve.stderr
    assert f"{path} line {strings_line}: deny_rules[{rules[1]}].when" in serve.stderr
    assert "serving on" not in serve.stderr


def test_an_expression_over_the_iteration_budget_at_run_time_fails_closed(
    deployment: Deployment, window: Window
) -> None:
    d = deployment
    deep = d.call("lookup", {"q": "deep"})
    assert deep.status == pb.EXECUTION_STATUS_POLICY_DENIED
    assert deep.error.startswith(
        "denied by policy rule too-deep: too deep (its condition could not be evaluated: "
    ), deep.error
    assert "budget" in deep.error.lower(), deep.error
    assert window.containers_for(deep.execution_id) == []
    # The loop is evaluated only when the left side holds; the server still serves.
    shallow = d.call("lookup", {"q": "shallow"})
    assert shallow.status == pb.EXECUTION_STATUS_OK, shallow.error


# ------------------------------------------------------------------ 5. categories


def test_a_registrant_cannot_weaken_a_rule_through_categories(deployment: Deployment) -> None:
    d = deployment

    def register(name: str, categories: list[str]) -> None:
        tool = parse_definition(manifest(name, "dangerous", {"n": {"type": "integer"}},
                                         categories=categories))  # fmt: skip
        d.stub("team").RegisterTool(
            pb.RegisterToolRequest(tool=convert.tool_to_pb(tool), replace=True), timeout=30
        )

    register("team_job", [])
    register("team_fast_job", ["fast", "lenient"])
    plain = d.call("team_job", {"n": 1})
    assert plain.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED
    assert plain.approval_request.approvals_required == 2
    fast = d.call("team_fast_job", {"n": 1})
    assert fast.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED
    # Its categories add fast-lane (1 from anyone); never's condition is false:
    # team-tools' 2 from sre still apply.
    request = fast.approval_request
    assert request.approvals_required == 2
    assert "it needs 2 approval(s) from sre and 1 approval(s) from any approver;" in fast.error
    stored = d.stub("admin").GetApprovalRequest(pb.GetApprovalRequestRequest(id=request.id))
    assert applied(stored) == [
        ("team-tools", "level dangerous", 'tool.owner != "[operator]"', 2, ["sre"]),
        ("fast-lane", "category fast", "", 1, []),
    ]
    # carol counts for fast-lane, never for sre: carol and alice are not enough.
    two = d.call(
        "team_fast_job", {"n": 1},
        approval_tokens=[d.sign("carol", request), d.sign("alice", request)],
    )  # fmt: skip
    assert two.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED
    assert "2 valid so far" in two.error
    ran = d.call(
        "team_fast_job", {"n": 1},
        approval_tokens=[d.sign("alice", request), d.sign("bob", request)],
    )  # fmt: skip
    assert ran.status == pb.EXECUTION_STATUS_OK, ran.error


# ------------------------------------------------------------------ 6. live reload


def test_reloading_recompiles_conditions_and_a_broken_condition_leaves_the_old_policy(
    tmp_path: Path, engine: docker.DockerClient
) -> None:
    private, public = keypairs()
    d = serve(tmp_path, policy_of(public), private)
    try:
        last_execution = _reload_steps(d, public)
    finally:
        stop(d, engine)
    _assert_no_credentials_in(d, last_execution)


def _reload_steps(d: Deployment, public: dict[str, str]) -> str:
    """The steps of the reload test; returns the last call's execution id."""
    admin = d.stub("admin")
    in_force = admin.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).policy_digest
    # A staging request carol approves (1 from anyone, the default), not run yet.
    staging = {"env": "staging", "version": "2.0.0"}
    approved = d.call("deploy", staging).approval_request
    assert approved.approvals_required == 1
    after_carol = d.stub("carol").SubmitApproval(
        pb.SubmitApprovalRequest(request_id=approved.id, token=d.sign("carol", approved))
    )
    assert after_carol.state == "APPROVED"

    # A `when` that does not compile: refused, naming the file, the line and the
    # rule; the old policy stays, conditions and all.
    broken = policy_of(public)
    broken["approval_rules"][0]["when"] = 'args.env == "prod" &&'
    write_yaml(d.policy_file, broken)
    line = 1 + next(
        i for i, text in enumerate(d.policy_file.read_text().splitlines()) if "&&" in text
    )
    with pytest.raises(grpc.RpcError) as refused:
        admin.ReloadPolicy(pb.ReloadPolicyRequest(), timeout=30)
    assert rpc_code(refused.value) == grpc.StatusCode.FAILED_PRECONDITION
    details = str(refused.value.details())
    assert "the policy in force stays" in details
    name = broken["approval_rules"][0]["name"]
    assert (
        f"{d.policy_file} line {line}: approval_rules[0].when: (rule {name}) CEL: line 1, column"
        in details
    )
    assert admin.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).policy_digest == in_force
    prod = d.call("deploy", {"env": "prod", "version": "2.0.0"})
    assert prod.approval_request.approvals_required == 2  # sre-prod, as it was
    rc = d.approved_with("deploy", {"env": "staging", "version": "2.0.0-rc"}, "carol")
    assert rc.status == pb.EXECUTION_STATUS_OK, rc.error  # staging: 1 from anyone, as it was

    # The same file on SIGHUP: refused and logged with the file and the line.
    os.kill(d.server.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while not any("policy reload (SIGHUP) refused" in text for text in d.server.log):
        assert time.monotonic() < deadline, d.log()[-3000:]
        time.sleep(0.1)
    logged = d.log()
    refusal = logged[logged.index("policy reload (SIGHUP) refused") :]
    assert f"{d.policy_file} line {line}: approval_rules[0].when: (rule {name}) CEL:" in refusal, (
        refusal
    )
    assert admin.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).policy_digest == in_force

    # A good edit takes effect from the next call: sre-prod now covers staging
    # (its condition recompiled), and a new conditional deny rule freezes prod.
    edited = policy_of(public)
    edited["approval_rules"][0]["when"] = 'args.env in ["prod", "staging"]'
    edited["deny_rules"].append(
        {"name": "prod-freeze", "match": {"tool": "deploy"}, "when": 'args.env == "prod"',
         "reason": "change freeze until Monday"}
    )  # fmt: skip
    write_yaml(d.policy_file, edited)
    info = admin.ReloadPolicy(pb.ReloadPolicyRequest(), timeout=30)
    assert info.policy_digest != in_force
    frozen = d.call("deploy", {"env": "prod", "version": "2.0.0"})
    assert frozen.status == pb.EXECUTION_STATUS_POLICY_DENIED
    assert frozen.error == "denied by policy rule prod-freeze: change freeze until Monday"
    fresh = d.call("deploy", {"env": "staging", "version": "2.0.1"})
    assert fresh.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED
    assert fresh.approval_request.approvals_required == 2
    assert "it needs 2 approval(s) from sre;" in fresh.error
    carols = d.call(
        "deploy", {"env": "staging", "version": "2.0.1"},
        approval_tokens=[d.sign("carol", fresh.approval_request)],
    )  # fmt: skip
    assert carols.status == pb.EXECUTION_STATUS_APPROVAL_DENIED
    assert "sre-prod (tool deploy, when args.env in" in carols.error

    # The request carol approved before the reload no longer runs the call:
    # carol counts for no rule that applies now.
    again = d.call("deploy", staging, approval_request_id=approved.id)
    assert again.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, again.error
    assert "it needs 2 approval(s) from sre; 0 valid so far" in again.error
    view = admin.GetApprovalRequest(pb.GetApprovalRequestRequest(id=approved.id))
    # It says so: 2 required now (it was made when 1 was), 2 missing.
    assert (view.approvals_required, view.approvals_missing) == (2, 2), view
    assert applied(view) == [
        ("sre-prod", "tool deploy", 'args.env in ["prod", "staging"]', 2, ["sre"])
    ]
    for who in ("alice", "bob"):
        d.stub(who).SubmitApproval(
            pb.SubmitApprovalRequest(request_id=approved.id, token=d.sign(who, approved))
        )
    ran = d.call("deploy", staging, approval_request_id=approved.id)
    assert ran.status == pb.EXECUTION_STATUS_OK, ran.error
    assert sorted(d.audit(ran.execution_id)["approvers"]) == ["alice", "bob"]
    return ran.execution_id


# ------------------------------------------------------------------ credentials


def _assert_no_credentials_in(d: Deployment, last_execution: str = "") -> None:
    """No bearer token and no approval token (nor its signature) in the log
    (read once the call ``last_execution`` is in it: the log is read from the
    process's stderr as it arrives)."""
    deadline = time.monotonic() + 10
    while last_execution not in d.log():
        assert time.monotonic() < deadline, f"{last_execution} never reached the log"
        time.sleep(0.05)
    log = d.log()
    for who, token in TOKENS.items():
        assert token not in log, f"{who}'s bearer token is in the server's log"
    assert d.tokens_made, "no approval token was made"
    for token in d.tokens_made:
        assert token not in log and token.rsplit(".", 1)[-1] not in log, (
            "an approval token is in the server's log"
        )


def test_credentials_never_reach_the_log(deployment: Deployment) -> None:
    """Last: after every call above (and these) on the deployment, at DEBUG."""
    d = deployment
    ran = d.approved_with("deploy", {"env": "qa", "version": "3"}, "bob")
    assert ran.status == pb.EXECUTION_STATUS_OK, ran.error
    asked = d.call("deploy", {"env": "prod", "version": "3"})
    d.stub("alice").SubmitApproval(
        pb.SubmitApprovalRequest(
            request_id=asked.approval_request.id, token=d.sign("alice", asked.approval_request)
        )
    )
    wrong = d.call("deploy", {"env": "prod", "version": "3"},
                   approval_tokens=[d.sign("carol", asked.approval_request)])  # fmt: skip
    assert wrong.status == pb.EXECUTION_STATUS_APPROVAL_DENIED
    bad = open_channel(d.server.address, token="not-" + TOKENS["agent"])
    try:
        with pytest.raises(grpc.RpcError):
            pb_grpc.ToolRegistryStub(bad).ListTools(pb.ListToolsRequest(), timeout=10)
    finally:
        bad.close()
    _assert_no_credentials_in(d, wrong.execution_id)
