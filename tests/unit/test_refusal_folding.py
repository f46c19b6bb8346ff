"""Refusals on the record (issue 37, item 1), the pure parts: folding
identical refusals into one record per interval with a fake clock, the
bounded table and its overflow groups (counts always add up), what a
record holds (never a credential), the reason codes of domain errors, the
peer address without its port, the tool only when it is a name, the
refusal log over the in-memory store (first of a burst at once, the rest at
the interval's end or at close), and each refusal record as its OCSF class."""

from __future__ import annotations

import json
import logging
from typing import Any

import grpc
import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.api import refusals as api_refusals
from registry_server.api.auth import Authenticator, AuthInterceptor
from registry_server.domain.errors import (
    AtCapacity,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    StoreError,
    Unauthenticated,
)
from registry_server.domain.refusals import (
    BEARER,
    OVERFLOW,
    UNKNOWN_CREDENTIAL,
    Folder,
    Refusal,
)
from registry_server.execution.refusal_log import KIND, RefusalLog
from registry_server.notify.siem import ocsf
from registry_server.store import audit_chain
from registry_server.store.memory import MemoryStore
from tests import ocsf_schema

pytestmark = pytest.mark.unit

INTERVAL = 10.0


class Clock:
    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def wrong_token(peer: str = "10.0.0.7", tool: str = "echo") -> Refusal:
    return Refusal(
        status="UNAUTHENTICATED",
        code="unknown_bearer_token",
        text="unknown bearer token",
        method="ExecuteTool",
        credential=BEARER,
        peer=peer,
        tool=tool,
    )


def missing_role(client: str = "reader", peer: str = "10.0.0.8") -> Refusal:
    return Refusal(
        status="PERMISSION_DENIED",
        code="missing_role",
        text=f"client '{client}' lacks the execute role for ExecuteTool",
        method="ExecuteTool",
        client=client,
        credential=BEARER,
        peer=peer,
        tool="echo",
    )


def total(records: list[dict[str, Any]]) -> int:
    return sum(int(r["count"]) for r in records)


def test_the_first_of_a_burst_is_written_at_once_and_the_rest_at_the_intervals_end() -> None:
    clock = Clock()
    folder = Folder(interval_s=INTERVAL, clock=clock)
    first = folder.add(wrong_token())
    assert first is not None
    assert (first["count"], first["first_at"], first["last_at"]) == (1, 1_000.0, 1_000.0)
    for i in range(99):
        clock.now = 1_000.0 + 0.05 * (i + 1)
        assert folder.add(wrong_token()) is None
    assert folder.due() == []  # the interval has not ended
    clock.now = 1_000.0 + INTERVAL
    (rest,) = folder.due()
    assert rest["count"] == 99
    assert (rest["first_at"], rest["last_at"]) == (1_000.05, pytest.approx(1_004.95))
    assert total([first, rest]) == 100
    assert folder.due() == [] and folder.drain() == []


def test_a_steady_flood_is_one_record_per_interval_and_a_quiet_group_is_dropped() -> None:
    clock = Clock()
    folder = Folder(interval_s=INTERVAL, clock=clock)
    records = []
    for step in range(500):  # 50 s of 10 refusals a second
        clock.now = 1_000.0 + step * 0.1
        written = folder.add(wrong_token())
        records += [written] if written else []
        records += folder.due()
    clock.now += INTERVAL
    records += folder.due()
    assert total(records) == 500
    assert len(records) <= 1 + 50 / INTERVAL + 1
    clock.now += INTERVAL
    assert folder.due() == [] and len(folder) == 0  # quiet: dropped
    assert folder.add(wrong_token()) is not None  # a new burst: written at once again


def test_refusals_fold_only_with_the_same_source_method_tool_and_reason() -> None:
    folder = Folder(interval_s=INTERVAL, clock=Clock())
    base = wrong_token()
    others = [
        wrong_token(peer="10.0.0.9"),
        wrong_token(tool="other_tool"),
        Refusal(**{**base.__dict__, "method": "ListTools", "tool": ""}),
        Refusal(**{**base.__dict__, "code": "malformed_authorization"}),
        missing_role(),
    ]
    assert folder.add(base) is not None
    for refusal in others:
        assert folder.add(refusal) is not None, refusal
    # the same peer with another credential kind is the same source: folded
    assert folder.add(Refusal(**{**base.__dict__, "credential": "idp_jwt"})) is None
    # a known client is counted by its id, whatever address it calls from
    assert folder.add(missing_role(peer="192.0.2.1")) is None
    assert len(folder) == 1 + len(others)


