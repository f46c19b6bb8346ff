"""The audit log's checkpoints in every store (memory, SQLite, PostgreSQL),
and several servers signing checkpoints of one PostgreSQL database's log
(two checkpointers, then two real `toolreg serve` processes): one tree;
every checkpoint any of them stores verifies and is consistent with the log."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.api.config import CHECKPOINT_COPY_FILENAME
from registry_server.domain import merkle
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.notes import Signer, open_checkpoint
from registry_server.store import audit_chain, audit_tree
from registry_server.store.base import CheckpointRecord, Store
from registry_server.store.postgres import PostgresStore
from tests.cluster.conftest import AUDIENCE, ROOT, StartCluster

ORIGIN = "toolreg/cluster-test"


def append(store: Store, count: int) -> None:
    for n in range(count):
        with store.unit_of_work() as uow:
            audit_chain.append(uow, "execution", {"n": n})


def test_entries_after_a_seq_and_checkpoints_by_origin_and_size(store: Store) -> None:
    append(store, 7)
    with store.reading() as reads:
        assert [e.seq for e in reads.audit_entries_after(3, 2)] == [4, 5]
        assert [e.seq for e in reads.audit_entries_after(5, 100)] == [6, 7]
        assert reads.audit_entries_after(7, 10) == []
        assert reads.latest_checkpoint() is None
    a = CheckpointRecord(ORIGIN, 5, "aa" * 32, "note a\n", 10.0)
    b = CheckpointRecord(ORIGIN, 7, "bb" * 32, "note b\n", 11.0)
    other = CheckpointRecord("toolreg/other", 9, "cc" * 32, "note c\n", 9.0)
    with store.unit_of_work() as uow:
        assert uow.add_checkpoint(b) and uow.add_checkpoint(a) and uow.add_checkpoint(other)
    with store.unit_of_work() as uow:
        assert not uow.add_checkpoint(CheckpointRecord(ORIGIN, 7, "dd" * 32, "again\n", 12.0))
    with store.reading() as reads:
        assert reads.latest_checkpoint(ORIGIN) == b
        assert reads.latest_checkpoint("toolreg/other") == other
        assert reads.latest_checkpoint() == other  # the largest of any log
        assert reads.latest_checkpoint("toolreg/none") is None


def test_two_servers_checkpointers_on_one_postgresql_agree(database: str) -> None:
    stores = [PostgresStore(database), PostgresStore(database)]
    key = Ed25519PrivateKey.generate()
    signer = Signer(ORIGIN, key)
    append(stores[0], 1)
    checkpointers = []
    for store in stores:
        log = audit_tree.read_log(store)
        checkpointers.append(audit_tree.Checkpointer(
            store, Signer(ORIGIN, key), log.compact(), log.chain.head, every=7, interval_s=0.05,
            poll_s=0.01,
        ))  # fmt: skip
    stop = threading.Event()

    def write(store: Store) -> None:
        while not stop.is_set():
            append(store, 1)

    writers = [threading.Thread(target=write, args=(s,)) for s in stores]
    try:
        for c in checkpointers:
            c.start()
        for w in writers:
            w.start()
        time.sleep(3)
    finally:
        stop.set()
        for w in writers:
            w.join()
        for c in checkpointers:
            c.close()
    try:
        log = audit_tree.read_log(stores[0])
        assert log.chain.ok and log.size > 50
        with stores[1].reading() as reads:
            latest = reads.latest_checkpoint(ORIGIN)
        assert latest is not None and latest.size == log.size  # the last one, made at close
        stored = _all_checkpoints(database)
        assert len(stored) >= 2
        for size, note in stored:  # each server's, whoever signed it: one tree
            checkpoint = open_checkpoint(note, signer.verifier)
            assert checkpoint.size == size and checkpoint.root == log.root(size)
            proof = merkle.consistency_proof(log.leaves, size)
            assert merkle.verify_consistency(size, log.size, checkpoint.root, log.root(), proof)
    finally:
        for store in stores:
            store.close()


def _all_checkpoints(database: str, origin: str = ORIGIN) -> list[tuple[int, str]]:
    import psycopg

    with psycopg.connect(database) as conn:
        rows = conn.execute(
            "SELECT size, note FROM audit_checkpoints WHERE origin = %s ORDER BY size", (origin,)
        ).fetchall()
    return [(int(size), str(note)) for size, note in rows]


def test_servers_on_one_database_sign_one_log(
    start_cluster: StartCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pem, public = generate_keypair()
    key_file = tmp_path / "log.key"
    key_file.write_bytes(pem)
    key_file.chmod(0o600)
    (tmp_path / "log.pub").write_text(public + "\n")
    monkeypatch.setenv("TOOLREG_LOG_KEY_FILE", str(key_file))  # every server: one key, one origin
    monkeypatch.setenv("TOOLREG_CHECKPOINT_EVERY", "4")
    cluster = start_cluster(3)  # the three servers on one PostgreSQL: one tree
    errors: list[BaseException] = []

    def hammer(index: int) -> None:
        stub = cluster.stub(index, "agent")
        try:
            for _ in range(20):  # unknown tools: audited, no sandbox
                stub.ExecuteTool(pb.ExecuteToolRequest(name="missing_tool"))
                time.sleep(0.05)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    cluster.stop()  # each signs what is committed at close

    origin = f"toolreg/{AUDIENCE}"
    signer = Signer(origin, load_private_key(pem))
    store = PostgresStore(cluster.store_url)
    try:
        log = audit_tree.read_log(store)
    finally:
        store.close()
    assert log.chain.ok and log.size >= 60
    stored = _all_checkpoints(cluster.store_url, origin)
    assert len(stored) >= 3 and stored[-1][0] == log.size
    for size, note in stored:  # whichever server signed it: one tree
        assert open_checkpoint(note, signer.verifier).root == log.root(size)
    # Each server that signed keeps its own copy, and each copy proves the log
    # to an auditor (a server whose sizes the others signed first has none).
    copies = [tmp_path / f"server{i}" / CHECKPOINT_COPY_FILENAME for i in range(3)]
    assert sum(copy.exists() for copy in copies) >= 2
    for copy in (c for c in copies if c.exists()):
        verified = subprocess.run(
            [sys.executable, "-m", "registry_server.cli", "audit", "verify",
             "--checkpoint", str(copy), "--key", str(tmp_path / "log.pub"),
             "--store-url", cluster.store_url],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
        assert verified.returncode == 0, verified.stdout + verified.stderr
        assert f"verified: the log ({log.size} records) extends" in verified.stdout
