"""Containers end with their call: deadlines, cancellation, capacity, crashes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import docker
import grpc
import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.cli.launcher import spawn_server
from registry_server.domain.models import parse_definition
from registry_server.wire import convert
from tests.engine_events import of_label, recorded
from tests.integration.conftest import Running, StartServer
from tests.security.conftest import Register, execute, labelled, rpc_code, wait_until_gone

ROOT = Path(__file__).resolve().parents[2]


def test_client_deadline_stops_the_container(
    sandbox_server: Running, register: Register, engine: docker.DockerClient
) -> None:
    register("slow", "sleep 30", limits={"timeout_ms": 10_000})
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        execute(sandbox_server, "slow", timeout=1.5)
    assert rpc_code(info.value) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until_gone(engine, sandbox_server, timeout_s=5) == []
    assert time.monotonic() - started < 7  # long before the tool's own 10 s limit


def test_client_cancel_stops_the_stream(
    sandbox_server: Running, register: Register, engine: docker.DockerClient
) -> None:
    register(
        "ticker",
        "i=0; while :; do echo tick $i; i=$((i+1)); sleep 0.2; done",
        limits={"timeout_ms": 10_000},
    )
    call = sandbox_server.stub.StreamExecuteTool(pb.ExecuteToolRequest(name="ticker"))
    assert next(call).WhichOneof("event") == "started"
    first = next(call)
    assert first.stdout.startswith(b"tick 0")
    call.cancel()
    assert wait_until_gone(engine, sandbox_server, timeout_s=5) == []


def test_stream_delivers_chunks_then_one_result(
    sandbox_server: Running, register: Register
) -> None:
    register("chatty", "echo one; sleep 0.3; echo two >&2; sleep 0.3; echo three")
    events = list(
        sandbox_server.stub.StreamExecuteTool(pb.ExecuteToolRequest(name="chatty"), timeout=30)
    )
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds[0] == "started" and kinds.count("started") == 1
    assert events[0].started.execution_id == events[-1].result.execution_id
    assert kinds[-1] == "result" and kinds.count("result") == 1
    stdout = b"".join(e.stdout for e in events if e.WhichOneof("event") == "stdout")
    stderr = b"".join(e.stderr for e in events if e.WhichOneof("event") == "stderr")
    assert stdout == b"one\nthree\n" and stderr == b"two\n"
    assert kinds.index("stderr") > kinds.index("stdout")  # arrived as produced
    assert events[-1].result.success and events[-1].result.content == "one\nthree\n"


def test_capacity_excess_gets_resource_exhausted(
    start_server: StartServer, engine: docker.DockerClient, tmp_path: Path
) -> None:
    running = start_server(max_sandboxes=1, max_queued=1)
    tool = parse_definition(
        {
            "name": "hold",
            "description": "d",
            "parameters": {"type": "object"},
            "sandbox": {"image": "toolreg/base", "command": ["sleep", "2"]},
        }
    )
    running.stub.RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool)))
    results: list[object] = []

    def call() -> None:
        try:
            results.append(execute(running, "hold").status)
        except grpc.RpcError as exc:
            results.append(rpc_code(exc))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join()
    ok = pb.EXECUTION_STATUS_OK
    assert sorted(map(str, results)) == sorted(
        map(str, [ok, ok, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED])
    )
    assert wait_until_gone(engine, running) == []


def _spawn_server(data_dir: Path) -> tuple[subprocess.Popen[str], str]:
    server = spawn_server(data_dir, cwd=ROOT)
    return server.proc, server.address


def _owned_by(engine: docker.DockerClient, pid: int) -> list[str]:
    return labelled(engine, f"io.toolreg.owner-pid={pid}")


# Serial: what a SIGKILLed server leaves (owner provably gone) is every reaper's to remove,
# and each toolreg server starting on this engine reaps at start, whatever its test: one
# that another test file starts between the kill and the look at the leftovers takes them.
@pytest.mark.serial
def test_sigkilled_server_leaves_containers_the_next_start_removes(
    engine: docker.DockerClient, tmp_path: Path
) -> None:
    proc, address = _spawn_server(tmp_path / "a")
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.ToolRegistryStub(channel)
    tool = parse_definition(
        {
            "name": "nap",
            "description": "d",
            "parameters": {"type": "object"},
            "sandbox": {
                "image": "toolreg/base",
                "command": ["sleep", "60"],
                "limits": {"timeout_ms": 60_000},
            },
        }
    )
    stub.RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool)))
    calls = [stub.ExecuteTool.future(pb.ExecuteToolRequest(name="nap")) for _ in range(10)]
    deadline = time.monotonic() + 30
    while len(_owned_by(engine, proc.pid)) < 8 and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    for c in calls:
        c.cancel()
    channel.close()
    leftovers = _owned_by(engine, proc.pid)
    assert len(leftovers) >= 8, "the killed server should have left its running containers"
    successor, _ = _spawn_server(tmp_path / "b")
    try:
        assert _owned_by(engine, proc.pid) == []
    finally:
        successor.send_signal(signal.SIGTERM)
        successor.wait(timeout=30)


def _networks_owned_by(engine: docker.DockerClient, pid: int) -> list[str]:
    return [
        n["Name"] for n in engine.api.networks(filters={"label": f"io.toolreg.owner-pid={pid}"})
    ]


@pytest.mark.serial  # as the test above: another file's server would reap what is left
def test_sigkilled_server_leaves_egress_networks_the_next_start_removes(
    engine: docker.DockerClient, tmp_path: Path
) -> None:
    """The networks a server makes ahead of calls with egress (and its proxy)
    carry its labels: after a SIGKILL, the next server's start removes them."""
    proc, address = _spawn_server(tmp_path / "a")
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.ToolRegistryStub(channel)
            tool = parse_definition(
                {
                    "name": "offline_egress",
                    "description": "d",
                    "parameters": {"type": "object"},
                    "safety_level": "cautious",
                    "network": {"egress": ["example.com:443"]},
                    "sandbox": {"image": "toolreg/base", "command": ["cat"]},
                }
            )
            stub.RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool)))
            result = stub.ExecuteTool(pb.ExecuteToolRequest(name="offline_egress"), timeout=60)
            assert result.success, result.error
            deadline = time.monotonic() + 30  # the pool fills after the call
            while time.monotonic() < deadline:
                pooled = [n for n in _networks_owned_by(engine, proc.pid) if "net-pool-" in n]
                if len(pooled) >= 2:
                    break
                time.sleep(0.2)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    left = _networks_owned_by(engine, proc.pid)
    assert len([n for n in left if "net-pool-" in n]) >= 2, left
    assert _owned_by(engine, proc.pid), "the killed server's proxy should be left"
    successor, _ = _spawn_server(tmp_path / "b")
    try:
        assert _owned_by(engine, proc.pid) == []
        assert _networks_owned_by(engine, proc.pid) == []
    finally:
        successor.send_signal(signal.SIGTERM)
        successor.wait(timeout=30)


