"""SIEM export cursors and their leases in every store (memory, SQLite,
PostgreSQL): one exporter per destination at a time, a cursor that never
goes back, a lapsed or released lease taken over; and on PostgreSQL, many
servers claiming one destination at once: exactly one holds it."""

from __future__ import annotations

import threading

from registry_server.store.base import Store
from registry_server.store.postgres import PostgresStore

SINK = "syslog:127.0.0.1:6514"


def test_one_exporter_holds_a_destination_until_its_lease_lapses_or_is_released(
    store: Store,
) -> None:
    with store.reading() as reads:
        assert reads.export_cursor(SINK) is None
    with store.unit_of_work() as uow:
        first = uow.claim_export(SINK, "a", 100.0, 110.0)
        assert first is not None and (first.seq, first.owner) == (0, "a")
        assert uow.claim_export(SINK, "b", 105.0, 115.0) is None  # a's lease holds
        assert uow.claim_export("jsonl:/var/log/x.jsonl", "b", 105.0, 115.0) is not None
    with store.unit_of_work() as uow:
        assert uow.advance_export(SINK, "a", 40, 106.0, 116.0)
        assert not uow.advance_export(SINK, "b", 90, 106.0, 116.0)  # not b's to move
        assert uow.advance_export(SINK, "a", 30, 107.0, 117.0)  # never back
        renewed = uow.claim_export(SINK, "a", 108.0, 118.0)
        assert renewed is not None and renewed.seq == 40 and renewed.lease_until == 118.0
    with store.unit_of_work() as uow:  # a died: once its lease lapses, b takes over
        assert uow.claim_export(SINK, "b", 117.0, 127.0) is None
        taken = uow.claim_export(SINK, "b", 118.0, 128.0)
        assert taken is not None and (taken.seq, taken.owner) == (40, "b")
        assert not uow.advance_export(SINK, "a", 50, 119.0, 129.0)  # a's late write: refused
    with store.unit_of_work() as uow:
        uow.release_export(SINK, "a")  # not a's: changes nothing
        assert uow.claim_export(SINK, "c", 120.0, 130.0) is None
        uow.release_export(SINK, "b")  # b stops: c takes over at once
        held = uow.claim_export(SINK, "c", 120.0, 130.0)
        assert held is not None and (held.seq, held.owner) == (40, "c")
    with store.reading() as reads:
        cursor = reads.export_cursor(SINK)
        assert cursor is not None and (cursor.seq, cursor.owner, cursor.updated_at) == (
            40, "c", 107.0,
        )  # fmt: skip


def test_servers_claiming_one_destination_at_once_on_postgresql(database: str) -> None:
    stores = [PostgresStore(database) for _ in range(6)]
    won: list[str] = []
    barrier = threading.Barrier(len(stores))

    def claim(store: Store, owner: str) -> None:
        barrier.wait()
        with store.unit_of_work() as uow:
            if uow.claim_export(SINK, owner, 100.0, 200.0) is not None:
                won.append(owner)

    try:
        threads = [threading.Thread(target=claim, args=(s, f"server-{n}"))
                   for n, s in enumerate(stores)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(won) == 1
        with stores[0].reading() as reads:
            cursor = reads.export_cursor(SINK)
        assert cursor is not None and cursor.owner == won[0]
    finally:
        for s in stores:
            s.close()
