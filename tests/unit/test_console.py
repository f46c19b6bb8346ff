"""The approval console's decisions without a browser or a server
(client/console): who may sign in and where it may listen, sessions (cap,
idle end, CSRF), when a request may be signed and what the page is told, and
how the live feed starts a page and drops one that falls behind."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.client import approval_view
from registry_server.console import views
from registry_server.console.feed import PAGE_QUEUE_SIZE, Feed, Page
from registry_server.console.sessions import Sessions, SessionsFull
from registry_server.console.settings import ConsoleSettings, may_sign_in
from registry_server.domain.arguments import arguments_digest
from registry_server.domain.errors import ConfigError
from registry_server.domain.outcome import ApprovalEventView, ApprovalRequestView
from registry_server.policy.clients import Client, Role
from registry_server.policy.model import Approver, Policy
from registry_server.signing.keys import generate_keypair, public_key_from_text
from registry_server.wire import convert
from tests.factories import sha, tool

_, ALICE_KEY = generate_keypair()
POLICY = Policy(
    audience="console-unit",
    approvers=(Approver("alice", public_key_from_text(ALICE_KEY), ("security",)),),
    clients=(
        Client("alice", frozenset({Role.APPROVE}), token_sha256=sha("alice-token")),
        Client("agent", frozenset({Role.EXECUTE}), token_sha256=sha("agent-token")),
        # The approve role, but no approver of that id and none named: nothing to sign as.
        Client("helper", frozenset({Role.APPROVE}), token_sha256=sha("helper-token")),
        Client("by-cert", frozenset({Role.APPROVE}), mtls_subject="CN=alice", approver="alice"),
    ),
)


def settings(**changes: Any) -> ConsoleSettings:
    return dataclasses.replace(ConsoleSettings("127.0.0.1", 8780, POLICY), **changes)


# ----------------------------------------------------------- settings


def test_only_token_holding_approvers_may_sign_in() -> None:
    allowed = {c.id: may_sign_in(POLICY, c) for c in POLICY.clients}
    assert allowed == {"alice": True, "agent": False, "helper": False, "by-cert": False}


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"host": "10.0.0.5"}, "without TLS"),
        ({"host": "console.example.com"}, "without TLS"),
        ({"tls_cert": Path("c.pem")}, "go together"),
        ({"host": "0.0.0.0", "tls_cert": Path("c"), "tls_key": Path("k")}, "needs --allow-host"),
        ({"max_sessions": 0}, "must be positive"),
        ({"session_idle_s": 0}, "must be positive"),
        ({"policy": dataclasses.replace(POLICY, clients=POLICY.clients[1:])}, "no client could"),
    ],
)
def test_refuses_to_serve_unsafely(changes: dict[str, Any], reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        settings(**changes).check()


def test_serves_loopback_and_tls_and_needs_a_policy(tmp_path: Path) -> None:
    settings().check()
    settings(host="::1").check()
    settings(host="10.0.0.5", tls_cert=Path("c"), tls_key=Path("k")).check()
    with pytest.raises(ConfigError, match="needs --policy FILE"):
        ConsoleSettings.from_options("127.0.0.1:8780", policy_file=None)
    broken = tmp_path / "policy.yaml"
    broken.write_text("audience: x\nsurprise: 1\n")
    with pytest.raises(ConfigError) as raised:
        ConsoleSettings.from_options("127.0.0.1:8780", policy_file=broken)
    assert "\n" not in raised.value.message  # one line, as `toolreg console` prints it


# ----------------------------------------------------------- sessions


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sessions_are_capped_and_end_when_idle() -> None:
    clock = Clock()
    sessions = Sessions(max_sessions=2, idle_s=60, clock=clock)
    first, session = sessions.open("alice", "alice")
    told: list[str] = []
    session.streams[1] = told.append
    second, _ = sessions.open("alice", "alice")
    with pytest.raises(SessionsFull):
        sessions.open("bob", "bob")
    clock.now += 30
    assert sessions.use(second) is not None  # used: its idle time starts again
    clock.now += 45
    assert sessions.use(first) is None  # 75 s without a request
    assert told == ["your session was idle too long; sign in again"]
    assert sessions.use(second) is not None and len(sessions) == 1
    sessions.open("bob", "bob")  # the idle one's place
    assert sessions.use("made-up") is None and sessions.use(None) is None


def test_ending_a_session_ends_its_pages_and_its_id() -> None:
    sessions = Sessions(max_sessions=4, idle_s=60)
    session_id, session = sessions.open("alice", "alice")
    told: list[str] = []
    session.streams[1] = told.append
    session.streams[2] = told.append
    sessions.end(session_id)
    assert told == ["signed out", "signed out"]
    assert sessions.use(session_id) is None
    other_id, other = sessions.open("alice", "alice")
    assert other_id != session_id and other.csrf != session.csrf


def test_csrf_tokens_are_compared_exactly() -> None:
    _, session = Sessions(max_sessions=1, idle_s=60).open("alice", "alice")
    assert session.csrf_matches(session.csrf)
    for wrong in (None, "", session.csrf[:-1], session.csrf + "x", "\udcff"):
        assert not session.csrf_matches(wrong)


# -------------------------------------------------------------- views


def request(**changes: Any) -> pb.ApprovalRequest:
    definition = tool(name="deploy", safety_level="dangerous")
    arguments = {"note": "ship it \u202e now", "n": 1}
    msg = pb.ApprovalRequest(
        id="a" * 32, tool_name="deploy", tool_digest=definition.digest,
        arguments_json=json.dumps(arguments), arguments_digest=arguments_digest(arguments),
        requested_by="agent", approvals_required=2, state="PENDING", audience="console-unit",
        max_token_ttl_s=600, approvals_missing=2, tool=convert.tool_to_pb(definition),
    )  # fmt: skip
    msg.tool.owner = "ops\u202eteam"  # not part of the digest; shown all the same
    for name, value in changes.items():
        if name == "approved_by":
            msg.approved_by.extend(value)
        else:
            setattr(msg, name, value)
    return msg


def test_a_request_is_signable_only_as_shown() -> None:
    ok = request()
    assert views.why_not_signable(ok, "alice", views.checks_of(ok)) is None
    other_args = request(arguments_json=json.dumps({"note": "something else", "n": 1}))
    changed_tool = request()
    changed_tool.tool.sandbox.command[:] = ["sh", "-c", "rm -rf /"]
    no_tool = request()
    no_tool.ClearField("tool")
    cases = {
        "is approved": request(state="APPROVED"),
        "is rejected": request(state="REJECTED"),
        "is voided": request(state="VOIDED", voided_reason="tool disabled: incident 7"),
        "no definition": no_tool,
        "does not match tool_digest": changed_tool,
        "do not match arguments_digest": other_args,
        "approved this request already": request(approved_by=["alice"]),
    }
    for says, req in cases.items():
        refusal = views.why_not_signable(req, "alice", views.checks_of(req))
        assert refusal is not None and says in refusal, (says, refusal)
    assert approval_view.arguments_match(request(arguments_json="not json")) is False


def test_the_detail_is_escaped_and_the_claims_are_exact() -> None:
    detail = views.detail(request(), "alice")
    fields = dict(detail["fields"])
    assert fields["owner"] == "ops\\u202eteam"
    assert fields["definition"] == "matches the digest signed"
    assert "\\u202e" in detail["arguments"] and "\u202e" not in json.dumps(detail)
    assert detail["signable"] and detail["checks"] == {"definition": True, "arguments": True}
    req = request()
    assert detail["claims"] == {
        "iss": "alice", "aud": "console-unit", "sub": "deploy", "tool_digest": req.tool_digest,
        "args_digest": req.arguments_digest, "requester": "agent", "req": req.id, "ttl_s": 600,
    }  # fmt: skip
    refused = views.detail(request(state="EXPIRED"), "alice")
    assert refused["claims"] is None and "expired" in refused["not_signable"]


# --------------------------------------------------------------- feed


def listed(request_id: str, state: str) -> ApprovalRequestView:
    now = datetime.now(UTC)
    return ApprovalRequestView(
        id=request_id, tool_name="deploy", tool_digest="d", arguments_json="",
        arguments_digest="a", requested_by="agent\u202e", approvals_required=1,
        approved_by=(), state=state, created_at=now, expires_at=now,
    )  # fmt: skip


class StoppedWatch:
    def stop(self) -> None:
        pass


def test_a_page_starts_from_what_is_open_and_a_slow_page_resyncs() -> None:
    async def scenario() -> None:
        feed = Feed(client=None)  # type: ignore[arg-type]  # no watch runs here
        watch = feed._watch = StoppedWatch()  # type: ignore[assignment]
        for request_id, state in (("r1", "PENDING"), ("r2", "PENDING"), ("r1", "CONSUMED")):
            event = ApprovalEventView("OPENED", listed(request_id, state))
            feed._apply(watch, event)  # type: ignore[arg-type]
        feed._apply(watch, ApprovalEventView("SYNCED", None))  # type: ignore[arg-type]
        page = Page()
        feed.join(page)
        got = [page.queue.get_nowait() for _ in range(page.queue.qsize())]
        assert [m["kind"] for m in got] == ["start", "request", "synced"]
        assert got[1]["event"] == "CURRENT" and got[1]["request"]["id"] == "r2"
        assert got[1]["request"]["requested_by"] == "agent\\u202e"
        for n in range(PAGE_QUEUE_SIZE + 1):  # the page never reads
            feed._apply(watch, ApprovalEventView("OPENED", listed(f"x{n}", "PENDING")))  # type: ignore[arg-type]
        assert [page.queue.get_nowait() for _ in range(page.queue.qsize())] == [{"kind": "resync"}]
        assert feed._watch is None  # its last page left: the watch stops

    asyncio.run(scenario())


def test_the_cli_and_the_console_show_the_same_fields() -> None:
    from registry_server.cli.approvals import request_lines

    req = request(state="REJECTED", rejected_by="bob", rejection_reason="no\u202e")
    lines = request_lines(req)
    shown = dict(views.detail(req, "alice")["fields"])
    assert lines[: len(shown)] == [f"{label:<9} {value}" for label, value in shown.items()]
    assert lines[0] == f"request   {'a' * 32}" and "rejected  by bob: no\\u202e" in lines
    assert lines[-2] == f"arguments (digest {req.arguments_digest}):"
    assert json.loads(lines[-1].replace("\\u202e", "")) == {"note": "ship it  now", "n": 1}


def test_a_voided_request_says_why() -> None:
    fields = dict(approval_view.request_fields(request(state="VOIDED", voided_reason="gone\u202e")))
    assert fields["voided"] == "gone\\u202e"
