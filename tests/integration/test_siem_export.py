"""SIEM export end to end (issue 29, item 3, docs/how-to/audit.md "SIEM export"):
a real server with a real policy, the real engine for the calls that run,
a real rsyslogd (Debian's, started here on loopback with TLS and client
certificates required; tests/rsyslog_receiver.py) and a JSON Lines file.

* Calls of every kind (safe and dangerous runs, approvals, a rejection, an
  unknown tool, invalid arguments, a deny rule, a bad token, a registration,
  the kill switch, a policy reload): every audit record reaches both
  destinations once, as an event of its class carrying what OCSF 1.4.0
  requires of that class (tests/ocsf_schema.py), its seq and hash equal to
  the store's; the file rotates by size and keeps every line; a record's
  leaf hash, from the SIEM's copy alone, is in the log's Merkle tree; no
  token, secret, argument value or tool env reaches either.
* A receiver that is not the one the CA vouches for, or that refuses our
  client certificate, gets nothing and confirms nothing.
* The server killed (SIGKILL) while thousands of records are being
  exported, and started again: every record arrives at both; the file holds
  none twice; the syslog receiver holds again only what was in flight at
  the kill (one batch at most), byte for byte the same messages, so
  de-duplicating by event uid leaves each record once (the guarantee
  docs/how-to/audit.md states: RFC 5425 has no acknowledgement to do better).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.api.config import DB_FILENAME
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import open_channel
from registry_server.domain import merkle
from registry_server.domain.arguments import arguments_digest
from registry_server.notify.siem.sinks import SinkError, SyslogTls, SyslogTlsSink
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint, mint_for
from registry_server.store import audit_chain, audit_tree
from registry_server.store.base import AuditEntry, Store
from registry_server.store.sqlite import SqliteStore
from tests import ocsf_schema
from tests.certs import CertificateAuthority
from tests.factories import sha
from tests.integration.conftest import Running, StartServer
from tests.rsyslog_receiver import Rsyslog

ROOT = Path(__file__).resolve().parents[2]
AUDIENCE = "toolreg-siem"
TOKENS = {"agent": "siem-agent-token-51c", "alice": "siem-alice-token-7de",
          "team": "siem-team-token-3aa", "admin": "siem-admin-token-c09"}  # fmt: skip
CANARY = "canary-env-0b7d41"  # in a tool's env
ARGUMENT = "argument-value-e45f1a"  # in calls' arguments: the audit keeps their digest only
PROBE = {
    "name": "siem_probe",
    "description": "Echoes its arguments; dangerous, so each call needs an approval.",
    "safety_level": "dangerous",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"},
                                                    "note": {"type": "string"}}},
    "sandbox": {"image": "toolreg/base", "command": ["cat"], "env": {"PROBE_KEY": CANARY}},
}  # fmt: skip
ECHO = {
    "name": "siem_echo",
    "description": "Echoes its arguments.",
    "parameters": {"type": "object", "properties": {"message": {"type": "string"}},
                   "required": ["message"]},
    "sandbox": {"image": "toolreg/base", "command": ["cat"]},
}  # fmt: skip
RUN_SQL = {
    "name": "run_sql",
    "description": "Runs SQL (here: echoes it).",
    "parameters": {"type": "object", "properties": {"sql": {"type": "string"}}},
    "sandbox": {"image": "toolreg/base", "command": ["cat"]},
}
CAUGHT_UP_S = 60.0  # seconds for the export to reach the log's head
KILLED_RECORDS = 6_000  # records queued for export when the server is killed
KILL_BATCH = 20  # events per confirmed batch in that test: many batches, one in flight


@pytest.fixture(scope="session")
def rsyslog(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rsyslog]:
    """One rsyslogd for every test of the run (each test reads its own log's events)."""
    receiver = Rsyslog(tmp_path_factory.mktemp("rsyslog")).start()
    yield receiver
    receiver.stop()


def write_policy(path: Path, alice_public: str) -> Path:
    policy = {
        "audience": AUDIENCE,
        "approvers": [{"id": "alice", "public_key": alice_public, "groups": ["security"]}],
        "approval_rules": [{"match": {"level": "dangerous"}, "approvals_required": 1}],
        "deny_rules": [{"name": "no-drop-table", "match": {"tool": "run_sql"},
                        "when": 'args.sql.matches(r"(?i)\\bdrop\\s+table\\b")',
                        "reason": "run_sql may not drop tables"}],
        "clients": [
            {"id": "agent", "token_sha256": sha(TOKENS["agent"]), "roles": ["execute"],
             "max_safety_level": "dangerous"},
            {"id": "alice", "token_sha256": sha(TOKENS["alice"]), "roles": ["approve"]},
            {"id": "team", "token_sha256": sha(TOKENS["team"]), "roles": ["register"]},
            {"id": "admin", "token_sha256": sha(TOKENS["admin"]), "roles": ["admin"]},
        ],
    }  # fmt: skip
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    return path


@dataclass
class Deployment:
    running: Running
    alice_key: bytes
    log_name: str
    jsonl: Path
    channels: list[grpc.Channel]

    def stub(self, who: str) -> pb_grpc.ToolRegistryStub:
        channel = open_channel(self.running.address, token=TOKENS[who])
        self.channels.append(channel)
        return pb_grpc.ToolRegistryStub(channel)

    def call(self, name: str, args: dict[str, Any], **kw: Any) -> pb.ToolResult:
        result: pb.ToolResult = self.stub("agent").ExecuteTool(
            pb.ExecuteToolRequest(name=name, arguments_json=json.dumps(args), **kw), timeout=120
        )
        return result


def exporter_args(rsyslog: Rsyslog) -> dict[str, Any]:
    return {
        "export_syslog": rsyslog.address,
        "export_syslog_ca": rsyslog.ca_file,
        "export_syslog_cert": rsyslog.client_cert,
        "export_syslog_key": rsyslog.client_key,
    }


def store_entries(store: Store) -> list[AuditEntry]:
    with store.reading() as reads:
        return reads.audit_entries()


def jsonl_events(path: Path) -> list[dict[str, Any]]:
    """Every event in the file and its rotated files, oldest file first."""
    files = sorted(path.parent.glob(f"{path.name}.*"), key=lambda p: -int(p.suffix[1:]))
    return [json.loads(line) for f in [*files, path] if f.exists()
            for line in f.read_text().splitlines()]  # fmt: skip


def seq_of(event: dict[str, Any]) -> int:
    return int(event["unmapped"]["audit"]["seq"])


def wait_for(what: str, done: Any, timeout_s: float = CAUGHT_UP_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_every_record_reaches_rsyslog_and_the_file_as_its_ocsf_class(
    start_server: StartServer, rsyslog: Rsyslog, tmp_path: Path
) -> None:
    private, public = generate_keypair()
    tools = tmp_path / "tools"
    tools.mkdir()
    for manifest in (PROBE, ECHO, RUN_SQL):
        (tools / f"{manifest['name']}.yaml").write_text(yaml.safe_dump(manifest))
    log_name = "toolreg/siem-every-kind"
    jsonl = tmp_path / "export" / "audit.jsonl"
    running = start_server(
        policy_file=write_policy(tmp_path / "policy.yaml", public), tools_dir=tools,
        log_origin=log_name, export_jsonl=jsonl, export_jsonl_max_bytes=8 * 1024,
        export_jsonl_keep=100, **exporter_args(rsyslog),
    )  # fmt: skip
    d = Deployment(running, private, log_name, jsonl, [])
    try:
        make_every_kind_of_record(d)
        check_both_destinations(d, rsyslog)
    finally:
        for channel in d.channels:
            channel.close()


def make_every_kind_of_record(d: Deployment) -> None:
    ok = d.call("siem_echo", {"message": ARGUMENT})
    assert ok.status == pb.EXECUTION_STATUS_OK, ok.error
    asked = d.call("siem_probe", {"n": 1, "note": ARGUMENT})
    assert asked.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, asked.error
    alice = d.stub("alice")
    request = alice.GetApprovalRequest(pb.GetApprovalRequestRequest(id=asked.approval_request.id))
    token = mint_for(load_private_key(d.alice_key), issuer="alice", request=request,
                     bind_request=True)  # fmt: skip
    alice.SubmitApproval(pb.SubmitApprovalRequest(request_id=request.id, token=token))
    ran = d.call("siem_probe", {"n": 1, "note": ARGUMENT}, approval_request_id=request.id)
    assert ran.status == pb.EXECUTION_STATUS_OK, ran.error
    refused = d.call("siem_probe", {"n": 2})
    alice.RejectApprovalRequest(pb.RejectApprovalRequestRequest(
        request_id=refused.approval_request.id, reason="not on a Friday"))  # fmt: skip
    wrong = mint(  # approves other arguments: refused
        load_private_key(d.alice_key), issuer="alice", audience=AUDIENCE,
        tool_name="siem_probe", tool_digest=request.tool_digest,
        args_digest=arguments_digest({"n": 99}), requester="agent", ttl_s=300,
    )  # fmt: skip
    bad = d.call("siem_probe", {"n": 3}, approval_tokens=[wrong])
    assert bad.status == pb.EXECUTION_STATUS_APPROVAL_DENIED, bad.error
    assert d.call("nope", {}).status == pb.EXECUTION_STATUS_TOOL_NOT_FOUND
    assert d.call("siem_echo", {}).status == pb.EXECUTION_STATUS_INVALID_ARGUMENTS
    denied = d.call("run_sql", {"sql": f"DROP TABLE {ARGUMENT}"})
    assert denied.status == pb.EXECUTION_STATUS_POLICY_DENIED, denied.error
    team_tool = pb.Tool(
        name="team_tool", description="A team's tool.", parameters_json='{"type":"object"}',
        safety_level=pb.SAFETY_LEVEL_SAFE, sandbox=pb.SandboxSpec(image="toolreg/base",
                                                                  command=["cat"]),
    )  # fmt: skip
    d.stub("team").RegisterTool(pb.RegisterToolRequest(tool=team_tool))
    admin = d.stub("admin")
    admin.SetToolEnabled(pb.SetToolEnabledRequest(name="team_tool", enabled=False,
                                                  reason="incident 42"))  # fmt: skip
    admin.ReloadPolicy(pb.ReloadPolicyRequest())


def check_both_destinations(d: Deployment, rsyslog: Rsyslog) -> None:
    app = d.running.app
    entries = store_entries(app.store)
    head = entries[-1].seq
    wait_for("both destinations to confirm the whole log",
             lambda: all(e.cursor >= head for e in app.exporters))  # fmt: skip
    wait_for("rsyslog to write what it acknowledged",
             lambda: len(rsyslog.messages(d.log_name)) >= head)  # fmt: skip
    received = rsyslog.messages(d.log_name)
    by_destination = {"jsonl": jsonl_events(d.jsonl), "syslog": [m.event for m in received]}
    classes: Counter[int] = Counter()
    for name, events in by_destination.items():
        assert [seq_of(e) for e in events] == list(range(1, head + 1)), name  # each once, in order
        for entry, event in zip(entries, events, strict=True):
            audit = event["unmapped"]["audit"]
            assert (audit["hash"], audit["prev_hash"], audit["record"]) == (
                entry.hash, entry.prev_hash, entry.record,
            ), name  # fmt: skip
            assert event["metadata"]["uid"] == f"{d.log_name}#{entry.seq}"
            assert ocsf_schema.problems(event) == [], (name, event)
            if name == "jsonl":
                classes[event["class_uid"]] += 1
    assert set(classes) == {1007, 3003, 3005, 6003}, classes
    assert len(list(d.jsonl.parent.glob("audit.jsonl.*"))) >= 2  # rotated by size
    for message in received:  # RFC 5424, facility log audit (13)
        assert message.app_name == "toolreg" and message.procid == "-"
        assert (
            message.pri // 8 == 13 and message.msgid == message.event["unmapped"]["audit"]["kind"]
        )
    kinds = {
        (e["class_uid"], e["activity_name"], e.get("status_detail"))
        for e in by_destination["jsonl"]
    }
    for expected in [(1007, "Launch", "approved"), (1007, "Terminate", "approved"),
                     (1007, "Terminate", "allowed"), (3003, "Assign Privileges", "policy_denied"),
                     (3003, "Assign Privileges", "approval_denied"),
                     (3003, "Assign Privileges", "approval_required"),
                     (3005, "Request", "requested"), (3005, "Assign Privileges", "approved"),
                     (3005, "Revoke Privileges", "rejected"), (6003, "Execute", "not_found"),
                     (6003, "Execute", "invalid_arguments"), (6003, "Create", "created"),
                     (6003, "Update", "disabled"), (6003, "Update", "reloaded")]:  # fmt: skip
        assert expected in kinds, expected
    # A SIEM's copy against the log's tree: its leaf hash, alone, at its index.
    log_now = audit_tree.read_log(app.store)
    for event in by_destination["syslog"][::5]:
        index = event["unmapped"]["audit"]["index"]
        proof = merkle.inclusion_proof(log_now.leaves, index)
        leaf = bytes.fromhex(event["unmapped"]["audit"]["leaf_hash"])
        assert merkle.verify_inclusion(index, log_now.size, leaf, proof, log_now.root())
    # Nothing secret: not a bearer token, an approval token, a tool's env, an argument value.
    for text in (rsyslog.raw_text(), *(p.read_text() for p in d.jsonl.parent.iterdir())):
        for secret in (*TOKENS.values(), CANARY, ARGUMENT, "eyJ"):
            assert secret not in text
    labels = {"sink": "syslog"}
    metrics = app.metrics.registry
    assert metrics.get_sample_value("toolreg_siem_export_lag_records", labels) == 0
    assert metrics.get_sample_value("toolreg_siem_exported_events_total", labels) == head
    assert metrics.get_sample_value("toolreg_siem_export_active", labels) == 1


def test_a_receiver_the_ca_does_not_vouch_for_or_that_refuses_us_confirms_nothing(
    rsyslog: Rsyslog, tmp_path: Path
) -> None:
    from registry_server.notify.siem.sinks import Line

    line = Line(1, time.time(), "execution", 1, "0" * 64, '{"probe":"must-not-arrive-7c1"}')
    other = CertificateAuthority("another-ca")
    (tmp_path / "other.pem").write_bytes(other.pem)
    cases = {
        "its certificate does not verify": SyslogTls(
            "127.0.0.1", rsyslog.port, tmp_path / "other.pem", rsyslog.client_cert,
            rsyslog.client_key,
        ),
        "does not verify: Hostname mismatch": SyslogTls(
            "127.0.0.1", rsyslog.port, rsyslog.ca_file, rsyslog.client_cert, rsyslog.client_key,
            server_name="siem.example.org",
        ),
        "the receiver closed the connection": SyslogTls(  # no client certificate
            "127.0.0.1", rsyslog.port, rsyslog.ca_file, timeout_s=5
        ),
    }  # fmt: skip
    for reason, target in cases.items():
        sink = SyslogTlsSink(target)
        with pytest.raises(SinkError, match=reason):
            sink.write([line])
        sink.close()
    time.sleep(0.5)
    assert "must-not-arrive-7c1" not in rsyslog.raw_text()
    # rsyslogd writes its own log as it gets to it: the refusal's line comes later.
    refused = "peer did not provide a certificate"
    wait_for(f"rsyslogd to log {refused!r}", lambda: refused in rsyslog.daemon_log())
    assert "peer did not provide a certificate" in rsyslog.daemon_log()


def append(data_dir: Path, count: int, start: int = 0) -> None:
    store = SqliteStore(data_dir / DB_FILENAME)
    try:
        for first in range(start, start + count, 500):
            with store.unit_of_work() as uow:
                for n in range(first, min(first + 500, start + count)):
                    record = {"execution_id": f"e{n}", "caller": "agent", "tool": "siem_echo",
                              "decision": "allowed", "status": "OK", "exit_code": 0,
                              "duration_ms": 1}  # fmt: skip
                    audit_chain.append(uow, "execution", record)
    finally:
        store.close()


def test_the_server_killed_while_exporting_and_restarted_loses_nothing(
    rsyslog: Rsyslog, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    append(data, KILLED_RECORDS)
    log_name = "toolreg/siem-killed"
    jsonl = tmp_path / "export" / "audit.jsonl"
    flags = [
        "--log-origin", log_name, "--export-jsonl", str(jsonl),
        "--export-syslog", rsyslog.address, "--export-syslog-ca", str(rsyslog.ca_file),
        "--export-syslog-cert", str(rsyslog.client_cert),
        "--export-syslog-key", str(rsyslog.client_key),
    ]  # fmt: skip
    env = {**os.environ, "TOOLREG_EXPORT_BATCH": str(KILL_BATCH), "TOOLREG_EXPORT_LEASE_S": "2"}
    server = spawn_server(data, *flags, cwd=ROOT, env=env)
    try:
        wait_for("the export to be under way",
                 lambda: len(jsonl_lines(jsonl)) >= KILLED_RECORDS // 5)  # fmt: skip
        server.kill()  # SIGKILL: no drain, no lease released, the cursor where it was
    finally:
        stop(server)
    in_file = len(jsonl_lines(jsonl))
    settled(lambda: len(rsyslog.messages(log_name)))  # what the kernel had sent, written
    at_kill = Counter(m.seq for m in rsyslog.messages(log_name))
    assert in_file < KILLED_RECORDS, "the export finished before the kill: nothing was tested"
    print(f"\nkilled with {in_file} of {KILLED_RECORDS} records in the file,"
          f" {len(at_kill)} at rsyslog")  # fmt: skip
    append(data, 100, start=KILLED_RECORDS)  # and the log grows while the server is down
    total = KILLED_RECORDS + 100
    again = spawn_server(data, *flags, cwd=ROOT, env=env)
    try:
        wait_for("the file to hold every record", lambda: len(jsonl_lines(jsonl)) >= total)
        wait_for("rsyslog to hold every record",
                 lambda: len({m.seq for m in rsyslog.messages(log_name)}) >= total)  # fmt: skip
    finally:
        assert again.stop() == 0  # SIGTERM: drains, then lets the lease go
    store = SqliteStore(data / DB_FILENAME)
    try:
        entries = store_entries(store)
    finally:
        store.close()
    hashes = {e.seq: e.hash for e in entries}
    # The file: every record, none twice, each the store's.
    events = [json.loads(line) for line in jsonl_lines(jsonl)]
    assert [seq_of(e) for e in events] == list(range(1, total + 1))
    assert all(e["unmapped"]["audit"]["hash"] == hashes[seq_of(e)] for e in events)
    # Syslog: every record; what arrived twice is what was in flight at the kill.
    received = rsyslog.messages(log_name)
    counts = Counter(m.seq for m in received)
    assert set(counts) == set(range(1, total + 1))
    twice = sorted(seq for seq, n in counts.items() if n > 1)
    print(f"syslog: {len(twice)} record(s) received twice (in flight at the kill): "
          f"{twice[:1]}..{twice[-1:]}")  # fmt: skip
    assert max(counts.values()) <= 2
    assert len(twice) <= KILL_BATCH
    if twice:
        assert twice == list(range(twice[0], twice[-1] + 1))  # one contiguous batch
        assert set(twice) <= set(at_kill)  # sent before the kill
        assert twice[-1] == max(at_kill)  # the last batch sent before it
    raw_by_seq: dict[int, set[bytes]] = {}
    for m in received:
        raw_by_seq.setdefault(m.seq, set()).add(m.raw)
        assert m.event["unmapped"]["audit"]["hash"] == hashes[m.seq]
    assert all(len(copies) == 1 for copies in raw_by_seq.values())  # a copy is the same bytes
    uids = {m.event["metadata"]["uid"] for m in received}
    assert len(uids) == total  # de-duplicated by event uid: each record once
    whole = [m.raw for m in received]
    for (
        cut
    ) in rsyslog.cut_short():  # a frame cut by the kill, if rsyslog wrote it: sent again whole
        assert log_name.encode() not in cut or any(w.startswith(cut) for w in whole), cut[:200]


def settled(count: Any, quiet_s: float = 1.0, timeout_s: float = 30.0) -> None:
    """Wait until ``count()`` has not changed for ``quiet_s``."""
    deadline = time.monotonic() + timeout_s
    last, since = count(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        time.sleep(0.1)
        now = count()
        if now != last:
            last, since = now, time.monotonic()


def jsonl_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def stop(server: ServerProcess) -> None:
    if server.proc.poll() is None:
        server.kill()
