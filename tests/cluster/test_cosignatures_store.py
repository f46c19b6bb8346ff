"""Witnesses' cosignatures of the audit log's checkpoints in every store
(memory, SQLite, PostgreSQL): one per witness key and checkpoint (the first
kept), listed per checkpoint, and each witness key's latest."""

from __future__ import annotations

from registry_server.store.base import CosignatureRecord, Store

LOG = "toolreg.example/log"


def cosignature(
    witness: str, size: int, key_id: str = "0a0b0c0d", at: int = 1
) -> CosignatureRecord:
    return CosignatureRecord(LOG, size, f"{size:064x}", witness, key_id,
                             f"\u2014 {witness} AAAA{size}", at)  # fmt: skip


def test_cosignatures_are_kept_per_witness_key_and_checkpoint(store: Store) -> None:
    with store.reading() as reads:
        assert reads.cosignatures(LOG, 10) == [] and reads.latest_cosignatures(LOG) == []
    with store.unit_of_work() as uow:
        assert uow.add_cosignature(cosignature("w2.example", 10))
        assert uow.add_cosignature(cosignature("w1.example", 10))
        assert not uow.add_cosignature(cosignature("w1.example", 10, at=2))  # the first kept
        assert uow.add_cosignature(cosignature("w1.example", 20))
        assert uow.add_cosignature(cosignature("w1.example", 15))  # late: not the latest
        assert uow.add_cosignature(cosignature("w1.example", 5, key_id="ffffffff"))  # a new key
        other = CosignatureRecord("other/log", 99, "00" * 32, "w1.example", "0a0b0c0d", "x", 1)
        assert uow.add_cosignature(other)
    with store.reading() as reads:
        at_10 = reads.cosignatures(LOG, 10)
        assert [(c.witness, c.cosigned_at) for c in at_10] == [("w1.example", 1),
                                                               ("w2.example", 1)]  # fmt: skip
        assert at_10[0] == cosignature("w1.example", 10)
        latest = reads.latest_cosignatures(LOG)
        assert [(c.witness, c.key_id, c.size) for c in latest] == [
            ("w1.example", "0a0b0c0d", 20), ("w1.example", "ffffffff", 5),
            ("w2.example", "0a0b0c0d", 10),
        ]  # fmt: skip
        assert [c.size for c in reads.latest_cosignatures("other/log")] == [99]
