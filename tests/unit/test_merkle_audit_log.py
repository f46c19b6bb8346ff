"""The audit log's tree and checkpoints over a store (store/audit_tree.py),
in memory: which logs extend a checkpoint, what the start check finds, and
when the checkpointer signs."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from registry_server.domain import merkle
from registry_server.signing.notes import Checkpoint, Signer, open_checkpoint
from registry_server.store import audit_chain, audit_tree
from registry_server.store.base import AuditEntry
from registry_server.store.memory import MemoryStore

ORIGIN = "toolreg/unit"


def log_of(count: int) -> MemoryStore:
    store = MemoryStore()
    append(store, count)
    return store


def append(store: MemoryStore, count: int) -> None:
    for i in range(count):
        with store.unit_of_work() as uow:
            audit_chain.append(uow, "execution", {"call": i, "tool": "echo"})


def signer() -> Signer:
    return Signer(ORIGIN, Ed25519PrivateKey.generate())


def rewrite(store: MemoryStore, entries: list[AuditEntry]) -> None:
    """What a holder of the database can do: replace the log wholesale."""
    store._data.audit = list(entries)


def rechained(entries: list[AuditEntry]) -> list[AuditEntry]:
    """The entries with every prev_hash and hash recomputed: a valid chain."""
    out: list[AuditEntry] = []
    prev = audit_chain.GENESIS_HASH
    for e in entries:
        h = audit_chain.entry_hash(e.seq, e.at, e.kind, e.record, prev)
        out.append(dataclasses.replace(e, prev_hash=prev, hash=h))
        prev = h
    return out


def test_leaves_are_the_entries_canonical_bytes() -> None:
    store = log_of(5)
    log = audit_tree.read_log(store)
    assert log.chain.ok and log.size == 5
    for seq, entry in enumerate(log.entries, start=1):
        data = log.leaf_bytes(seq)
        assert hashlib.sha256(data).hexdigest() == entry.hash  # the bytes the chain hashes
        assert log.leaves[seq - 1] == merkle.leaf_hash(data)
    assert log.compact().root() == log.root() == merkle.root(log.leaves)


def test_what_extends_a_checkpoint_and_what_does_not() -> None:
    store = log_of(20)
    old = audit_tree.read_log(store)
    checkpoint = Checkpoint(ORIGIN, 20, old.root())
    assert audit_tree.extends(old, checkpoint).ok
    append(store, 7)
    grown = audit_tree.extends(audit_tree.read_log(store), checkpoint)
    assert grown.ok and "20 -> 27" in grown.reason and grown.proof

    entries = audit_tree.read_log(store).entries
    rewrite(store, entries[:15])  # the last records cut off
    cut = audit_tree.extends(audit_tree.read_log(store), checkpoint)
    assert not cut.ok and "fewer than the 20" in cut.reason

    edited = list(entries)
    edited[9] = dataclasses.replace(edited[9], record=edited[9].record.replace("echo", "ech0"))
    rewrite(store, edited)
    log = audit_tree.read_log(store)
    assert not log.chain.ok and not audit_tree.extends(log, checkpoint).ok

    rewrite(store, rechained(edited))  # the chain recomputed after the edit: intact again
    log = audit_tree.read_log(store)
    assert log.chain.ok
    outcome = audit_tree.extends(log, checkpoint)
    assert not outcome.ok and "chain rewritten" in outcome.reason


def test_the_start_check_finds_a_cut_log_through_the_copy_outside_the_store(
    tmp_path: Path,
) -> None:
    store, key = log_of(10), signer()
    copy = tmp_path / "audit-checkpoint.txt"
    record = audit_tree.checkpoint_now(store, key)
    audit_tree.write_copy(copy, record.note)
    check = audit_tree.check_log(store, origin=ORIGIN, verifier=key.verifier, copy_file=copy)
    assert check.ok and len(check.passed) == 3, check.passed

    rewrite(store, store._data.audit[:8])
    store._data.checkpoints.clear()  # the holder of the database removes the checkpoints too
    check = audit_tree.check_log(store, origin=ORIGIN, verifier=key.verifier, copy_file=copy)
    assert not check.ok
    assert check.problems == [
        f"the last checkpoint this server made ({copy}): the log holds 8 records, fewer than"
        " the 10 the checkpoint signed: records were cut off its end"
    ]


def test_the_start_check_refuses_a_checkpoint_row_the_key_did_not_sign() -> None:
    store, key = log_of(4), signer()
    forged = audit_tree.sign(signer(), 4, audit_tree.read_log(store).root(), 1.0)
    with store.unit_of_work() as uow:
        uow.add_checkpoint(forged)
    check = audit_tree.check_log(store, origin=ORIGIN, verifier=key.verifier)
    assert not check.ok and "no signature by a known key" in check.problems[0]
    # Without the key, only the tree is checked.
    assert audit_tree.check_log(store, origin=None, verifier=None).ok
    # A row whose columns say another size than its note.
    store._data.checkpoints.clear()
    real = audit_tree.sign(key, 4, audit_tree.read_log(store).root(), 1.0)
    with store.unit_of_work() as uow:
        uow.add_checkpoint(dataclasses.replace(real, size=3))
    check = audit_tree.check_log(store, origin=ORIGIN, verifier=key.verifier)
    assert not check.ok and "does not say what its signed note says" in check.problems[0]


def test_checkpoint_now_signs_only_a_log_that_extends_the_last_one() -> None:
    store, key = log_of(6), signer()
    first = audit_tree.checkpoint_now(store, key, now=1.0)
    checkpoint = open_checkpoint(first.note, key.verifier)
    assert (checkpoint.origin, checkpoint.size) == (ORIGIN, 6)
    assert base64.b64encode(checkpoint.root).decode() in first.note
    assert audit_tree.checkpoint_now(store, key) == first  # nothing new: the same one
    append(store, 2)
    assert audit_tree.checkpoint_now(store, key).size == 8
    rewrite(store, rechained(store._data.audit[:5]))
    with pytest.raises(audit_tree.CheckpointRefused, match="cut off"):
        audit_tree.checkpoint_now(store, key)
    rewrite(store, store._data.audit[:3] + store._data.audit[4:])
    with pytest.raises(audit_tree.CheckpointRefused, match="broken at record 5: expected record 4"):
        audit_tree.checkpoint_now(store, key)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def checkpointer(store: MemoryStore, key: Signer, clock: Clock) -> audit_tree.Checkpointer:
    log = audit_tree.read_log(store)
    return audit_tree.Checkpointer(
        store, key, log.compact(), log.chain.head, every=10, interval_s=60, clock=clock
    )


def test_the_checkpointer_signs_every_n_records_or_t_seconds(tmp_path: Path) -> None:
    store, key, clock = log_of(3), signer(), Clock()
    copy = tmp_path / "copy.txt"
    cp = audit_tree.Checkpointer(
        store, key, merkle.CompactRange(), audit_chain.GENESIS_HASH, every=10, interval_s=60,
        copy_file=copy, clock=clock,
    )  # fmt: skip
    first = cp.tick()  # no checkpoint yet: the first is made at once
    assert first is not None and first.size == 3 and copy.read_text() == first.note
    assert cp.tick() is None
    append(store, 9)
    clock.now += 30
    assert cp.tick() is None  # 9 waiting, 30 s: not yet
    append(store, 1)
    made = cp.tick()
    assert made is not None and made.size == 13  # 10 waiting
    append(store, 1)
    clock.now += 59
    assert cp.tick() is None
    clock.now += 1
    made = cp.tick()
    assert made is not None and made.size == 14  # 60 s since the last
    log = audit_tree.read_log(store)
    assert made.root == log.root().hex()
    assert open_checkpoint(made.note, key.verifier).root == log.root()
    append(store, 2)
    cp.close()  # a last one for what is committed
    assert store._data.audit and cp.last is not None and cp.last.size == 16
    assert copy.read_text() == cp.last.note


def test_two_checkpointers_on_one_store_store_one_checkpoint_per_size() -> None:
    store, key, clock = log_of(12), signer(), Clock()
    a, b = checkpointer(store, key, clock), checkpointer(store, key, clock)
    assert a.tick() is not None
    assert b.tick() is None  # a's is the latest: not due
    append(store, 1)
    clock.now += 60
    # Both sign size 13 at once: the same note (Ed25519 is deterministic), stored once.
    root = audit_tree.read_log(store).root()
    made_a, made_b = (audit_tree.sign(key, 13, root, clock.now) for _ in "ab")
    assert made_a.note == made_b.note
    with store.unit_of_work() as uow:
        assert uow.add_checkpoint(made_a)
    assert b.tick() is None  # b finds 13 signed: nothing due
    with store.unit_of_work() as uow:
        assert not uow.add_checkpoint(made_b)
    assert sorted(c.size for c in store._data.checkpoints.values()) == [12, 13]


def test_the_checkpointer_stops_signing_when_the_log_stops_being_a_chain() -> None:
    store, key, clock = log_of(5), signer(), Clock()
    cp = checkpointer(store, key, clock)
    assert cp.tick() is not None
    append(store, 2)
    entries = store._data.audit
    entries[6] = dataclasses.replace(entries[6], prev_hash="f" * 64)
    assert cp.tick(force=True) is None
    assert "record 7" in cp.broken
    assert max(c.size for c in store._data.checkpoints.values()) == 5
