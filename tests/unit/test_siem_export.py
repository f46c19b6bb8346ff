"""SIEM export (issue 29, item 3), in process: each kind of audit record as
its OCSF class, checked against what OCSF 1.4.0 requires of that class
(tests/ocsf_schema.py); the audit entry carried in every event, enough to
recompute its hash and Merkle leaf; no argument value, token or secret; the
JSON Lines sink's rotation and its repair of a line cut short; RFC 5424
messages in RFC 5425 framing; and the exporter over the in-memory store:
every record once, a crash between a write and the cursor's update writing
nothing twice to the file, a failing destination tried again without
losing its place, one exporter per destination, and the lag metrics."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from prometheus_client import CollectorRegistry

from registry_server.api.app import _export_sinks
from registry_server.api.config import ServerConfig
from registry_server.domain import merkle
from registry_server.domain.errors import ConfigError
from registry_server.notify.claimant import claimant
from registry_server.notify.siem import exporter as exporter_module
from registry_server.notify.siem import ocsf
from registry_server.notify.siem.exporter import Exporter
from registry_server.notify.siem.metrics import ExportMetrics
from registry_server.notify.siem.sinks import (
    JsonlSink,
    Line,
    SinkError,
    Written,
    octet_counted,
    rfc5424,
)
from registry_server.store import audit_chain
from registry_server.store.base import AuditEntry, Store
from registry_server.store.memory import MemoryStore
from sandbox_runner.ownership import OwnerIdentity
from tests import ocsf_schema
from tests.certs import CertificateAuthority

pytestmark = pytest.mark.unit

SOURCE = ocsf.Source("toolreg/siem-unit")
SECRET = "s3cr3t-value-9f2c"  # what a tool's env or arguments would hold: never exported
JWT = "eyJhbGciOiJFZERTQSJ9.eyJpc3MiOiJhbGljZSJ9.c2ln"
REQUEST = "0123456789abcdef0123456789abcdef"

# Records as the server writes them (execution/audit_record.py, approvals/service.py,
# approvals/events.py, catalog/registry.py, api/policy_reload.py).
EXECUTION = {
    "execution_id": "exec-1", "caller": "agent", "tool": "echo", "tool_digest": "d" * 64,
    "level": "safe", "args_digest": "a" * 64, "decision": "allowed", "approvers": [],
    "jtis": [], "approval_request_id": None, "status": "OK", "exit_code": 0,
    "duration_ms": 42, "runtime": "runc", "container_id": "c" * 12, "warm": True,
    "limits": {"memory_mb": 256},
}  # fmt: skip
RECORDS: list[tuple[str, dict[str, Any]]] = [
    ("registration", {"event": "created", "tool": "wipe", "digest": "e" * 64,
                      "previous_digest": None, "level": "dangerous", "image": "toolreg/base",
                      "by": "team", "previous_owner": None}),
    ("policy", {"event": "reloaded", "by": "admin", "source": "/etc/toolreg/policy.yaml",
                "digest": "f" * 64, "previous_digest": "0" * 64}),
    ("policy", {"event": "reload_refused", "by": "SIGHUP", "source": "/etc/toolreg/policy.yaml",
                "digest_in_force": "f" * 64, "problems": ["line 3: unknown key"]}),
    ("execution", EXECUTION),
    ("execution", {**EXECUTION, "execution_id": "exec-2", "status": "TOOL_ERROR",
                   "exit_code": 3}),
    ("execution", {**EXECUTION, "execution_id": "exec-3", "tool": "nope", "tool_digest": "",
                   "level": "", "decision": "not_found", "status": "TOOL_NOT_FOUND",
                   "exit_code": None, "runtime": "", "container_id": ""}),
    ("execution", {**EXECUTION, "execution_id": "exec-4", "tool": "wipe", "level": "dangerous",
                   "decision": "approval_required", "status": "APPROVAL_REQUIRED",
                   "exit_code": None}),
    ("approval", {"event": "requested", "request_id": REQUEST, "tool": "wipe",
                  "tool_digest": "e" * 64, "args_digest": "a" * 64, "requested_by": "agent",
                  "approvals_required": 1}),
    ("approval", {"event": "approved", "request_id": REQUEST, "approver": "alice",
                  "jti": "jti-1", "submitted_by": "console"}),
    ("approval", {"event": "request_approved", "request_id": REQUEST}),
    ("execution", {**EXECUTION, "execution_id": "exec-5", "tool": "wipe", "level": "dangerous",
                   "decision": "approved", "approvers": ["alice"], "jtis": ["jti-1"],
                   "approval_request_id": REQUEST, "status": "STARTING", "exit_code": None,
                   "duration_ms": 0}),
    ("execution", {**EXECUTION, "execution_id": "exec-5", "tool": "wipe", "level": "dangerous",
                   "decision": "approved", "approvers": ["alice"], "jtis": ["jti-1"],
                   "approval_request_id": REQUEST}),
    ("approval", {"event": "rejected", "request_id": REQUEST, "rejected_by": "bob",
                  "reason": "not today", "submitted_by": "bob"}),
    ("approval", {"event": "expired", "request_id": REQUEST}),
    ("approval", {"event": "voided", "request_id": REQUEST, "tool": "wipe",
                  "reason": "tool 'wipe' was deleted", "by": "team"}),
    ("execution", {**EXECUTION, "execution_id": "exec-6", "tool": "run_sql",
                   "decision": "policy_denied", "status": "POLICY_DENIED", "exit_code": None}),
    ("execution", {**EXECUTION, "execution_id": "exec-7", "decision": "approval_denied",
                   "status": "APPROVAL_DENIED", "exit_code": None}),
    ("execution", {**EXECUTION, "execution_id": "exec-8", "decision": "disabled",
                   "status": "TOOL_DISABLED", "exit_code": None}),
    ("registration", {"event": "disabled", "tool": "wipe", "digest": "e" * 64, "by": "admin",
                      "owner": "team", "reason": "incident 42"}),
    ("registration", {"event": "deleted", "tool": "wipe", "digest": "e" * 64, "by": "team",
                      "owner": "team", "reason": ""}),
    ("checkpoint", {"note": "a kind this version does not know"}),
]  # fmt: skip
# (class_uid, activity_id, status_id) of each record above, in order
EXPECTED = [
    (6003, 1, 1), (6003, 3, 1), (6003, 3, 2),
    (1007, 2, 1), (1007, 2, 2), (6003, 99, 2), (3003, 1, 2),
    (3005, 99, 1), (3005, 1, 1), (3005, 1, 1),
    (1007, 1, 99), (1007, 2, 1),
    (3005, 2, 1), (3005, 2, 1), (3005, 2, 1),
    (3003, 1, 2), (3003, 1, 2), (6003, 99, 2),
    (6003, 3, 1), (6003, 4, 1),
    (0, 99, 1),
]  # fmt: skip


def log_of(records: Sequence[tuple[str, dict[str, Any]]] = RECORDS) -> MemoryStore:
    store = MemoryStore()
    for kind, record in records:
        with store.unit_of_work() as uow:
            audit_chain.append(uow, kind, record)
    return store


def entries(store: Store) -> list[AuditEntry]:
    with store.reading() as reads:
        return reads.audit_entries()


def events_of(store: Store) -> list[dict[str, Any]]:
    facts = {REQUEST: ocsf.RequestFacts("agent", "wipe")}
    return [ocsf.event(e, SOURCE, facts) for e in entries(store)]


# ---------------------------------------------------------------- the mapping


def test_each_kind_of_record_is_its_class_with_what_ocsf_requires() -> None:
    events = events_of(log_of())
    got = [(e["class_uid"], e["activity_id"], e["status_id"]) for e in events]
    assert got == EXPECTED
    for event in events:
        assert ocsf_schema.problems(event) == [], event
        assert event["class_name"] == ocsf_schema.CLASSES[event["class_uid"]]["name"]
        assert event["metadata"]["product"]["name"] == "toolreg"
        assert event["metadata"]["log_name"] == SOURCE.log_name
        assert json.loads(ocsf.dumps(event)) == event  # JSON-ready as it is


def test_what_each_class_says_of_its_record() -> None:
    by_id = {e["unmapped"]["audit"]["seq"]: e for e in events_of(log_of())}
    run = by_id[4]
    assert run["actor"]["user"]["uid"] == "agent"
    assert run["process"] == {"uid": "exec-1", "name": "echo"}
    assert (run["exit_code"], run["duration"], run["status_code"]) == (0, 42, "OK")
    assert run["device"]["name"] == SOURCE.log_name
    launch = by_id[11]
    assert launch["activity_name"] == "Launch" and launch["status"] == "STARTING"
    assert launch["metadata"]["correlation_uid"] == REQUEST
    refused = by_id[7]
    assert refused["user"]["uid"] == "agent" and refused["privileges"] == ["execute:wipe"]
    assert refused["session"] == {"uid": "exec-4"}
    assert refused["status_detail"] == "approval_required"
    denied = by_id[16]
    assert denied["severity_id"] == 3 and denied["status_code"] == "POLICY_DENIED"
    approved = by_id[9]  # the approver acts; the requester is granted; the tool from the request
    assert approved["actor"] == {"user": {"uid": "alice", "name": "alice"}, "invoked_by": "console"}
    assert approved["user"]["uid"] == "agent" and approved["privileges"] == ["execute:wipe"]
    assert approved["resource"] == {"type": "approval request", "uid": REQUEST, "name": "wipe"}
    assert by_id[10]["actor"] == {"app_name": "toolreg"}  # the threshold: toolreg itself
    assert by_id[13]["actor"]["user"]["uid"] == "bob"
    assert by_id[13]["activity_name"] == "Revoke Privileges"
    registered = by_id[1]
    assert registered["api"] == {"operation": "RegisterTool",
                                 "service": {"name": "toolregistry.v1.ToolRegistry"}}  # fmt: skip
    assert registered["resources"] == [{"type": "tool", "name": "wipe", "uid": "e" * 64}]
    assert by_id[19]["api"]["operation"] == "SetToolEnabled" and by_id[19]["severity_id"] == 3
    assert by_id[20]["activity_name"] == "Delete"
    assert by_id[3]["status_detail"] == "reload_refused" and by_id[3]["severity_id"] == 3
    unknown = by_id[21]
    assert unknown["class_name"] == "Base Event" and unknown["activity_name"] == "checkpoint"


def test_an_approval_event_whose_request_is_unknown_still_has_a_user() -> None:
    store = log_of([("approval", {"event": "expired", "request_id": REQUEST})])
    (entry,) = entries(store)
    assert ocsf.request_wanted(entry) == REQUEST
    event = ocsf.event(entry, SOURCE)
    assert event["user"] == {"uid": "(unknown)", "name": "(unknown)"}
    assert ocsf_schema.problems(event) == []
    requested = log_of([RECORDS[7]])
    assert ocsf.request_wanted(entries(requested)[0]) is None  # it says who and what itself


def test_a_record_that_cannot_be_read_is_still_exported_as_a_base_event() -> None:
    store = log_of([("execution", {**EXECUTION, "exit_code": "three"}),
                    ("execution", {**EXECUTION, "duration_ms": {"ms": 1}})])  # fmt: skip
    for entry in entries(store):
        event = ocsf.event(entry, SOURCE)
        assert (event["class_uid"], event["activity_name"]) == (0, entry.kind)
        assert ocsf_schema.problems(event) == []
        assert event["unmapped"]["audit"]["record"] == entry.record


def test_every_event_carries_its_audit_entry_to_check_against_the_chain_and_a_proof() -> None:
    store = log_of()
    for entry, event in zip(entries(store), events_of(store), strict=True):
        audit = event["unmapped"]["audit"]
        assert (audit["seq"], audit["index"]) == (entry.seq, entry.seq - 1)
        assert event["metadata"]["uid"] == f"{SOURCE.log_name}#{entry.seq}"
        assert event["metadata"]["sequence"] == entry.seq
        assert event["time"] == round(entry.at * 1000)
        # From the event alone, as a SIEM would: the entry's bytes, hash and leaf.
        data = rfc8785.dumps({k: audit[k] for k in ("seq", "at", "kind", "record", "prev_hash")})
        assert hashlib.sha256(data).hexdigest() == audit["hash"] == entry.hash
        assert audit["leaf_hash"] == merkle.leaf_hash(data).hex()
        assert audit["prev_hash"] == entry.prev_hash


def test_no_argument_value_token_or_secret_is_exported() -> None:
    # What the server keeps out of the record stays out of the event; a value
    # that is in the record (a reason) is exported as the record has it.
    store = log_of(RECORDS)
    text = "\n".join(ocsf.dumps(e) for e in events_of(store))
    assert SECRET not in text and JWT not in text and "eyJ" not in text
    assert "not today" in text  # the audit's own field
    assert "\n" not in ocsf.dumps(events_of(store)[0])
    assert text.isascii()


# ---------------------------------------------------------------- sinks


def lines_of(store: Store) -> list[Line]:
    return [
        Line(e.seq, e.at, e.kind, int(ev["severity_id"]), e.hash, ocsf.dumps(ev))
        for e, ev in zip(entries(store), events_of(store), strict=True)
    ]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def seqs_in(*paths: Path) -> list[int]:
    found: list[int] = []
    for path in paths:
        if path.exists():
            found += [e["unmapped"]["audit"]["seq"] for e in read_jsonl(path)]
    return found


def test_the_file_rotates_by_size_keeps_its_last_files_and_says_where_it_ends(
    tmp_path: Path,
) -> None:
    lines = lines_of(log_of())
    longest = max(len(line.text) + 1 for line in lines)
    sink = JsonlSink(tmp_path / "audit.jsonl", max_bytes=3 * longest, keep=2)
    assert sink.last_written() is None
    sink.write(lines[:10])
    sink.write(lines[10:])
    sink.close()
    path = sink.path
    files = [path.with_name("audit.jsonl.2"), path.with_name("audit.jsonl.1"), path]
    assert all(f.stat().st_size <= 3 * longest for f in files)
    assert not path.with_name("audit.jsonl.3").exists()  # keep=2: older ones deleted
    kept = seqs_in(*files)
    assert kept == list(range(kept[0], len(lines) + 1))  # the newest, in order, once each
    assert oct(path.stat().st_mode & 0o777) == oct(0o640)
    last = lines[-1]
    assert sink.last_written() == Written(last.seq, last.hash, SOURCE.log_name)
    files[1].replace(files[0])  # rotated just before a crash: an empty new file
    path.replace(files[1])
    path.write_text("")
    assert sink.last_written() == Written(last.seq, last.hash, SOURCE.log_name)
    path.unlink()  # or none yet
    assert sink.last_written() == Written(last.seq, last.hash, SOURCE.log_name)


def test_a_line_cut_short_by_a_crash_is_cut_off_and_written_again_whole(tmp_path: Path) -> None:
    lines = lines_of(log_of())
    sink = JsonlSink(tmp_path / "audit.jsonl")
    sink.write(lines[:3])
    sink.close()
    with sink.path.open("ab") as f:  # a crash in the middle of line 4
        f.write(lines[3].text.encode()[:50])
    assert sink.last_written() == Written(3, lines[2].hash, SOURCE.log_name)
    sink.write(lines[3:5])
    sink.close()
    assert seqs_in(sink.path) == [1, 2, 3, 4, 5]


def test_syslog_messages_are_rfc_5424_in_rfc_5425_framing() -> None:
    line = lines_of(log_of())[15]  # policy_denied: OCSF Medium -> syslog warning
    message = rfc5424(line, "host-1")
    header = re.match(
        rb"<(\d+)>1 (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z) host-1 toolreg - execution - ",
        message,
    )
    assert header is not None
    assert int(header.group(1)) == 13 * 8 + 4  # facility log audit, severity warning
    assert json.loads(message[header.end() :]) == json.loads(line.text)
    framed = octet_counted(message)
    length, _, rest = framed.partition(b" ")
    assert int(length) == len(rest) == len(message) and rest == message


# ---------------------------------------------------------------- the exporter


class Flaky(JsonlSink):
    """A JSON Lines sink that fails while ``down``, and can die after writing
    (a crash between the write and the cursor's update)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.down = False
        self.crash_after_write = False
        self.batches: list[list[int]] = []

    def write(self, lines: Sequence[Line]) -> None:
        if self.down:
            raise SinkError("receiver down")
        super().write(lines)
        self.batches.append([line.seq for line in lines])
        if self.crash_after_write:
            raise KeyboardInterrupt  # the process dies here: nothing after runs


def exporter(store: Store, sink: JsonlSink, **kw: Any) -> Exporter:
    kw.setdefault("batch", 5)
    return Exporter(store, sink, SOURCE, **kw)


def test_every_record_once_in_batches_then_only_new_ones(tmp_path: Path) -> None:
    store = log_of()
    sink = Flaky(tmp_path / "audit.jsonl")
    e = exporter(store, sink)
    while e.pump():
        pass
    assert sink.batches == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15],
                            [16, 17, 18, 19, 20], [21]]  # fmt: skip
    assert (e.cursor, e.head, e.lag_records, e.exported) == (21, 21, 0, 21)
    with store.unit_of_work() as uow:
        audit_chain.append(uow, "execution", EXECUTION)
    assert e.pump() == 1 and e.pump() == 0
    assert seqs_in(sink.path) == list(range(1, 23))
    with store.reading() as reads:
        cursor = reads.export_cursor(sink.id)
    assert cursor is not None and cursor.seq == 22 and cursor.owner == e.owner


