"""The store interface (registry_server/store/base.py) means the same in every
implementation: the in-memory store, SQLite and PostgreSQL answer each
question alike."""

from __future__ import annotations

import json
import time

import pytest

from registry_server.store import audit_chain
from registry_server.store.base import (
    APPROVED,
    CONSUMED,
    EXPIRED,
    PENDING,
    REJECTED,
    ApprovalEventRecord,
    ApprovalRequestRecord,
    IdentityRecord,
    Store,
    StoredTool,
)

NOW = 1_000_000.0


def record(rid: str, *, by: str = "agent", state: str = PENDING, created: float = NOW,
           expires: float = NOW + 100) -> ApprovalRequestRecord:  # fmt: skip
    manifest = json.dumps({"name": "t", "parameters": {"type": "object", "minProperties": 1}})
    return ApprovalRequestRecord(
        id=rid, tool_name="t", tool_digest="d", arguments_json='{"a":1}',
        arguments_digest="ad", requested_by=by, approvals_required=1, state=state,
        created_at=created, expires_at=expires, tool_manifest=manifest, tool_owner="o",
    )  # fmt: skip


def test_tools_are_stored_replaced_and_listed_by_name(store: Store) -> None:
    with store.unit_of_work() as uow:
        uow.put_tool(StoredTool("b", "{}", "d1", "o1"), NOW)
        uow.put_tool(StoredTool("a", "{}", "d2", "o2"), NOW)
    with store.unit_of_work() as uow:
        uow.put_tool(StoredTool("b", '{"x":1}', "d3", "o3"), NOW + 1)
    with store.reading() as reads:
        assert reads.tools() == [
            StoredTool("a", "{}", "d2", "o2"),
            StoredTool("b", '{"x":1}', "d3", "o3"),
        ]
        assert reads.tool("b") == StoredTool("b", '{"x":1}', "d3", "o3")
        assert reads.tool("c") is None


def test_a_failed_unit_of_work_stores_nothing(store: Store) -> None:
    with pytest.raises(RuntimeError), store.unit_of_work() as uow:
        uow.put_tool(StoredTool("a", "{}", "d", "o"), NOW)
        audit_chain.append(uow, "registration", {"tool": "a"})
        assert uow.use_jti("j", "alice", "e", NOW)
        raise RuntimeError("after the writes")
    with store.reading() as reads:
        assert (reads.tools(), reads.audit_entries(), reads.jti_used("j")) == ([], [], False)


def test_a_jti_is_spent_once(store: Store) -> None:
    with store.unit_of_work() as uow:
        assert uow.use_jti("j", "alice", "e1", NOW) is True
    with store.unit_of_work() as uow:
        assert uow.use_jti("j", "alice", "e2", NOW) is False
    with store.reading() as reads:
        assert reads.jti_used("j") and not reads.jti_used("k")


def test_requests_states_listing_and_consumption(store: Store) -> None:
    with store.unit_of_work() as uow:
        uow.add_request(record("r1", created=NOW - 3))
        uow.add_request(record("r2", created=NOW - 2, expires=NOW - 1))  # expired
        uow.add_request(record("r3", created=NOW - 1, by="agent2"))
        uow.put_approval_token("r1", "bob", "j1", "token-b", NOW + 50)
        uow.put_approval_token("r1", "alice", "j2", "token-a", NOW + 50)
        uow.put_approval_token("r1", "alice", "j3", "token-a2", NOW + 60)  # replaces
        uow.mark_approved("r1")
        uow.mark_approved("r2")
    with store.reading() as reads:
        assert reads.approvers_of("r1") == ["alice", "bob"]
        assert reads.tokens_of("r1") == ["token-a2", "token-b"]
        assert [r.id for r in reads.requests(state="", now=NOW, limit=10)] == ["r3", "r2", "r1"]
        assert [r.id for r in reads.requests(state="", now=NOW, limit=2)] == ["r3", "r2"]
        assert [r.id for r in reads.requests(state=APPROVED, now=NOW, limit=10)] == ["r1"]
        assert [r.id for r in reads.requests(state=EXPIRED, now=NOW, limit=10)] == ["r2"]
        assert [r.id for r in reads.requests(state=PENDING, now=NOW, limit=10)] == ["r3"]
        listed = reads.requests(state=PENDING, now=NOW, limit=1)[0]
        assert listed.arguments_json == ""
        assert json.loads(listed.tool_manifest)["parameters"] == {"type": "object"}
        full = reads.request("r3")
        assert full is not None and full.arguments_json == '{"a":1}'
        assert reads.open_requests_of("agent", NOW) == 0  # r1 approved, r2 expired
        assert reads.open_requests_of("agent2", NOW) == 1
        args = {"tool_name": "t", "tool_digest": "d", "arguments_digest": "ad", "now": NOW}
        assert reads.open_request_for(requested_by="agent2", **args) == "r3"  # type: ignore[arg-type]
        # r1 is approved and unused: still the request for this call (r2 expired)
        assert reads.open_request_for(requested_by="agent", **args) == "r1"  # type: ignore[arg-type]
    with store.unit_of_work() as uow:
        assert uow.consume_request("r1", NOW) is True
        assert uow.consume_request("r1", NOW) is False  # already consumed
        assert uow.consume_request("r2", NOW) is False  # expired
        assert uow.consume_request("nope", NOW) is False
    with store.reading() as reads:
        consumed = reads.request("r1")
        assert consumed is not None and consumed.state_at(NOW) == CONSUMED
        assert [r.id for r in reads.requests(state=CONSUMED, now=NOW, limit=10)] == ["r1"]
        args = {"tool_name": "t", "tool_digest": "d", "arguments_digest": "ad", "now": NOW}
        assert reads.open_request_for(requested_by="agent", **args) is None  # type: ignore[arg-type]


