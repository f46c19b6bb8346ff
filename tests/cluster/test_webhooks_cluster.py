"""Webhooks with three real servers on one real PostgreSQL: every server runs
a dispatcher, and each approval event reaches the receiver exactly once,
whichever server stored it (counted by webhook-id at the receiver, which
verifies each signature). The claims' lease and SKIP LOCKED make that so
(tests/cluster/test_webhook_outbox_store.py holds the store to it)."""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.notify.endpoints import new_secret
from registry_server.signing.keys import generate_keypair
from tests.cluster.conftest import Cluster
from tests.cluster.conftest import write_policy as cluster_policy
from tests.webhook_receiver import Receiver

SECRET_ENV = "TOOLREG_TEST_CLUSTER_WEBHOOK"
REQUESTS = 12  # each: OPENED, APPROVAL_ADDED, APPROVED -> 36 events


def write_policy(path: Path, alice_public: str, receiver: Receiver) -> None:
    """The cluster tests' policy, with one webhook endpoint: ``receiver``."""
    cluster_policy(path, alice_public)
    policy: dict[str, Any] = yaml.safe_load(path.read_text())
    policy["webhooks"] = [
        {"id": "team", "url": receiver.url, "secret_env": SECRET_ENV,
         "events": ["opened", "approval_added", "approved"]},
    ]  # fmt: skip
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


def test_three_servers_deliver_each_event_exactly_once(
    database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    receiver = Receiver(new_secret()).up()
    monkeypatch.setenv(SECRET_ENV, receiver.secret)
    monkeypatch.setenv("TOOLREG_WEBHOOK_RETRY_BASE_S", "0.5")
    monkeypatch.delenv("TOOLREG_STORE_URL", raising=False)
    private, public = generate_keypair()
    policy = tmp_path / "policy.yaml"
    write_policy(policy, public, receiver)
    cluster = Cluster(database, policy, tmp_path, private)
    try:
        for index in range(3):
            cluster.start(index)
        opened: list[str] = []
        for n in range(REQUESTS):
            # Opened through one server, approved through the next.
            result = cluster.stub(n % 3, "agent").ExecuteTool(
                pb.ExecuteToolRequest(
                    name="write_file",
                    arguments_json=f'{{"path": "w{n}.txt", "content": "{n}"}}',
                ),
                timeout=30,
            )
            assert result.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, result.error
            opened.append(result.approval_request.id)
            assert cluster.approve((n + 1) % 3, result.approval_request.id).state == "APPROVED"
        events = 3 * REQUESTS
        receiver.wait_for(f"{events} deliveries", lambda r: len(set(r.ids())) == events, 30)
        time.sleep(2)  # room for any duplicate to arrive
        counts = collections.Counter(receiver.ids())
        assert len(counts) == events and set(counts.values()) == {1}, counts.most_common(3)
        assert receiver.forged == 0
        by_request = collections.defaultdict(list)
        for body in receiver.bodies():
            by_request[body["data"]["request_id"]].append(body["type"])
        assert sorted(by_request) == sorted(opened)
        assert all(sorted(t) == ["approval.approval_added", "approval.approved",
                                 "approval.opened"] for t in by_request.values())  # fmt: skip
    finally:
        cluster.stop()
        receiver.down()
