"""Kept calls (store/base.py: put, read, prune; execution/call_relay.py
publishes them) mean the same in the in-memory store, SQLite and PostgreSQL."""

from __future__ import annotations

from dataclasses import replace

from registry_server.store.base import KeptCallRecord, Store

NOW = 1_000_000.0


def kept(execution_id: str = "a" * 32, **overrides: object) -> KeptCallRecord:
    base = KeptCallRecord(
        execution_id=execution_id, caller="agent", server="s1", stdout=b"one\n\x00\xff",
        stderr=b"", result_json="", beat_at=NOW,
    )  # fmt: skip
    return replace(base, **overrides)  # type: ignore[arg-type]


def test_a_call_is_published_replaced_by_its_server_only_and_read_back(store: Store) -> None:
    with store.reading() as reads:
        assert reads.kept_call("a" * 32) is None
    with store.unit_of_work() as uow:
        uow.put_kept_call(kept())
    ended = kept(stdout=b"one\ntwo\n", stderr=b"err", result_json='{"status":"OK"}',
                 beat_at=NOW + 1, ended_at=NOW + 1)  # fmt: skip
    with store.unit_of_work() as uow:
        uow.put_kept_call(ended)
        # Another server may never overwrite a call it does not run.
        uow.put_kept_call(kept(server="s2", stdout=b"forged", beat_at=NOW + 2))
    with store.reading() as reads:
        assert reads.kept_call("a" * 32) == ended


def test_prune_removes_calls_ended_or_silent_before_the_horizon(store: Store) -> None:
    with store.unit_of_work() as uow:
        uow.put_kept_call(kept("1" * 32, ended_at=NOW - 100, result_json="{}"))  # ended long ago
        uow.put_kept_call(kept("2" * 32, beat_at=NOW - 100))  # its server went silent
        uow.put_kept_call(kept("3" * 32, ended_at=NOW, result_json="{}"))  # ended just now
        uow.put_kept_call(kept("4" * 32, beat_at=NOW))  # running
    with store.unit_of_work() as uow:
        assert uow.prune_kept_calls(NOW - 10, 1) == 1  # bounded per call
        assert uow.prune_kept_calls(NOW - 10, 100) == 1
    with store.reading() as reads:
        left = [i for i in "1234" if reads.kept_call(i * 32) is not None]
    assert left == ["3", "4"]
