"""Webhooks (registry_server/notify), decision logic only: the outbox hook in
the event's own unit of work, payload shaping and escaping, signing, the
retry schedule, claiming and the dispatcher's outcomes. In-memory store,
a fake clock and a fake transport; the receiver checks signatures with the
standardwebhooks library itself."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from standardwebhooks.webhooks import Webhook

from registry_server.approvals.events import ExpirySweeper
from registry_server.approvals.service import Approvals, Call, Required, Viewer
from registry_server.catalog.registry import Registry
from registry_server.domain.arguments import arguments_digest
from registry_server.notify import payload
from registry_server.notify.dispatcher import (
    CLAIM_LEASE_S,
    MAX_ERROR_CHARS,
    OUT_DELIVERED,
    OUT_FAILED,
    OUT_RETRIED,
    UNKNOWN_ENDPOINT,
    DeliveryError,
    Dispatcher,
)
from registry_server.notify.endpoints import Endpoint, load_endpoints, new_secret
from registry_server.notify.outbox import MAX_RETRY_DELAY_S, Outbox, retry_delay, webhook_id
from registry_server.policy.loader import load_policy
from registry_server.policy.model import Policy, PolicyError
from registry_server.policy.webhooks import WebhookSpec
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from registry_server.store.base import (
    DELIVERED,
    DELIVERY_FAILED,
    DELIVERY_PENDING,
    ApprovalEventRecord,
    ApprovalRequestRecord,
    WebhookDeliveryRecord,
)
from registry_server.store.memory import MemoryStore
from tests.factories import sha
from tests.factories import tool as make_tool

SECRET = new_secret()
OTHER_SECRET = new_secret()
ALICE_PEM, ALICE_PUBLIC = generate_keypair()
BIDI = "\u202e"  # RIGHT-TO-LEFT OVERRIDE: reverses what follows on screen
CANARY = "canary-7f3e9a"  # a value in the tool's env: never in a payload


def policy_text(console: str = "https://console.example/app") -> str:
    return f"""\
audience: toolreg-test
approval_request_ttl_s: 60
console_url: {console}
approvers:
  - {{id: alice, public_key: "{ALICE_PUBLIC}", groups: [security]}}
approval_rules:
  - {{match: {{tool: run_shell}}, approvals_required: 1, groups: [security]}}
clients:
  - {{id: agent, token_sha256: "{sha("agent")}", roles: [execute], max_safety_level: dangerous}}
webhooks:
  - id: chat
    url: https://hooks.example/chat
    events: [opened, approval_added, approved, rejected, expired, consumed]
    secret_env: TEST_WEBHOOK_CHAT
    format: slack
  - id: audit
    url: http://127.0.0.1:9/audit
    events: [opened, rejected]
    secret_env: TEST_WEBHOOK_AUDIT
    include_arguments: true
