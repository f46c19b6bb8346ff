"""Every refusal on the record (issue 37, item 1; docs/how-to/audit.md,
"Refused requests"). A real server on loopback with a real policy and a real SQLite
file, the real engine for the calls that hold a sandbox, and the SIEM export
to a JSON Lines file:

* each kind of refusal is in the audit log as a "refusal" record (who, or
  "unknown credential" with the credential's kind; the method; the tool; the
  reason's code and text; the source) and in the OCSF export as its class
  (Authentication, Authorize Session, API Activity) with its count: a wrong,
  a malformed, a missing bearer token, an IdP token from an unknown issuer,
  a missing role, a client above its level, its rate quota, the admission
  queue full;
* the kill switch and a deny rule stay execution records (never twice),
  naming the admin's reason and the rule's name and reason; an approval
  request's record carries the rules it must satisfy;
* 10,000 wrong tokens from four threads leave a handful of records whose
  counts add up to exactly 10,000, and the chain still verifies
  (`toolreg audit verify`);
* no token, right or wrong, is in the audit log, the server's log lines or
  the OCSF export.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import subprocess
import threading
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
from registry_server.api.config import DB_FILENAME
from registry_server.domain.models import parse_definition
from registry_server.signing.keys import generate_keypair
from registry_server.store.sqlite import SqliteStore
from registry_server.wire import convert
from tests import ocsf_schema
from tests.certs import CertificateAuthority
from tests.factories import sha
from tests.integration.conftest import Running, StartServer, start_server  # noqa: F401
from tests.security.conftest import engine, list_over_mtls, wait_until_gone  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
AUDIENCE = "toolreg-refusals"
TOKENS = {
    who: f"{who}-{secrets.token_urlsafe(18)}"
    for who in ("agent", "admin", "reader", "lowly", "metered")
}
WRONG = f"wrong-{secrets.token_urlsafe(12)}"  # a bearer token no client holds
ISSUER = "https://idp.example.test/realms/acme"
# A JWT-shaped token from an issuer the policy does not trust (never verified further)
FOREIGN_JWT = "eyJhbGciOiJSUzI1NiJ9.eyJpc3MiOiJodHRwczovL2V2aWwuZXhhbXBsZSJ9." + (
    secrets.token_urlsafe(24)
)
FLOOD = 10_000  # wrong tokens, as the issue asks
FLOOD_THREADS = 4
FOLD_S = 2.0  # seconds: short, so the flusher writes during the flood too


def policy(approver_keys: dict[str, str]) -> dict[str, Any]:
    clients = [
        {"id": "agent", "roles": ["execute"], "max_safety_level": "dangerous"},
        {"id": "admin", "roles": ["admin", "register"]},
        {"id": "reader", "roles": ["register"]},  # no execute role
        {"id": "lowly", "roles": ["execute"], "max_safety_level": "safe"},
        {"id": "metered", "roles": ["execute"], "quotas": {"rate_per_s": 0.001, "burst": 1}},
    ]
    return {
        "audience": AUDIENCE,
        "approvers": [
            {"id": who, "public_key": key, "groups": ["sre"]} for who, key in approver_keys.items()
        ],
        "approval_rules": [
            {
                "name": "two-sre",
                "match": {"tool": "launch"},
                "approvals_required": 2,
                "groups": ["sre"],
            },
        ],
        "deny_rules": [
            {"name": "no-wipe", "match": {"tool": "wipe"}, "reason": "wiping is for operators"}
        ],
        "clients": [{**c, "token_sha256": sha(TOKENS[c["id"]])} for c in clients]
        + [{"id": "agent-tls", "mtls_subject": "CN=agent-tls", "roles": ["register"]}],
        "identity_providers": [
            {
                "id": "corp",
                "issuer": ISSUER,
                "audiences": ["https://registry.example.test"],
                "algorithms": ["RS256"],
                "groups": [{"group": "agents", "roles": ["execute"]}],
            },
        ],
    }


def tool(name: str, script: str, level: str = "safe") -> pb.Tool:
    return convert.tool_to_pb(
        parse_definition(
            {
                "name": name,
                "description": f"test tool {name}",
                "parameters": {"type": "object"},
                "safety_level": level,
                "sandbox": {"image": "toolreg/base", "command": ["sh", "-c", script]},
            }
        )
    )


class Captured(logging.Handler):
    """Every log line of the server (message and structured fields)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.getMessage()} {record.__dict__}")