def test_a_crash_between_a_write_and_the_cursor_writes_nothing_twice_to_the_file(
    tmp_path: Path,
) -> None:
    store = log_of()
    sink = Flaky(tmp_path / "audit.jsonl")
    first = exporter(store, sink)
    first.pump()
    sink.crash_after_write = True
    with pytest.raises(KeyboardInterrupt):
        first.pump()  # 6..10 written, the cursor still at 5
    with store.reading() as reads:
        cursor = reads.export_cursor(sink.id)
    assert cursor is not None and cursor.seq == 5
    with store.unit_of_work() as uow:  # the dead server's lease lapses
        uow.release_export(sink.id, first.owner)
    again = exporter(store, Flaky(sink.path))
    while again.pump():
        pass
    assert seqs_in(sink.path) == list(range(1, 22))  # every record, none twice
    assert again.cursor == 21


def test_a_file_from_another_log_does_not_move_the_cursor(tmp_path: Path) -> None:
    other = log_of(RECORDS[:8])  # a different log: its hashes are not this log's
    path = tmp_path / "audit.jsonl"
    JsonlSink(path).write(lines_of(other)[:4])
    store = log_of(RECORDS[2:])
    e = exporter(store, JsonlSink(path), batch=100)
    e.pump()
    assert seqs_in(path) == [1, 2, 3, 4, *range(1, 20)]  # appended after it, all of this log


