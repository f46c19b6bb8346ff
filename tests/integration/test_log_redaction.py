"""A webhook URL is a credential (a Slack URL's path is its secret): against
the real parts, it never reaches the server's log, not even through the HTTP
client library's own logger at DEBUG.

`toolreg serve` runs as its own process at ``--log-level DEBUG`` with a
policy whose webhook points at the test's own receiver on loopback, under a
path that carries a secret-looking token. Deliveries are made: one refused
(nothing listens yet), one answered 500, then delivered once the receiver
answers 200, each retry on the server's own schedule. The log the process
wrote is then read back: the token appears on no line, the endpoint's id
does (the retries and the delivery), and so does the rest of the DEBUG log
(so the level really was DEBUG)."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import RegistryClient
from registry_server.notify.endpoints import new_secret
from tests.factories import sha
from tests.webhook_receiver import Receiver

ROOT = Path(__file__).resolve().parents[2]
ENDPOINT_ID = "chat-ops"
AGENT_TOKEN = "redaction-agent-7d3e91"
SECRET_ENV = "TOOLREG_TEST_REDACTION_WEBHOOK_SECRET"
WAIT_S = 30.0  # seconds for a delivery or a log line
PROBE = {
    "name": "redaction_probe",
    "description": "Echoes its arguments; dangerous, so each call opens an approval request.",
    "safety_level": "dangerous",
    "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
    "sandbox": {"image": "toolreg/base", "command": ["cat"]},
}


def wait_until(what: str, check: Callable[[], bool], log: list[str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {WAIT_S} s; the server's last lines:\n"
                                 + "".join(log[-20:]))  # fmt: skip
        time.sleep(0.05)


@pytest.fixture
def hook_token() -> str:
    """The URL's secret part, as Slack's incoming-webhook URLs end in one."""
    return secrets.token_hex(12)


@pytest.fixture
def server(tmp_path: Path, hook_token: str) -> Iterator[tuple[ServerProcess, Receiver, str]]:
    receiver = Receiver(new_secret()).reserve_port()  # nothing listens yet: refused
    url = f"http://127.0.0.1:{receiver.port}/services/T0TEST/B0TEST/{hook_token}"
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "redaction_probe.yaml").write_text(yaml.safe_dump(PROBE))
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({
        "audience": "toolreg-redaction",
        "clients": [{"id": "agent", "token_sha256": sha(AGENT_TOKEN), "roles": ["execute"],
                     "max_safety_level": "dangerous"}],
        "webhooks": [{"id": ENDPOINT_ID, "url": url, "events": ["opened"],
                      "secret_env": SECRET_ENV}],
    }, sort_keys=False))  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLREG_")}
    env |= {SECRET_ENV: receiver.secret, "TOOLREG_WEBHOOK_RETRY_BASE_S": "0.3"}
    running = spawn_server(
        tmp_path / "data", "--tools", str(tools), "--policy", str(policy),
        "--log-level", "DEBUG", "--log-format", "json", cwd=ROOT, env=env,
    )  # fmt: skip
    try:
        yield running, receiver, url
    finally:
        running.stop()
        receiver.down()


def open_request(server: ServerProcess, n: int) -> str:
    with RegistryClient.connect(server.address, token=AGENT_TOKEN) as agent:
        result = agent.execute_tool("redaction_probe", {"n": n}, timeout=60)
    assert result.needs_approval and result.approval_request is not None, result
    return result.approval_request.id


def test_a_webhook_urls_secret_never_reaches_the_servers_log_at_debug(
    server: tuple[ServerProcess, Receiver, str], hook_token: str
) -> None:
    running, receiver, url = server
    log = running.log
    first = open_request(running, 1)

    def attempt_failed(n: int) -> Callable[[], bool]:
        mark = f"to endpoint {ENDPOINT_ID}: attempt {n} failed"
        return lambda: any(mark in line for line in list(log))

    wait_until("a refused attempt, logged", attempt_failed(1), log)
    receiver.status = 500
    receiver.up()  # on the same port: the next attempt gets an answer, an error
    wait_until("an attempt answered 500", lambda: len(receiver.received) >= 1, log)
    receiver.status = 200
    second = open_request(running, 2)
    wait_until(
        "both requests delivered",
        lambda: (
            {b["data"]["request_id"] for b in receiver.bodies()} >= {first, second}
            and receiver.status == 200
            and sum(1 for line in list(log) if f"delivered to {ENDPOINT_ID}" in line) >= 2
        ),
        log,
    )
    running.stop()  # everything it will write is written
    text = "".join(log)
    lines = [json.loads(line) for line in log if line.startswith("{")]

    assert hook_token not in text, "the webhook URL's secret reached the server's log"
    assert url not in text and "/services/T0TEST" not in text
    # The endpoint is named by its id instead: the failed attempts and the deliveries.
    failed = [x for x in lines if f"to endpoint {ENDPOINT_ID}: attempt" in x["event"]]
    assert any("ConnectError" in x["event"] for x in failed), failed  # the refused one
    assert any("HTTP 500" in x["event"] for x in failed), failed  # answered, an error
    delivered = [x for x in lines if f"delivered to {ENDPOINT_ID}" in x["event"]]
    assert len(delivered) >= 2 and {x["level"] for x in delivered} == {"debug"}
    # The level was DEBUG for the server's own loggers, not for the HTTP client's.
    assert not any(x["logger"].startswith(("httpx", "httpcore")) for x in lines), [
        x for x in lines if x["logger"].startswith(("httpx", "httpcore"))
    ]
