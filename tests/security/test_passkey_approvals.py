"""Passkey approvals end to end (docs/how-to/approvals.md, "Passkeys"): a real server
with a written policy whose approvers hold WebAuthn credentials, real SQLite,
the real engine, and a software authenticator (tests/passkey_authenticator.py,
an EC P-256 key) whose assertions py_webauthn verifies for real. The
envelopes travel in the proto's existing string fields (SubmitApproval.token,
ExecuteToolRequest.approval_tokens)."""

from __future__ import annotations

import base64
import json
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
from registry_server.client.registry_client import open_channel
from registry_server.signing import passkeys
from tests import store_file
from tests.factories import sha
from tests.integration.conftest import Running, StartServer
from tests.passkey_authenticator import FLAG_UP, ORIGIN, RP_ID, SoftAuthenticator
from tests.security.conftest import wait_until_gone

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "tools"
AUDIENCE = "toolreg-passkeys"
TOKENS = {"agent": "agent-secret", "alice": "alice-secret", "bob": "bob-secret"}
WRITE_ARGS = json.dumps({"path": "notes/today.txt", "content": "approved by passkeys"})


@dataclass
class Deployment:
    running: Running
    authenticators: dict[str, SoftAuthenticator]  # held by the approvers, not the server
    policy_file: Path
    data_dir: Path

    def stub(self, who: str, running: Running | None = None) -> pb_grpc.ToolRegistryStub:
        address = (running or self.running).address
        return pb_grpc.ToolRegistryStub(open_channel(address, token=TOKENS[who]))

    def ask(self, args: str = WRITE_ARGS, **kw: Any) -> pb.ToolResult:
        result: pb.ToolResult = self.stub("agent").ExecuteTool(
            pb.ExecuteToolRequest(name="write_file", arguments_json=args, **kw), timeout=60
        )
        return result

    def approve(self, approver: str, request: pb.ApprovalRequest, **options: Any) -> str:
        """An envelope from ``approver``'s passkey for ``request`` (the claims
        the console hands the page); ``claims`` entries override."""
        claims = passkeys.claims_for(request)
        claims.update(options.pop("claims", {}))
        return self.authenticators[approver].approve(claims, **options)

    def submit(self, approver: str, request_id: str, token: str) -> pb.ApprovalRequest:
        answer: pb.ApprovalRequest = self.stub(approver).SubmitApproval(
            pb.SubmitApprovalRequest(request_id=request_id, token=token)
        )
        return answer


def policy(authenticators: dict[str, SoftAuthenticator]) -> dict[str, Any]:
    return {
        "audience": AUDIENCE,
        "webauthn": {"rp_id": RP_ID, "origins": [ORIGIN]},
        "approvers": [
            {
                "id": who,
                "groups": ["security"],
                "passkeys": [
                    {
                        "id": a.credential_id,
                        "public_key": passkeys.b64url(a.cose_public_key()),
                    }
                ],
            }
            for who, a in authenticators.items()
        ],
        "approval_rules": [
            {
                "match": {"tool": "write_file"},
                "approvals_required": 2,
                "groups": ["security"],
                "max_token_ttl_s": 600,
            }
        ],
        "clients": [
            {
                "id": "agent",
                "token_sha256": sha(TOKENS["agent"]),
                "roles": ["execute"],
                "max_safety_level": "dangerous",
            },
            {"id": "alice", "token_sha256": sha(TOKENS["alice"]), "roles": ["approve"]},
            {"id": "bob", "token_sha256": sha(TOKENS["bob"]), "roles": ["approve"]},
        ],
    }


@pytest.fixture
def deployment(
    start_server: StartServer, tmp_path: Path, engine: docker.DockerClient
) -> Iterator[Deployment]:
    authenticators = {who: SoftAuthenticator(who) for who in ("alice", "bob")}
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy(authenticators), sort_keys=False))
    data_dir = tmp_path / "data"
    running = start_server(data_dir=data_dir, policy_file=policy_file, tools_dir=EXAMPLES)
    d = Deployment(running, authenticators, policy_file, data_dir)
    yield d
    assert wait_until_gone(engine, d.running) == []


def execution_records(d: Deployment) -> list[dict[str, Any]]:
    return [json.loads(r) for _, _, r in store_file.audit_rows(d.data_dir, "execution")]


def test_two_passkey_approvers_approve_and_the_call_runs(deployment: Deployment) -> None:
    d = deployment
    request = d.ask().approval_request
    assert request.approvals_required == 2 and request.state == "PENDING"

    after_alice = d.submit("alice", request.id, d.approve("alice", request))
    assert list(after_alice.approved_by) == ["alice"] and after_alice.state == "PENDING"
    after_bob = d.submit("bob", request.id, d.approve("bob", request))
    assert after_bob.state == "APPROVED" and sorted(after_bob.approved_by) == ["alice", "bob"]

    done = d.ask(approval_request_id=request.id)
    assert done.success, done.error
    assert json.loads(done.data_json) == {"path": "notes/today.txt", "bytes": 20}
    workspace = d.data_dir / "workspace"
    assert (workspace / "notes" / "today.txt").read_text() == "approved by passkeys"

    # The record written with the spent jtis (status STARTING) names each passkey.
    started = [r for r in execution_records(d) if r["status"] == "STARTING"]
    assert len(started) == 1 and sorted(started[0]["approvers"]) == ["alice", "bob"]
    by_approver = {p["approver"]: p for p in started[0]["passkeys"]}
    assert by_approver["alice"]["credential_id"] == d.authenticators["alice"].credential_id
    assert by_approver["bob"]["flags"] == {"UP": True, "UV": True, "BE": False, "BS": False}
    approval_events = [json.loads(r) for _, _, r in store_file.audit_rows(d.data_dir, "approval")]
    added = [e for e in approval_events if e.get("event") == "approved"]
    assert {e["approver"]: e["passkey"]["sign_count"] for e in added} == {"alice": 1, "bob": 1}

    again = d.ask(approval_request_id=request.id)
    assert again.status == pb.EXECUTION_STATUS_APPROVAL_DENIED and "consumed" in again.error


