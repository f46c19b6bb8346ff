"""A server killed (SIGKILL) while a webhook delivery is claimed and in
flight: restarted on the same data directory, it proves its previous
process gone (notify/claimant.py) and sends the delivery again at once,
not after the 70 s claim lease. Real parts: `toolreg serve` processes, the
SQLite file, the test's own receiver verifying the signature."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import open_channel
from registry_server.notify.dispatcher import CLAIM_LEASE_S
from registry_server.notify.endpoints import new_secret
from registry_server.signing.keys import generate_keypair
from tests.factories import sha
from tests.webhook_receiver import Receiver

ROOT = Path(__file__).resolve().parents[2]
AGENT_TOKEN = "crash-agent-secret"
SECRET_ENV = "TOOLREG_TEST_WEBHOOK_CRASH"
PROBE = {
    "name": "notify_probe",
    "description": "Echoes its arguments; dangerous, so each call needs an approval.",
    "safety_level": "dangerous",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
    "sandbox": {"image": "toolreg/base", "command": ["cat"]},
}
STALL_S = 120.0  # seconds the receiver holds the first attempt: past the whole test
TAKEN_BACK_WITHIN_S = 15.0  # seconds from the kill to the delivery: far below the lease
WAIT_S = 30.0  # seconds for what the second server does after the receiver got the delivery


def _wait_until(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"
        time.sleep(0.05)


def _claim(db: Path) -> str:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT claimed_by FROM webhook_deliveries").fetchall()
    return str(rows[0][0]) if rows else ""


def test_a_delivery_claimed_by_a_killed_server_is_sent_at_once_after_its_restart(
    tmp_path: Path,
) -> None:
    assert CLAIM_LEASE_S > 4 * TAKEN_BACK_WITHIN_S  # what the test tells apart
    receiver = Receiver(new_secret(), delay_s=STALL_S).up()
    _, public = generate_keypair()
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "notify_probe.yaml").write_text(yaml.safe_dump(PROBE))
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({
        "audience": "toolreg-webhook-crash",
        "approvers": [{"id": "alice", "public_key": public, "groups": ["security"]}],
        "approval_rules": [
            {"match": {"level": "dangerous"}, "approvals_required": 1, "groups": ["security"]}
        ],
        "clients": [{"id": "agent", "token_sha256": sha(AGENT_TOKEN), "roles": ["execute"],
                     "max_safety_level": "dangerous"}],
        "webhooks": [{"id": "crash", "url": receiver.url, "events": ["opened"],
                      "secret_env": SECRET_ENV, "timeout_s": 30}],
    }, sort_keys=False))  # fmt: skip
    data = tmp_path / "data"
    env = {**os.environ, SECRET_ENV: receiver.secret}
    args = ("--policy", str(policy), "--tools", str(tools))
    servers: list[ServerProcess] = []
    try:
        first = spawn_server(data, *args, cwd=ROOT, env=env)
        servers.append(first)
        channel = open_channel(first.address, token=AGENT_TOKEN)
        result = pb_grpc.ToolRegistryStub(channel).ExecuteTool(
            pb.ExecuteToolRequest(name="notify_probe", arguments_json=json.dumps({"n": 1})),
            timeout=30,
        )
        channel.close()
        assert result.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED, result.error
        request_id = result.approval_request.id

        # The first attempt is claimed and stalls at the receiver; then the crash.
        db = data / "toolreg.db"
        deadline = time.monotonic() + 20
        while ";pid=" not in _claim(db) and time.monotonic() < deadline:
            time.sleep(0.05)
        claimed_by = _claim(db)
        assert f";pid={first.pid};" in claimed_by, claimed_by
        # Killed once its attempt has wholly arrived and stalls, not while still sending
        # it (the claim is written first): a body cut short would not verify.
        receiver.wait_for(
            "the first attempt at the receiver", lambda r: r.arrived >= 1, timeout_s=20
        )
        first.kill()  # SIGKILL: no shutdown, the claim stays with its lease
        killed_at = time.time()
        receiver.delay_s = 0.0

        second = spawn_server(data, *args, cwd=ROOT, env=env)
        servers.append(second)
        receiver.wait_for(
            "the delivery after the restart",
            lambda r: any(d.at >= killed_at for d in r.received),
            timeout_s=TAKEN_BACK_WITHIN_S,
        )
        after = [d for d in receiver.received if d.at >= killed_at]
        assert after[0].at - killed_at < TAKEN_BACK_WITHIN_S
        assert after[0].body["data"]["request_id"] == request_id
        time.sleep(1)  # a second attempt, were there one, would come now
        assert len([d for d in receiver.received if d.at >= killed_at]) == 1  # exactly once
        assert receiver.forged == 0
        # A thread reads the server's stderr: its line reaches second.log a moment later.
        _wait_until(
            "the take-back in the log",
            lambda: any("taken back before their claim lapsed" in line for line in second.log),
        )
        assert any("taken back before their claim lapsed" in line for line in second.log)
        # Released by the sender once the receiver's answer is back, after it got it.
        _wait_until("the claim released", lambda: _claim(db) == "")
        assert _claim(db) == ""  # delivered: the claim is released
    finally:
        for server in servers:
            server.kill()
        receiver.down()
