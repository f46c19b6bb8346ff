"""Group commit of audit records (registry_server/store/group_commit.py):
records waiting while a commit is under way go in the next one together; a
batch commits whole or not at all, and every caller in it hears the outcome."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from registry_server.domain.errors import StoreError
from registry_server.store import audit_chain
from registry_server.store.group_commit import AuditAppender
from registry_server.store.memory import MemoryStore

WAIT_S = 5.0


class CountingStore(MemoryStore):
    """Counts units of work; the first one can be held open, or any made to fail."""

    def __init__(self) -> None:
        super().__init__()
        self.units = 0
        self.hold_first = threading.Event()
        self.hold_first.set()
        self.first_entered = threading.Event()
        self.fail = False

    @contextmanager
    def unit_of_work(self) -> Iterator[Any]:
        self.units += 1
        if self.units == 1:
            self.first_entered.set()
            assert self.hold_first.wait(WAIT_S)
        with super().unit_of_work() as uow:
            yield uow
            if self.fail:
                raise StoreError("store /data/toolreg.db: database or disk is full")


def _append_in_threads(
    appender: AuditAppender, count: int
) -> tuple[list[int], list[BaseException]]:
    seqs: list[int] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            seqs.append(appender.append("execution", {"call": i}))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    return seqs, errors


def test_a_record_alone_is_written_at_once_in_its_own_commit() -> None:
    store = CountingStore()
    appender = AuditAppender(store)
    assert appender.append("execution", {"call": 1}) == 1
    assert appender.append("execution", {"call": 2}) == 2
    assert store.units == 2
    assert audit_chain.verify(store).ok


def _behind_a_held_commit(
    store: CountingStore, appender: AuditAppender, count: int
) -> tuple[list[int], list[BaseException]]:
    """One record's commit is held open while ``count`` more queue up behind it;
    then it goes. What the ``count`` callers got back."""
    store.hold_first.clear()
    first = threading.Thread(target=appender.append, args=("execution", {"call": "first"}))
    first.start()
    assert store.first_entered.wait(WAIT_S)
    results: list[tuple[list[int], list[BaseException]]] = []
    waiting = threading.Thread(target=lambda: results.append(_append_in_threads(appender, count)))
    waiting.start()
    pause = threading.Event()
    while len(appender._waiting) < count and not pause.wait(0.01):
        pass
    store.hold_first.set()
    first.join(WAIT_S)
    waiting.join(WAIT_S)
    return results[0]


def test_records_waiting_behind_a_commit_share_the_next_one() -> None:
    store = CountingStore()
    seqs, errors = _behind_a_held_commit(store, AuditAppender(store), 8)
    assert errors == []
    assert sorted(seqs) == list(range(2, 10))
    assert store.units == 2  # the held one, then all eight together
    verdict = audit_chain.verify(store)
    assert verdict.ok and verdict.records == 9


def test_a_batch_that_cannot_be_stored_fails_every_caller_in_it_and_stores_nothing() -> None:
    store = CountingStore()
    appender = AuditAppender(store)
    store.fail = True
    seqs, errors = _append_in_threads(appender, 4)
    assert seqs == []
    assert len(errors) == 4 and all(isinstance(e, StoreError) for e in errors)
    assert "disk is full" in str(errors[0])
    assert audit_chain.verify(store).records == 0
    store.fail = False
    assert appender.append("execution", {"call": "after"}) == 1  # the appender lives on


def test_batches_are_capped() -> None:
    store = CountingStore()
    seqs, errors = _behind_a_held_commit(store, AuditAppender(store, max_batch=3), 7)
    assert errors == [] and sorted(seqs) == list(range(2, 9))
    assert store.units == 1 + 3  # 7 waiting records in batches of 3, 3 and 1


@pytest.mark.parametrize("count", [1, 16])
def test_every_caller_gets_its_own_seq(count: int) -> None:
    store = CountingStore()
    appender = AuditAppender(store)
    seqs, errors = _append_in_threads(appender, count)
    assert errors == [] and sorted(seqs) == list(range(1, count + 1))
    with store.reading() as reads:
        assert [e.seq for e in reads.audit_entries()] == list(range(1, count + 1))
