"""Fault: the Docker engine is stopped while calls run, and started again.

Calls in flight and calls made while it is down fail with SANDBOX_ERROR or
UNAVAILABLE (never INTERNAL, never a hang), the registry keeps answering,
health turns NOT_SERVING and back, and the same server process runs calls
again once the engine answers, leaving no container behind.

This stops the real dockerd of this machine (SIGTERM via its pid file, as
`systemctl stop docker` would) and starts it again with the project's own
`scripts/ensure_docker.sh`, so it needs root and an engine that script runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import docker
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.domain.models import parse_definition
from registry_server.wire import convert
from tests.integration.conftest import Running, StartServer, start_server  # noqa: F401
from tests.security.conftest import (  # noqa: F401
    INSTANCE_LABEL,
    containers_of,
    engine,
    wait_until_gone,
)

pytestmark = pytest.mark.fault

ROOT = Path(__file__).resolve().parents[2]
DOCKER_PIDFILE = Path("/var/run/docker.pid")
IN_FLIGHT = 3  # calls running in containers when the engine stops
WHILE_DOWN = 4  # calls made while it is down
HEALTH_INTERVAL_S = 0.5
FAIL_FAST_S = 5.0  # a call made while the engine is down must fail within this
ENGINE_STOP_S = 60.0  # dockerd stops its containers (10 s grace) before it exits
ENGINE_START_S = 120.0
# Runs until stopped; as PID 1 it must trap SIGTERM itself, or dockerd would wait
# its 10 s grace before SIGKILL and the safe profile's own timeout would fire first.
SLOW = "trap 'exit 143' TERM; while :; do sleep 0.2; done"
EXPECTED_FAILURES = {"UNAVAILABLE", "SANDBOX_ERROR"}


def _dockerd_pid() -> int:
    if os.geteuid() != 0 or not DOCKER_PIDFILE.is_file():
        pytest.skip("needs root and a dockerd with /var/run/docker.pid (as make test starts it)")
    pid = int(DOCKER_PIDFILE.read_text().strip())
    if Path(f"/proc/{pid}/comm").read_text().strip() != "dockerd":
        pytest.skip(f"{DOCKER_PIDFILE} does not name a running dockerd")
    return pid


def _start_engine() -> None:
    subprocess.run(
        ["bash", str(ROOT / "scripts/ensure_docker.sh")],
        check=True, timeout=ENGINE_START_S, capture_output=True, text=True,
    )  # fmt: skip


@pytest.fixture
def stoppable_engine(engine: docker.DockerClient) -> Iterator[int]:  # noqa: F811
    """The dockerd pid; whatever the test does, the engine answers again afterwards
    (the rest of the suite needs it)."""
    pid = _dockerd_pid()
    yield pid
    if not _answers(engine):
        _start_engine()


def _answers(engine: docker.DockerClient) -> bool:  # noqa: F811
    try:
        return bool(engine.ping())
    except Exception:
        return False


def _health(running: Running) -> int:
    stub = health_pb2_grpc.HealthStub(running.channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _wait_for(what: str, predicate: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _running_slow(client: docker.DockerClient, running: Running) -> int:
    """This server's containers running the slow command: the calls in flight, counted
    by what they run (the echo call's container, its removal queued, and the warm one
    are not calls in flight)."""
    listed = client.api.containers(
        filters={"label": f"{INSTANCE_LABEL}={running.app.backend.instance_id}",
                 "status": "running"}
    )  # fmt: skip
    return sum(SLOW in (c.get("Command") or "") for c in listed)


def _outcome(running: Running, name: str, args: dict[str, object]) -> tuple[str, str]:
    """("ok", content) or (failure kind, message) for one ExecuteTool."""
    try:
        result = running.stub.ExecuteTool(
            pb.ExecuteToolRequest(name=name, arguments_json=json.dumps(args)), timeout=90
        )  # the echo tool answers with the arguments as the server canonicalised them
    except grpc.RpcError as err:
        assert isinstance(err, grpc.Call)
        return err.code().name, err.details() or ""
    if result.success:
        return "ok", json.dumps(json.loads(result.content))
    return pb.ExecutionStatus.Name(result.status).removeprefix("EXECUTION_STATUS_"), result.error


def test_engine_stopped_during_calls_and_started_again(
    start_server: StartServer,  # noqa: F811
    engine: docker.DockerClient,  # noqa: F811
    stoppable_engine: int,
    tmp_path: Path,
) -> None:
    running = start_server(
        data_dir=tmp_path / "data", max_warm=2, health_interval_s=HEALTH_INTERVAL_S
    )
    tools = (("echo", ["cat"], 0), ("slow", ["sh", "-c", SLOW], 0), ("pooled", ["cat"], 1))
    for name, command, warm in tools:
        tool = parse_definition(
            {
                "name": name,
                "description": f"{name} for the engine-stop test",
                "parameters": {"type": "object"},
                "sandbox": {"image": "toolreg/base", "command": command},
                "warm_pool": warm,
            }
        )
        running.stub.RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool)))
    assert _outcome(running, "echo", {"before": 1}) == ("ok", json.dumps({"before": 1}))
    assert _health(running) == health_pb2.HealthCheckResponse.SERVING
    pools = running.app.pools
    assert pools is not None
    _wait_for("a warm container", lambda: pools.stats().warm.get("pooled") == 1, 30)

    # Calls that are running in their containers when the engine stops.
    in_flight: list[tuple[str, str]] = []
    threads = [
        threading.Thread(target=lambda: in_flight.append(_outcome(running, "slow", {})))
        for _ in range(IN_FLIGHT)
    ]
    for t in threads:
        t.start()
    _wait_for(
        "the slow calls' containers running",
        lambda: _running_slow(engine, running) == IN_FLIGHT,
        30,
    )

    os.kill(stoppable_engine, signal.SIGTERM)
    _wait_for("dockerd to exit", lambda: not Path(f"/proc/{stoppable_engine}").exists(),
              ENGINE_STOP_S)  # fmt: skip
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a call hung after the engine stopped"
    print("in flight when the engine stopped:", in_flight)
    assert len(in_flight) == IN_FLIGHT
    assert {kind for kind, _ in in_flight} <= EXPECTED_FAILURES, in_flight
    assert all(message.strip() for _, message in in_flight), in_flight

    # While it is down: health says so, executions fail fast and say why, the
    # registry itself keeps answering.
    _wait_for(
        "health NOT_SERVING",
        lambda: _health(running) == health_pb2.HealthCheckResponse.NOT_SERVING,
        10,
    )
    for i in range(WHILE_DOWN):
        start = time.monotonic()
        kind, message = _outcome(running, "echo", {"down": i})
        elapsed = time.monotonic() - start
        print(f"while down: {kind} in {elapsed * 1000:.0f} ms: {message}")
        assert kind in EXPECTED_FAILURES, (kind, message)
        assert "engine" in message.lower(), message
        assert elapsed < FAIL_FAST_S, elapsed
    listed = running.stub.ListTools(pb.ListToolsRequest(), timeout=5).tools
    assert {t.name for t in listed} == {name for name, _, _ in tools}

    # Started again: the same server process serves executions again.
    _start_engine()
    _wait_for(
        "health SERVING again",
        lambda: _health(running) == health_pb2.HealthCheckResponse.SERVING,
        30,
    )
    for i in range(3):
        assert _outcome(running, "echo", {"after": i}) == ("ok", json.dumps({"after": i}))
    # The warm container the engine killed is never handed a call; the pool refills.
    assert _outcome(running, "pooled", {"after": 0}) == ("ok", json.dumps({"after": 0}))
    _wait_for("the pool to refill", lambda: pools.stats().warm.get("pooled") == 1, 30)
    hits = pools.stats().hits
    assert _outcome(running, "pooled", {"after": 1}) == ("ok", json.dumps({"after": 1}))
    assert pools.stats().hits == hits + 1, "the call after recovery was not served warm"

    # The containers the engine stopped under us are removed once it is back; only
    # the pool's fresh warm container remains until the server stops.
    _wait_for(
        "only the warm container to remain",
        lambda: len(containers_of(engine, running)) == 1,
        30,
    )
    running.stop()
    assert wait_until_gone(engine, running) == []
