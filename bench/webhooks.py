"""How soon approvers are told: the time from an approval request opening
(and from its approval) to its webhook arriving at a receiver.

One `toolreg serve` with a policy naming one webhook endpoint: the tests'
receiver (tests/webhook_receiver.py) on loopback in this process, verifying
every signature. Requests are opened and approved one at a time, each
waiting for its webhook before the next, so the numbers are latency, not
queueing. Times are from just before the RPC is sent to the delivery's
arrival, and from the event's own timestamp (stored in the server) to it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from bench.common import OUR_PIDS, RPC_TIMEOUT_S, summary
from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.cli.launcher import spawn_server
from registry_server.client.registry_client import open_channel
from registry_server.notify.endpoints import new_secret
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from tests.webhook_receiver import Receiver

REQUESTS = 30  # requests opened and approved, one at a time
ARRIVAL_TIMEOUT_S = 10.0  # seconds a webhook may take before the run is an error
TOOL = "bench_notify"
TOKENS = {"agent": "bench-webhook-agent", "approver": "bench-webhook-approver"}
SECRET_ENV = "TOOLREG_BENCH_WEBHOOK_SECRET"


def run() -> dict[str, Any]:
    data = Path(tempfile.mkdtemp(prefix="toolreg-bench-webhooks-"))
    receiver = Receiver(new_secret()).up()
    private, public = generate_keypair()
    policy = _write_policy(data, public, receiver)
    (data / "tools").mkdir()
    (data / "tools" / f"{TOOL}.yaml").write_text(yaml.safe_dump({
        "name": TOOL, "description": "Echoes; dangerous, so every call needs an approval.",
        "safety_level": "dangerous", "parameters": {"type": "object"},
        "sandbox": {"image": "toolreg/base", "command": ["cat"]},
    }))  # fmt: skip
    env = {**os.environ, SECRET_ENV: receiver.secret}
    server = spawn_server(data / "server", "--policy", str(policy), "--tools",
                          str(data / "tools"), env=env)  # fmt: skip
    OUR_PIDS.add(server.pid)
    agent = open_channel(server.address, token=TOKENS["agent"])
    approver = open_channel(server.address, token=TOKENS["approver"])
    try:
        opened, approved, stored = [], [], []
        key = load_private_key(private)
        for n in range(-3, REQUESTS):  # three unmeasured first
            t_open = time.time()
            result = pb_grpc.ToolRegistryStub(agent).ExecuteTool(
                pb.ExecuteToolRequest(name=TOOL, arguments_json=json.dumps({"n": n})),
                timeout=RPC_TIMEOUT_S,
            )
            if result.status != pb.EXECUTION_STATUS_APPROVAL_REQUIRED:
                raise RuntimeError(f"expected APPROVAL_REQUIRED, got {result.error}")
            request = result.approval_request
            arrived = _arrival(receiver, request.id, "approval.opened")
            t_approve = time.time()
            token = mint_for(key, issuer="bench", request=request, bind_request=True)
            pb_grpc.ToolRegistryStub(approver).SubmitApproval(
                pb.SubmitApprovalRequest(request_id=request.id, token=token),
                timeout=RPC_TIMEOUT_S,
            )
            approved_at = _arrival(receiver, request.id, "approval.approved")
            if n >= 0:
                opened.append((arrived[0] - t_open) * 1000)
                approved.append((approved_at[0] - t_approve) * 1000)
                stored += [
                    (arrived[0] - arrived[1]) * 1000,
                    (approved_at[0] - approved_at[1]) * 1000,
                ]
        return {
            "requests": REQUESTS,
            "rows": [
                {"what": "request opened (ExecuteTool sent) -> webhook arrived", **summary(opened)},
                {"what": "request approved (SubmitApproval sent) -> webhook arrived",
                 **summary(approved)},
                {"what": "event stored (its timestamp) -> webhook arrived", **summary(stored)},
            ],
            "deliveries": len(receiver.received),
            "forged": receiver.forged,
        }  # fmt: skip
    finally:
        agent.close()
        approver.close()
        server.stop()
        receiver.down()
        shutil.rmtree(data, ignore_errors=True)


def _arrival(receiver: Receiver, request_id: str, type_: str) -> tuple[float, float]:
    """(when the delivery arrived, when the event was stored), both time.time()."""
    deadline = time.monotonic() + ARRIVAL_TIMEOUT_S
    while time.monotonic() < deadline:
        for d in list(receiver.received):
            if d.body.get("type") == type_ and d.body["data"]["request_id"] == request_id:
                return d.at, _epoch(d.body["timestamp"])
        time.sleep(0.0005)
    raise RuntimeError(f"no {type_} webhook for {request_id} within {ARRIVAL_TIMEOUT_S} s")


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _write_policy(data: Path, public: str, receiver: Receiver) -> Path:
    def sha(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    policy = {
        "audience": "toolreg-bench-webhooks",
        "approvers": [{"id": "bench", "public_key": public}],
        "clients": [
            {"id": "agent", "token_sha256": sha(TOKENS["agent"]), "roles": ["execute"],
             "max_safety_level": "dangerous"},
            {"id": "approver", "token_sha256": sha(TOKENS["approver"]), "roles": ["approve"]},
        ],
        "webhooks": [{"id": "bench", "url": receiver.url, "secret_env": SECRET_ENV,
                      "events": ["opened", "approved"]}],
    }  # fmt: skip
    path = data / "policy.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    return path
