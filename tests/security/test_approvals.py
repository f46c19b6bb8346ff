"""Dangerous tools under a written policy, end to end: a real server with a
real policy file, real SQLite, the real engine (gVisor), and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import grpc
import pytest
import yaml
from cryptography.hazmat.primitives import serialization

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.client.registry_client import open_channel
from registry_server.domain.models import parse_definition
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint
from registry_server.wire import convert
from tests import store_file
from tests.certs import CertificateAuthority
from tests.factories import sha
from tests.integration.conftest import Running, StartServer
from tests.security.conftest import approvers_of, list_over_mtls, rpc_code, wait_until_gone

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "tools"
AUDIENCE = "toolreg-test"
TOKENS = {
    "agent": "agent-secret",
    "admin": "admin-secret",
    "alice": "alice-secret",
    "bob": "bob-secret",
    "reader": "reader-secret",
}


@dataclass
class Deployment:
    running: Running
    keys: dict[str, bytes]  # approver id -> private key PEM (held by the approvers, not the server)
    policy_file: Path
    data_dir: Path
    workspace: Path

    def stub(self, who: str) -> pb_grpc.ToolRegistryStub:
        channel = open_channel(self.running.address, token=TOKENS[who])
        return pb_grpc.ToolRegistryStub(channel)

    def sign(self, approver: str, request: pb.ApprovalRequest, **claims: Any) -> str:
        fields: dict[str, Any] = {
            "issuer": approver,
            "audience": request.audience,
            "tool_name": request.tool_name,
            "tool_digest": request.tool_digest,
            "args_digest": request.arguments_digest,
            "requester": request.requested_by,
            "ttl_s": 300,
            "request_id": None,  # unbound: usable inline; test_trust_boundaries binds
        }
        fields.update(claims)
        return mint(load_private_key(self.keys[approver]), **fields)


def write_policy(
    path: Path, keys: dict[str, str], extra_clients: list[dict[str, Any]] = ()
) -> None:  # type: ignore[assignment]
    policy = {
        "audience": AUDIENCE,
        "approvers": approvers_of(keys),
        "approval_rules": [
            {
                "match": {"tool": "write_file"},
                "approvals_required": 2,
                "groups": ["security"],
                "max_token_ttl_s": 600,
            },
        ],
        "clients": [
            {
                "id": "agent",
                "token_sha256": sha(TOKENS["agent"]),
                "roles": ["execute"],
                "max_safety_level": "dangerous",
            },
            # the operator's client: may replace the operator's tools
            {"id": "admin", "token_sha256": sha(TOKENS["admin"]), "roles": ["register", "admin"]},
            {
                "id": "alice",
                "token_sha256": sha(TOKENS["alice"]),
                "roles": ["approve", "execute"],
                "max_safety_level": "dangerous",
            },
            {"id": "bob", "token_sha256": sha(TOKENS["bob"]), "roles": ["approve"]},
            {
                "id": "reader",
                "token_sha256": sha(TOKENS["reader"]),
                "roles": ["execute"],
                "max_safety_level": "safe",
            },
            *extra_clients,
        ],
    }
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


def deploy(
    start_server: StartServer,
    tmp_path: Path,
    extra_clients: list[dict[str, Any]] = (),  # type: ignore[assignment]
) -> Deployment:
    """A real server with the tests' policy (alice, bob, carol as approvers;
    ``extra_clients`` added) and the example tools."""
    private: dict[str, bytes] = {}
    public: dict[str, str] = {}
    for who in ("alice", "bob", "carol"):
        private[who], public[who] = generate_keypair()
    policy_file = tmp_path / "policy.yaml"
    write_policy(policy_file, public, extra_clients)
    data_dir = tmp_path / "data"
    running = start_server(data_dir=data_dir, policy_file=policy_file, tools_dir=EXAMPLES)
    return Deployment(running, private, policy_file, data_dir, data_dir / "workspace")


@pytest.fixture
def deployment(
    start_server: StartServer, tmp_path: Path, engine: docker.DockerClient
) -> Iterator[Deployment]:
    d = deploy(start_server, tmp_path)
    yield d
    assert wait_until_gone(engine, d.running) == []


WRITE_ARGS = json.dumps({"path": "notes/today.txt", "content": "approved text"})


def ask(d: Deployment, args: str = WRITE_ARGS, **kw: Any) -> pb.ToolResult:
    result: pb.ToolResult = d.stub("agent").ExecuteTool(
        pb.ExecuteToolRequest(name="write_file", arguments_json=args, **kw), timeout=60
    )
    return result


def test_two_approvers_end_to_end(deployment: Deployment) -> None:
    d = deployment
    first = ask(d)
    assert first.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED
    request = first.approval_request
    assert request.id and request.approvals_required == 2 and request.state == "PENDING"
    assert request.audience == AUDIENCE and request.max_token_ttl_s == 600
    assert json.loads(request.arguments_json) == json.loads(WRITE_ARGS)
    assert ask(d).approval_request.id == request.id  # asking again reuses the open request

    listed = d.stub("alice").ListApprovalRequests(pb.ListApprovalRequestsRequest(state="PENDING"))
    assert [r.id for r in listed.requests] == [request.id]
    after_alice = d.stub("alice").SubmitApproval(
        pb.SubmitApprovalRequest(request_id=request.id, token=d.sign("alice", request))
    )
    assert list(after_alice.approved_by) == ["alice"] and after_alice.state == "PENDING"
    assert after_alice.approvals_missing == 1
    still = ask(d, approval_request_id=request.id)
    assert still.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED and "1 valid so far" in still.error

    after_bob = d.stub("bob").SubmitApproval(
        pb.SubmitApprovalRequest(request_id=request.id, token=d.sign("bob", request))
    )
    assert after_bob.state == "APPROVED" and sorted(after_bob.approved_by) == ["alice", "bob"]

    done = ask(d, approval_request_id=request.id)
    assert done.success, done.error
    assert json.loads(done.data_json) == {"path": "notes/today.txt", "bytes": 13}
    assert (d.workspace / "notes" / "today.txt").read_text() == "approved text"

    again = ask(d, approval_request_id=request.id)
    assert again.status == pb.EXECUTION_STATUS_APPROVAL_DENIED and "consumed" in again.error
    consumed = d.stub("alice").GetApprovalRequest(pb.GetApprovalRequestRequest(id=request.id))
    assert consumed.state == "CONSUMED"


def test_tokens_passed_directly_and_replay_fails_even_after_restart(
    deployment: Deployment, start_server: StartServer
) -> None:
    d = deployment
    request = ask(d).approval_request
    tokens = [d.sign("alice", request), d.sign("bob", request)]
    assert ask(d, approval_tokens=tokens).success
    replay = ask(d, approval_tokens=tokens)
    assert replay.status == pb.EXECUTION_STATUS_APPROVAL_DENIED and "replayed" in replay.error
    d.running.stop()
    restarted = start_server(data_dir=d.data_dir, policy_file=d.policy_file, tools_dir=EXAMPLES)
    stub = pb_grpc.ToolRegistryStub(open_channel(restarted.address, token=TOKENS["agent"]))
    after = stub.ExecuteTool(
        pb.ExecuteToolRequest(name="write_file", arguments_json=WRITE_ARGS, approval_tokens=tokens),
        timeout=60,
    )
    assert after.status == pb.EXECUTION_STATUS_APPROVAL_DENIED and "replayed" in after.error


def test_one_approver_twice_counts_once(deployment: Deployment) -> None:
    d = deployment
    request = ask(d).approval_request
    result = ask(d, approval_tokens=[d.sign("alice", request), d.sign("alice", request)])
    assert result.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED


@pytest.mark.parametrize(
    ("make_tokens", "reason"),
    [
        (lambda d, r: [d.sign("alice", r), d.sign("carol", r)], "not eligible"),
        (lambda d, r: [d.sign("alice", r), d.sign("bob", r, ttl_s=3600)], "exceeds"),
        (lambda d, r: [d.sign("alice", r), d.sign("bob", r, audience="elsewhere")], "audience"),
        (lambda d, r: [d.sign("alice", r), d.sign("bob", r, args_digest=sha("x"))], "args"),
        (lambda d, r: [d.sign("alice", r), d.sign("bob", r, tool_digest=sha("x"))], "tool"),
        (lambda d, r: [d.sign("alice", r), d.sign("bob", r, issuer="mallory")], "unknown approver"),
        (lambda d, r: [d.sign("alice", r), d.sign("bob", r)[:-4] + "AAAA"], "signature"),
    ],
)
def test_wrong_tokens_are_denied_with_the_reason(
    deployment: Deployment,
    make_tokens: Callable[[Deployment, pb.ApprovalRequest], list[str]],
    reason: str,
) -> None:
    d = deployment
    request = ask(d).approval_request
    result = ask(d, approval_tokens=make_tokens(d, request))
    assert result.status == pb.EXECUTION_STATUS_APPROVAL_DENIED
    assert reason in result.error, result.error
    assert not (d.workspace / "notes").exists()


def test_submit_rejects_ineligible_and_own_approval(deployment: Deployment) -> None:
    d = deployment
    own = d.stub("alice").ExecuteTool(
        pb.ExecuteToolRequest(name="write_file", arguments_json=WRITE_ARGS)
    )
    request = own.approval_request
    assert request.requested_by == "alice"
    with pytest.raises(grpc.RpcError) as info:
        d.stub("alice").SubmitApproval(
            pb.SubmitApprovalRequest(request_id=request.id, token=d.sign("alice", request))
        )
    assert (
        rpc_code(info.value) == grpc.StatusCode.PERMISSION_DENIED
        and "own call" in info.value.details()
    )
    with pytest.raises(grpc.RpcError) as info:
        d.stub("bob").SubmitApproval(
            pb.SubmitApprovalRequest(request_id=request.id, token=d.sign("carol", request))
        )
    assert (
        rpc_code(info.value) == grpc.StatusCode.PERMISSION_DENIED
        and "not eligible" in info.value.details()
    )


def test_changed_arguments_or_redefined_tool_invalidate_approval(deployment: Deployment) -> None:
    d = deployment
    request = ask(d).approval_request
    for who in ("alice", "bob"):
        d.stub(who).SubmitApproval(
            pb.SubmitApprovalRequest(request_id=request.id, token=d.sign(who, request))
        )
    changed = ask(
        d,
        json.dumps({"path": "notes/today.txt", "content": "approved texT"}),
        approval_request_id=request.id,
    )
    assert (
        changed.status == pb.EXECUTION_STATUS_APPROVAL_DENIED
        and "arguments differ" in changed.error
    )
    reordered = ask(
        d,
        json.dumps({"content": "approved text", "path": "notes/today.txt"}),
        approval_tokens=[d.sign("alice", request), d.sign("bob", request)],
    )
    assert reordered.success, reordered.error  # same canonical JSON: same approval
    request2 = ask(d, json.dumps({"path": "b.txt", "content": "x"})).approval_request
    for who in ("alice", "bob"):
        d.stub(who).SubmitApproval(
            pb.SubmitApprovalRequest(request_id=request2.id, token=d.sign(who, request2))
        )
    manifest = yaml.safe_load((EXAMPLES / "write_file.yaml").read_text())
    manifest["description"] += " (v2)"
    d.stub("admin").RegisterTool(
        pb.RegisterToolRequest(tool=convert.tool_to_pb(parse_definition(manifest)), replace=True)
    )
    redefined = ask(
        d, json.dumps({"path": "b.txt", "content": "x"}), approval_request_id=request2.id
    )
    assert (
        redefined.status == pb.EXECUTION_STATUS_APPROVAL_DENIED and "redefined" in redefined.error
    )


def test_role_boundaries(deployment: Deployment) -> None:
    d = deployment
    anonymous = pb_grpc.ToolRegistryStub(grpc.insecure_channel(d.running.address))
    unknown = pb_grpc.ToolRegistryStub(open_channel(d.running.address, token="guess"))

    def code(call: Callable[[], object]) -> grpc.StatusCode | None:
        try:
            call()
        except grpc.RpcError as exc:
            return rpc_code(exc)
        return grpc.StatusCode.OK

    echo = pb.ExecuteToolRequest(name="echo", arguments_json='{"message": "hi"}')
    code_run = pb.ExecuteToolRequest(name="run_python", arguments_json='{"code": "print(1)"}')
    tool = convert.tool_to_pb(
        parse_definition(yaml.safe_load((EXAMPLES / "echo.yaml").read_text()))
    )
    assert (
        code(lambda: anonymous.ListTools(pb.ListToolsRequest())) == grpc.StatusCode.UNAUTHENTICATED
    )
    assert code(lambda: unknown.ListTools(pb.ListToolsRequest())) == grpc.StatusCode.UNAUTHENTICATED
    assert code(lambda: d.stub("reader").ListTools(pb.ListToolsRequest())) == grpc.StatusCode.OK
    assert (
        code(lambda: d.stub("agent").RegisterTool(pb.RegisterToolRequest(tool=tool)))
        == grpc.StatusCode.PERMISSION_DENIED
    )
    assert (
        code(lambda: d.stub("admin").RegisterTool(pb.RegisterToolRequest(tool=tool)))
        == grpc.StatusCode.OK
    )
    assert code(lambda: d.stub("admin").ExecuteTool(echo)) == grpc.StatusCode.PERMISSION_DENIED
    assert code(lambda: d.stub("reader").ExecuteTool(echo)) == grpc.StatusCode.OK
    assert code(lambda: d.stub("reader").ExecuteTool(code_run)) == grpc.StatusCode.PERMISSION_DENIED
    assert code(lambda: d.stub("agent").ExecuteTool(code_run)) == grpc.StatusCode.OK
    assert (
        code(lambda: d.stub("agent").ListApprovalRequests(pb.ListApprovalRequestsRequest()))
        == grpc.StatusCode.PERMISSION_DENIED
    )
    assert (
        code(lambda: d.stub("bob").ListApprovalRequests(pb.ListApprovalRequestsRequest()))
        == grpc.StatusCode.OK
    )
    assert code(lambda: d.stub("bob").ExecuteTool(echo)) == grpc.StatusCode.PERMISSION_DENIED
    assert code(lambda: d.stub("agent").StreamExecuteTool(echo).__next__()) == grpc.StatusCode.OK
    assert (
        code(lambda: d.stub("admin").StreamExecuteTool(echo).__next__())
        == grpc.StatusCode.PERMISSION_DENIED
    )


def _audit_rows(d: Deployment) -> list[tuple[Any, ...]]:
    return list(store_file.audit_rows(d.data_dir))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "registry_server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_audit_records_every_attempt_and_detects_tampering(
    deployment: Deployment, start_server: StartServer
) -> None:
    d = deployment
    request = ask(d).approval_request
    tokens = [d.sign("alice", request), d.sign("bob", request)]
    assert ask(d, approval_tokens=tokens).success
    d.stub("agent").ExecuteTool(
        pb.ExecuteToolRequest(name="echo", arguments_json='{"message":"x"}')
    )
    d.stub("agent").ExecuteTool(pb.ExecuteToolRequest(name="nope"))
    records = [(kind, json.loads(rec)) for _, kind, rec in _audit_rows(d)]
    executions = [r for k, r in records if k == "execution"]
    decisions = [(r["tool"], r["decision"], r["status"]) for r in executions]
    assert ("write_file", "approval_required", "APPROVAL_REQUIRED") in decisions
    assert ("write_file", "approved", "STARTING") in decisions
    assert ("write_file", "approved", "OK") in decisions
    assert ("echo", "allowed", "OK") in decisions
    assert ("nope", "not_found", "TOOL_NOT_FOUND") in decisions
    approved = next(r for r in executions if r["decision"] == "approved" and r["status"] == "OK")
    assert sorted(approved["approvers"]) == ["alice", "bob"] and len(approved["jtis"]) == 2
    assert approved["limits"]["memory_mb"] == 128 and approved["runtime"] in ("runsc", "runc")
    assert any(k == "registration" for k, _ in records)

    ok = _cli("audit", "verify", "--data-dir", str(d.data_dir))
    assert ok.returncode == 0 and "intact" in ok.stdout
    tail = _cli("audit", "tail", "-n", "3", "--data-dir", str(d.data_dir))
    assert len(tail.stdout.splitlines()) == 3

    d.running.stop()
    with store_file.connect(d.data_dir) as db:  # edit one record: the approvers of the approved run
        seq, record = next(
            (s, r)
            for s, k, r in db.execute("SELECT seq, kind, record FROM audit")
            if '"approved"' in r
        )
        db.execute(
            "UPDATE audit SET record = ? WHERE seq = ?", (record.replace("alice", "alicf"), seq)
        )
    broken = _cli("audit", "verify", "--data-dir", str(d.data_dir))
    assert broken.returncode == 1 and f"broken at record {seq}" in broken.stdout
    with pytest.raises(Exception, match="refusing to start"):
        start_server(data_dir=d.data_dir, policy_file=d.policy_file)
    allowed = start_server(data_dir=d.data_dir, policy_file=d.policy_file, allow_broken_audit=True)
    allowed.stop()


@pytest.mark.parametrize("tamper", ["delete", "reorder"])
def test_audit_detects_deleted_and_reordered_records(deployment: Deployment, tamper: str) -> None:
    d = deployment
    for _ in range(3):
        d.stub("agent").ExecuteTool(pb.ExecuteToolRequest(name="nope"))
    d.running.stop()
    with store_file.connect(d.data_dir) as db:
        last = db.execute("SELECT MAX(seq) FROM audit").fetchone()[0]
        if tamper == "delete":
            db.execute("DELETE FROM audit WHERE seq = ?", (last - 1,))
            expected = last
        else:
            a = db.execute(
                "SELECT at, kind, record, prev_hash, hash FROM audit WHERE seq = ?", (last - 1,)
            ).fetchone()
            b = db.execute(
                "SELECT at, kind, record, prev_hash, hash FROM audit WHERE seq = ?", (last,)
            ).fetchone()
            db.execute(
                "UPDATE audit SET at=?, kind=?, record=?, prev_hash=?, hash=? WHERE seq = ?",
                (*b, last - 1),
            )
            db.execute(
                "UPDATE audit SET at=?, kind=?, record=?, prev_hash=?, hash=? WHERE seq = ?",
                (*a, last),
            )
            expected = last - 1
    out = _cli("audit", "verify", "--data-dir", str(d.data_dir))
    assert out.returncode == 1 and f"broken at record {expected}" in out.stdout


def test_cli_approves_with_a_key_that_never_leaves_it(
    deployment: Deployment, tmp_path: Path
) -> None:
    d = deployment
    request = ask(d).approval_request
    env = dict(os.environ, TOOLREG_ADDRESS=d.running.address)
    for who in ("alice", "bob"):
        key = tmp_path / f"{who}.key"
        key.write_bytes(d.keys[who])
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "registry_server.cli",
                "--token",
                TOKENS[who],
                "approvals",
                "approve",
                request.id,
                "--key",
                str(key),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            cwd=ROOT,
        )
        assert out.returncode == 0, out.stderr
    show = subprocess.run(
        [
            sys.executable,
            "-m",
            "registry_server.cli",
            "--token",
            TOKENS["alice"],
            "approvals",
            "show",
            request.id,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=ROOT,
    )
    assert "APPROVED" in show.stdout and '"content": "approved text"' in show.stdout
    assert ask(d, approval_request_id=request.id).success


def test_cli_approves_with_an_encrypted_key_and_its_passphrase(
    deployment: Deployment, tmp_path: Path
) -> None:
    """`toolreg approvals approve --key` with keys encrypted by a passphrase: from
    TOOLREG_KEY_PASSPHRASE; without it (and no terminal), or with a wrong one,
    one line and exit 2, nothing signed, the passphrase never shown."""
    d = deployment
    request = ask(d).approval_request
    passphrase = "approvers' shared test passphrase"

    def approve(who: str, key: Path, given: str | None) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "TOOLREG_KEY_PASSPHRASE"}
        env |= {"TOOLREG_ADDRESS": d.running.address}
        if given is not None:
            env["TOOLREG_KEY_PASSPHRASE"] = given
        return subprocess.run(
            [sys.executable, "-m", "registry_server.cli", "--token", TOKENS[who],
             "approvals", "approve", request.id, "--key", str(key)],
            capture_output=True, text=True, env=env, timeout=60, cwd=ROOT,
            stdin=subprocess.DEVNULL,  # no terminal to ask on
        )  # fmt: skip

    for who in ("alice", "bob"):
        key = tmp_path / f"{who}.key"
        encrypted = load_private_key(d.keys[who]).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(passphrase.encode()),
        )
        key.write_bytes(encrypted)
        missing = approve(who, key, None)
        assert missing.returncode == 2 and missing.stdout == ""
        assert missing.stderr == (
            f"toolreg: {key} is encrypted: set TOOLREG_KEY_PASSPHRASE to its passphrase,"
            " or run this on a terminal to be asked for it\n"
        )
        wrong = approve(who, key, "a wrong passphrase")
        assert wrong.returncode == 2
        assert wrong.stderr == f"toolreg: {key}: wrong passphrase (or a damaged key file)\n"
        assert "a wrong passphrase" not in wrong.stdout + wrong.stderr
        assert not ask(d, approval_request_id=request.id).success  # nothing was signed
        done = approve(who, key, passphrase)
        assert done.returncode == 0, done.stderr
        assert passphrase not in done.stdout + done.stderr
    assert ask(d, approval_request_id=request.id).success


def test_mtls_clients_by_certificate(start_server: StartServer, tmp_path: Path) -> None:
    ca, rogue = CertificateAuthority("toolreg test CA"), CertificateAuthority("rogue CA")
    server_cert = ca.issue("localhost", server=True)
    good, bad = ca.issue("agent-tls"), rogue.issue("agent-tls")
    files = {}
    for name, data in [
        ("ca.pem", ca.pem),
        ("server.pem", server_cert.cert_pem),
        ("server.key", server_cert.key_pem),
    ]:
        files[name] = tmp_path / name
        files[name].write_bytes(data)
    policy = tmp_path / "policy.yaml"
    write_policy(
        policy,
        {who: generate_keypair()[1] for who in ("alice", "bob", "carol")},
        [{"id": "agent-tls", "mtls_subject": "CN=agent-tls", "roles": ["execute"]}],
    )
    running = start_server(
        policy_file=policy,
        tools_dir=EXAMPLES,
        tls_cert=files["server.pem"],
        tls_key=files["server.key"],
        tls_client_ca=files["ca.pem"],
        host="localhost",
    )

    def list_with(cert: Any) -> grpc.StatusCode | None:
        return list_over_mtls(running.port, ca.pem, cert)

    assert list_with(good) == grpc.StatusCode.OK
    assert (
        list_with(bad) == grpc.StatusCode.UNAVAILABLE
    )  # the handshake fails: another CA signed it
    plain = pb_grpc.ToolRegistryStub(grpc.insecure_channel(f"localhost:{running.port}"))
    with pytest.raises(grpc.RpcError):
        plain.ListTools(pb.ListToolsRequest(), timeout=5)