def test_a_failing_destination_is_tried_again_from_where_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where it resumes is the point here, not how long it waits first (0.5 s).
    monkeypatch.setattr(exporter_module, "RETRY_S", (0.02, 0.1))
    store = log_of()
    sink = Flaky(tmp_path / "audit.jsonl")
    e = exporter(store, sink, poll_s=0.01)
    e.pump()
    sink.down = True
    with pytest.raises(SinkError):
        e.pump()
    assert e.cursor == 5 and e.lag_records == 16 and e.lag_seconds > 0
    e.start()
    deadline = time.monotonic() + 5
    while e.failures == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert e.failures >= 1 and e.last_error == "receiver down"
    sink.down = False
    while e.cursor < 21 and time.monotonic() < deadline + 5:
        time.sleep(0.01)
    e.close()
    assert seqs_in(sink.path) == list(range(1, 22))


def test_one_exporter_per_destination_and_both_report_the_lag(tmp_path: Path) -> None:
    store = log_of()
    path = tmp_path / "audit.jsonl"
    clock = [1000.0]
    a = exporter(store, JsonlSink(path), lease_s=10, clock=lambda: clock[0])
    b = exporter(store, JsonlSink(path), lease_s=10, clock=lambda: clock[0])
    assert a.pump() == 5
    assert b.pump() == 0 and not b.holds  # a holds it
    assert (b.cursor, b.head, b.lag_records) == (5, 21, 16)
    registry = CollectorRegistry()
    registry.register(ExportMetrics([a, b]))
    labels = {"sink": "jsonl"}
    assert registry.get_sample_value("toolreg_siem_export_lag_records", labels) == 16
    assert registry.get_sample_value("toolreg_siem_exported_events_total", labels) == 5
    assert registry.get_sample_value("toolreg_siem_export_confirmed_seq", labels) == 5
    clock[0] += 11  # a died: its lease lapses and b takes over from the stored cursor
    assert b.pump() == 5 and b.holds and b.cursor == 10
    assert a.pump() == 0  # a is back: b holds it now
    a.close(drain_s=0)
    b.close()  # drains what is left, then lets go at once
    assert seqs_in(path) == list(range(1, 22))
    with store.reading() as reads:
        cursor = reads.export_cursor(JsonlSink(path).id)
    assert cursor is not None and cursor.seq == 21 and cursor.lease_until == 0