"""


ENVIRON = {"TEST_WEBHOOK_CHAT": SECRET, "TEST_WEBHOOK_AUDIT": OTHER_SECRET}
RUN_SHELL = make_tool(
    name="run_shell", safety_level="dangerous", categories=["shell"],
    sandbox={"image": "toolreg/base", "command": ["sh"], "env": {"TOKEN": CANARY}},
)  # fmt: skip


@dataclass
class Sent:
    endpoint: str
    body: bytes
    headers: dict[str, str]


@dataclass
class FakeTransport:
    """Answers with the next status of ``statuses`` (a DeliveryError when an
    entry is a string), then 200."""

    statuses: list[int | str] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)

    def post(self, endpoint: Endpoint, body: bytes, headers: Mapping[str, str]) -> int:
        self.sent.append(Sent(endpoint.id, body, dict(headers)))
        answer = self.statuses.pop(0) if self.statuses else 200
        if isinstance(answer, str):
            raise DeliveryError(answer)
        return answer

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = time.time()  # receivers check webhook-timestamp against real time

    def __call__(self) -> float:
        return self.now


@dataclass
class Env:
    store: MemoryStore
    policy: Policy
    approvals: Approvals
    endpoints: dict[str, Endpoint]
    clock: Clock
    transport: FakeTransport
    dispatcher: Dispatcher
    observed: list[tuple[str, str]]

    def open(self, args: dict[str, Any] | None = None) -> str:
        arguments = {"command": "ls"} if args is None else args
        call = Call(RUN_SHELL, rfc8785.dumps(arguments).decode(), arguments_digest(arguments),
                    "agent")  # fmt: skip
        decision = self.approvals.decide(call, (), "")
        assert isinstance(decision, Required)
        return decision.request.id

    def approve(self, request_id: str) -> None:
        view = self.approvals.get(request_id)
        token = mint_for(load_private_key(ALICE_PEM), issuer="alice", request=view)
        self.approvals.submit(request_id, token, "alice")

    def reject(self, request_id: str, reason: str) -> None:
        self.approvals.reject(request_id, reason, Viewer("alice", approver="alice"))

    def rows(self) -> list[WebhookDeliveryRecord]:
        data = self.store._data.deliveries  # the memory store's own table
        return sorted(data.values(), key=lambda d: (d.event_seq, d.endpoint))


@pytest.fixture
def env(tmp_path: Path) -> Env:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_text())
    policy = load_policy(path)
    store = MemoryStore()
    registry = Registry(store)
    registry.register(RUN_SHELL)
    approvals = Approvals(store, policy, registry)
    clock = Clock()
    outbox = Outbox(policy.webhooks, policy, console_url=policy.console_url, clock=clock)
    approvals.hooks.append(outbox.hook)
    endpoints = load_endpoints(policy.webhooks, ENVIRON)
    transport = FakeTransport()
    observed: list[tuple[str, str]] = []
    dispatcher = Dispatcher(
        store, endpoints, transport, retry_base_s=10, max_attempts=3, clock=clock,
        rng=lambda: 0.5, observe=lambda e, o: observed.append((e, o)),
    )  # fmt: skip
    return Env(store, policy, approvals, endpoints, clock, transport, dispatcher, observed)


def verified(sent: Sent) -> Any:
    secret = SECRET if sent.endpoint == "chat" else OTHER_SECRET
    return Webhook(secret).verify(sent.body, sent.headers)


# ------------------------------------------------------------------ the outbox


def test_each_event_queues_one_delivery_per_endpoint_that_wants_it(env: Env) -> None:
    rid = env.open()
    env.approve(rid)
    other = env.open({"command": "pwd"})
    env.reject(other, "not today")
    kinds = [(d.endpoint, json.loads(d.payload).get("type") or "slack") for d in env.rows()]
    assert kinds == [
        ("audit", "approval.opened"), ("chat", "slack"),  # opened
        ("chat", "slack"), ("chat", "slack"),  # approval added, approved
        ("audit", "approval.opened"), ("chat", "slack"),  # the second request
        ("audit", "approval.rejected"), ("chat", "slack"),
    ]  # fmt: skip
    assert {d.state for d in env.rows()} == {DELIVERY_PENDING}
    first = env.rows()[0]
    assert first.webhook_id == webhook_id(rid, first.event_seq, "audit")


def test_a_rolled_back_event_leaves_no_delivery(env: Env) -> None:
    with pytest.raises(RuntimeError), env.store.unit_of_work() as uow:
        env.approvals.hooks[0](uow, _event(1, "OPENED", "r"), _request("r"))
        assert uow.webhook_backlog().pending == 2
        raise RuntimeError("the event's transaction fails after the hook ran")
    assert env.rows() == []


def test_expiry_and_consumption_are_delivered_to_who_wants_them(env: Env) -> None:
    rid = env.open()
    sweeper = ExpirySweeper(env.store, env.approvals.hub, env.approvals.hooks)
    assert sweeper.sweep(now=time.time() + 120) == 1
    expired = [json.loads(d.payload) for d in env.rows() if d.endpoint == "chat"][-1]
    assert expired["text"].startswith("Expired unused: `run_shell` (dangerous) for agent")
    assert rid in expired["text"]
    assert [d.endpoint for d in env.rows()].count("audit") == 1  # audit wants no expiry


# ------------------------------------------------------------------ payloads


def test_the_standard_payload_carries_what_approvers_need_and_nothing_secret(env: Env) -> None:
    rid = env.open({"command": "x" * 500, "why": BIDI + "evil"})
    env.reject(rid, f"no {BIDI}way <!channel> & <https://evil|click>")
    for d in env.rows():
        assert CANARY not in d.payload and "eyJ" not in d.payload  # no env value, no JWT
    opened, rejected = (json.loads(d.payload) for d in env.rows() if d.endpoint == "audit")
    assert opened["type"] == "approval.opened" and opened["timestamp"].endswith("Z")
    data = opened["data"]
    assert {k: data[k] for k in ("request_id", "tool", "level", "requested_by", "state")} == {
        "request_id": rid, "tool": "run_shell", "level": "dangerous", "requested_by": "agent",
        "state": "PENDING",
    }  # fmt: skip
    assert (data["approvals_required"], data["approvals_missing"], data["approved_by"]) == (
        1, 1, [],
    )  # fmt: skip
    assert data["console_url"] == f"https://console.example/app/#/requests/{rid}"
    preview = data["arguments_preview"]
    assert preview.endswith("…") and len(preview) <= payload.PREVIEW_CHARS + 1
    assert rejected["data"]["reason"] == "no \\u202eway <!channel> & <https://evil|click>"
    assert rejected["data"]["actor"] == "alice" and rejected["data"]["state"] == "REJECTED"
    assert BIDI not in json.dumps(rejected, ensure_ascii=False)


def test_the_slack_payload_escapes_mrkdwn_so_a_reason_is_never_a_link(env: Env) -> None:
    rid = env.open()
    env.reject(rid, f"no {BIDI}way <!channel> & <https://evil|click>")
    message = json.loads([d.payload for d in env.rows() if d.endpoint == "chat"][-1])
    text = message["blocks"][0]["text"]["text"]
    assert "> no \\u202eway &lt;!channel&gt; &amp; &lt;https://evil|click&gt;" in text
    assert "<!channel>" not in json.dumps(message) and "<https://evil" not in json.dumps(message)
    context = message["blocks"][1]["elements"][0]["text"]
    assert f"<https://console.example/app/#/requests/{rid}|Open in the approval console>" in context
    assert message["text"] == f"Rejected: `run_shell` (dangerous) for agent (request {rid})"


def test_without_a_console_url_there_is_no_link(tmp_path: Path) -> None:
    facts = _facts(console_url="")
    assert "console_url" not in payload.standard(facts)["data"]
    assert "Open in" not in json.dumps(payload.slack(facts))
    assert payload.preview("a" * 200) == "a" * 200 and payload.preview("\x1b[2J") == "\\u001b[2J"


# ------------------------------------------------------------------ delivery


def test_a_delivery_is_signed_and_marked_delivered_on_2xx(env: Env) -> None:
    rid = env.open()
    assert env.dispatcher.pump() == 2
    assert all(d.state == DELIVERED and d.attempts == 1 for d in env.rows())
    bodies = {s.endpoint: verified(s) for s in env.transport.sent}  # raises when forged
    assert bodies["audit"]["data"]["request_id"] == rid
    assert {s.headers["webhook-id"] for s in env.transport.sent} == {
        d.webhook_id for d in env.rows()
    }
    sent = env.transport.sent[0]
    assert sent.headers["webhook-signature"].startswith("v1,")
    with pytest.raises(Exception, match="No matching signature"):
        Webhook(new_secret()).verify(sent.body, sent.headers)
    assert sorted(env.observed) == [("audit", OUT_DELIVERED), ("chat", OUT_DELIVERED)]
    assert env.dispatcher.pump() == 0  # nothing twice


def test_failures_are_retried_with_backoff_the_same_id_then_given_up(env: Env) -> None:
    env.transport.statuses = [503, "ConnectError: refused", 302]
    env.open()
    rows = [d for d in env.rows() if d.endpoint == "chat"]
    env.store._data.deliveries = {(d.event_seq, d.endpoint): d for d in rows}  # one endpoint
    assert env.dispatcher.pump() == 1
    (row,) = env.rows()
    assert (row.state, row.attempts, row.last_error) == (DELIVERY_PENDING, 1, "HTTP 503")
    assert row.next_attempt_at == pytest.approx(env.clock.now + 10)
    assert env.dispatcher.pump() == 0  # not due yet
    env.clock.now += 10
    assert env.dispatcher.pump() == 1
    assert env.rows()[0].next_attempt_at == pytest.approx(env.clock.now + 20)  # doubled
    env.clock.now += 20
    assert env.dispatcher.pump() == 1
    (row,) = env.rows()
    assert (row.state, row.attempts) == (DELIVERY_FAILED, 3)
    assert row.last_error == "HTTP 302 (redirects are not followed)"
    assert [o for _, o in env.observed] == [OUT_RETRIED, OUT_RETRIED, OUT_FAILED]
    assert len({s.headers["webhook-id"] for s in env.transport.sent}) == 1
    assert len({s.headers["webhook-signature"] for s in env.transport.sent}) >= 1
    for s in env.transport.sent:
        verified(s)


def test_the_retry_schedule_doubles_with_jitter_caps_and_spans_about_an_hour() -> None:
    assert [retry_delay(n, 30, lambda: 0.5) for n in (1, 2, 3)] == [30, 60, 120]
    assert retry_delay(30, 30, lambda: 0.5) == MAX_RETRY_DELAY_S
    assert retry_delay(1, 30, lambda: 0.0) == 22.5 and retry_delay(1, 30, lambda: 1.0) == 37.5
    total = sum(retry_delay(n, 30, lambda: 0.5) for n in range(1, 8))  # 7 waits, 8 attempts
    assert 3_000 < total < 4_500


def test_a_lapsed_claim_is_sent_again_and_an_unknown_endpoint_fails(env: Env) -> None:
    env.open()
    with env.store.unit_of_work() as uow:  # a server that claimed and died
        assert len(uow.claim_webhook_deliveries("dead", env.clock.now, env.clock.now + 5, 9)) == 2
    assert env.dispatcher.pump() == 0
    env.clock.now += CLAIM_LEASE_S
    assert env.dispatcher.pump() == 2
    assert {d.state for d in env.rows()} == {DELIVERED}
    with env.store.unit_of_work() as uow:
        uow.add_webhook_delivery(
            WebhookDeliveryRecord(99, "gone", "msg_x", "{}", env.clock.now, env.clock.now)
        )
    env.dispatcher.pump()
    gone = env.store._data.deliveries[(99, "gone")]
    assert gone.state == DELIVERY_FAILED and "not in this server's policy" in gone.last_error
    assert (UNKNOWN_ENDPOINT, OUT_FAILED) in env.observed


def test_an_error_is_capped_and_escaped_before_it_is_stored(env: Env) -> None:
    env.transport.statuses = ["x\x1b[31m" + "y" * 1000]
    env.open()
    env.dispatcher.pump()
    error = next(d.last_error for d in env.rows() if d.last_error)
    assert error.startswith("x\\u001b[31m") and len(error) == MAX_ERROR_CHARS


def test_the_dispatcher_thread_delivers_when_woken(env: Env) -> None:
    dispatcher = Dispatcher(env.store, env.endpoints, env.transport, poll_s=30)
    env.approvals.hub.on_event(dispatcher.wake)
    dispatcher.start()
    try:
        started = time.monotonic()
        env.open()
        while len(env.transport.sent) < 2 and time.monotonic() - started < 5:
            time.sleep(0.01)
        assert len(env.transport.sent) == 2  # well before the 30 s poll
        assert time.monotonic() - started < 2
    finally:
        dispatcher.close()


def test_two_dispatchers_on_one_store_send_each_delivery_once(env: Env) -> None:
    for n in range(10):
        env.open({"n": n})
    one = Dispatcher(env.store, env.endpoints, env.transport, concurrency=3)
    two = Dispatcher(env.store, env.endpoints, env.transport, concurrency=3)
    threads = [threading.Thread(target=d.pump) for d in (one, two) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    while one.pump() + two.pump():
        pass
    ids = [s.headers["webhook-id"] for s in env.transport.sent]
    assert len(ids) == 20 and len(set(ids)) == 20


# ------------------------------------------------------------------ secrets at start


def _spec(**fields: Any) -> WebhookSpec:
    base: dict[str, Any] = {"id": "chat", "url": "https://h.example/x", "events": frozenset(
        {"opened"}), "secret_env": "S", "where": "p.yaml line 3: webhooks[0]"}  # fmt: skip
    base.update(fields)
    return WebhookSpec(**base)


def _private(tmp_path: Path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / f"s{len(list(tmp_path.iterdir()))}.whsec"
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_secrets_are_read_at_start_and_every_bad_one_is_refused(tmp_path: Path) -> None:
    good = _private(tmp_path, SECRET + "\n")
    assert load_endpoints([_spec(secret_env=None, secret_file=good)], {})["chat"].id == "chat"
    assert load_endpoints([_spec()], {"S": SECRET})["chat"].tls is None
    short = "whsec_" + "QUJD" * 4
    cases = [
        (_spec(), {}, "p.yaml line 3: webhooks[0]: secret_env: $S is not set"),
        (_spec(), {"S": "c2VjcmV0"}, "must start with 'whsec_'"),
        (_spec(), {"S": "whsec_not*base64!"}, "is not base64"),
        (_spec(), {"S": short}, "the key is 12 bytes; use 24 to 64"),
        (_spec(secret_env=None, secret_file=_private(tmp_path, SECRET, 0o644)), {},
         "group or others may read it (mode 644); chmod 600 it"),
        (_spec(secret_env=None, secret_file=str(tmp_path / "none")), {}, "cannot read it"),
        (_spec(ca_file=str(tmp_path / "no-ca.pem")), {"S": SECRET}, "cannot load CA"),
    ]  # fmt: skip
    for spec, environ, expected in cases:
        with pytest.raises(PolicyError) as info:
            load_endpoints([spec], environ)
        assert expected in str(info.value)
        assert SECRET not in str(info.value)


def test_a_secret_file_behind_a_link_is_refused(tmp_path: Path) -> None:
    target = _private(tmp_path, SECRET)
    link = tmp_path / "link.whsec"
    os.symlink(target, link)
    with pytest.raises(PolicyError, match="cannot read it"):
        load_endpoints([_spec(secret_env=None, secret_file=str(link))], {})


# ------------------------------------------------------------------ helpers


def _facts(**changes: Any) -> payload.Facts:
    base: dict[str, Any] = {
        "event_type": "OPENED", "event_seq": 7, "at": 1_700_000_000.0, "request_id": "r1",
        "tool": "run_shell", "level": "dangerous", "requested_by": "agent",
        "approvals_required": 2, "approvals_missing": 1, "approved_by": ["alice"],
        "state": "PENDING", "actor": "", "reason": "", "created_at": 1_700_000_000.0,
        "expires_at": 1_700_003_600.0, "arguments_json": "{}", "console_url": "",
    }  # fmt: skip
    base.update(changes)
    return payload.Facts(**base)


def _event(seq: int, type_: str, request_id: str) -> ApprovalEventRecord:
    return ApprovalEventRecord(seq, request_id, type_, "", "", time.time())


def _request(request_id: str) -> ApprovalRequestRecord:
    now = time.time()
    return ApprovalRequestRecord(
        id=request_id, tool_name="run_shell", tool_digest="d", arguments_json="{}",
        arguments_digest="a", requested_by="agent", approvals_required=1, state="PENDING",
        created_at=now, expires_at=now + 60, tool_manifest="", tool_owner="o",
    )  # fmt: skip


def test_the_outbox_counts_missing_approvals_by_the_policy_in_force(
    env: Env, tmp_path: Path
) -> None:
    """After a reload (a new policy in force) the next event's payload counts
    by the new rules; the endpoints stay those the server started with."""
    bob_public = generate_keypair()[1]
    stricter = (
        policy_text()
        .replace(
            "approval_rules:\n",
            f'  - {{id: bob, public_key: "{bob_public}", groups: [security]}}\napproval_rules:\n',
        )
        .replace("approvals_required: 1", "approvals_required: 2")
    )
    path = tmp_path / "stricter.yaml"
    path.write_text(stricter)
    in_force = [env.policy]
    outbox = Outbox(env.policy.webhooks, lambda: in_force[0], console_url="")
    env.approvals.hooks[:] = [outbox.hook]
    env.open({"before": 1})
    in_force[0] = load_policy(path)
    env.open({"after": 1})
    opened = [json.loads(d.payload)["data"] for d in env.rows() if d.endpoint == "audit"]
    assert [o["approvals_missing"] for o in opened] == [1, 2]
    assert all("console_url" not in o for o in opened)


def test_the_loop_waits_rather_than_spins_on_deliveries_claimed_elsewhere(env: Env) -> None:
    """A due delivery in flight (here, or claimed by another server) is not a
    reason to look again at once: the loop waits for a sender or its poll."""
    env.open()
    with env.store.unit_of_work() as uow:
        assert uow.claim_webhook_deliveries("other", env.clock.now, env.clock.now + 60, 9)
    assert env.dispatcher._turn() == env.dispatcher._poll_s
    env.clock.now += 60  # the claims lapsed: claimed and sent now
    env.dispatcher._turn()
    env.dispatcher.close()
    assert {d.state for d in env.rows()} == {DELIVERED}
