"""The witness's decisions (witness/core.py) on c2sp.org/tlog-witness
requests, in memory: a growing log cosigned, and each refusal the spec
names (400, 403, 404, 409 with the size, 409 for a fork, 422), evidence
kept; two requests at once never roll a log back; the state file survives
a restart, and an unreadable one or a second process stops the witness;
the HTTP edge checks Host and size and passes the answers through."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from starlette.testclient import TestClient

from registry_server.domain import merkle
from registry_server.domain.errors import ConfigError
from registry_server.signing.cosignatures import (
    Cosigner,
    check_cosignatures,
    with_signature_lines,
)
from registry_server.signing.notes import Checkpoint, Signer
from registry_server.signing.tlog_witness import (
    MAX_REQUEST_BYTES,
    SIZE_CONTENT_TYPE,
    AddCheckpoint,
)
from registry_server.witness.core import Witness
from registry_server.witness.state import FileState, LogState, MemoryState
from registry_server.witness.web import build_app, check_prefix

ORIGIN = "toolreg.example/log"
NOW = 1_800_000_000


class Log:
    """A log's leaves and its key: signs checkpoints of its first n leaves."""

    def __init__(self, leaves: int = 64, seed: bytes = b"") -> None:
        self.leaves = [merkle.leaf_hash(seed + bytes([i])) for i in range(leaves)]
        self.signer = Signer(ORIGIN, Ed25519PrivateKey.generate())

    def note(self, size: int) -> str:
        return self.signer.sign(Checkpoint(ORIGIN, size, merkle.root(self.leaves, size)).body())

    def request(self, old: int, size: int) -> bytes:
        proof = merkle.consistency_proof(self.leaves, old, size) if old else []
        return AddCheckpoint(old, tuple(proof), self.note(size)).body()


@pytest.fixture
def log() -> Log:
    return Log()


def witness_for(log: Log, state: MemoryState | FileState | None = None) -> Witness:
    cosigner = Cosigner("witness.example/w1", Ed25519PrivateKey.generate())
    return Witness(cosigner, {ORIGIN: [log.signer.verifier]}, state or MemoryState(),
                   clock=lambda: NOW)  # fmt: skip


def cosigned(witness: Witness, note: str, answer_body: str) -> int:
    lines = answer_body.rstrip("\n").split("\n")
    return check_cosignatures(
        with_signature_lines(note, lines), [witness.cosigner.verifier]
    ).count()


def test_a_growing_log_is_cosigned_step_by_step(log: Log) -> None:
    witness = witness_for(log)
    previous = 0
    for size in (1, 2, 3, 7, 8, 20, 64):
        answer = witness.add_checkpoint(log.request(previous, size))
        assert answer.status == 200, answer.body
        assert cosigned(witness, log.note(size), answer.body) == 1
        previous = size
    # The same checkpoint again: cosigned again (the spec: old size = size, same root).
    answer = witness.add_checkpoint(log.request(64, 64))
    assert answer.status == 200


def test_a_stale_or_unknown_old_size_is_409_with_the_witness_size(log: Log) -> None:
    witness = witness_for(log)
    assert witness.add_checkpoint(log.request(0, 10)).status == 200
    for old in (0, 5, 9):
        answer = witness.add_checkpoint(log.request(old, 20))
        assert (answer.status, answer.content_type, answer.body) == (409, SIZE_CONTENT_TYPE, "10\n")
    # A client that asked with 0 learns 10, and then gets its cosignature.
    assert witness.add_checkpoint(log.request(10, 20)).status == 200


def test_a_fork_of_the_same_size_is_refused_and_kept_as_evidence(log: Log) -> None:
    state = MemoryState()
    witness = witness_for(log, state)
    assert witness.add_checkpoint(log.request(0, 10)).status == 200
    fork = Log(seed=b"fork")
    fork.signer = log.signer  # the log key signs another tree of the same size
    answer = witness.add_checkpoint(AddCheckpoint(10, (), fork.note(10)).body())
    assert answer.status == 409
    assert answer.content_type.startswith("text/plain")
    assert answer.body.startswith("fork detected: ")
    [evidence] = state.evidence[ORIGIN]
    assert evidence["kind"] == "fork"
    assert evidence["cosigned"] == log.note(10) and evidence["offered"] == fork.note(10)
    # The witness still stands by the first: it is cosigned again, the fork is not.
    assert state.logs[ORIGIN].root == merkle.root(log.leaves, 10)
    assert witness.add_checkpoint(log.request(10, 10)).status == 200


def test_a_checkpoint_that_does_not_extend_the_cosigned_one_is_422(log: Log) -> None:
    state = MemoryState()
    witness = witness_for(log, state)
    assert witness.add_checkpoint(log.request(0, 10)).status == 200
    fork = Log(seed=b"fork")
    fork.signer = log.signer
    # A larger tree of another history, with its own (valid for it) proof from 10.
    answer = witness.add_checkpoint(fork.request(10, 20))
    assert answer.status == 422, answer.body
    assert "does not verify" in answer.body
    assert state.evidence[ORIGIN][0]["kind"] == "inconsistent"
    # A wrong proof for the right tree: refused the same way; then the right one passes.
    proof = list(merkle.consistency_proof(log.leaves, 10, 20))
    proof[0] = bytes(32)
    body = AddCheckpoint(10, tuple(proof), log.note(20)).body()
    assert witness.add_checkpoint(body).status == 422
    # A proof from size 0 must be empty.
    fresh = witness_for(log)
    body = AddCheckpoint(0, (bytes(32),), log.note(5)).body()
    assert fresh.add_checkpoint(body).status == 422
    assert witness.add_checkpoint(log.request(10, 20)).status == 200