def test_the_table_is_bounded_and_overflow_groups_keep_the_counts() -> None:
    clock = Clock()
    folder = Folder(interval_s=INTERVAL, max_keys=3, clock=clock)
    records = []
    for n in range(1_000):  # a thousand addresses, two reasons
        refusal = wrong_token(peer=f"10.1.{n // 250}.{n % 250}")
        if n % 2:
            refusal = Refusal(**{**refusal.__dict__, "code": "malformed_authorization"})
        written = folder.add(refusal)
        records += [written] if written else []
        assert len(folder) <= 3 + 2  # the keys, and one overflow group per reason
    clock.now += INTERVAL
    records += folder.due()
    assert total(records) == 1_000
    overflow = [r for r in records if r.get("overflow")]
    assert {r["reason"]["code"] for r in overflow} == {
        "unknown_bearer_token",
        "malformed_authorization",
    }
    assert all(r["method"] == OVERFLOW and r["source"] == {"peer": OVERFLOW} for r in overflow)
    # distinct sources are counted up to the table's size, then said to be more
    assert [(r["count"], r["sources"], r.get("sources_capped")) for r in overflow] == [
        (1, 1, None),
        (1, 1, None),
        (498, 3, True),
        (497, 3, True),
    ]
    assert len(records) == 3 + 2 + 2  # three groups at once, each overflow group twice


def test_one_source_varying_tool_names_fills_its_own_share_not_the_table() -> None:
    clock = Clock()
    folder = Folder(interval_s=INTERVAL, max_per_source=4, clock=clock)
    written = [folder.add(wrong_token(tool=f"tool_{n}")) for n in range(100)]
    first = [r for r in written if r is not None]
    # four groups of its own, then its overflow group (no tool), written at once
    assert [r.get("tool") for r in first] == ["tool_0", "tool_1", "tool_2", "tool_3", None]
    assert first[-1]["method"] == OVERFLOW and first[-1]["source"] == {"peer": "10.0.0.7"}
    assert len(folder) == 5
    assert folder.add(wrong_token(peer="10.0.0.9", tool="tool_99")) is not None  # others: own
    clock.now += INTERVAL
    rest = folder.due()
    assert total(first) + total(rest) == 100
    assert total([r for r in rest if r["method"] == OVERFLOW]) == 95
    clock.now += INTERVAL
    assert folder.due() == [] and len(folder) == 0  # quiet: the source's share is free again
    assert (folder.add(wrong_token(tool="tool_50")) or {}).get("tool") == "tool_50"


def test_a_record_says_who_what_why_and_from_where_and_nothing_else() -> None:
    folder = Folder(interval_s=INTERVAL, clock=Clock())
    unknown = folder.add(wrong_token())
    assert unknown == {
        "status": "UNAUTHENTICATED",
        "who": UNKNOWN_CREDENTIAL,
        "credential": BEARER,
        "method": "ExecuteTool",
        "tool": "echo",
        "reason": {"code": "unknown_bearer_token", "text": "unknown bearer token"},
        "source": {"peer": "10.0.0.7"},
        "count": 1,
        "first_at": 1_000.0,
        "last_at": 1_000.0,
        "interval_s": INTERVAL,
    }
    known = folder.add(missing_role())
    assert known is not None
    assert (known["who"], known["source"]) == ("reader", {"peer": "10.0.0.8", "client": "reader"})
    long = Refusal(**{**wrong_token(peer="10.0.0.1").__dict__, "text": "x" * 5_000})
    assert len((folder.add(long) or {})["reason"]["text"]) == 300


