"""A live policy, end to end: a real server with a real policy file, real
SQLite and the real engine. A reload takes effect for the next call (a
revoked client, a removed approver, a narrowed grant), a file that does not
load leaves the policy in force, each reload is audited with its digest,
health and GetServerInfo name the digest, and SIGHUP reloads a real
`toolreg serve` process."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.cli.launcher import spawn_server
from registry_server.client.registry_client import open_channel
from registry_server.domain.models import parse_definition
from registry_server.signing.keys import generate_keypair
from registry_server.wire import convert
from tests import store_file
from tests.factories import sha
from tests.integration.conftest import StartServer
from tests.security.conftest import rpc_code, wait_until_gone
from tests.security.test_approvals import (
    EXAMPLES,
    TOKENS,
    Deployment,
    ask,
    write_policy,
)

ROOT = Path(__file__).resolve().parents[2]
TOKENS["team"] = "team-secret"
TEAM = {"id": "team", "token_sha256": sha(TOKENS["team"]), "roles": ["register", "execute"],
        "max_safety_level": "cautious",
        "register": {"max_safety_level": "cautious", "images": ["toolreg/base"]}}  # fmt: skip


def policy_text(public: dict[str, str], *, drop: tuple[str, ...] = (), **changes: Any) -> str:
    """The tests' policy (tests/security/test_approvals.py) with the team
    client, less the clients or approvers in ``drop``, with ``changes``."""
    tmp = Path(f"/tmp/toolreg-live-{os.getpid()}.yaml")
    write_policy(tmp, public, [TEAM])
    policy = yaml.safe_load(tmp.read_text())
    tmp.unlink()
    policy["clients"] = [c for c in policy["clients"] if c["id"] not in drop]
    policy["approvers"] = [a for a in policy["approvers"] if a["id"] not in drop]
    policy.update(changes)
    return str(yaml.safe_dump(policy, sort_keys=False))


@pytest.fixture
def live(
    start_server: StartServer, tmp_path: Path, engine: docker.DockerClient
) -> Iterator[tuple[Deployment, dict[str, str]]]:
    private: dict[str, bytes] = {}
    public: dict[str, str] = {}
    for who in ("alice", "bob", "carol"):
        private[who], public[who] = generate_keypair()
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(policy_text(public))
    data_dir = tmp_path / "data"
    running = start_server(data_dir=data_dir, policy_file=policy_file, tools_dir=EXAMPLES)
    yield Deployment(running, private, policy_file, data_dir, data_dir / "workspace"), public
    assert wait_until_gone(engine, running) == []


def reload(d: Deployment) -> pb.ServerInfo:
    info: pb.ServerInfo = d.stub("admin").ReloadPolicy(pb.ReloadPolicyRequest(), timeout=30)
    return info


def digest_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def health_digest(address: str) -> str:
    channel = grpc.insecure_channel(address)
    try:
        _answer, call = health_pb2_grpc.HealthStub(channel).Check.with_call(
            health_pb2.HealthCheckRequest(service=""), timeout=10
        )
        return dict(call.trailing_metadata())["toolreg-policy-digest"]  # type: ignore[no-any-return]
    finally:
        channel.close()


def audit_records(d: Deployment, kind: str) -> list[dict[str, Any]]:
    return [json.loads(record) for _seq, _kind, record in store_file.audit_rows(d.data_dir, kind)]


def test_a_revoked_client_is_refused_from_its_next_call(live: tuple[Deployment, Any]) -> None:
    d, public = live
    before = d.stub("reader").GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert before.policy_digest == digest_of(d.policy_file)
    assert health_digest(d.running.address) == before.policy_digest
    d.stub("reader").ListTools(pb.ListToolsRequest(), timeout=10)

    d.policy_file.write_text(policy_text(public, drop=("reader",)))
    info = reload(d)
    assert info.policy_digest == digest_of(d.policy_file) != before.policy_digest
    assert info.policy_source == str(d.policy_file)
    with pytest.raises(grpc.RpcError) as revoked:
        d.stub("reader").ListTools(pb.ListToolsRequest(), timeout=10)
    assert rpc_code(revoked.value) == grpc.StatusCode.UNAUTHENTICATED
    assert health_digest(d.running.address) == info.policy_digest
    assert audit_records(d, "policy")[-1] == {
        "event": "reloaded", "by": "admin", "source": str(d.policy_file),
        "digest": info.policy_digest, "previous_digest": before.policy_digest,
    }  # fmt: skip


def test_a_file_that_does_not_load_is_refused_and_the_old_policy_stays(
    live: tuple[Deployment, Any],
) -> None:
    d, _public = live
    in_force = digest_of(d.policy_file)
    good = d.policy_file.read_text()
    d.policy_file.write_text(good.replace("roles:", "rolez:", 1))
    with pytest.raises(grpc.RpcError) as refused:
        reload(d)
    assert rpc_code(refused.value) == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details()  # type: ignore[attr-defined]
    assert "the policy in force stays" in details
    assert f"{d.policy_file} line " in details and "rolez: unknown key" in details
    # The old policy still serves: every client as before.
    assert d.stub("reader").GetServerInfo(pb.GetServerInfoRequest()).policy_digest == in_force
    record = audit_records(d, "policy")[-1]
    assert record["event"] == "reload_refused" and record["digest_in_force"] == in_force
    assert any("rolez" in p for p in record["problems"])
    # A non-admin may not reload at all.
    d.policy_file.write_text(good)
    with pytest.raises(grpc.RpcError) as denied:
        d.stub("agent").ReloadPolicy(pb.ReloadPolicyRequest(), timeout=10)
    assert rpc_code(denied.value) == grpc.StatusCode.PERMISSION_DENIED


def test_a_removed_approvers_stored_approval_stops_counting(
    live: tuple[Deployment, Any],
) -> None:
    d, public = live
    request = ask(d).approval_request
    for who in ("alice", "bob"):
        d.stub(who).SubmitApproval(
            pb.SubmitApprovalRequest(request_id=request.id, token=d.sign(who, request))
        )
    extra = {"id": "dave", "public_key": generate_keypair()[1], "groups": ["security"]}
    text = yaml.safe_load(policy_text(public, drop=("bob",)))
    text["approvers"].append(extra)  # the rule still needs 2 from security: dave, alice
    d.policy_file.write_text(yaml.safe_dump(text, sort_keys=False))
    reload(d)
    result = ask(d, approval_request_id=request.id)
    assert result.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, result.error
    assert "1 valid so far" in result.error


def test_a_narrowed_grant_stops_the_tools_outside_it(live: tuple[Deployment, Any]) -> None:
    d, public = live
    tool = parse_definition({
        "name": "team_tool", "description": "the team's cautious tool",
        "safety_level": "cautious", "parameters": {"type": "object"},
        "sandbox": {"image": "toolreg/base", "command": ["sh", "-c", "echo ok"]},
    })  # fmt: skip
    d.stub("team").RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool)))
    call = pb.ExecuteToolRequest(name="team_tool", arguments_json="{}")
    assert d.stub("team").ExecuteTool(call, timeout=60).success
    narrowed = dict(TEAM, register={"max_safety_level": "safe", "images": ["toolreg/base"]})
    text = yaml.safe_load(policy_text(public))
    text["clients"] = [narrowed if c["id"] == "team" else c for c in text["clients"]]
    d.policy_file.write_text(yaml.safe_dump(text, sort_keys=False))
    reload(d)
    stopped = d.stub("team").ExecuteTool(call, timeout=60)
    assert stopped.status == pb.EXECUTION_STATUS_SANDBOX_ERROR
    assert stopped.error == (
        "Tool 'team_tool' cannot run: client 'team' may register tools up to level safe;"
        " 'team_tool' is cautious"
    )


def _signal_state(pid: int) -> str:
    """Each thread's name and signal masks (pending, blocked, caught), to tell a lost
    signal from a slow reload."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        with contextlib.suppress(OSError):
            status = (task / "status").read_text().splitlines()
            name = (task / "comm").read_text().strip()
            masks = [
                line for line in status if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigCgt"))
            ]
            lines.append(f"{task.name} {name}: {' '.join(masks)}")
    return "\nthreads:\n" + "\n".join(lines)


