"""The kill switch in the store (store/base.py: delete_tool, set_tool_disabled,
open_requests_for_tool, void_request) means the same in the in-memory store,
SQLite and PostgreSQL; on PostgreSQL every change of a tool is announced to
the other servers, on commit only."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from registry_server.store.base import (
    CONSUMED,
    PENDING,
    VOIDED,
    Store,
    StoredTool,
)
from registry_server.store.postgres import PostgresStore
from tests.cluster.test_store_contract import record

NOW = 1_000_000.0
TOOL = StoredTool("t", "{}", "d1", "owner")


def stored(store: Store, name: str = "t") -> StoredTool | None:
    with store.reading() as reads:
        return reads.tool(name)


def test_a_tool_is_disabled_with_its_reason_and_enabled_again(store: Store) -> None:
    with store.unit_of_work() as uow:
        uow.put_tool(TOOL, NOW)
        assert not uow.set_tool_disabled("nope", True, "why", NOW)
    assert stored(store) == TOOL  # created enabled, no tokens refused
    with store.unit_of_work() as uow:
        assert uow.set_tool_disabled("t", True, "leaks data", NOW + 5)
    assert stored(store) == replace(
        TOOL, disabled=True, disabled_reason="leaks data", tokens_not_before=NOW + 5
    )
    with store.unit_of_work() as uow:  # a replacement keeps the switch as stored
        uow.put_tool(StoredTool("t", '{"x":1}', "d2", "owner"), NOW + 6)
    with store.reading() as reads:
        assert reads.tools() == [
            StoredTool("t", '{"x":1}', "d2", "owner", True, "leaks data", NOW + 5)
        ]
    with store.unit_of_work() as uow:
        assert uow.set_tool_disabled("t", False, "", NOW + 7)
    # enabled again; tokens issued before the disabling stay refused
    assert stored(store) == StoredTool("t", '{"x":1}', "d2", "owner", False, "", NOW + 5)


def test_a_deleted_name_is_registered_again_as_a_new_tool(store: Store) -> None:
    with store.unit_of_work() as uow:
        uow.put_tool(TOOL, NOW)
        uow.put_tool(StoredTool("other", "{}", "d", "o"), NOW)
        assert uow.set_tool_disabled("t", True, "bad", NOW + 1)
    with store.unit_of_work() as uow:
        assert uow.delete_tool("t", NOW + 10)
        assert not uow.delete_tool("t", NOW + 11)  # gone already
        assert not uow.delete_tool("never", NOW + 11)
    with store.reading() as reads:
        assert [t.name for t in reads.tools()] == ["other"]
        assert reads.tool("t") is None
    with store.unit_of_work() as uow:
        uow.put_tool(TOOL, NOW + 20)
    # enabled, and no token issued before the deletion counts for it
    assert stored(store) == replace(TOOL, tokens_not_before=NOW + 10)
    assert stored(store, "other") == StoredTool("other", "{}", "d", "o")


def test_a_rolled_back_deletion_deletes_nothing(store: Store) -> None:
    with store.unit_of_work() as uow:
        uow.put_tool(TOOL, NOW)
    with pytest.raises(RuntimeError), store.unit_of_work() as uow:
        assert uow.delete_tool("t", NOW + 1)
        raise RuntimeError("after the deletion")
    assert stored(store) == TOOL
    with store.unit_of_work() as uow:  # and it left no deletion time behind
        assert uow.delete_tool("t", NOW + 2)
        uow.put_tool(TOOL, NOW + 3)
    assert stored(store) == replace(TOOL, tokens_not_before=NOW + 2)


def test_open_requests_of_a_tool_are_voided_with_the_reason(store: Store) -> None:
    other = replace(record("r4", created=NOW + 3), tool_name="u")
    with store.unit_of_work() as uow:
        uow.add_request(record("r2", created=NOW + 2))
        uow.add_request(record("r1", created=NOW + 1))
        uow.add_request(record("r3", created=NOW, expires=NOW + 5))  # expires first
        uow.add_request(record("used", created=NOW))
        uow.add_request(other)
        assert uow.consume_request("used", NOW)
    with store.reading() as reads:
        assert reads.open_requests_for_tool("t", NOW) == ["r3", "r1", "r2"]
        assert reads.open_requests_for_tool("t", NOW + 5) == ["r1", "r2"]  # r3 expired
        assert reads.open_requests_for_tool("none", NOW) == []
    with store.unit_of_work() as uow:
        assert uow.void_request("r1", "tool 't' was deleted: compromised", NOW)
        assert not uow.void_request("r1", "again", NOW)  # final
        assert not uow.void_request("used", "x", NOW)
        assert not uow.void_request("r3", "x", NOW + 6)  # expired: the sweep's
    with store.reading() as reads:
        voided = reads.request("r1")
        assert voided is not None
        assert (voided.state, voided.voided_reason) == (VOIDED, "tool 't' was deleted: compromised")
        assert [r.id for r in reads.requests(state=VOIDED, now=NOW, limit=10)] == ["r1"]
        assert reads.requests(state=VOIDED, now=NOW, limit=10)[0].voided_reason.endswith(
            "compromised"
        )
        assert reads.open_requests_for_tool("t", NOW) == ["r3", "r2"]
        assert {r.id: r.state for r in reads.requests(state="", now=NOW, limit=10)}["used"] == (
            CONSUMED
        )
        assert (
            reads.open_request_for(
                tool_name="t", tool_digest="d", arguments_digest="ad", requested_by="agent", now=NOW
            )
            == "r2"
        )  # a voided request is not the open one
        assert reads.open_requests_of("agent", NOW) == 3  # r2, r3 and u's r4 are pending
        r2 = reads.request("r2")
        assert r2 is not None and r2.state == PENDING


def test_postgres_announces_tool_changes_on_commit(database: str) -> None:
    writer, listener = PostgresStore(database), PostgresStore(database)
    heard: list[str | None] = []
    ready = threading.Event()

    def on_change(name: str | None) -> None:
        heard.append(name)
        ready.set()

    try:
        listener.watch_tools(on_change)
        assert ready.wait(10)  # the (re)connect reload: None
        with writer.unit_of_work() as uow:
            uow.put_tool(TOOL, NOW)
        with pytest.raises(RuntimeError), writer.unit_of_work() as uow:
            assert uow.delete_tool("t", NOW + 1)
            raise RuntimeError("rolled back: never announced")
        with writer.unit_of_work() as uow:
            assert uow.set_tool_disabled("t", True, "r", NOW + 2)
        with writer.unit_of_work() as uow:
            assert uow.set_tool_disabled("t", False, "", NOW + 3)
        with writer.unit_of_work() as uow:
            assert uow.delete_tool("t", NOW + 4)
        with writer.unit_of_work() as uow:
            uow.put_tool(StoredTool("u", "{}", "d", "o"), NOW + 5)  # a marker: all came before
        pause = threading.Event()
        for _ in range(100):
            if "u" in heard:
                break
            pause.wait(0.05)
        assert heard == [None, "t", "t", "t", "t", "u"]
    finally:
        listener.close()
        writer.close()
