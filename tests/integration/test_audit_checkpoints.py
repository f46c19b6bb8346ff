"""Signed checkpoints of the audit log (issue 29, docs/how-to/audit.md), end to end
with a real SQLite file, the real `toolreg` CLI and a real server process.

A log of 1,000 records is checkpointed; then the last 10 records are
deleted, or one record is edited, or the whole chain is recomputed after an
edit (and the store's checkpoints deleted): `toolreg audit verify
--checkpoint old.txt --key log.pub` detects each with the old checkpoint and
the public key alone. An inclusion proof from `toolreg audit prove` is
checked by a verifier written here from RFC 9162 and c2sp.org/signed-note
(hashlib, base64 and cryptography's Ed25519), not by the project's code. A
server whose tree does not extend its last checkpoint refuses to start,
unless told to."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import rfc8785
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.api.config import CHECKPOINT_COPY_FILENAME, DB_FILENAME
from registry_server.cli.launcher import spawn_server
from registry_server.store import audit_chain
from registry_server.store.sqlite import SqliteStore

ROOT = Path(__file__).resolve().parents[2]
TOOLREG = [sys.executable, "-m", "registry_server.cli"]
ORIGIN = "toolreg.example/audit-test"
RECORDS = 1_000


def toolreg(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TOOLREG, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def append(data_dir: Path, count: int, start: int = 0) -> None:
    store = SqliteStore(data_dir / DB_FILENAME)
    try:
        for first in range(start, start + count, 100):  # 100 records per transaction
            with store.unit_of_work() as uow:
                for n in range(first, min(first + 100, start + count)):
                    record = {"tool": "echo", "caller": "agent", "decision": "allowed", "n": n}
                    audit_chain.append(uow, "execution", record)
    finally:
        store.close()


def sql(data_dir: Path, *statements: tuple[str, tuple[object, ...]]) -> None:
    """Edit the store behind every server's back, as its holder can."""
    db = sqlite3.connect(data_dir / DB_FILENAME, isolation_level=None)
    try:
        for statement, params in statements:
            db.execute(statement, params)
    finally:
        db.close()


