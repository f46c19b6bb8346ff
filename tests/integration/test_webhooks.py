"""Webhooks against the real parts: a real server (in-process, SQLite, the real
engine for the one call that runs) with a real policy naming the test's own
receivers, which verify every delivery with the standardwebhooks library.

Opened, approved (and the approval added), consumed, rejected and expired
requests each reach the receivers that asked for them, signed; a receiver
that is down at first gets them once it is back; a receiver that takes 10 s
to answer slows no RPC; a server stopped with deliveries pending delivers
them after its restart, none lost and none twice; HTTPS receivers are
verified against the policy's CA file. No payload carries the tool's env,
a token or a secret."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.api.app import build_app
from registry_server.api.config import ServerConfig
from registry_server.client.registry_client import open_channel
from registry_server.domain.errors import ConfigError
from registry_server.notify.endpoints import new_secret
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from registry_server.store.base import DELIVERED
from registry_server.store.sqlite import SqliteStore
from tests.certs import CertificateAuthority
from tests.factories import sha
from tests.integration.conftest import Running, StartServer
from tests.webhook_receiver import Receiver

AUDIENCE = "toolreg-webhooks"
CANARY = "canary-env-5b1f0c"  # in the tool's env: must reach no receiver
TOKENS = {"agent": "webhook-agent-secret", "alice": "webhook-alice-secret"}
ALL_EVENTS = ["opened", "approval_added", "approved", "rejected", "consumed", "expired"]
RETRY_BASE_S = 0.3  # seconds: retries come quickly in these tests
WAIT_S = 30.0  # seconds for the dispatcher's thread to store what a delivery came to
PROBE = {
    "name": "notify_probe",
    "description": "Echoes its arguments; dangerous, so each call needs an approval.",
    "safety_level": "dangerous",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
    "sandbox": {"image": "toolreg/base", "command": ["cat"], "env": {"PROBE_KEY": CANARY}},
}


@dataclass
class Hook:
    """One endpoint of the policy and the receiver behind it."""

    id: str
    receiver: Receiver
    events: list[str]
    extra: dict[str, Any]


@dataclass
class Deployment:
    running: Running
    alice_key: bytes
    policy: Path
    channels: list[grpc.Channel]

    def stub(self, who: str) -> pb_grpc.ToolRegistryStub:
        channel = open_channel(self.running.address, token=TOKENS[who])
        self.channels.append(channel)
        return pb_grpc.ToolRegistryStub(channel)

    def open(self, n: int) -> str:
        result = self.stub("agent").ExecuteTool(
            pb.ExecuteToolRequest(name="notify_probe", arguments_json=json.dumps({"n": n})),
            timeout=30,
        )
        assert result.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, result.error
        return str(result.approval_request.id)

    def approve(self, request_id: str) -> pb.ApprovalRequest:
        stub = self.stub("alice")
        request = stub.GetApprovalRequest(pb.GetApprovalRequestRequest(id=request_id))
        token = mint_for(
            load_private_key(self.alice_key), issuer="alice", request=request, bind_request=True
        )
        answer: pb.ApprovalRequest = stub.SubmitApproval(
            pb.SubmitApprovalRequest(request_id=request_id, token=token), timeout=30
        )
        return answer

    def run(self, n: int, request_id: str) -> pb.ToolResult:
        result: pb.ToolResult = self.stub("agent").ExecuteTool(
            pb.ExecuteToolRequest(
                name="notify_probe", arguments_json=json.dumps({"n": n}),
                approval_request_id=request_id,
            ),
            timeout=120,
        )  # fmt: skip
        return result

    def reject(self, request_id: str, reason: str) -> None:
        self.stub("alice").RejectApprovalRequest(
            pb.RejectApprovalRequestRequest(request_id=request_id, reason=reason), timeout=30
        )


@pytest.fixture
def deploy(
    start_server: StartServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    made: list[Deployment] = []

    def make(hooks: list[Hook], *, ttl_s: int = 3600, data_dir: Path | None = None,
             **settings: Any) -> Deployment:  # fmt: skip
        private, public = generate_keypair()
        tools = tmp_path / "tools"
        tools.mkdir(exist_ok=True)
        (tools / "notify_probe.yaml").write_text(yaml.safe_dump(PROBE))
        webhooks = []
        for hook in hooks:
            env_name = f"TOOLREG_TEST_WEBHOOK_{hook.id.upper()}"
            monkeypatch.setenv(env_name, hook.receiver.secret)
            webhooks.append({"id": hook.id, "url": hook.receiver.url, "events": hook.events,
                             "secret_env": env_name, **hook.extra})  # fmt: skip
        policy = {
            "audience": AUDIENCE,
            "approval_request_ttl_s": ttl_s,
            "console_url": "https://console.test/toolreg",
            "approvers": [{"id": "alice", "public_key": public, "groups": ["security"]}],
            "approval_rules": [
                {"match": {"level": "dangerous"}, "approvals_required": 1, "groups": ["security"]}
            ],
            "clients": [
                {
                    "id": "agent",
                    "token_sha256": sha(TOKENS["agent"]),
                    "roles": ["execute"],
                    "max_safety_level": "dangerous",
                },
                {"id": "alice", "token_sha256": sha(TOKENS["alice"]), "roles": ["approve"]},
            ],
            "webhooks": webhooks,
        }
        path = tmp_path / "policy.yaml"
        path.write_text(yaml.safe_dump(policy, sort_keys=False))
        settings.setdefault("webhook_retry_base_s", RETRY_BASE_S)
        running = start_server(data_dir=data_dir, policy_file=path, tools_dir=tools, **settings)
        deployment = Deployment(running, private, path, [])
        made.append(deployment)
        return deployment

    yield make
    for deployment in made:
        for channel in deployment.channels:
            channel.close()


def wait_until(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    """For what the dispatcher's threads do after a receiver has answered
    (store the outcome, count it, look at the backlog again)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


