"""The webhook outbox (store/base.py: add, claim, finish, prune) means the same
in the in-memory store, SQLite and PostgreSQL; on PostgreSQL, servers that
claim at the same moment never get the same row."""

from __future__ import annotations

import threading
from dataclasses import replace

from registry_server.store.base import (
    DELIVERED,
    DELIVERY_FAILED,
    DELIVERY_PENDING,
    Store,
    WebhookBacklog,
    WebhookDeliveryRecord,
)
from registry_server.store.postgres import PostgresStore

NOW = 1_000_000.0


def delivery(seq: int, endpoint: str = "chat", due: float = NOW) -> WebhookDeliveryRecord:
    return WebhookDeliveryRecord(
        event_seq=seq, endpoint=endpoint, webhook_id=f"msg_{seq}_{endpoint}",
        payload='{"type":"approval.opened"}', created_at=NOW - 10, next_attempt_at=due,
    )  # fmt: skip


def test_deliveries_are_claimed_when_due_once_per_lease_and_finished(store: Store) -> None:
    with store.unit_of_work() as uow:
        uow.add_webhook_delivery(delivery(1))
        uow.add_webhook_delivery(delivery(1, "ops"))
        uow.add_webhook_delivery(delivery(2, due=NOW + 60))  # not due yet
    with store.reading() as reads:
        assert reads.webhook_backlog() == WebhookBacklog(3, NOW)
        assert reads.webhook_delivery(1, "ops") == delivery(1, "ops")
    with store.unit_of_work() as uow:
        claimed = uow.claim_webhook_deliveries("a", NOW, NOW + 30, 10)
    assert [(d.event_seq, d.endpoint, d.claimed_by, d.claim_until) for d in claimed] == [
        (1, "chat", "a", NOW + 30), (1, "ops", "a", NOW + 30),
    ]  # fmt: skip
    with store.unit_of_work() as uow:  # held by a: nobody else gets them meanwhile
        assert uow.claim_webhook_deliveries("b", NOW + 1, NOW + 31, 10) == []
    sent = replace(claimed[0], state=DELIVERED, attempts=1, delivered_at=NOW + 2)
    retry = replace(claimed[1], attempts=1, next_attempt_at=NOW + 40, last_error="HTTP 503")
    with store.unit_of_work() as uow:
        assert uow.finish_webhook_delivery(sent, "a")
        assert uow.finish_webhook_delivery(retry, "a")
        assert not uow.finish_webhook_delivery(sent, "a")  # done already
    with store.reading() as reads:
        done = reads.webhook_delivery(1, "chat")
        again = reads.webhook_delivery(1, "ops")
        assert reads.webhook_backlog() == WebhookBacklog(2, NOW + 40)
    assert done is not None and (done.state, done.attempts, done.delivered_at) == (
        DELIVERED, 1, NOW + 2,
    )  # fmt: skip
    assert again is not None and (again.state, again.last_error, again.claimed_by) == (
        DELIVERY_PENDING, "HTTP 503", "",
    )  # fmt: skip
    with store.unit_of_work() as uow:
        later = uow.claim_webhook_deliveries("b", NOW + 60, NOW + 90, 10)
    assert [(d.event_seq, d.endpoint) for d in later] == [(1, "ops"), (2, "chat")]


def test_a_lapsed_claim_is_taken_over_and_its_old_owner_cannot_finish(store: Store) -> None:
    with store.unit_of_work() as uow:
        uow.add_webhook_delivery(delivery(1))
        (first,) = uow.claim_webhook_deliveries("dead-server", NOW, NOW + 30, 10)
    with store.unit_of_work() as uow:
        (taken,) = uow.claim_webhook_deliveries("b", NOW + 31, NOW + 61, 10)
    assert taken.claimed_by == "b"
    with store.unit_of_work() as uow:
        assert not uow.finish_webhook_delivery(replace(first, state=DELIVERED), "dead-server")
        assert uow.finish_webhook_delivery(replace(taken, state=DELIVERY_FAILED), "b")


def test_only_finished_old_deliveries_are_pruned(store: Store) -> None:
    with store.unit_of_work() as uow:
        for seq in (1, 2, 3):
            uow.add_webhook_delivery(delivery(seq))
        claimed = uow.claim_webhook_deliveries("a", NOW, NOW + 30, 2)
        uow.finish_webhook_delivery(replace(claimed[0], state=DELIVERED), "a")
        uow.finish_webhook_delivery(replace(claimed[1], state=DELIVERY_FAILED), "a")
    with store.unit_of_work() as uow:
        assert uow.prune_webhook_deliveries(NOW - 20, 10) == 0  # not old enough
        assert uow.prune_webhook_deliveries(NOW, 10) == 2
    with store.reading() as reads:
        assert reads.webhook_backlog() == WebhookBacklog(1, NOW)


def test_servers_claiming_at_once_on_postgres_never_share_a_row(database: str) -> None:
    stores = [PostgresStore(database) for _ in range(3)]
    try:
        with stores[0].unit_of_work() as uow:
            for seq in range(1, 201):
                uow.add_webhook_delivery(delivery(seq))
        got: dict[str, list[int]] = {}
        start = threading.Barrier(len(stores))

        def claim(index: int) -> None:
            owner = f"server{index}"
            got[owner] = []
            start.wait()
            while True:
                with stores[index].unit_of_work() as uow:
                    batch = uow.claim_webhook_deliveries(owner, NOW, NOW + 30, 7)
                if not batch:
                    return
                got[owner] += [d.event_seq for d in batch]

        threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(stores))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        everything = sorted(seq for seqs in got.values() for seq in seqs)
        assert everything == list(range(1, 201))  # each row claimed once, none missed
    finally:
        for s in stores:
            s.close()


def test_the_claims_of_a_gone_server_are_given_back_at_once(store: Store) -> None:
    """What a server proved dead (notify/claimant.py) held is claimable before
    its lease lapses; nobody else's claims move."""
    with store.unit_of_work() as uow:
        for seq in (1, 2, 3):
            uow.add_webhook_delivery(delivery(seq))
        uow.claim_webhook_deliveries("dead-server", NOW, NOW + 70, 2)
        uow.claim_webhook_deliveries("live-server", NOW, NOW + 70, 1)
    with store.reading() as reads:
        assert reads.webhook_claimants(NOW + 1) == ["dead-server", "live-server"]
        assert reads.webhook_claimants(NOW + 70) == []  # lapsed claims hold nothing
    with store.unit_of_work() as uow:
        assert uow.release_webhook_claims("dead-server") == 2
        assert uow.release_webhook_claims("dead-server") == 0
        taken = uow.claim_webhook_deliveries("b", NOW + 1, NOW + 71, 10)
    assert [(d.event_seq, d.claimed_by) for d in taken] == [(1, "b"), (2, "b")]
    with store.reading() as reads:
        assert reads.webhook_claimants(NOW + 1) == ["b", "live-server"]