def test_two_servers_never_remove_each_others_live_containers(
    engine: docker.DockerClient, tmp_path: Path
) -> None:
    first, address = _spawn_server(tmp_path / "a")
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.ToolRegistryStub(channel)
            tool = parse_definition(
                {
                    "name": "nap",
                    "description": "d",
                    "parameters": {"type": "object"},
                    "sandbox": {
                        "image": "toolreg/base",
                        "command": ["sh", "-c", "sleep 3; echo done"],
                    },
                }
            )
            stub.RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool)))
            call = stub.ExecuteTool.future(pb.ExecuteToolRequest(name="nap"), timeout=30)
            deadline = time.monotonic() + 10
            while not _owned_by(engine, first.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _owned_by(engine, first.pid), "first server's call never started"
            second, _ = _spawn_server(tmp_path / "b")  # reaps at start
            reaper = subprocess.run(
                [sys.executable, "-m", "registry_server.cli", "reap"],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=60,
            )
            assert reaper.returncode == 0, reaper.stderr
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=30)
            result = call.result()
            assert result.success and result.content == "done\n"
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=30)
    assert _owned_by(engine, first.pid) == []


def test_engine_errors_are_results_not_crashes(sandbox_server: Running, register: Register) -> None:
    register("ghost_image", "", image="toolreg/does-not-exist", command=["true"])
    result = execute(sandbox_server, "ghost_image")
    assert result.status == pb.EXECUTION_STATUS_SANDBOX_ERROR
    assert "toolreg/does-not-exist" in result.error
    register("still_ok", "echo fine")
    assert execute(sandbox_server, "still_ok").content == "fine\n"


def test_invalid_arguments_start_no_container(
    sandbox_server: Running, register: Register, engine: docker.DockerClient
) -> None:
    tool = parse_definition(
        {
            "name": "typed",
            "description": "d",
            "parameters": {
                "type": "object",
                "properties": {
                    "n": {"type": "integer", "minimum": 0},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["n"],
            },
            "sandbox": {"image": "toolreg/base", "command": ["sh", "-c", "sleep 5"]},
        }
    )
    sandbox_server.stub.RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool)))
    events: list[object] = []
    # Recorded live: the engine's replay (events --since) holds only its last 256 events,
    # which other test files' containers push out, and an empty answer would prove nothing.
    with recorded(engine) as recording:
        for args, needle in [
            ('{"n": -1, "tags": ["a", 2]}', "$.n"),
            ('{"n": 1, "n": 2}', "duplicate key"),
            ('{"n": NaN}', "NaN"),
            ("[1]", "JSON object"),
            ('{"tags": []}', "'n' is a required"),
        ]:
            result = execute(sandbox_server, "typed", args)
            assert result.status == pb.EXECUTION_STATUS_INVALID_ARGUMENTS, args
            assert needle in result.error
            events.append(result)
        both = execute(sandbox_server, "typed", '{"n": -1, "tags": ["a", 2]}').error
        assert "$.n" in both and "$.tags[1]" in both  # every violation, by JSON path
    instance = sandbox_server.app.backend.instance_id
    created = [
        e for e in recording.events if e.get("Type") == "container" and e.get("Action") == "create"
    ]
    assert of_label(created, "io.toolreg.instance", instance) == []