def test_a_holder_proven_gone_loses_the_destination_at_once(tmp_path: Path) -> None:
    """A server restarted after a crash takes its destination back from its
    own previous process without waiting out the lease (claimant.py); a live
    holder, or one on another host, keeps it."""
    store = log_of()
    path = tmp_path / "audit.jsonl"
    clock = [1000.0]
    before_crash = exporter(store, JsonlSink(path), lease_s=60, clock=lambda: clock[0])
    # The exporter of this host's previous server process (another pid).
    me = OwnerIdentity.current()
    before_crash.owner = claimant(dataclasses.replace(me, pid=me.pid + 1, start_ticks=1))
    assert before_crash.pump() == 5 and before_crash.holds
    alive = exporter(store, JsonlSink(path), lease_s=60, clock=lambda: clock[0],
                     owner_alive=lambda pid, start: True)  # fmt: skip
    assert alive.pump() == 0 and not alive.holds  # the holder's process runs: it waits
    restarted = exporter(
        store, JsonlSink(path), lease_s=60, clock=lambda: clock[0],
        owner_alive=lambda pid, start: False,  # the holder's pid is no longer running
    )  # fmt: skip
    assert restarted.pump() == 5 and restarted.holds and restarted.cursor == 10
    elsewhere = exporter(
        store, JsonlSink(path), lease_s=60, clock=lambda: clock[0],
        owner_alive=lambda pid, start: False,
    )  # fmt: skip
    elsewhere_owner = "other-host/abc;" + restarted.owner.split(";", 1)[1]
    with store.unit_of_work() as uow:
        uow.release_export(JsonlSink(path).id, restarted.owner)
        assert uow.claim_export(JsonlSink(path).id, elsewhere_owner, clock[0], clock[0] + 60)
    assert elsewhere.pump() == 0 and not elsewhere.holds  # another host's: its lease stands
    before_crash.close(drain_s=0)
    alive.close(drain_s=0)
    restarted.close(drain_s=0)
    elsewhere.close(drain_s=0)