def test_unknown_logs_bad_signatures_and_malformed_requests(log: Log) -> None:
    witness = witness_for(log)
    other = Log()
    other.signer = Signer("someone.else/log", Ed25519PrivateKey.generate())
    note = other.signer.sign(Checkpoint("someone.else/log", 3, merkle.root(other.leaves, 3)).body())
    assert witness.add_checkpoint(AddCheckpoint(0, (), note).body()).status == 404
    # The right origin, another key: 403.
    impostor = Log()
    impostor.signer = Signer(ORIGIN, Ed25519PrivateKey.generate())
    assert witness.add_checkpoint(impostor.request(0, 3)).status == 403
    # The right key, an altered note: 403.
    altered = log.note(3).replace("\n3\n", "\n4\n", 1)
    assert witness.add_checkpoint(AddCheckpoint(0, (), altered).body()).status == 403
    # Old size above the checkpoint's: 400; garbage: 400.
    assert witness.add_checkpoint(AddCheckpoint(5, (), log.note(3)).body()).status == 400
    assert witness.add_checkpoint(b"hello").status == 400
    assert witness.add_checkpoint(b"old 0\n\nnot a note\n").status == 400
    # None of them changed anything.
    assert witness.add_checkpoint(log.request(0, 3)).status == 200


def test_two_requests_at_once_never_roll_the_log_back(log: Log) -> None:
    witness = witness_for(log)
    assert witness.add_checkpoint(log.request(0, 8)).status == 200
    statuses: dict[int, int] = {}
    start = threading.Barrier(2)

    def submit(size: int) -> None:
        start.wait()
        statuses[size] = witness.add_checkpoint(log.request(8, size)).status

    threads = [threading.Thread(target=submit, args=(size,)) for size in (20, 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # One of them won; the other's old size (8) is stale by then.
    assert sorted(statuses.values()) == [200, 409]
    winner = next(size for size, status in statuses.items() if status == 200)
    answer = witness.add_checkpoint(log.request(0, 64))
    assert answer.body == f"{winner}\n"


def test_the_state_file_survives_a_restart(log: Log, tmp_path: Path) -> None:
    path = tmp_path / "witness" / "state.json"
    state = FileState(path)
    witness = witness_for(log, state)
    assert witness.add_checkpoint(log.request(0, 10)).status == 200
    state.close()
    data = json.loads(path.read_text())
    assert data["logs"][ORIGIN]["size"] == 10 and data["logs"][ORIGIN]["cosigned_at"] == NOW
    again = FileState(path)
    restarted = witness_for(log, again)
    assert restarted.add_checkpoint(log.request(0, 20)).body == "10\n"
    fork = Log(seed=b"fork")
    fork.signer = log.signer
    assert restarted.add_checkpoint(AddCheckpoint(10, (), fork.note(10)).body()).status == 409
    assert restarted.add_checkpoint(log.request(10, 20)).status == 200
    again.close()
    assert json.loads(path.read_text())["evidence"][ORIGIN][0]["kind"] == "fork"
    assert not list(path.parent.glob(".*.tmp"))  # no temporary file left


def test_one_process_per_state_file_and_an_unreadable_one_stops_the_witness(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.json"
    held = FileState(path)
    with pytest.raises(ConfigError, match="another witness process"):
        FileState(path)
    held.close()
    FileState(path).close()
    for text in ("{not json", '{"version": 99, "logs": {}}', '{"version": 1}', "[]"):
        path.write_text(text)
        with pytest.raises(ConfigError, match="refusing to start"):
            FileState(path)


def test_a_state_that_cannot_be_written_is_never_cosigned(log: Log) -> None:
    class Full(MemoryState):
        def put(self, origin: str, state: LogState) -> None:
            raise OSError(28, "No space left on device")

    witness = witness_for(log, Full())
    answer = witness.add_checkpoint(log.request(0, 5))
    assert answer.status == 500 and "\u2014" not in answer.body


def test_the_http_edge_checks_host_size_and_path(log: Log) -> None:
    witness = witness_for(log)
    app = build_app(witness, prefix="/w", hosts=frozenset({"testserver"}))
    with TestClient(app) as client:
        answer = client.post("/w/add-checkpoint", content=log.request(0, 5))
        assert answer.status_code == 200
        assert cosigned(witness, log.note(5), answer.text) == 1
        stale = client.post("/w/add-checkpoint", content=log.request(0, 9))
        assert stale.status_code == 409
        assert stale.headers["content-type"] == SIZE_CONTENT_TYPE  # as the spec writes it
        assert stale.text == "5\n"
        evil = client.post("/w/add-checkpoint", content=log.request(5, 9),
                           headers={"host": "evil.example"})  # fmt: skip
        assert evil.status_code == 421
        big = client.post("/w/add-checkpoint", content=b"x" * (MAX_REQUEST_BYTES + 1))
        assert big.status_code == 413
        assert client.get("/w/add-checkpoint").status_code == 405
        assert client.post("/add-checkpoint", content=log.request(5, 9)).status_code == 404
    for bad in ("w", "/w/", "//w"):
        with pytest.raises(ConfigError):
            check_prefix(bad)
