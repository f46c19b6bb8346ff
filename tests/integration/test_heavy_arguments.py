"""Calls with large arguments through a real server on loopback: checked in a
worker process after a turn of the fair gate (execution/heavy_work.py), they
are answered exactly as the same calls checked on the server's own thread.

The server's threshold is lowered to 1 KiB so one server serves both paths:
each case is sent once small (light) and once padded past the threshold
(heavy), with the same outcome and the same text."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
import rfc8785
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.client.registry_client import open_channel
from registry_server.domain.models import parse_definition
from registry_server.wire import convert
from tests.factories import sha
from tests.integration.conftest import Running, StartServer
from tests.security.conftest import engine, wait_until_gone  # noqa: F401

THRESHOLD = 1024  # bytes: the server's heavy_arguments_bytes here
PAD = "p" * (2 * THRESHOLD)  # makes any of these calls heavy
TOKEN = "heavy-arguments-secret"
S = pb.ExecutionStatus
PARAMETERS = {
    "type": "object",
    "properties": {"q": {"type": "string"}, "pad": {"type": "string"}},
    "required": ["q"],
    "additionalProperties": False,
}


@pytest.fixture
def served(
    start_server: StartServer,
    tmp_path: Path,
    engine: docker.DockerClient,  # noqa: F811
) -> Iterator[tuple[Running, pb_grpc.ToolRegistryStub]]:
    policy = {
        "audience": "toolreg-heavy-arguments",
        "clients": [{"id": "agent", "token_sha256": sha(TOKEN), "roles": ["execute", "register"],
                     "max_safety_level": "safe"}],
        "deny_rules": [{"name": "no-forbidden", "match": {"tool": "echo"},
                        "when": 'args.q.startsWith("forbidden")', "reason": "q is forbidden"}],
    }  # fmt: skip
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    running = start_server(
        data_dir=tmp_path / "data", policy_file=path, heavy_arguments_bytes=THRESHOLD,
        heavy_workers=1, max_warm=0,
    )  # fmt: skip
    channel = open_channel(running.address, token=TOKEN)
    stub = pb_grpc.ToolRegistryStub(channel)
    tool = parse_definition({
        "name": "echo", "description": "echoes its arguments", "parameters": PARAMETERS,
        "guard": [{"condition": 'args.q != "refuse me"', "message": "q must not be refuse me"}],
        "sandbox": {"image": "toolreg/base", "command": ["cat"]},
    })  # fmt: skip
    stub.RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool)), timeout=30)
    yield running, stub
    channel.close()
    assert wait_until_gone(engine, running, timeout_s=60) == []


def call(stub: pb_grpc.ToolRegistryStub, text: str) -> pb.ToolResult:
    request = pb.ExecuteToolRequest(name="echo", arguments_json=text)
    result: pb.ToolResult = stub.ExecuteTool(request, timeout=60)
    return result


def turns(running: Running) -> float:
    """Heavy calls that got their turn so far (the metrics' count)."""
    value = running.app.metrics.registry.get_sample_value("toolreg_heavy_wait_seconds_count")
    return value or 0.0


def both(
    running: Running, stub: pb_grpc.ToolRegistryStub, args: dict[str, Any]
) -> tuple[pb.ToolResult, ...]:
    light, heavy = json.dumps(args), json.dumps({**args, "pad": PAD})
    assert len(light) <= THRESHOLD < len(heavy)
    before = turns(running)
    light_result = call(stub, light)
    assert turns(running) == before  # a light call takes no turn
    heavy_result = call(stub, heavy)
    assert turns(running) == before + 1
    return light_result, heavy_result


def test_a_heavy_call_runs_with_its_canonical_arguments(
    served: tuple[Running, pb_grpc.ToolRegistryStub],
) -> None:
    running, stub = served
    args = {"q": "hello", "pad": PAD}
    result = call(stub, json.dumps(args, indent=2))  # not canonical as sent
    assert turns(running) == 1
    assert result.status == S.EXECUTION_STATUS_OK, result.error
    assert result.content.encode() == rfc8785.dumps(args)
    # Its audit record holds the digest of the canonical arguments, as a light call's does.
    with running.app.store.reading() as reads:
        records = [json.loads(e.record) for e in reads.audit_entries()]
    mine = [r for r in records if r.get("execution_id") == result.execution_id]
    assert [r["args_digest"] for r in mine] == [hashlib.sha256(rfc8785.dumps(args)).hexdigest()]


@pytest.mark.parametrize(
    ("args", "status", "error"),
    [
        ({"q": 5}, S.EXECUTION_STATUS_INVALID_ARGUMENTS, "invalid arguments for tool 'echo'"),
        ({"q": "refuse me"}, S.EXECUTION_STATUS_INVALID_ARGUMENTS,
         "guard failed: q must not be refuse me"),
        ({"q": "forbidden!"}, S.EXECUTION_STATUS_POLICY_DENIED,
         "denied by policy rule no-forbidden: q is forbidden"),
    ],
)  # fmt: skip
def test_a_heavy_call_is_refused_as_a_light_one_is(
    served: tuple[Running, pb_grpc.ToolRegistryStub], args: dict[str, Any], status: int, error: str
) -> None:
    running, stub = served
    light, heavy = both(running, stub, args)
    assert (light.status, heavy.status) == (status, status), (light.error, heavy.error)
    assert light.error.startswith(error) and heavy.error.startswith(error)


def test_unparseable_heavy_arguments_get_the_same_error(
    served: tuple[Running, pb_grpc.ToolRegistryStub],
) -> None:
    running, stub = served
    light, heavy = call(stub, '{"q": "x",'), call(stub, '{"q": "' + PAD + '",')
    assert turns(running) == 1
    for result in (light, heavy):
        assert result.status == S.EXECUTION_STATUS_INVALID_ARGUMENTS
        assert result.error.startswith("arguments_json: not valid JSON")
    dup = call(stub, '{"q": "a", "q": "' + PAD + '"}')
    assert dup.error == "arguments_json: duplicate key 'q'"


def test_arguments_over_the_cap_are_refused_before_any_turn(
    served: tuple[Running, pb_grpc.ToolRegistryStub],
) -> None:
    running, stub = served
    for text in ('{"q": "' + "a" * (1024 * 1024) + '"}', '{"q": "' + "é" * 600_000 + '"}'):
        result = call(stub, text)
        assert result.status == S.EXECUTION_STATUS_INVALID_ARGUMENTS
        assert result.error == "arguments_json: larger than 1048576 bytes"
    assert turns(running) == 0


def spawned_workers() -> set[int]:
    """This process's children started by multiprocessing's spawn."""
    found = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(
                line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line
            )
            cmdline = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields.get("PPid", "0")) == os.getpid() and b"spawn_main" in cmdline:
            found.add(int(status.parent.name))
    return found


def test_a_worker_killed_between_calls_is_replaced_and_no_call_fails(
    served: tuple[Running, pb_grpc.ToolRegistryStub],
) -> None:
    running, stub = served
    before = spawned_workers()
    heavy = json.dumps({"q": "hello", "pad": PAD})
    assert call(stub, heavy).status == S.EXECUTION_STATUS_OK
    workers = spawned_workers() - before
    assert len(workers) == 1  # heavy_workers=1
    (worker,) = workers
    os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while worker in spawned_workers():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    result = call(stub, heavy)
    assert result.status == S.EXECUTION_STATUS_OK, result.error
    replaced = spawned_workers() - before
    assert len(replaced) == 1 and worker not in replaced
    running.stop()  # the pool is shut down with the server: no worker is left
    assert spawned_workers() - before == set()
