"""Metrics, health and logs of a real server on the real engine."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.cli.launcher import spawn_server
from tests.integration.conftest import Running, StartServer
from tests.security.conftest import execute

ROOT = Path(__file__).resolve().parents[2]
LOG_WAIT_S = 30  # seconds for a line the server wrote to reach its log reader thread


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@pytest.fixture
def metered(start_server: StartServer, tmp_path: Path) -> Running:
    return start_server(data_dir=tmp_path / "metered", metrics_port=0)


def test_metrics_over_http(metered: Running) -> None:
    from registry_server.domain.models import parse_definition
    from registry_server.wire import convert

    tool = parse_definition(
        {
            "name": "echo",
            "description": "d",
            "parameters": {"type": "object"},
            "sandbox": {"image": "toolreg/base", "command": ["cat"]},
        }
    )
    metered.stub.RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool)))
    assert execute(metered, "echo", '{"a": 1}').success
    assert execute(metered, "ghost").status == pb.EXECUTION_STATUS_TOOL_NOT_FOUND
    with pytest.raises(grpc.RpcError):
        metered.stub.RegisterTool(pb.RegisterToolRequest())
    m = scrape(metered.app.metrics_port)
    assert m['toolreg_grpc_calls_total{code="OK",method="ExecuteTool"}'] == 2
    assert m['toolreg_grpc_calls_total{code="INVALID_ARGUMENT",method="RegisterTool"}'] == 1
    assert m['toolreg_executions_total{level="safe",status="OK",tool="echo"}'] == 1
    # only registered names become labels
    assert (
        m['toolreg_executions_total{level="unknown",status="TOOL_NOT_FOUND",tool="(unregistered)"}']
        == 1
    )
    assert m['toolreg_sandbox_seconds_count{level="safe",warm="cold"}'] == 1
    assert m['toolreg_grpc_call_seconds_count{method="ExecuteTool"}'] == 2
    assert m["toolreg_live_sandboxes"] == 0 and m["toolreg_queued_calls"] == 0
    assert m["toolreg_engine_up"] == 1


def test_health_is_not_serving_without_an_engine(start_server: StartServer, tmp_path: Path) -> None:
    running = start_server(
        data_dir=tmp_path / "noengine", docker_url="unix:///nonexistent/docker.sock"
    )
    health = health_pb2_grpc.HealthStub(running.channel)
    for service in ("", "toolregistry.v1.ToolRegistry"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert running.stub.ListTools(pb.ListToolsRequest()).tools == []  # the registry still serves


def test_json_logs_one_object_per_line(tmp_path: Path) -> None:
    server = spawn_server(
        tmp_path / "data",
        "--tools",
        str(ROOT / "examples" / "tools"),
        "--log-format",
        "json",
        cwd=ROOT,
    )
    try:
        with grpc.insecure_channel(server.address) as channel:
            from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc

            result = pb_grpc.ToolRegistryStub(channel).ExecuteTool(
                pb.ExecuteToolRequest(name="echo", arguments_json='{"message": "hi"}'), timeout=60
            )
            assert result.success
    finally:
        assert server.stop() == 0
    # A thread reads its stderr: lines it wrote reach server.log a moment later,
    # even after it exited.
    deadline = time.monotonic() + LOG_WAIT_S
    while not any(
        '"execution"' in line and json.loads(line).get("execution_id") == result.execution_id
        for line in list(server.log)
    ):
        assert time.monotonic() < deadline, "the execution's line never reached the log"
        time.sleep(0.05)
    lines = [json.loads(line) for line in server.log if line.strip()]
    assert all({"ts", "level", "logger", "event"} <= set(line) for line in lines)
    executions = [line for line in lines if line["event"] == "execution"]
    assert executions and executions[-1]["tool"] == "echo" and executions[-1]["status"] == "OK"
    assert (
        executions[-1]["execution_id"] == result.execution_id
        and executions[-1]["caller"] == "developer"
    )