def test_rejection_expiry_and_events(store: Store) -> None:
    args = {"tool_name": "t", "tool_digest": "d", "arguments_digest": "ad", "now": NOW}
    with store.unit_of_work() as uow:
        uow.add_request(record("r1", created=NOW - 3))
        uow.add_request(record("r2", created=NOW - 2, expires=NOW - 1))  # due to expire
        uow.add_request(record("r3", created=NOW - 1))
        uow.mark_approved("r3")
    with store.unit_of_work() as uow:
        assert uow.reject_request("r1", "bob", "not today", NOW) is True
        assert uow.reject_request("r1", "alice", "again", NOW) is False  # final
        assert uow.reject_request("r2", "bob", "late", NOW) is False  # expired
        assert uow.consume_request("r1", NOW) is False
    with store.reading() as reads:
        rejected = reads.request("r1")
        assert rejected is not None
        assert (rejected.state, rejected.rejected_by, rejected.rejection_reason) == (
            REJECTED, "bob", "not today",
        )  # fmt: skip
        assert rejected.state_at(NOW + 1_000) == REJECTED  # stays rejected past its expiry
        assert [r.id for r in reads.requests(state=REJECTED, now=NOW, limit=10)] == ["r1"]
        assert reads.rejected_request_for(requested_by="agent", **args) == "r1"  # type: ignore[arg-type]
        later = {**args, "now": NOW + 100}
        assert reads.rejected_request_for(requested_by="agent", **later) is None  # type: ignore[arg-type]
        assert reads.expired_open_requests(NOW, 10) == ["r2"]
        assert reads.expired_open_requests(NOW + 100, 10) == ["r2", "r3"]
    with store.unit_of_work() as uow:
        assert uow.expire_request("r2", NOW) is True
        assert uow.expire_request("r2", NOW) is False  # once
        assert uow.expire_request("r3", NOW) is False  # not due yet
    with store.reading() as reads:
        assert reads.expired_open_requests(NOW, 10) == []
        assert [r.id for r in reads.requests(state=EXPIRED, now=NOW, limit=10)] == ["r2"]
        assert reads.last_event_seq() == 0
    with store.unit_of_work() as uow:
        for seq, kind in ((3, "OPENED"), (7, "REJECTED"), (9, "EXPIRED")):
            uow.add_event(ApprovalEventRecord(seq, "r1", kind, "bob", "why", NOW + seq))
    with store.reading() as reads:
        assert [e.seq for e in reads.events_after(0, 10)] == [3, 7, 9]
        assert reads.events_after(3, 1) == [
            ApprovalEventRecord(7, "r1", "REJECTED", "bob", "why", NOW + 7)
        ]
        assert reads.last_event_seq() == 9


def test_the_audit_chain_appends_and_verifies(store: Store) -> None:
    for n in range(5):
        with store.unit_of_work() as uow:
            assert audit_chain.append(uow, "execution", {"n": n, "at": time.time()}) == n + 1
    verdict = audit_chain.verify(store)
    assert verdict.ok and verdict.records == 5
    assert [e["record"]["n"] for e in audit_chain.tail(store, 2)] == [3, 4]
    with store.reading() as reads:
        assert reads.audit_tail(0) == []
        assert [e.seq for e in reads.audit_entries()] == [1, 2, 3, 4, 5]


