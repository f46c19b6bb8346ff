"""The audit log's checkpoints in every store (memory, SQLite, PostgreSQL),
and two servers' checkpointers on one PostgreSQL database: one tree, every
checkpoint either of them stores verifies and is consistent with the log."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from registry_server.domain import merkle
from registry_server.signing.notes import Signer, open_checkpoint
from registry_server.store import audit_chain, audit_tree
from registry_server.store.base import CheckpointRecord, Store
from registry_server.store.memory import MemoryStore
from registry_server.store.postgres import PostgresStore
from registry_server.store.sqlite import SqliteStore

ORIGIN = "toolreg/cluster-test"


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "memory":
        made: Store = MemoryStore()
    elif request.param == "sqlite":
        made = SqliteStore(tmp_path / "toolreg.db")
    else:
        made = PostgresStore(request.getfixturevalue("database"))
    yield made
    made.close()


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


def _all_checkpoints(database: str) -> list[tuple[int, str]]:
    import psycopg

    with psycopg.connect(database) as conn:
        rows = conn.execute(
            "SELECT size, note FROM audit_checkpoints WHERE origin = %s ORDER BY size", (ORIGIN,)
        ).fetchall()
    return [(int(size), str(note)) for size, note in rows]