def types_for(receiver: Receiver, request_id: str) -> list[str]:
    """The request's events as the receiver got them, in event order (deliveries
    may arrive in any order; data.event_seq is the order they happened in)."""
    mine = [b for b in receiver.bodies() if "data" in b and b["data"]["request_id"] == request_id]
    return [b["type"] for b in sorted(mine, key=lambda b: b["data"]["event_seq"])]


def assert_nothing_secret(receiver: Receiver) -> None:
    for delivery in receiver.received:
        text = delivery.raw.decode()
        assert CANARY not in text, "the tool's env reached a receiver"
        assert "eyJ" not in text, "a JWT (approval token) reached a receiver"
        assert receiver.secret not in text and TOKENS["agent"] not in text


def test_every_event_reaches_the_receivers_that_asked_signed_and_nothing_secret(
    deploy: Any,
) -> None:
    everything = Receiver(new_secret()).up()
    chat = Receiver(new_secret()).up()
    d = deploy([
        Hook("all", everything, ALL_EVENTS, {}),
        Hook("chat", chat, ["opened", "rejected"], {"format": "slack"}),
    ])  # fmt: skip
    approved = d.open(1)
    assert d.approve(approved).state == "APPROVED"
    result = d.run(1, approved)
    assert result.status == pb.EXECUTION_STATUS_OK, result.error
    rejected = d.open(2)
    d.reject(rejected, "not on a Friday <!channel>")

    everything.wait_for("six events", lambda r: len(r.received) == 6)
    assert types_for(everything, approved) == [
        "approval.opened", "approval.approval_added", "approval.approved", "approval.consumed",
    ]  # fmt: skip
    assert types_for(everything, rejected) == ["approval.opened", "approval.rejected"]
    by_type = {b["type"]: b["data"] for b in everything.bodies()
               if b["data"]["request_id"] == approved or b["type"] == "approval.rejected"}  # fmt: skip
    assert by_type["approval.opened"]["approvals_missing"] == 1
    assert by_type["approval.approved"]["approved_by"] == ["alice"]
    assert by_type["approval.approved"]["approvals_missing"] == 0
    assert by_type["approval.rejected"]["reason"] == "not on a Friday <!channel>"
    assert by_type["approval.rejected"]["actor"] == "alice"
    assert by_type["approval.consumed"]["state"] == "CONSUMED"
    assert by_type["approval.opened"]["console_url"] == (
        f"https://console.test/toolreg/#/requests/{approved}"
    )
    # Slack: only what it asked for; the reason cannot become a mention.
    chat.wait_for("three messages", lambda r: len(r.received) == 3)
    texts = [json.dumps(b) for b in chat.bodies()]
    assert all('"blocks"' in t for t in texts)
    assert "&lt;!channel&gt;" in texts[-1] and "<!channel>" not in texts[-1]
    assert everything.forged == chat.forged == 0  # every delivery verified
    assert len(set(everything.ids())) == 6
    for receiver in (everything, chat):
        assert_nothing_secret(receiver)
        receiver.down()