def test_requests_page_by_created_at_then_id_newest_first(store: Store) -> None:
    """The keyset of ListApprovalRequests' pages: (created_at, id) descending,
    the next page strictly below the last key, ties on created_at broken by id,
    alike in every store; filtered by state and requester in the store."""
    made = [
        record(f"r{i:02d}", created=NOW - i // 3, by="agent" if i % 2 else "agent2",
               state=APPROVED if i % 5 == 0 else PENDING,
               expires=NOW - 1 if i == 7 else NOW + 100)
        for i in range(20)
    ]  # fmt: skip
    with store.unit_of_work() as uow:
        for r in made:
            uow.add_request(r)
    order = [r.id for r in sorted(made, key=lambda r: (r.created_at, r.id), reverse=True)]
    with store.reading() as reads:

        def pages(size: int, **kw: object) -> list[list[str]]:
            out: list[list[str]] = []
            before: tuple[float, str] | None = None
            while True:
                found = reads.requests(now=NOW, limit=size, before=before, **kw)  # type: ignore[arg-type]
                out.append([r.id for r in found])
                if len(found) < size:
                    return out
                before = (found[-1].created_at, found[-1].id)

        assert [i for p in pages(1, state="") for i in p] == order
        assert [i for p in pages(7, state="") for i in p] == order
        assert [len(p) for p in pages(7, state="")] == [7, 7, 6]
        by_agent = [r.id for r in made if r.requested_by == "agent"]
        want = [i for i in order if i in by_agent]
        assert [i for p in pages(3, state="", requested_by="agent") for i in p] == want
        pending = [i for i in order if i not in ("r00", "r05", "r10", "r15", "r07")]
        assert [i for p in pages(4, state=PENDING) for i in p] == pending
        expired = reads.requests(state=EXPIRED, now=NOW, limit=10, before=(NOW, "r99"))
        assert [r.id for r in expired] == ["r07"]
        # a key between rows: strictly below it, ties by id
        tie = [r.id for r in reads.requests(state="", now=NOW, limit=3, before=(NOW - 1, "r04"))]
        assert tie == ["r03", "r08", "r07"]
        assert reads.requests(state="", now=NOW, limit=5, before=(NOW - 100, "")) == []
        assert reads.requests(state="", now=NOW, limit=5, requested_by="nobody") == []
        listed = reads.requests(state="", now=NOW, limit=1, before=(NOW, "r01"))[0]
        assert listed.id == "r00" and listed.arguments_json == ""  # the listed form


def test_a_secret_is_kept_by_the_first_to_store_it(store: Store) -> None:
    with store.unit_of_work() as uow:
        assert uow.keep_secret("page_tokens", "aa" * 32, NOW) == "aa" * 32
    with store.unit_of_work() as uow:
        assert uow.keep_secret("page_tokens", "bb" * 32, NOW + 1) == "aa" * 32
        assert uow.keep_secret("other", "cc", NOW) == "cc"
    with pytest.raises(RuntimeError), store.unit_of_work() as uow:
        uow.keep_secret("rolled_back", "dd", NOW)
        raise RuntimeError("after the write")
    with store.unit_of_work() as uow:
        assert uow.keep_secret("rolled_back", "ee", NOW) == "ee"


def identity(client_id: str, groups: tuple[str, ...], issued: float, seen: float,
             subject: str = "bob") -> IdentityRecord:  # fmt: skip
    return IdentityRecord(client_id, "corp", subject, groups, issued, issued + 300, seen, seen)


def test_remembered_identities_keep_the_newest_token_and_move_last_seen_forward(
    store: Store,
) -> None:
    with store.unit_of_work() as uow:
        uow.put_identity(identity("corp.bob", ("agents", "builders"), 10.0, NOW))
    with store.unit_of_work() as uow:
        # A newer token, seen later: its groups (bob left "builders"); first_seen kept.
        uow.put_identity(identity("corp.bob", ("agents",), 20.0, NOW + 50))
    with store.unit_of_work() as uow:
        # An older token seen later still (another server, a token still valid):
        # last_seen moves, the groups stay the newest token's.
        uow.put_identity(identity("corp.bob", ("agents", "ops"), 15.0, NOW + 90))
    with store.unit_of_work() as uow:
        # A write that arrives late (seen earlier): last_seen does not go back.
        uow.put_identity(identity("corp.bob", ("agents",), 20.0, NOW + 60))
    with store.reading() as reads:
        assert reads.identity("corp.bob") == IdentityRecord(
            "corp.bob", "corp", "bob", ("agents",), 20.0, 320.0, NOW, NOW + 90
        )
        assert reads.identity("corp.nobody") is None


def test_remembered_identities_are_listed_by_id_and_forgotten(store: Store) -> None:
    with store.unit_of_work() as uow:
        for name in ("carol", "alice", "bob"):
            uow.put_identity(identity(f"corp.{name}", (), 1.0, NOW, subject=name))
    with store.reading() as reads:
        assert [r.client_id for r in reads.identities("", 2)] == ["corp.alice", "corp.bob"]
        assert [r.client_id for r in reads.identities("corp.bob", 10)] == ["corp.carol"]
        assert reads.identity("corp.alice") == identity("corp.alice", (), 1.0, NOW, "alice")
    with store.unit_of_work() as uow:
        assert uow.forget_identity("corp.bob") is True
        assert uow.forget_identity("corp.bob") is False
    with pytest.raises(RuntimeError), store.unit_of_work() as uow:
        uow.forget_identity("corp.alice")
        raise RuntimeError("rolled back")
    with store.reading() as reads:
        assert [r.client_id for r in reads.identities("", 10)] == ["corp.alice", "corp.carol"]
