"""CancelExecution against a real `toolreg serve` with a policy and real
containers: the caller stops its own call (streamed or detached) and the
call's container is gone; the result is CANCELLED and the audit record says
who cancelled it and why; another client gets NOT_FOUND, as for an unknown
id; an admin may cancel any call; an ended call is FAILED_PRECONDITION;
malformed requests are INVALID_ARGUMENT before any look-up; Ctrl-C in
`toolreg exec --stream` cancels the call."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import RegistryClient
from tests import store_file
from tests.factories import collect_events, token_client

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
AGENT, OTHER, ADMIN = "cancel-agent", "cancel-other", "cancel-admin"
EXECUTION_LABEL = "io.toolreg.execution-id"
DATA_DIRS: dict[str, Path] = {}  # server address -> its data directory
SLEEPER = {
    "name": "sleeper",
    "description": "Says it started, then sleeps a minute.",
    "safety_level": "safe",
    "parameters": {"type": "object"},
    "sandbox": {
        "image": "toolreg/base",
        "command": ["sh", "-c", "echo started; sleep 60; echo never"],
        "limits": {"timeout_ms": 90_000},
    },
}
QUICK = {
    "name": "quick",
    "description": "Says hello.",
    "safety_level": "safe",
    "parameters": {"type": "object"},
    "sandbox": {"image": "toolreg/base", "command": ["echo", "hello"]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    base = tmp_path_factory.mktemp("cancel")
    tools = base / "tools"
    tools.mkdir()
    (tools / "sleeper.yaml").write_text(yaml.safe_dump(SLEEPER))
    (tools / "quick.yaml").write_text(yaml.safe_dump(QUICK))
    clients = [
        token_client("agent", AGENT, ["execute"]),
        token_client("other", OTHER, ["execute"]),
        token_client("ops", ADMIN, ["admin"]),
    ]
    policy = base / "policy.yaml"
    policy.write_text(yaml.safe_dump({"audience": "toolreg-cancel", "clients": clients}))
    running = spawn_server(
        base / "data", "--policy", str(policy), "--tools", str(tools), cwd=ROOT, env={**os.environ}
    )
    DATA_DIRS[running.address] = base / "data"
    yield running
    running.kill()


def containers_of(execution_id: str) -> list[str]:
    """`docker ps -a` by the call's label: every container of the call, running or not."""
    out = subprocess.run(
        ["docker", "ps", "-a", "-q", "--filter", f"label={EXECUTION_LABEL}={execution_id}"],
        check=True, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    return out.stdout.split()


def wait_gone(execution_id: str, within_s: float = 20.0) -> list[str]:
    until = time.monotonic() + within_s
    while (left := containers_of(execution_id)) and time.monotonic() < until:
        time.sleep(0.2)
    return left


def audit_of(server: ServerProcess, execution_id: str, within_s: float = 10.0) -> dict[str, Any]:
    until = time.monotonic() + within_s
    while True:
        for _seq, _kind, record in store_file.audit_rows(DATA_DIRS[server.address], "execution"):
            entry: dict[str, Any] = json.loads(record)
            if entry.get("execution_id") == execution_id:
                return entry
        if time.monotonic() > until:
            raise AssertionError(f"no audit record for execution {execution_id}")
        time.sleep(0.2)


def start_sleeper(client: RegistryClient) -> tuple[Iterator[pb.ExecutionEvent], str]:
    """A streamed sleeper, once its tool runs (it printed): (events, execution id)."""
    events = client.stream("sleeper", timeout=120)
    started = next(events)
    assert started.WhichOneof("event") == "started"
    assert next(events).stdout == b"started\n"
    return events, started.started.execution_id


def test_the_caller_cancels_its_streamed_call_and_the_container_is_gone(
    server: ServerProcess,
) -> None:
    with RegistryClient.connect(server.address, token=AGENT) as agent:
        events, execution_id = start_sleeper(agent)
        assert containers_of(execution_id), "the call's container runs"
        began = time.monotonic()
        answer = agent.cancel(execution_id, "the user pressed Ctrl-C", timeout=10)
        assert answer.execution_id == execution_id
        _, _, result = collect_events(events)
        assert time.monotonic() - began < 15, "stopped at once, not at the tool's end"
        assert result is not None and not result.success
        assert result.status == pb.EXECUTION_STATUS_CANCELLED
        assert result.error == "call cancelled by 'agent': the user pressed Ctrl-C"
        assert "never" not in result.content
        assert wait_gone(execution_id) == []
        record = audit_of(server, execution_id)
        assert record["status"] == "CANCELLED" and record["decision"] == "allowed"
        assert (record["cancelled_by"], record["cancel_reason"]) == (
            "agent", "the user pressed Ctrl-C",
        )  # fmt: skip
        # Ended: its result stands.
        with pytest.raises(grpc.RpcError) as info:
            agent.cancel(execution_id, timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_detached_call_is_cancelled_after_its_stream_is_gone(server: ServerProcess) -> None:
    first = RegistryClient.connect(server.address, token=AGENT)
    _events, execution_id = start_sleeper(first)
    first.close()  # the stream ends; the call runs on for its client to re-attach
    time.sleep(1.0)
    assert containers_of(execution_id), "a detached call runs on"
    with RegistryClient.connect(server.address, token=AGENT) as again:
        again.cancel(execution_id, "", timeout=10)
        _, _, result = collect_events(again.attach(execution_id, timeout=30))
    assert result is not None and result.status == pb.EXECUTION_STATUS_CANCELLED
    assert result.error == "call cancelled by 'agent'"
    assert wait_gone(execution_id) == []
    record = audit_of(server, execution_id)
    assert (record["cancelled_by"], record["cancel_reason"]) == ("agent", "")


def test_another_client_cannot_cancel_and_an_admin_can(server: ServerProcess) -> None:
    with RegistryClient.connect(server.address, token=AGENT) as agent:
        events, execution_id = start_sleeper(agent)
        with RegistryClient.connect(server.address, token=OTHER) as other:
            for attempt in (execution_id, "0" * 32):  # another's call, an unknown id
                with pytest.raises(grpc.RpcError) as info:
                    other.cancel(attempt, "not mine", timeout=10)
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
                assert info.value.details() == "no such call runs on this server for this client"
        assert containers_of(execution_id), "the refused cancel stopped nothing"
        with RegistryClient.connect(server.address, token=ADMIN) as admin:
            admin.cancel(execution_id, "runaway call", timeout=10)
            admin.cancel(execution_id, "asked twice", timeout=10)  # still stopping: OK
        _, _, result = collect_events(events)
    assert result is not None and result.status == pb.EXECUTION_STATUS_CANCELLED
    assert result.error == "call cancelled by 'ops': runaway call"
    assert wait_gone(execution_id) == []
    record = audit_of(server, execution_id)
    assert (record["caller"], record["cancelled_by"], record["cancel_reason"]) == (
        "agent", "ops", "runaway call",
    )  # fmt: skip


def test_malformed_requests_are_refused_before_any_look_up(server: ServerProcess) -> None:
    with RegistryClient.connect(server.address, token=AGENT) as agent:
        _, _, result = collect_events(agent.stream("quick", timeout=60))
        assert result is not None and result.success
        for bad_id, reason in (
            ("not-an-id", ""),
            ("x" * 5000, ""),
            (result.execution_id, "r" * 1001),
            (result.execution_id, "line\nbreak"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                agent.cancel(bad_id, reason, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "x" * 100 not in (info.value.details() or "")
        with pytest.raises(grpc.RpcError) as info:
            agent.cancel(result.execution_id, timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_ctrl_c_in_toolreg_exec_stream_cancels_the_call(server: ServerProcess) -> None:
    """`toolreg exec --stream` re-attaches by default; SIGINT cancels the call."""
    env = {**os.environ, "TOOLREG_TOKEN": AGENT}
    argv = [sys.executable, "-m", "registry_server.cli", "exec", "sleeper", "--stream",
            "--address", server.address]  # fmt: skip
    cli = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )
    try:
        assert cli.stdout is not None
        assert cli.stdout.readline() == "started\n"  # the tool runs
        cli.send_signal(signal.SIGINT)
        _, err = cli.communicate(timeout=30)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 130, err
    found = re.search(r"interrupted: call ([0-9a-f]{32}) cancelled", err)
    assert found, err
    execution_id = found.group(1)
    assert wait_gone(execution_id) == []
    record = audit_of(server, execution_id)
    assert record["status"] == "CANCELLED"
    assert (record["cancelled_by"], record["cancel_reason"]) == (
        "agent", "Ctrl-C at the terminal (toolreg exec --stream)",
    )  # fmt: skip