def test_drain_writes_what_is_counted() -> None:
    clock = Clock()
    folder = Folder(interval_s=INTERVAL, clock=clock)
    for _ in range(5):
        folder.add(wrong_token())
        folder.add(missing_role())
    drained = folder.drain()
    assert sorted(r["count"] for r in drained) == [4, 4]
    assert len(folder) == 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        Folder(interval_s=0, clock=Clock())
    with pytest.raises(ValueError, match="max_keys"):
        Folder(max_keys=0, clock=Clock())
    with pytest.raises(ValueError, match="max_per_source"):
        Folder(max_per_source=0, clock=Clock())


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            QuotaExceeded("m", subject="client:a", limit="rate"),
            ("RESOURCE_EXHAUSTED", "quota_rate"),
        ),
        (
            QuotaExceeded("m", subject="server", limit="max_queued"),
            ("RESOURCE_EXHAUSTED", "server_max_queued"),
        ),
        (AtCapacity("m"), ("RESOURCE_EXHAUSTED", "at_capacity")),
        (PermissionDenied("m"), ("PERMISSION_DENIED", "permission_denied")),
        (Unauthenticated("m"), ("UNAUTHENTICATED", "unauthenticated")),
        (NotFound("m"), None),
        (InvalidArgument("m"), None),
    ],
)
def test_which_domain_errors_are_refusals(error: Exception, expected: object) -> None:
    assert api_refusals.reason_of(error) == expected  # type: ignore[arg-type]


def test_a_peer_is_its_address_without_the_port() -> None:
    assert api_refusals.peer_host("ipv4:127.0.0.1:51234") == "127.0.0.1"
    assert api_refusals.peer_host("ipv6:[::1]:51234") == "::1"
    assert api_refusals.peer_host("ipv6:%5B2001:db8::7%5D:51234") == "2001:db8::7"  # as gRPC says
    assert api_refusals.peer_host("unix:/run/toolreg.sock") == "unix:/run/toolreg.sock"
    assert len(api_refusals.peer_host("unix:" + "a" * 1_000)) == api_refusals.MAX_PEER_CHARS


def test_the_tool_is_recorded_only_when_it_is_a_name() -> None:
    assert api_refusals.tool_of(pb.ExecuteToolRequest(name="echo")) == "echo"
    assert api_refusals.tool_of(pb.ExecuteToolRequest(name="Robert'); DROP")) == ""
    assert api_refusals.tool_of(pb.ExecuteToolRequest(name="x" * 100)) == ""
    assert api_refusals.tool_of(pb.RegisterToolRequest(tool=pb.Tool(name="mine"))) == "mine"
    assert api_refusals.tool_of(pb.GetApprovalRequestRequest(id="abc")) == ""


def test_the_refusal_log_writes_the_first_at_once_and_the_rest_at_the_end() -> None:
    store = MemoryStore()
    clock = Clock()
    refusals = RefusalLog(store, interval_s=INTERVAL, clock=clock)  # no flusher thread
    for _ in range(10):
        refusals.refuse(wrong_token())
    entries = _refusal_records(store)
    assert [r["count"] for r in entries] == [1]  # before the answer, the first one
    refusals.flush()
    assert len(_refusal_records(store)) == 1  # the interval has not ended
    clock.now += INTERVAL
    refusals.flush()
    refusals.refuse(wrong_token())
    refusals.close()  # what is still counted is written
    counts = [r["count"] for r in _refusal_records(store)]
    assert counts == [1, 9, 1] and sum(counts) == 11
    with store.reading() as reads:
        assert audit_chain.verify_entries(reads.audit_entries()).ok


def _refusal_records(store: MemoryStore) -> list[dict[str, Any]]:
    with store.reading() as reads:
        return [json.loads(e.record) for e in reads.audit_entries() if e.kind == KIND]


def _entry(record: dict[str, Any]) -> Any:
    store = MemoryStore()
    with store.unit_of_work() as uow:
        audit_chain.append(uow, KIND, record)
    with store.reading() as reads:
        return reads.audit_entries()[0]