def rewrite_chain(data_dir: Path) -> None:
    """Recompute every prev_hash and hash from the records as they are now:
    a valid chain again, as a holder of the database would leave it."""
    db = sqlite3.connect(data_dir / DB_FILENAME, isolation_level=None)
    try:
        rows = db.execute("SELECT seq, at, kind, record FROM audit ORDER BY seq").fetchall()
        prev = audit_chain.GENESIS_HASH
        db.execute("BEGIN")
        for seq, at, kind, record in rows:
            entry = {"seq": seq, "at": at, "kind": kind, "record": record, "prev_hash": prev}
            new = hashlib.sha256(rfc8785.dumps(entry)).hexdigest()
            db.execute("UPDATE audit SET prev_hash = ?, hash = ? WHERE seq = ?", (prev, new, seq))
            prev = new
        db.execute("COMMIT")
    finally:
        db.close()


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory with 1,000 records and a checkpoint of them
    (old.txt), signed with log.key; the auditor has log.pub."""
    base = tmp_path_factory.mktemp("audit")
    made = toolreg("keys", "generate", "--out", str(base / "log.key"))
    assert made.returncode == 0, made.stderr
    data = base / "data"
    append(data, RECORDS)
    signed = toolreg(
        "audit", "checkpoint", "--make", "--log-key", str(base / "log.key"), "--origin", ORIGIN,
        "--data-dir", str(data), "--out", str(base / "old.txt"),
    )  # fmt: skip
    assert signed.returncode == 0, signed.stderr
    assert signed.stdout.startswith(f"{ORIGIN}\n{RECORDS}\n")
    return base


@pytest.fixture
def deployment(checkpointed: Path, tmp_path: Path) -> Iterator[Path]:
    """A copy of the checkpointed data directory for one test to tamper with."""
    shutil.copytree(checkpointed / "data", tmp_path / "data")
    for name in ("log.key", "log.pub", "old.txt"):
        shutil.copy2(checkpointed / name, tmp_path / name)
    yield tmp_path


def verify_against_old(d: Path) -> subprocess.CompletedProcess[str]:
    return toolreg("audit", "verify", "--checkpoint", str(d / "old.txt"), "--key",
                   str(d / "log.pub"), "--data-dir", str(d / "data"))  # fmt: skip


def test_a_grown_log_extends_the_old_checkpoint(deployment: Path) -> None:
    append(deployment / "data", 5, start=RECORDS)
    done = verify_against_old(deployment)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "signature verified" in done.stdout
    assert f"consistency proof {RECORDS} -> {RECORDS + 5} records verified" in done.stdout
    assert f"verified: the log ({RECORDS + 5} records) extends" in done.stdout
    # The log's verifier key (name+id+base64, as the server logs it) works as well.
    vkey = toolreg("audit", "verifier-key", "--key", str(deployment / "log.pub"), "--origin",
                   ORIGIN)  # fmt: skip
    assert vkey.returncode == 0 and vkey.stdout.startswith(f"{ORIGIN}+"), vkey.stderr
    done = toolreg("audit", "verify", "--checkpoint", str(deployment / "old.txt"), "--key",
                   vkey.stdout.strip(), "--data-dir", str(deployment / "data"))  # fmt: skip
    name_and_id = "+".join(vkey.stdout.split("+", 2)[:2])
    assert done.returncode == 0 and f"signature verified ({name_and_id})" in done.stdout


def test_the_last_ten_records_deleted(deployment: Path) -> None:
    sql(deployment / "data", ("DELETE FROM audit WHERE seq > ?", (RECORDS - 10,)))
    chain = toolreg("audit", "verify", "--data-dir", str(deployment / "data"))
    assert chain.returncode == 0  # the chain alone cannot tell: a valid, shorter chain
    done = verify_against_old(deployment)
    assert done.returncode == 1
    assert (
        f"FAILED: the log does not extend the checkpoint: the log holds {RECORDS - 10} records,"
        f" fewer than the {RECORDS} the checkpoint signed: records were cut off its end"
    ) in done.stdout


def test_one_record_edited(deployment: Path) -> None:
    sql(deployment / "data", ("UPDATE audit SET record = replace(record, 'allowed', 'refused')"
                              " WHERE seq = ?", (500,)))  # fmt: skip
    done = verify_against_old(deployment)
    assert done.returncode == 1
    assert "FAILED: audit chain broken at record 500" in done.stdout
    assert (
        "FAILED: the log does not extend the checkpoint: the log's first 1000 records are not"
        " those the checkpoint signed"
    ) in done.stdout


def test_the_whole_chain_recomputed_after_an_edit(deployment: Path) -> None:
    data = deployment / "data"
    edit = "UPDATE audit SET record = replace(record, 'allowed', 'refused') WHERE seq = ?"
    # The edit, and the store's own checkpoints removed as well.
    sql(data, (edit, (500,)), ("DELETE FROM audit_checkpoints", ()))
    rewrite_chain(data)
    chain = toolreg("audit", "verify", "--data-dir", str(data))
    assert chain.returncode == 0, chain.stdout  # a valid chain again
    done = verify_against_old(deployment)
    assert done.returncode == 1
    assert f"audit chain intact: {RECORDS} records" in done.stdout
    assert (
        "FAILED: the log does not extend the checkpoint: the log's first 1000 records are not"
        " those the checkpoint signed"
    ) in done.stdout
    assert "records were edited, replaced or removed, or the chain rewritten" in done.stdout
    # The store's own checkpoints are gone: old.txt and the public key alone tell.
    assert "no checkpoint of toolreg.example/audit-test in the store" in done.stdout


def test_a_forged_checkpoint_or_another_key_is_refused(deployment: Path) -> None:
    old = (deployment / "old.txt").read_text()
    (deployment / "forged.txt").write_text(old.replace(f"\n{RECORDS}\n", f"\n{RECORDS - 10}\n"))
    forged = toolreg("audit", "verify", "--checkpoint", str(deployment / "forged.txt"), "--key",
                     str(deployment / "log.pub"), "--data-dir", str(deployment / "data"))  # fmt: skip
    assert forged.returncode == 1 and "does not verify" in forged.stderr
    made = toolreg("keys", "generate", "--out", str(deployment / "other.key"))
    assert made.returncode == 0
    other = toolreg("audit", "verify", "--checkpoint", str(deployment / "old.txt"), "--key",
                    str(deployment / "other.pub"), "--data-dir", str(deployment / "data"))  # fmt: skip
    assert other.returncode == 1 and "no signature by a known key" in other.stderr


# -- an inclusion proof, checked without the project's code -----------------------------


def rfc9162_verify_inclusion(index: int, size: int, leaf: bytes, path: list[bytes],
                             root: bytes) -> bool:  # fmt: skip
    """RFC 9162, 2.1.3.2, step by step."""
    if index >= size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in path:
        if sn == 0:
            return False
        if fn % 2 == 1 or fn == sn:
            r = hashlib.sha256(b"\x01" + p + r).digest()
            while fn % 2 == 0 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            r = hashlib.sha256(b"\x01" + r + p).digest()
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and r == root


def check_tlog_proof(text: str, public_key_b64: str) -> dict[str, object]:
    """c2sp.org/tlog-proof, tlog-checkpoint and signed-note (Ed25519), read by
    hand; the record it proves, or AssertionError."""
    head, checkpoint = text.split("\n\n", 1)
    lines = head.split("\n")
    assert lines[0] == "c2sp.org/tlog-proof@v1"
    assert lines[1].startswith("extra ") and lines[2].startswith("index ")
    leaf_data = base64.b64decode(lines[1][6:])
    index = int(lines[2][6:])
    path = [base64.b64decode(line) for line in lines[3:]]
    body, signatures = checkpoint.rsplit("\n\n", 1)
    body += "\n"
    origin, size, root_b64 = body.splitlines()[:3]
    raw_key = base64.b64decode(public_key_b64)
    key_id = hashlib.sha256(origin.encode() + b"\n\x01" + raw_key).digest()[:4]
    ours = [s for s in signatures.splitlines() if s.startswith(f"\u2014 {origin} ")]
    blob = base64.b64decode(ours[0].rsplit(" ", 1)[1])
    assert blob[:4] == key_id
    Ed25519PublicKey.from_public_bytes(raw_key).verify(blob[4:], body.encode())
    leaf = hashlib.sha256(b"\x00" + leaf_data).digest()
    root = base64.b64decode(root_b64)
    assert rfc9162_verify_inclusion(index, int(size), leaf, path, root), "not included"
    record: dict[str, object] = json.loads(leaf_data)
    assert record["seq"] == index + 1
    return record


def test_an_inclusion_proof_checked_from_the_rfc(deployment: Path) -> None:
    append(deployment / "data", 3, start=RECORDS)  # records past the checkpoint are not proved
    out = deployment / "record-123.tlog-proof"
    done = toolreg("audit", "prove", "--record", "123", "--out", str(out), "--data-dir",
                   str(deployment / "data"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    public_key = (deployment / "log.pub").read_text().strip()
    record = check_tlog_proof(text, public_key)
    assert record["kind"] == "execution"
    assert json.loads(str(record["record"]))["n"] == 122
    stored = sqlite3.connect(deployment / "data" / DB_FILENAME).execute(
        "SELECT hash FROM audit WHERE seq = 123").fetchone()[0]  # fmt: skip
    assert hashlib.sha256(base64.b64decode(text.split("\n")[1][6:])).hexdigest() == stored
    # The project's own offline check agrees.
    ok = toolreg("audit", "verify", "--proof", str(out), "--key", public_key)
    assert ok.returncode == 0 and "verified: record 123 is in log" in ok.stdout, ok.stderr

    # A proof of another record's bytes, a changed path or checkpoint: refused by both.
    lines = text.split("\n")
    other = json.loads(base64.b64decode(lines[1][6:]))
    other["record"] = other["record"].replace("allowed", "refused")
    lines[1] = "extra " + base64.b64encode(rfc8785.dumps(other)).decode()
    tampered = "\n".join(lines)
    with pytest.raises(AssertionError, match="not included"):
        check_tlog_proof(tampered, public_key)
    out.write_text(tampered)
    refused = toolreg("audit", "verify", "--proof", str(out), "--key", public_key)
    assert refused.returncode == 1 and "not in the checkpoint's tree" in refused.stderr
    with pytest.raises(InvalidSignature):
        check_tlog_proof(text.replace(f"\n{RECORDS}\n", f"\n{RECORDS + 3}\n"), public_key)
    past = toolreg("audit", "prove", "--record", str(RECORDS + 1), "--data-dir",
                   str(deployment / "data"))  # fmt: skip
    assert past.returncode == 1 and f"not in the checkpoint ({RECORDS} records)" in past.stderr


# -- the server's own checkpoints and its start check -------------------------------------


def refused_start(data_dir: Path, *flags: str) -> str:
    """`toolreg serve` that must refuse to start: its message (run to its end,
    not through the launcher, which waits for a line saying where it serves)."""
    done = toolreg("serve", "--port", "0", "--data-dir", str(data_dir), *flags)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "refusing to start" in done.stderr
    return done.stderr


def test_a_server_refuses_to_start_on_a_log_that_does_not_extend_its_checkpoint(
    tmp_path: Path,
) -> None:
    made = toolreg("keys", "generate", "--out", str(tmp_path / "log.key"))
    assert made.returncode == 0
    data = tmp_path / "data"
    append(data, 30)
    flags = ("--log-key", str(tmp_path / "log.key"), "--checkpoint-every", "10")
    server = spawn_server(data, *flags, cwd=ROOT)
    try:
        first = "audit checkpoint: toolreg/toolreg-dev, 30 records"  # none yet: one at once
        deadline = time.monotonic() + 15
        while not any(first in line for line in server.log) and time.monotonic() < deadline:
            time.sleep(0.1)
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.ToolRegistryStub(channel)
            for _ in range(3):  # records the server writes itself
                result = stub.ExecuteTool(pb.ExecuteToolRequest(name="nope"), timeout=30)
                assert result.status == pb.EXECUTION_STATUS_TOOL_NOT_FOUND
    finally:
        assert server.stop() == 0
    log = "".join(server.log)
    assert "audit checkpoints: log toolreg/toolreg-dev" in log
    assert first in log
    copy = data / CHECKPOINT_COPY_FILENAME
    assert copy.read_text().startswith("toolreg/toolreg-dev\n33\n")  # the last, at close
    # The server's checkpoint proves the log to an auditor with the public key alone.
    ok = toolreg("audit", "verify", "--checkpoint", str(copy), "--key",
                 str(tmp_path / "log.pub"), "--data-dir", str(data))  # fmt: skip
    assert ok.returncode == 0, ok.stdout

    # Its holder cuts the last 3 records and deletes the store's checkpoints: the
    # copy the server keeps outside the store still tells.
    sql(data, ("DELETE FROM audit WHERE seq > ?", (30,)), ("DELETE FROM audit_checkpoints", ()))
    refused = refused_start(data, *flags)
    assert "fewer than the 33 the checkpoint signed" in refused
    allowed = spawn_server(data, *flags, cwd=ROOT,
                           env={**os.environ, "TOOLREG_ALLOW_BROKEN_AUDIT": "true"})  # fmt: skip
    try:
        assert any("no audit checkpoint will be signed" in line for line in allowed.log)
    finally:
        assert allowed.stop() == 0
    assert copy.read_text().startswith("toolreg/toolreg-dev\n33\n")  # nothing signed since


def test_a_server_refuses_to_start_on_an_edited_and_rechained_log(tmp_path: Path) -> None:
    made = toolreg("keys", "generate", "--out", str(tmp_path / "log.key"))
    assert made.returncode == 0
    data = tmp_path / "data"
    append(data, 12)
    flags = ("--log-key", str(tmp_path / "log.key"))
    spawn_server(data, *flags, cwd=ROOT).stop()
    sql(data, ("UPDATE audit SET record = replace(record, 'agent', 'agent2') WHERE seq = 4", ()))
    rewrite_chain(data)
    assert "the chain rewritten" in refused_start(data, *flags)