def test_a_stop_does_not_wait_on_a_failing_destination(tmp_path: Path) -> None:
    store = log_of()
    sink = Flaky(tmp_path / "audit.jsonl")
    sink.down = True
    e = exporter(store, sink, poll_s=0.01)
    e.start()
    deadline = time.monotonic() + 5
    while e.failures == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    e.close()
    assert time.monotonic() - t0 < 1.0 and e.cursor == 0
    with store.reading() as reads:
        cursor = reads.export_cursor(sink.id)
    assert cursor is not None and cursor.lease_until == 0  # let go: another server may go on


def test_the_destinations_a_server_is_given(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(CertificateAuthority("siem-unit-ca").pem)
    assert _export_sinks(ServerConfig()) == []
    sinks = _export_sinks(ServerConfig(export_jsonl=tmp_path / "a.jsonl",
                                       export_syslog="[::1]:6514", export_syslog_ca=ca))  # fmt: skip
    assert [s.id for s in sinks] == [f"jsonl:{tmp_path / 'a.jsonl'}", "syslog:[::1]:6514"]
    refused = {
        "give HOST:PORT": {"export_syslog": "siem.example.org", "export_syslog_ca": ca},
        "needs --export-syslog-ca": {"export_syslog": "siem.example.org:6514"},
        "go together": {"export_syslog": "h:1", "export_syslog_ca": ca,
                        "export_syslog_cert": ca},
        "need --export-syslog HOST:PORT": {"export_syslog_ca": ca},
        "cannot read the CA file": {"export_syslog": "h:1",
                                    "export_syslog_ca": tmp_path / "missing.pem"},
    }  # fmt: skip
    for reason, settings in refused.items():
        with pytest.raises(ConfigError, match=reason):
            _export_sinks(ServerConfig(**settings))