def test_an_expired_request_is_delivered(deploy: Any) -> None:
    receiver = Receiver(new_secret()).up()
    d = deploy([Hook("ops", receiver, ["expired"], {})], ttl_s=1)
    request_id = d.open(3)
    receiver.wait_for("the expiry", lambda r: len(r.received) == 1, timeout_s=15)
    (body,) = receiver.bodies()
    assert body["type"] == "approval.expired" and body["data"]["request_id"] == request_id
    assert body["data"]["state"] == "EXPIRED"
    receiver.down()


def test_a_receiver_down_at_first_gets_its_deliveries_when_back(deploy: Any) -> None:
    receiver = Receiver(new_secret()).reserve_port()  # nothing listens yet
    d = deploy([Hook("late", receiver, ["opened", "approved"], {})])
    first = d.open(4)
    d.approve(first)
    metrics = d.running.app.metrics.registry

    def retried() -> float:
        labels = {"endpoint": "late", "outcome": "retried"}
        return metrics.get_sample_value("toolreg_webhook_deliveries_total", labels) or 0

    deadline = time.monotonic() + 10
    while retried() < 3 and time.monotonic() < deadline:  # refused, and refused again
        time.sleep(0.05)
    assert retried() >= 3
    # The gauge is the dispatcher's last look at the backlog, taken on its own thread.
    wait_until("a backlog of 2", lambda: metrics.get_sample_value("toolreg_webhook_backlog") == 2)
    assert metrics.get_sample_value("toolreg_webhook_backlog") == 2
    receiver.up()
    receiver.wait_for("both deliveries", lambda r: len(r.received) == 2, timeout_s=20)
    assert types_for(receiver, first) == ["approval.opened", "approval.approved"]
    time.sleep(1)
    assert len(receiver.ids()) == len(set(receiver.ids())) == 2  # and nothing twice

    def delivered() -> float | None:
        labels = {"endpoint": "late", "outcome": "delivered"}
        return metrics.get_sample_value("toolreg_webhook_deliveries_total", labels)

    # Counted by the sender once the receiver's answer is back: after it got the delivery.
    wait_until("2 deliveries counted", lambda: delivered() == 2)
    assert delivered() == 2
    receiver.down()