def test_an_assertion_for_other_arguments_is_refused(deployment: Deployment) -> None:
    d = deployment
    request = d.ask().approval_request
    other = d.ask(json.dumps({"path": "notes/x.txt", "content": "other"})).approval_request
    # Alice's passkey signed the other request's claims: submitted to this one.
    with pytest.raises(grpc.RpcError) as info:
        d.submit("alice", request.id, d.approve("alice", other))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "arguments do not match (args_digest)" in info.value.details()
    # The claims rewritten to this call's arguments: the signature is over others.
    forged = d.approve(
        "alice", request, signed_claims={**passkeys.claims_for(other), "req": request.id}
    )
    inline = d.ask(approval_tokens=[forged, d.approve("bob", request)])
    assert inline.status == pb.EXECUTION_STATUS_APPROVAL_DENIED
    assert "not made for these claims" in inline.error
    assert forged[20:60] not in inline.error  # the envelope is never echoed
    assert not (d.data_dir / "workspace" / "notes").exists()


def test_an_assertion_without_user_verification_is_refused(deployment: Deployment) -> None:
    d = deployment
    request = d.ask().approval_request
    with pytest.raises(grpc.RpcError) as info:
        d.submit("alice", request.id, d.approve("alice", request, flags=FLAG_UP))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "UV flag not set" in info.value.details()
    inline = d.ask(
        approval_tokens=[d.approve("alice", request, flags=FLAG_UP), d.approve("bob", request)]
    )
    assert inline.status == pb.EXECUTION_STATUS_APPROVAL_DENIED and "UV flag" in inline.error


def test_a_counter_that_goes_back_is_refused(deployment: Deployment) -> None:
    d = deployment
    request = d.ask().approval_request
    d.submit("alice", request.id, d.approve("alice", request, counter=41))
    # A clone of Alice's authenticator, behind the original's count.
    with pytest.raises(grpc.RpcError) as info:
        d.submit("alice", request.id, d.approve("alice", request, counter=40))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "signature counter went back" in info.value.details()
    inline = d.ask(
        approval_tokens=[d.approve("alice", request, counter=41), d.approve("bob", request)]
    )
    assert inline.status == pb.EXECUTION_STATUS_APPROVAL_DENIED
    assert "counter 41, not above 41" in inline.error
    # The original goes on counting, and the call runs.
    d.submit("alice", request.id, d.approve("alice", request, counter=42))
    d.submit("bob", request.id, d.approve("bob", request))
    assert d.ask(approval_request_id=request.id).success


def test_a_replayed_jti_is_refused_also_after_a_restart(
    deployment: Deployment, start_server: StartServer
) -> None:
    d = deployment
    request = d.ask().approval_request
    tokens = [d.approve("alice", request), d.approve("bob", request)]
    spent_count = d.authenticators["alice"].counter
    assert d.ask(approval_tokens=tokens, approval_request_id=request.id).success
    replay = d.ask(approval_tokens=tokens)
    assert replay.status == pb.EXECUTION_STATUS_APPROVAL_DENIED and "replayed" in replay.error

    # The same claims (and jti) signed again, with a higher counter: still the same jti.
    body = tokens[0][len(passkeys.PREFIX) :]
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))["claims"]
    d.running.stop()
    restarted = start_server(data_dir=d.data_dir, policy_file=d.policy_file, tools_dir=EXAMPLES)
    d.running = restarted
    resigned = d.authenticators["alice"].approve(claims)
    after = d.ask(approval_tokens=[resigned, d.approve("bob", d.ask().approval_request)])
    assert after.status == pb.EXECUTION_STATUS_APPROVAL_DENIED and "replayed" in after.error
    # And the counters survived the restart: the count Alice's spent approval
    # had is refused again, for a new request and a new jti.
    fresh = d.ask().approval_request
    with pytest.raises(grpc.RpcError) as info:
        d.submit("alice", fresh.id, d.approve("alice", fresh, counter=spent_count))
    assert "signature counter went back" in info.value.details()


def test_an_unknown_passkey_and_an_oversized_envelope_are_refused(
    deployment: Deployment,
) -> None:
    d = deployment
    request = d.ask().approval_request
    stranger = SoftAuthenticator("mallory")
    with pytest.raises(grpc.RpcError) as info:
        d.submit("alice", request.id, stranger.approve(passkeys.claims_for(request)))
    assert "unknown passkey" in info.value.details()
    huge = passkeys.PREFIX + "A" * 9_000
    with pytest.raises(grpc.RpcError) as info:
        d.submit("alice", request.id, huge)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "AAAA" not in info.value.details()