@dataclass
class Served:
    running: Running
    data: Path
    export: Path
    logs: Captured
    stubs: dict[str, pb_grpc.ToolRegistryStub] = field(default_factory=dict)

    def as_(self, who: str) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {TOKENS[who]}")]

    def refused(self, call: Any, request: Any, metadata: list[tuple[str, str]]) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as refused:
            call(request, metadata=metadata, timeout=30)
        code: grpc.StatusCode = refused.value.code()  # type: ignore[attr-defined]
        return code

    def entries(self) -> list[tuple[str, dict[str, Any]]]:
        store = SqliteStore(self.data / DB_FILENAME)
        try:
            with store.reading() as reads:
                return [(e.kind, json.loads(e.record)) for e in reads.audit_entries()]
        finally:
            store.close()

    def refusals(self) -> list[dict[str, Any]]:
        return [r for kind, r in self.entries() if kind == "refusal"]

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.export.read_text().splitlines()]


@pytest.fixture
def serve(
    start_server: StartServer,  # noqa: F811
    engine: docker.DockerClient,  # noqa: F811
    tmp_path: Path,
) -> Iterator[Any]:
    started: list[Served] = []
    root = logging.getLogger()

    def start(**settings: Any) -> Served:
        keys = {who: generate_keypair()[1] for who in ("alice", "bob")}
        path = tmp_path / f"policy{len(started)}.yaml"
        path.write_text(yaml.safe_dump(policy(keys), sort_keys=False))
        data, export = tmp_path / f"data{len(started)}", tmp_path / f"siem{len(started)}.jsonl"
        logs = Captured()
        root.addHandler(logs)
        previous = root.level
        root.setLevel(logging.DEBUG)
        try:
            running = start_server(
                data_dir=data,
                policy_file=path,
                export_jsonl=export,
                max_sandboxes=1,
                max_queued=0,
                max_warm=0,
                **settings,
            )
        finally:
            root.setLevel(previous)
        served = Served(running, data, export, logs)
        started.append(served)
        return served

    yield start
    for served in started:
        root.removeHandler(served.logs)
        served.running.stop()
        assert wait_until_gone(engine, served.running, timeout_s=60) == []


def no_token_anywhere(served: Served) -> None:
    """No token (the policy's, the wrong ones) in the store's files, the log
    lines or the OCSF export; their hashes are not secrets, the tokens are."""
    texts = {
        "the audit log": json.dumps(served.entries()),
        "the store's files": b"".join(
            p.read_bytes() for p in served.data.glob(f"{DB_FILENAME}*")
        ).decode("latin-1"),
        "the server's log": "\n".join(served.logs.lines),
        "the OCSF export": served.export.read_text(),
    }
    for where, text in texts.items():
        for token in [*TOKENS.values(), WRONG, FOREIGN_JWT, FOREIGN_JWT.split(".")[2]]:
            assert token not in text, f"a token in {where}"
        assert "flood-" not in text, f"a flood token in {where}"


