"""Overload: more concurrent executions than sandbox slots plus queue. The excess
is refused with RESOURCE_EXHAUSTED at once; admitted calls complete; nothing is
left behind."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import docker
import grpc
import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.domain.models import parse_definition
from registry_server.wire import convert
from tests.integration.conftest import StartServer, start_server  # noqa: F401
from tests.security.conftest import engine, wait_until_gone  # noqa: F401

pytestmark = pytest.mark.load

SLOTS, QUEUE, CALLS = 2, 2, 12
REFUSAL_MAX_S = 1.0  # a refused call must come back within this


def test_excess_calls_are_refused_quickly(
    start_server: StartServer,  # noqa: F811
    engine: docker.DockerClient,  # noqa: F811
    tmp_path: Path,
) -> None:
    running = start_server(
        data_dir=tmp_path / "data", max_sandboxes=SLOTS, max_queued=QUEUE, max_warm=0
    )
    tool = parse_definition(
        {
            "name": "slow",
            "description": "sleeps two seconds",
            "parameters": {"type": "object"},
            "sandbox": {"image": "toolreg/base", "command": ["sh", "-c", "sleep 2; echo done"]},
        }
    )
    running.stub.RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool)))

    barrier = threading.Barrier(CALLS)
    outcomes: list[tuple[str, float, str]] = []
    lock = threading.Lock()

    def call() -> None:
        barrier.wait()
        start = time.monotonic()
        try:
            result = running.stub.ExecuteTool(
                pb.ExecuteToolRequest(name="slow", arguments_json="{}"), timeout=60
            )
            outcome = ("ok" if result.success else f"status {result.status}", result.error)
        except grpc.RpcError as err:
            assert isinstance(err, grpc.Call)
            outcome = (err.code().name, err.details() or "")
        with lock:
            outcomes.append((outcome[0], time.monotonic() - start, outcome[1]))

    threads = [threading.Thread(target=call) for _ in range(CALLS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads)

    ok = [o for o in outcomes if o[0] == "ok"]
    refused = [o for o in outcomes if o[0] == "RESOURCE_EXHAUSTED"]
    assert len(ok) + len(refused) == CALLS, outcomes
    assert len(ok) >= SLOTS + QUEUE, outcomes
    assert refused, outcomes
    slow_refusals = [o for o in refused if o[1] >= REFUSAL_MAX_S]
    assert not slow_refusals, slow_refusals
    assert all(o[2].strip() for o in refused), "a refusal must say why"
    assert wait_until_gone(engine, running) == [], "containers left behind"