def test_a_slow_receiver_slows_no_call(deploy: Any) -> None:
    receiver = Receiver(new_secret()).up()
    d = deploy([Hook("slow", receiver, ALL_EVENTS, {"timeout_s": 15})])
    d.open(100), d.approve(d.open(101))  # warm the channels and the path

    def timed(n: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        request_id = d.open(n)
        t1 = time.perf_counter()
        d.approve(request_id)
        return (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000

    fast = [timed(n) for n in range(10, 16)]
    sent_fast = 4 + 6 * 3  # warm-up: 4 events; then 3 each (opened, approval added, approved)
    receiver.wait_for("the fast deliveries", lambda r: len(r.received) == sent_fast)
    receiver.delay_s = 10.0  # every answer now takes 10 s
    slow = [timed(n) for n in range(20, 26)]
    open_fast, open_slow = (statistics.median(x[0] for x in s) for s in (fast, slow))
    submit_fast, submit_slow = (statistics.median(x[1] for x in s) for s in (fast, slow))
    print(f"\nExecuteTool (opens a request) p50: {open_fast:.1f} ms with a fast receiver,"
          f" {open_slow:.1f} ms with a 10 s one; SubmitApproval p50: {submit_fast:.1f} ms,"
          f" {submit_slow:.1f} ms")  # fmt: skip
    # Noise on a shared machine is tens of ms; waiting for a delivery would be 10 s.
    assert open_slow < open_fast + 100 and submit_slow < submit_fast + 100
    assert max(x for pair in slow for x in pair) < 2_000
    late = receiver.wait_for(
        "a delivery 10 s late", lambda r: len(r.received) > sent_fast, timeout_s=30
    )
    assert late >= 5  # it did wait on the receiver: the calls above did not
    receiver.delay_s = 0
    receiver.down()


def test_deliveries_pending_at_a_restart_are_delivered_after_it(
    deploy: Any, tmp_path: Path
) -> None:
    receiver = Receiver(new_secret()).reserve_port()
    data = tmp_path / "restart-data"
    d = deploy([Hook("durable", receiver, ["opened"], {})], data_dir=data)
    opened = [d.open(n) for n in range(30, 35)]
    d.running.stop()  # with all five still pending: the receiver was never up
    store = SqliteStore(data / "toolreg.db")
    with store.reading() as reads:
        assert reads.webhook_backlog().pending == 5
    store.close()
    receiver.up()
    again = deploy([Hook("durable", receiver, ["opened"], {})], data_dir=data)
    receiver.wait_for("all five", lambda r: len(r.received) == 5, timeout_s=30)
    assert sorted(b["data"]["request_id"] for b in receiver.bodies()) == sorted(opened)
    time.sleep(1)
    assert len(receiver.ids()) == len(set(receiver.ids())) == 5  # none lost, none twice

    def pending() -> int:
        with again.running.app.store.reading() as reads:
            return reads.webhook_backlog().pending

    # Marked delivered by the sender once the receiver's answer is back: after it got it.
    wait_until("an empty backlog", lambda: pending() == 0)
    assert pending() == 0
    receiver.down()


def test_https_receivers_are_verified_against_the_policys_ca(deploy: Any, tmp_path: Path) -> None:
    ca = CertificateAuthority("webhook-test-ca")
    leaf = ca.issue("localhost", server=True)
    files = {}
    for name, data in (("ca.pem", ca.pem), ("cert.pem", leaf.cert_pem), ("key.pem", leaf.key_pem)):
        files[name] = tmp_path / name
        files[name].write_bytes(data)
    receiver = Receiver(new_secret(), cert_file=files["cert.pem"], key_file=files["key.pem"]).up()
    d = deploy([
        Hook("trusted", receiver, ["opened"], {"ca_file": str(files["ca.pem"])}),
        Hook("untrusted", receiver, ["opened"], {}),  # the system's CAs: refused
    ])  # fmt: skip
    request_id = d.open(40)
    receiver.wait_for("the trusted delivery", lambda r: len(r.received) == 1)
    assert receiver.ids() == [f"msg_{request_id}_{receiver.received[0].body['data']['event_seq']}"
                              "_trusted"]  # fmt: skip
    store = d.running.app.store
    deadline = time.monotonic() + 10
    refused = None
    while time.monotonic() < deadline:
        with store.reading() as reads:
            refused = reads.webhook_delivery(receiver.received[0].body["data"]["event_seq"],
                                             "untrusted")  # fmt: skip
        if refused is not None and refused.attempts:
            break
        time.sleep(0.05)
    assert refused is not None and refused.state != DELIVERED
    assert "CERTIFICATE_VERIFY_FAILED" in refused.last_error
    assert receiver.url not in refused.last_error
    receiver.down()


def test_a_server_without_its_webhook_secret_refuses_to_start(
    deploy: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver = Receiver("whsec_c2hvcnQ=").reserve_port()  # 5 bytes: too short to sign with
    with pytest.raises(ConfigError) as info:
        deploy([Hook("weak", receiver, ["opened"], {})])
    message = str(info.value)
    assert "policy.yaml line 26: webhooks[0]: secret_env: $TOOLREG_TEST_WEBHOOK_WEAK" in message
    assert "the key is 5 bytes" in message and receiver.secret not in message
    monkeypatch.delenv("TOOLREG_TEST_WEBHOOK_WEAK")
    config = ServerConfig(data_dir=tmp_path / "unused", policy_file=tmp_path / "policy.yaml")
    with pytest.raises(ConfigError, match=r"\$TOOLREG_TEST_WEBHOOK_WEAK is not set"):
        build_app(config)