def test_every_kind_of_refusal_is_on_the_record_and_in_the_export(serve: Any) -> None:
    served: Served = serve()
    stub = served.running.stub
    stub.RegisterTool(
        pb.RegisterToolRequest(tool=tool("slow", "sleep 4; echo done")),
        metadata=served.as_("admin"),
    )
    for name, level in (("echo_it", "safe"), ("wipe", "safe"), ("launch", "dangerous")):
        stub.RegisterTool(
            pb.RegisterToolRequest(tool=tool(name, "cat", level)), metadata=served.as_("admin")
        )
    run = pb.ExecuteToolRequest(name="echo_it", arguments_json="{}")
    UNAUTH, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
    # credentials refused: wrong, malformed, none, an IdP token from elsewhere
    assert served.refused(stub.ExecuteTool, run, [("authorization", f"Bearer {WRONG}")]) == UNAUTH
    assert served.refused(stub.ExecuteTool, run, [("authorization", f"Bearer {WRONG}")]) == UNAUTH
    assert (
        served.refused(stub.ListTools, pb.ListToolsRequest(), [("authorization", f"Basic {WRONG}")])
        == UNAUTH
    )
    assert served.refused(stub.GetTool, pb.GetToolRequest(name="echo_it"), []) == UNAUTH
    assert (
        served.refused(stub.ExecuteTool, run, [("authorization", f"Bearer {FOREIGN_JWT}")])
        == UNAUTH
    )
    # known clients without the right
    assert served.refused(stub.ExecuteTool, run, served.as_("reader")) == DENIED
    launch = pb.ExecuteToolRequest(name="launch", arguments_json="{}")
    assert served.refused(stub.ExecuteTool, launch, served.as_("lowly")) == DENIED
    assert (
        served.refused(
            stub.SetToolEnabled, pb.SetToolEnabledRequest(name="echo_it"), served.as_("agent")
        )
        == DENIED
    )
    # a quota: the first call spends the burst, the next ones are over the rate
    missing = pb.ExecuteToolRequest(name="no_such_tool", arguments_json="{}")
    assert (
        stub.ExecuteTool(missing, metadata=served.as_("metered")).status
        == pb.EXECUTION_STATUS_TOOL_NOT_FOUND
    )
    for _ in range(3):
        assert served.refused(stub.ExecuteTool, missing, served.as_("metered")) == (
            grpc.StatusCode.RESOURCE_EXHAUSTED
        )
    # the admission queue: one slot, no queue, the slot taken
    slow = threading.Thread(
        target=lambda: stub.ExecuteTool(
            pb.ExecuteToolRequest(name="slow", arguments_json="{}"),
            metadata=served.as_("agent"),
            timeout=60,
        )
    )
    slow.start()
    deadline = time.monotonic() + 30
    while served.running.app.executor.admission.running < 1:
        assert time.monotonic() < deadline, "the slow call never took its slot"
        time.sleep(0.05)
    assert served.refused(stub.ExecuteTool, run, served.as_("agent")) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    slow.join()
    # results, not refusals: a deny rule, an approval still needed, the kill switch
    wipe = stub.ExecuteTool(
        pb.ExecuteToolRequest(name="wipe", arguments_json="{}"), metadata=served.as_("agent")
    )
    assert wipe.status == pb.EXECUTION_STATUS_POLICY_DENIED
    needs = stub.ExecuteTool(launch, metadata=served.as_("agent"))
    assert needs.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED
    stub.SetToolEnabled(
        pb.SetToolEnabledRequest(name="echo_it", enabled=False, reason="incident 42"),
        metadata=served.as_("admin"),
    )
    off = stub.ExecuteTool(run, metadata=served.as_("agent"))
    assert off.status == pb.EXECUTION_STATUS_TOOL_DISABLED

    served.running.stop()  # what is still counted is written at close, then exported
    records = served.refusals()
    by_code: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_code.setdefault(r["reason"]["code"], []).append(r)
    counts = {code: sum(r["count"] for r in rs) for code, rs in by_code.items()}
    assert counts == {
        "unknown_bearer_token": 2,
        "malformed_authorization": 1,
        "no_credential": 1,
        "idp_token_invalid": 1,
        "missing_role": 2,
        "permission_denied": 1,
        "quota_rate": 3,
        "server_max_queued": 1,
    }
    (wrong, *_rest) = by_code["unknown_bearer_token"]
    assert wrong["who"] == "unknown credential" and wrong["credential"] == "bearer"
    assert (wrong["method"], wrong["tool"], wrong["source"]) == (
        "ExecuteTool",
        "echo_it",
        {"peer": "127.0.0.1"},
    )
    assert wrong["status"] == "UNAUTHENTICATED" and wrong["first_at"] <= wrong["last_at"]
    assert by_code["malformed_authorization"][0]["credential"] == "malformed"
    assert by_code["no_credential"][0]["credential"] == "none"
    (idp,) = by_code["idp_token_invalid"]
    assert (idp["credential"], idp["reason"]["text"]) == (
        "idp_jwt",
        "invalid access token",
    )
    missing_role = {(r["who"], r["method"], r.get("tool")) for r in by_code["missing_role"]}
    assert missing_role == {
        ("reader", "ExecuteTool", "echo_it"),
        ("agent", "SetToolEnabled", "echo_it"),
    }
    assert by_code["missing_role"][0]["source"]["client"] in ("reader", "agent")
    (level,) = by_code["permission_denied"]
    assert (level["who"], level["tool"]) == ("lowly", "launch")
    assert "may run tools up to safe" in level["reason"]["text"]
    assert {r["who"] for r in by_code["quota_rate"]} == {"metered"}
    assert [r["count"] for r in by_code["quota_rate"]] == [1, 2]  # at once, then folded
    (full,) = by_code["server_max_queued"]
    assert (full["who"], full["status"]) == ("agent", "RESOURCE_EXHAUSTED")

    entries = served.entries()
    executions = [r for kind, r in entries if kind == "execution"]
    (denied,) = [r for r in executions if r["decision"] == "policy_denied"]
    assert (denied["rule"], denied["reason"]) == ("no-wipe", "wiping is for operators")
    (disabled,) = [r for r in executions if r["decision"] == "disabled"]
    assert disabled["reason"] == "incident 42"
    # the kill switch's refusal is its execution record, and nothing more: the one
    # refusal record of agent's ExecuteTool of echo_it is the full queue's
    assert [
        r["reason"]["code"]
        for r in records
        if (r["who"], r.get("tool")) == ("agent", "echo_it") and r["method"] == "ExecuteTool"
    ] == ["server_max_queued"]
    (requested,) = [r for kind, r in entries if kind == "approval" and r["event"] == "requested"]
    assert requested["requirements"] == [
        {"rule": "two-sre", "approvals_required": 2, "groups": ["sre"]}
    ]

    events = [e for e in served.events() if e["unmapped"]["audit"]["kind"] == "refusal"]
    assert len(events) == len(records)
    classes = {e["status_code"]: e["class_uid"] for e in events}
    assert classes == {
        "unknown_bearer_token": 3002,
        "malformed_authorization": 3002,
        "no_credential": 3002,
        "idp_token_invalid": 3002,
        "missing_role": 3003,
        "permission_denied": 3003,
        "quota_rate": 6003,
        "server_max_queued": 6003,
    }
    for event in events:
        assert ocsf_schema.problems(event) == [], event
        assert event["status_id"] == 2 and event["count"] >= 1
    assert sum(e["count"] for e in events) == sum(counts.values())
    no_token_anywhere(served)