@pytest.mark.parametrize(
    ("refusal", "class_uid"),
    [
        (wrong_token(), 3002),
        (Refusal(**{**wrong_token().__dict__, "peer": "::1", "tool": ""}), 3002),
        (missing_role(), 3003),
        (
            Refusal(
                status="RESOURCE_EXHAUSTED",
                code="quota_rate",
                text="over its rate",
                method="ExecuteTool",
                client="agent",
                peer="10.0.0.2",
                tool="echo",
            ),
            6003,
        ),
        (
            Refusal(
                status="RESOURCE_EXHAUSTED",
                code="server_max_queued",
                text="full",
                method="StreamExecuteTool",
                client="agent",
                peer="10.0.0.2",
            ),
            6003,
        ),
    ],
)
def test_each_refusal_is_an_ocsf_event_of_its_class_with_its_count(
    refusal: Refusal, class_uid: int
) -> None:
    clock = Clock()
    folder = Folder(interval_s=INTERVAL, clock=clock)
    folder.add(refusal)
    for _ in range(41):
        clock.now += 0.1
        folder.add(refusal)
    clock.now += INTERVAL
    (record,) = folder.due()
    event = ocsf.event(_entry(record), ocsf.Source("toolreg/unit"))
    assert ocsf_schema.problems(event) == []
    assert (event["class_uid"], event["status_id"], event["count"]) == (class_uid, ocsf.FAILURE, 41)
    assert (event["start_time"], event["end_time"]) == (1_000_100, 1_004_100)
    assert event["status_code"] == refusal.code
    assert event["src_endpoint"]["name"] == (refusal.client or refusal.peer)


def test_an_overflow_record_is_an_ocsf_event_too() -> None:
    folder = Folder(interval_s=INTERVAL, max_keys=1, clock=Clock())
    folder.add(wrong_token(peer="10.0.0.1"))
    record = folder.add(wrong_token(peer="10.0.0.2"))
    assert record is not None and record["overflow"]
    event = ocsf.event(_entry(record), ocsf.Source("toolreg/unit"))
    assert ocsf_schema.problems(event) == [] and event["class_uid"] == 3002
    assert "ip" not in event["src_endpoint"]


class _BrokenStore(MemoryStore):
    """A store whose writes fail (a full disk, a lost database)."""

    def unit_of_work(self) -> Any:
        raise StoreError("disk full")


def test_a_store_that_cannot_take_the_record_costs_a_warning_not_the_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refusals = RefusalLog(_BrokenStore(), interval_s=INTERVAL, clock=Clock())
    with caplog.at_level(logging.WARNING):
        refusals.refuse(wrong_token())  # written at once: fails, does not raise
        refusals.refuse(wrong_token())
        refusals.close()  # the drained record fails too
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("unknown_bearer_token" in w for w in warnings)
    assert all("disk full" in w for w in warnings)


class _Abort(Exception):
    pass


class _Context:
    """What the interceptor reads of a call, for a method nobody opened."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    def peer(self) -> str:
        return "ipv4:192.0.2.9:40000"

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", "Bearer not-a-token-of-anyone-5d1"),)

    def auth_context(self) -> dict[str, Any]:
        return {}

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        raise _Abort(message)


class _Details:
    method = "/x.Y/Leak"
    invocation_metadata = ()


def test_a_method_nobody_opened_is_refused_on_the_record_too() -> None:
    store = MemoryStore()
    refusals = RefusalLog(store, interval_s=INTERVAL, clock=Clock())
    interceptor = AuthInterceptor(Authenticator(None), refusals)
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: "secret")
    wrapped = interceptor.intercept_service(lambda d: handler, _Details())  # type: ignore[arg-type]
    assert wrapped is not None and wrapped.unary_unary is not None
    context = _Context()
    with pytest.raises(_Abort):
        wrapped.unary_unary(pb.ExecuteToolRequest(name="echo"), context)  # type: ignore[arg-type]
    assert context.code is grpc.StatusCode.PERMISSION_DENIED
    (record,) = _refusal_records(store)
    assert (record["method"], record["reason"]["code"], record["credential"]) == (
        "/x.Y/Leak", "method_not_open", BEARER,
    )  # fmt: skip
    assert record["source"] == {"peer": "192.0.2.9"} and record["tool"] == "echo"
    assert "not-a-token" not in json.dumps(record)