def test_sighup_reloads_a_serving_process(tmp_path: Path) -> None:
    public = {who: generate_keypair()[1] for who in ("alice", "bob", "carol")}
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(policy_text(public))
    server = spawn_server(tmp_path / "data", "--policy", str(policy_file), cwd=ROOT)
    try:
        stub = pb_grpc.ToolRegistryStub(open_channel(server.address, token=TOKENS["reader"]))
        first = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).policy_digest
        assert first == digest_of(policy_file)
        policy_file.write_text(policy_text(public, approval_request_ttl_s=60))
        os.kill(server.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).policy_digest == first:
            assert time.monotonic() < deadline, (
                "SIGHUP did not reload:\n" + "".join(server.log) + _signal_state(server.pid)
            )
            time.sleep(0.1)
        assert health_digest(server.address) == digest_of(policy_file)
        # A broken file on SIGHUP: refused, logged with line and rule, still serving.
        policy_file.write_text("audience: [\n")
        os.kill(server.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while not any("policy reload (SIGHUP) refused" in line for line in server.log):
            assert time.monotonic() < deadline, "".join(server.log)
            time.sleep(0.1)
        assert stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10).policy_digest
    finally:
        server.stop()


def test_policy_check_validates_a_file_offline(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(policy_text({w: generate_keypair()[1] for w in ("alice", "bob", "carol")}))
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("audience:", "audiences:"))

    def check(path: Path) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "registry_server.cli", "policy", "check", str(path)]
        return subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=60)

    ok = check(good)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"{good}: ok, digest {digest_of(good)};")
    broken = check(bad)
    assert broken.returncode == 2
    assert f"{bad} line 1: audiences: unknown key" in broken.stderr
    assert json.dumps("audience") not in broken.stdout


def test_a_reload_ends_open_watches_so_a_revoked_client_sees_no_more(
    live: tuple[Deployment, Any],
) -> None:
    d, public = live
    watch = d.stub("bob").WatchApprovalRequests(pb.WatchApprovalRequestsRequest(), timeout=30)
    events = iter(watch)
    assert next(events).type == pb.APPROVAL_EVENT_TYPE_SYNCED
    text = yaml.safe_load(policy_text(public))
    text["clients"] = [c for c in text["clients"] if c["id"] != "bob"]  # bob's client only
    d.policy_file.write_text(yaml.safe_dump(text, sort_keys=False))
    reload(d)
    with pytest.raises(grpc.RpcError) as ended:
        next(events)
    assert rpc_code(ended.value) == grpc.StatusCode.ABORTED
    assert "the policy was reloaded; watch again" in ended.value.details()  # type: ignore[attr-defined]
    again = d.stub("bob").WatchApprovalRequests(pb.WatchApprovalRequestsRequest(), timeout=10)
    with pytest.raises(grpc.RpcError) as refused:
        next(iter(again))
    assert rpc_code(refused.value) == grpc.StatusCode.UNAUTHENTICATED
