"""IdP access tokens on the gRPC API, end to end: a real OpenID Provider
(oidc-provider, on loopback over TLS), a real `toolreg serve` process that
trusts it through its policy, the real engine for the tool's sandbox.

The provider signs with keys the test made (it holds their private parts), so
a test can ask for real tokens and also forge ones that differ in one way.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from cryptography.hazmat.primitives import serialization

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.idp_tokens import ClientCredentials
from registry_server.client.registry_client import RegistryClient, open_channel
from registry_server.domain.models import parse_definition
from registry_server.wire import convert
from tests import store_file
from tests.factories import sha
from tests.identity.idp_world import OTHER_RESOURCE, RESOURCE, SCOPE, IdP, SigningKey

ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "identity-admin-secret"
REFRESH_INTERVAL_S = 1  # the policy's min_refresh_interval_s here (seconds)
LOG_WAIT_S = 30  # seconds for a line the server wrote to reach its log reader thread


@dataclass
class Deployment:
    server: ServerProcess
    data_dir: Path
    policy_file: Path
    idp: IdP

    def stub(self, token: str) -> pb_grpc.ToolRegistryStub:
        return pb_grpc.ToolRegistryStub(open_channel(self.server.address, token=token))

    def write_policy(self, denied: list[str] | None = None) -> None:
        policy = {
            "audience": "toolreg-identity-test",
            "clients": [
                {"id": "admin", "token_sha256": sha(ADMIN_TOKEN), "roles": ["admin", "register"]},
                {"id": "pinned-agent", "idp": {"provider": "testidp", "subject": "agent-pinned"},
                 "roles": ["execute"], "max_safety_level": "safe"},
            ],
            "identity_providers": [{
                "id": "testidp",
                "issuer": self.idp.issuer,
                "audiences": [RESOURCE],
                "algorithms": ["ES256", "RS256"],
                "ca_file": str(self.idp.ca_file),
                "client_claim": "sub",
                "groups_claim": "groups",
                "min_refresh_interval_s": REFRESH_INTERVAL_S,
                "groups": [
                    {"group": "toolreg-agents", "roles": ["execute"],
                     "max_safety_level": "cautious"},
                ],
                "denied_subjects": denied or [],
            }],
        }  # fmt: skip
        self.policy_file.write_text(yaml.safe_dump(policy, sort_keys=False))

    def log_text(self, *lines: str) -> str:
        """The server's log once it holds every one of ``lines``: a thread reads
        its stderr, so a line it wrote reaches the test a moment later."""
        deadline = time.monotonic() + LOG_WAIT_S
        while True:
            log = "".join(self.server.log)
            missing = [line for line in lines if line not in log]
            if not missing:
                return log
            assert time.monotonic() < deadline, f"not in the server's log: {missing}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def deployment(
    idp: IdP, tmp_path_factory: pytest.TempPathFactory, engine: Any
) -> Iterator[Deployment]:
    for client_id in ("agent-1", "agent-2", "agent-pinned"):
        if client_id not in idp.clients:
            idp.add_client(client_id, groups=["toolreg-agents"])
    tmp = tmp_path_factory.mktemp("identity")
    d = Deployment(None, tmp / "data", tmp / "policy.yaml", idp)  # type: ignore[arg-type]
    d.write_policy()
    # DEBUG: every log line a token, a key fetch or a refusal could make is made.
    d.server = spawn_server(
        d.data_dir, "--policy", str(d.policy_file), "--log-level", "DEBUG", cwd=ROOT
    )
    tool = parse_definition({
        "name": "whoami_echo", "description": "echoes its input",
        "parameters": {"type": "object"}, "safety_level": "safe",
        "sandbox": {"image": "toolreg/base", "command": ["cat"]},
    })  # fmt: skip
    d.stub(ADMIN_TOKEN).RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool)))
    yield d
    d.server.stop()


@pytest.fixture(scope="module")
def engine() -> Iterator[Any]:
    import docker

    client = docker.from_env()
    client.ping()
    yield client
    client.close()


def code_of(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code(), caught.value.details()


def list_tools(d: Deployment, token: str) -> Any:
    return lambda: d.stub(token).ListTools(pb.ListToolsRequest(), timeout=20)


def credentials(idp: IdP, client_id: str, resource: str = RESOURCE) -> ClientCredentials:
    return ClientCredentials(
        f"{idp.issuer}/token", client_id, idp.clients[client_id],
        resource=resource, scope=SCOPE, ca_file=str(idp.ca_file),
    )  # fmt: skip


def test_an_agent_with_a_client_credentials_token_runs_a_tool(deployment: Deployment) -> None:
    tokens = credentials(deployment.idp, "agent-1")
    with RegistryClient.connect(deployment.server.address, token=tokens) as client:
        result = client.stub.ExecuteTool(
            pb.ExecuteToolRequest(name="whoami_echo", arguments_json='{"hello": "idp"}'),
            timeout=60,
        )
        assert result.status == pb.EXECUTION_STATUS_OK, result.error
        assert json.loads(result.content) == {"hello": "idp"}
        client.stub.ListTools(pb.ListToolsRequest(), timeout=20)
    assert tokens.fetches == 1  # one token served both calls
    records = [json.loads(r) for _, k, r in store_file.audit_rows(deployment.data_dir)
               if k == "execution"]  # fmt: skip
    assert any(r.get("caller") == "testidp.agent-1" for r in records), records
    # The pinned subject is the policy's own client, not a group-mapped one.
    pinned = credentials(deployment.idp, "agent-pinned")
    with RegistryClient.connect(deployment.server.address, token=pinned) as client:
        result = client.stub.ExecuteTool(
            pb.ExecuteToolRequest(name="whoami_echo", arguments_json="{}"), timeout=60
        )
        assert result.status == pb.EXECUTION_STATUS_OK, result.error
    records = [json.loads(r) for _, k, r in store_file.audit_rows(deployment.data_dir)
               if k == "execution"]  # fmt: skip
    assert any(r.get("caller") == "pinned-agent" for r in records)


def test_every_bad_token_is_unauthenticated_and_logged_without_it(
    deployment: Deployment,
) -> None:
    idp = deployment.idp
    now = int(time.time())
    real = idp.client_credentials("agent-2")
    header, claims, signature = real.split(".")
    bad = {
        "alg none": f"{header}.{claims}.",
        "wrong iss": idp.forge(iss="https://127.0.0.1:1"),
        "wrong aud (another resource of the same IdP)": idp.client_credentials(
            "agent-2", resource=OTHER_RESOURCE
        ),
        "expired": idp.forge(iat=now - 900, exp=now - 600),
        "not yet valid": idp.forge(nbf=now + 600),
        "missing sub": idp.forge(sub=None),
        "missing exp": idp.forge(exp=None),
        "signed by a key the IdP never published": idp.forge(SigningKey("ES256")),
        "payload changed": f"{header}.{idp.forge().split('.')[1]}.{signature}",
        "HS256 signed with the IdP's published RSA key": hs256_with_public_key(idp),
    }
    for case, token in bad.items():
        code, details = code_of(list_tools(deployment, token))
        assert code is grpc.StatusCode.UNAUTHENTICATED, case
        assert details in ("invalid access token", "access token expired"), (case, details)
    assert list_tools(deployment, real)() is not None  # the real one works
    time.sleep(0.5)  # its latest lines a moment, for what must not be in them
    log = deployment.log_text(
        "access token refused: provider testidp: expired", "audience not accepted"
    )
    assert "access token refused: provider testidp: expired" in log
    assert "audience not accepted" in log
    assert "eyJ" not in log  # no JWT, nor any part of one that starts like one
    assert "/jwks" not in log and "openid-configuration" not in log  # no fetch URLs
    for token in [real, *bad.values()]:
        assert token.split(".")[-1] not in log or not token.split(".")[-1]
        assert token not in log


def test_forged_kids_cause_at_most_a_handful_of_jwks_fetches(deployment: Deployment) -> None:
    idp = deployment.idp
    assert list_tools(deployment, idp.client_credentials("agent-1"))() is not None  # keys cached
    before = idp.requests_to("/jwks")
    attacker = SigningKey("ES256")
    stub = pb_grpc.ToolRegistryStub(grpc.insecure_channel(deployment.server.address))
    started = time.monotonic()
    for n in range(1000):
        attacker.kid = f"forged-{n}"
        bearer = (("authorization", f"Bearer {attacker.sign(_claims(idp))}"),)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ListTools(pb.ListToolsRequest(), metadata=bearer, timeout=20)
        assert caught.value.code() is grpc.StatusCode.UNAUTHENTICATED
    elapsed = time.monotonic() - started
    fetches = idp.requests_to("/jwks") - before
    # At most one per refresh interval (plus the one in flight at each end).
    assert fetches <= int(elapsed / REFRESH_INTERVAL_S) + 2, f"{fetches} in {elapsed:.1f} s"


def _claims(idp: IdP) -> dict[str, Any]:
    now = int(time.time())
    return {"iss": idp.issuer, "aud": RESOURCE, "sub": "agent-1", "iat": now, "exp": now + 300,
            "groups": ["toolreg-agents"]}  # fmt: skip


def test_a_key_rotation_at_the_idp_is_picked_up_with_no_restart(deployment: Deployment) -> None:
    idp = deployment.idp
    assert list_tools(deployment, idp.client_credentials("agent-1"))() is not None
    new_key = idp.rotate()
    token = idp.client_credentials("agent-1")
    assert json.loads(_b64decode(token.split(".")[0]))["kid"] == new_key.kid
    time.sleep(REFRESH_INTERVAL_S + 0.2)  # past the interval since the last fetch
    assert list_tools(deployment, token)() is not None


def test_with_the_idp_down_cached_keys_work_and_unknown_ones_fail_closed(
    deployment: Deployment,
) -> None:
    idp = deployment.idp
    assert list_tools(deployment, idp.client_credentials("agent-1"))() is not None
    cached = idp.forge(sub="agent-1", groups=["toolreg-agents"])
    idp.stop()
    try:
        assert list_tools(deployment, cached)() is not None
        never_published = SigningKey("ES256")
        time.sleep(REFRESH_INTERVAL_S + 0.2)  # a refresh is allowed, and fails
        code, _ = code_of(list_tools(deployment, never_published.sign(_claims(idp))))
        assert code is grpc.StatusCode.UNAUTHENTICATED
        assert list_tools(deployment, cached)() is not None  # still, after the failed refresh
    finally:
        idp.start()


def test_a_group_taken_away_at_the_idp_holds_from_the_next_token(
    deployment: Deployment,
) -> None:
    idp = deployment.idp
    idp.add_client("agent-3", groups=["toolreg-agents"])
    before = idp.client_credentials("agent-3")
    assert list_tools(deployment, before)() is not None
    idp.set_claims("clients", "agent-3", groups=[])
    after = idp.client_credentials("agent-3")
    code, details = code_of(list_tools(deployment, after))
    assert code is grpc.StatusCode.PERMISSION_DENIED
    assert "testidp.agent-3" in details and "none of its groups is mapped" in details


def test_a_denied_subject_is_revoked_by_a_live_reload_before_its_token_expires(
    deployment: Deployment,
) -> None:
    token = deployment.idp.client_credentials("agent-2")
    assert list_tools(deployment, token)() is not None
    deployment.write_policy(denied=["agent-2"])
    try:
        deployment.stub(ADMIN_TOKEN).ReloadPolicy(pb.ReloadPolicyRequest(), timeout=20)
        code, _ = code_of(list_tools(deployment, token))
        assert code is grpc.StatusCode.UNAUTHENTICATED
    finally:
        deployment.write_policy()
        deployment.stub(ADMIN_TOKEN).ReloadPolicy(pb.ReloadPolicyRequest(), timeout=20)
    assert list_tools(deployment, token)() is not None


def _b64decode(part: str) -> bytes:
    import base64

    return base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))


def hs256_with_public_key(idp: IdP) -> str:
    """The key-confusion attack: HMAC-SHA256 keyed with the RSA public key the
    provider publishes (its JWKS), with that key's kid; a verifier that took
    the algorithm from the token would check it with the same public bytes."""
    rsa_key = next(k for k in idp.keys if k.alg == "RS256")
    public_pem = rsa_key.key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    header = {"alg": "HS256", "typ": "at+jwt", "kid": rsa_key.kid}
    now = int(time.time())
    claims = {"iss": idp.issuer, "aud": RESOURCE, "sub": "agent-1", "iat": now, "exp": now + 300,
              "groups": ["toolreg-agents"]}  # fmt: skip
    signing_input = f"{_b64(header)}.{_b64(claims)}"
    mac = hmac.new(public_pem, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"


def _b64(value: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()
