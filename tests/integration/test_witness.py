"""Witnesses (issue 29, item 2; docs/how-to/audit.md "Witnesses") end to end: a
real `toolreg witness serve` process on loopback, a real SQLite store, the
real `toolreg` CLI and a real `toolreg serve` process.

First the protocol (c2sp.org/tlog-witness), with checkpoints the library
signs over a growing SQLite log: the witness cosigns each one whose
consistency proof from the last it cosigned verifies; it answers a stale
old size with 409 and its size, an unknown log with 404, a checkpoint the
log key did not sign with 403; after a restart it still knows where it
stopped; and a forked checkpoint (the log key signing another tree of the
same size) is refused with 409 saying "fork detected", and logged.

Then the server: `toolreg serve --log-key ... --witness` submits each
checkpoint it signs as the log grows, the witness cosigns them in turn,
`toolreg audit checkpoint` shows the cosignature, and `toolreg audit verify
--checkpoint OLD --witness VKEY --min-witnesses 1` passes with it and fails
without it. Cosignatures are checked here by hand from c2sp.org/
tlog-cosignature with hashlib and cryptography, not only by the project."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from registry_server.api.config import DB_FILENAME
from registry_server.cli.launcher import spawn_server, spawn_until
from registry_server.domain import merkle
from registry_server.signing.keys import load_private_key
from registry_server.signing.notes import Signer
from registry_server.signing.tlog_witness import AddCheckpoint
from registry_server.store import audit_chain, audit_tree
from registry_server.store.base import CheckpointRecord
from registry_server.store.sqlite import SqliteStore

ROOT = Path(__file__).resolve().parents[2]
TOOLREG = [sys.executable, "-m", "registry_server.cli"]
ORIGIN = "toolreg.example/witnessed"
WITNESS = "witness.example/w1"
SERVING = re.compile(r"serving on (http://\S+)")


def toolreg(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TOOLREG, *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)  # fmt: skip


@dataclass
class Keys:
    base: Path
    log_vkey: str
    witness_vkey: str

    @property
    def log_key(self) -> Path:
        return self.base / "log.key"

    @property
    def witness_key(self) -> Path:
        return self.base / "witness.key"

    def signer(self, origin: str = ORIGIN) -> Signer:
        return Signer(origin, load_private_key(self.log_key.read_bytes()))


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    made = toolreg("keys", "generate", "--out", str(tmp_path / "log.key"))
    assert made.returncode == 0, made.stderr
    vkey = toolreg("audit", "verifier-key", "--key", str(tmp_path / "log.pub"), "--origin", ORIGIN)
    assert vkey.returncode == 0, vkey.stderr
    witness = toolreg("witness", "keygen", "--out", str(tmp_path / "witness.key"), "--name",
                      WITNESS)  # fmt: skip
    assert witness.returncode == 0, witness.stderr
    assert (tmp_path / "witness.key").stat().st_mode & 0o777 == 0o600
    return Keys(tmp_path, vkey.stdout.strip(), witness.stdout.strip())


def logged(lines: list[str], text: str, timeout_s: float = 10) -> bool:
    """Whether a process logged ``text`` (its log is read as it comes)."""
    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in lines):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class WitnessProcess:
    def __init__(self, keys: Keys, state: Path) -> None:
        argv = [*TOOLREG, "witness", "serve", "--key", str(keys.witness_key), "--name", WITNESS,
                "--log", keys.log_vkey, "--state", str(state), "--listen", "127.0.0.1:0",
                "--log-format", "text"]  # fmt: skip
        self.proc, self.url, self.log = spawn_until(argv, SERVING, what="toolreg witness",
                                                    cwd=ROOT)  # fmt: skip

    def add(self, body: bytes) -> httpx.Response:
        return httpx.post(f"{self.url}/add-checkpoint", content=body, timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        assert self.proc.wait(timeout=30) == 0

    def said(self, text: str) -> bool:
        return logged(self.log, text)


@pytest.fixture
def witnesses(keys: Keys) -> Iterator[list[WitnessProcess]]:
    started: list[WitnessProcess] = []
    yield started
    for w in started:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait(timeout=30)


def append(store: SqliteStore, count: int, tag: str = "") -> None:
    with store.unit_of_work() as uow:
        for n in range(count):
            audit_chain.append(uow, "execution", {"tool": "echo", "n": n, "tag": tag})


def check_by_hand(line: str, note: str, witness_vkey: str) -> int:
    """The cosignature line verified from c2sp.org/tlog-cosignature alone;
    its timestamp."""
    name, key_id_hex, key_b64 = witness_vkey.split("+", 2)
    typed = base64.b64decode(key_b64)
    assert typed[0] == 0x04
    assert hashlib.sha256(name.encode() + b"\n" + typed).digest()[:4].hex() == key_id_hex
    prefix = f"\u2014 {name} "
    assert line.startswith(prefix)
    blob = base64.b64decode(line[len(prefix) :].strip())
    assert blob[:4].hex() == key_id_hex and len(blob) == 4 + 8 + 64
    timestamp = int.from_bytes(blob[4:12], "big")
    text = note[: note.rindex("\n\n") + 1]  # the note's text, without signature lines
    message = f"cosignature/v1\ntime {timestamp}\n{text}".encode()
    Ed25519PublicKey.from_public_bytes(typed[1:]).verify(blob[12:], message)  # raises if not
    return timestamp


def test_the_witness_protocol_on_a_growing_log(
    keys: Keys, witnesses: list[WitnessProcess], tmp_path: Path
) -> None:
    state = tmp_path / "witness-state.json"
    witness = WitnessProcess(keys, state)
    witnesses.append(witness)
    store = SqliteStore(tmp_path / "log" / DB_FILENAME)
    signer = keys.signer()
    cosigned = 0
    try:
        for grow in (7, 1, 24, 100):
            append(store, grow)
            checkpoint = audit_tree.checkpoint_now(store, signer)
            leaves = audit_tree.read_log(store).leaves
            proof = merkle.consistency_proof(leaves, cosigned, checkpoint.size)
            answer = witness.add(AddCheckpoint(cosigned, tuple(proof), checkpoint.note).body())
            assert answer.status_code == 200, answer.text
            assert check_by_hand(answer.text, checkpoint.note, keys.witness_vkey) > 0
            assert witness.said(f"cosigned {ORIGIN} at size {checkpoint.size}")
            cosigned = checkpoint.size
        assert cosigned == 132

        # A stale old size: 409, text/x.tlog.size, the witness's size.
        stale = witness.add(AddCheckpoint(0, (), checkpoint.note).body())
        assert stale.status_code == 409
        assert stale.headers["content-type"] == "text/x.tlog.size"
        assert stale.text == "132\n"

        # An unknown log: 404. A checkpoint of this log the log key did not sign: 403.
        stranger = Signer("someone.else/log", load_private_key(keys.log_key.read_bytes()))
        record = audit_tree.sign(stranger, checkpoint.size, bytes.fromhex(checkpoint.root), 0)
        assert witness.add(AddCheckpoint(132, (), record.note).body()).status_code == 404
        forged = checkpoint.note.replace("\n132\n", "\n133\n", 1)
        assert witness.add(AddCheckpoint(132, (), forged).body()).status_code == 403

        # A restart keeps what it cosigned.
        witness.stop()
        witness = WitnessProcess(keys, state)
        witnesses.append(witness)
        assert witness.add(AddCheckpoint(0, (), checkpoint.note).body()).text == "132\n"

        # A fork: the log key signs another tree of 132 records.
        fork_store = SqliteStore(tmp_path / "fork" / DB_FILENAME)
        append(fork_store, 132, tag="fork")
        fork = audit_tree.checkpoint_now(fork_store, signer)
        fork_store.close()
        assert fork.size == 132 and fork.root != checkpoint.root
        refused = witness.add(AddCheckpoint(132, (), fork.note).body())
        assert refused.status_code == 409
        assert refused.headers["content-type"].startswith("text/plain")
        assert refused.text.startswith("fork detected: ")
        assert witness.said("FORK DETECTED")
        # ... and a forked history that grew past it, with a proof of its own: 422.
        fork_leaves = [merkle.leaf_hash(bytes([i])) for i in range(140)]
        bigger = signer.sign(f"{ORIGIN}\n140\n"
                             f"{base64.b64encode(merkle.root(fork_leaves)).decode()}\n")  # fmt: skip
        proof = merkle.consistency_proof(fork_leaves, 132, 140)
        assert witness.add(AddCheckpoint(132, tuple(proof), bigger).body()).status_code == 422

        # The log it cosigned still grows under it.
        append(store, 3)
        checkpoint = audit_tree.checkpoint_now(store, signer)
        proof = merkle.consistency_proof(audit_tree.read_log(store).leaves, 132, 135)
        answer = witness.add(AddCheckpoint(132, tuple(proof), checkpoint.note).body())
        assert answer.status_code == 200, answer.text
    finally:
        store.close()
    witness.stop()
    evidence = json.loads(state.read_text())["evidence"][ORIGIN]
    assert [e["kind"] for e in evidence] == ["fork", "inconsistent"]


def stored_checkpoint(data: Path, size: int) -> str:
    """The log-signed note as the store keeps it (no cosignatures)."""
    db = sqlite3.connect(data / DB_FILENAME)
    try:
        (note,) = db.execute(
            "SELECT note FROM audit_checkpoints WHERE origin = ? AND size = ?", (ORIGIN, size)
        ).fetchone()
    finally:
        db.close()
    return str(note)


def wait_cosigned(data: Path, size: int, timeout_s: float = 30) -> CheckpointRecord:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        store = SqliteStore(data / DB_FILENAME)
        try:
            with store.reading() as reads:
                latest = reads.latest_checkpoint(ORIGIN)
                cosigned = [c.size for c in reads.latest_cosignatures(ORIGIN)]
        finally:
            store.close()
        if latest is not None and latest.size == size and cosigned == [size]:
            return latest
        time.sleep(0.2)
    raise AssertionError(f"no cosignature of {size} records in time")


def test_a_server_gets_its_checkpoints_witnessed_and_an_auditor_requires_them(
    keys: Keys, witnesses: list[WitnessProcess], tmp_path: Path
) -> None:
    witness = WitnessProcess(keys, tmp_path / "witness-state.json")
    witnesses.append(witness)
    data = tmp_path / "data"
    server = spawn_server(
        data, "--log-key", str(keys.log_key), "--log-origin", ORIGIN, "--checkpoint-every", "5",
        "--checkpoint-interval-s", "1", "--witness", f"{keys.witness_vkey} {witness.url}",
        cwd=ROOT,
    )  # fmt: skip
    try:
        sizes = []
        for grow in (6, 9, 40):
            store = SqliteStore(data / DB_FILENAME)
            try:
                append(store, grow)
                size = audit_tree.read_log(store).size
            finally:
                store.close()
            wait_cosigned(data, size)
            sizes.append(size)
        # Each checkpoint came with the proof from the one before it.
        for before, after in zip([0, *sizes], sizes, strict=False):
            assert witness.said(f"cosigned {ORIGIN} at size {after} (root"), witness.log
            assert any(f"at size {after} (" in line and line.rstrip().endswith(
                f"after size {before}") for line in witness.log), witness.log  # fmt: skip
        assert logged(server.log, f"cosigned by witness {WITNESS}")
    finally:
        assert server.stop() == 0

    # `audit checkpoint` shows the cosignature, and it verifies by hand.
    shown = toolreg("audit", "checkpoint", "--data-dir", str(data), "--out",
                    str(tmp_path / "cosigned.txt"))  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    last = sizes[-1]
    assert shown.stdout.startswith(f"{ORIGIN}\n{last}\n")
    [line] = [x for x in shown.stdout.splitlines() if x.startswith(f"\u2014 {WITNESS} ")]
    check_by_hand(line, shown.stdout, keys.witness_vkey)

    # An auditor holds the first checkpoint as the log signed it (no cosignature).
    old = tmp_path / "old.txt"
    old.write_text(stored_checkpoint(data, sizes[0]))
    (tmp_path / "witness.vkey").write_text(keys.witness_vkey + "\n")
    verify = ["audit", "verify", "--checkpoint", str(old), "--key", keys.log_vkey,
              "--data-dir", str(data)]  # fmt: skip
    done = toolreg(*verify, "--witness", str(tmp_path / "witness.vkey"), "--min-witnesses", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    name_and_id = "+".join(keys.witness_vkey.split("+", 2)[:2])
    assert f"witness {name_and_id}: cosigned {last} records" in done.stdout
    assert "witnessed: 1 of the --witness keys cosigned the log at or beyond" in done.stdout

    # Without it: a witness the auditor trusts that never saw this log ...
    other = toolreg("witness", "keygen", "--out", str(tmp_path / "other.key"), "--name",
                    "witness.example/w2")  # fmt: skip
    done = toolreg(*verify, "--witness", other.stdout.strip(), "--min-witnesses", "1")
    assert done.returncode == 1
    assert "FAILED: 0 of the --witness keys cosigned the log" in done.stdout
    # ... two required of one ...
    done = toolreg(*verify, "--witness", keys.witness_vkey, "--witness", other.stdout.strip(),
                   "--min-witnesses", "2")  # fmt: skip
    assert done.returncode == 1 and "1 of the --witness keys cosigned" in done.stdout
    # ... or the store's cosignatures gone (the holder of the database deleted them).
    db = sqlite3.connect(data / DB_FILENAME)
    db.execute("DELETE FROM audit_cosignatures")
    db.commit()
    db.close()
    done = toolreg(*verify, "--witness", keys.witness_vkey)
    assert done.returncode == 1 and "FAILED: 0 of the --witness keys" in done.stdout
    # A checkpoint that carries its own cosignature still counts, offline of the store.
    done = toolreg("audit", "verify", "--checkpoint", str(tmp_path / "cosigned.txt"), "--key",
                   keys.log_vkey, "--data-dir", str(data), "--witness", keys.witness_vkey)  # fmt: skip
    assert done.returncode == 0, done.stdout
    assert "(on the checkpoint)" in done.stdout
    assert os.stat(tmp_path / "witness-state.json").st_size > 0