def test_a_flood_of_wrong_tokens_leaves_a_few_records_that_add_up(serve: Any) -> None:
    served: Served = serve(refusal_fold_s=FOLD_S)
    address = served.running.address
    per_thread = FLOOD // FLOOD_THREADS
    answers: list[grpc.StatusCode] = []
    lock = threading.Lock()

    def flood(n: int) -> None:
        # a channel (a connection) of its own per thread: one source all the same
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.ToolRegistryStub(channel)
            request = pb.ExecuteToolRequest(name="echo_it", arguments_json="{}")
            codes = []
            for i in range(per_thread):
                token = f"flood-{n}-{i}-{secrets.token_hex(8)}"
                try:
                    stub.ExecuteTool(request, metadata=[("authorization", f"Bearer {token}")])
                except grpc.RpcError as exc:
                    codes.append(exc.code())  # type: ignore[attr-defined]
        with lock:
            answers.extend(codes)

    started = time.monotonic()
    threads = [threading.Thread(target=flood, args=(n,)) for n in range(FLOOD_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    took = time.monotonic() - started
    assert answers == [grpc.StatusCode.UNAUTHENTICATED] * FLOOD
    served.running.stop()

    records = served.refusals()
    assert sum(r["count"] for r in records) == FLOOD
    assert {
        (r["source"]["peer"], r["method"], r["tool"], r["reason"]["code"]) for r in records
    } == {("127.0.0.1", "ExecuteTool", "echo_it", "unknown_bearer_token")}
    # the first at once, one per interval while it lasts, the rest at close
    assert len(records) <= math.ceil(took / FOLD_S) + 2, (len(records), took)
    print(f"\n{FLOOD} wrong tokens in {took:.1f} s: {len(records)} refusal records")
    verified = subprocess.run(
        [
            str(ROOT / ".venv" / "bin" / "toolreg"),
            "audit",
            "verify",
            "--data-dir",
            str(served.data),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "audit chain intact" in verified.stdout
    events = [e for e in served.events() if e["unmapped"]["audit"]["kind"] == "refusal"]
    assert sum(e["count"] for e in events) == FLOOD
    assert {e["class_uid"] for e in events} == {3002}
    no_token_anywhere(served)


def test_certificates_are_refused_on_the_record_by_kind_never_by_subject(
    serve: Any, tmp_path: Path
) -> None:
    ca = CertificateAuthority("toolreg refusals CA")
    server_cert = ca.issue("localhost", server=True)
    files = {"ca": ca.pem, "cert": server_cert.cert_pem, "key": server_cert.key_pem}
    for name, data in files.items():
        (tmp_path / f"{name}.pem").write_bytes(data)
    served: Served = serve(
        tls_cert=tmp_path / "cert.pem",
        tls_key=tmp_path / "key.pem",
        tls_client_ca=tmp_path / "ca.pem",
        host="localhost",
    )
    port = served.running.port
    # a certificate the CA signed for a subject the policy does not know
    stranger = ca.issue("stranger-7f3a")
    assert list_over_mtls(port, ca.pem, stranger) == grpc.StatusCode.UNAUTHENTICATED
    # a known certificate without the role
    known = ca.issue("agent-tls")
    assert list_over_mtls(port, ca.pem, known) == grpc.StatusCode.OK
    from registry_server.client.registry_client import open_channel

    with open_channel(
        f"localhost:{port}", tls_ca=ca.pem, tls_cert=known.cert_pem, tls_key=known.key_pem
    ) as channel:
        stub = pb_grpc.ToolRegistryStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ExecuteTool(pb.ExecuteToolRequest(name="echo_it", arguments_json="{}"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    served.running.stop()
    records = {r["reason"]["code"]: r for r in served.refusals()}
    assert set(records) == {"unknown_certificate", "missing_role"}
    unknown = records["unknown_certificate"]
    assert (unknown["who"], unknown["credential"], unknown["method"]) == (
        "unknown credential",
        "mtls",
        "ListTools",
    )
    assert unknown["source"]["peer"] in ("127.0.0.1", "::1")
    role = records["missing_role"]
    assert (role["who"], role["credential"], role["tool"]) == ("agent-tls", "mtls", "echo_it")
    # the certificate's subject is not a credential the record repeats
    assert "stranger-7f3a" not in json.dumps(served.entries())
    events = [e for e in served.events() if e["unmapped"]["audit"]["kind"] == "refusal"]
    assert sorted(
        (e["class_uid"], e["auth_protocol"] if e["class_uid"] == 3002 else "") for e in events
    ) == [(3002, "mtls"), (3003, "")]
    for event in events:
        assert ocsf_schema.problems(event) == []
