"""Warm pools against the real engine: same answers as cold calls, one
container per call, never shared, nothing left behind."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.domain.models import parse_definition
from registry_server.signing.keys import generate_keypair
from registry_server.wire import convert
from tests import store_file
from tests.integration.conftest import Running, StartServer
from tests.security import conftest as sec
from tests.security.conftest import containers_of, execute, wait_until_gone

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tools"
WAIT_FOR_POOL_S = 30.0  # seconds a pool may take to fill on this machine


@pytest.fixture
def pooled(
    start_server: StartServer, engine: docker.DockerClient, tmp_path: Path
) -> Iterator[Running]:
    private, public = generate_keypair()
    data = tmp_path / "pooled"
    (data / "approvers").mkdir(parents=True)
    (data / "approvers" / f"{sec.APPROVER}.pub").write_text(public)
    running = start_server(
        data_dir=data,
        max_warm=24,
        warm_max_age_s=120,
        workspace_tools=("write_file", "write_file_warm"),
    )
    sec._approver_keys[running.port] = private
    yield running
    running.stop()  # shutdown removes the warm containers too
    assert wait_until_gone(engine, running) == [], "containers left behind"


def register(running: Running, manifest: dict[str, Any], replace: bool = True) -> None:
    tool = convert.tool_to_pb(parse_definition(manifest))
    running.stub.RegisterTool(pb.RegisterToolRequest(tool=tool, replace=replace))


def shell_tool(name: str, script: str, pool: int, **limits: int) -> dict[str, Any]:
    return {
        "name": name,
        "description": f"test {name}",
        "parameters": {"type": "object"},
        "warm_pool": pool,
        "sandbox": {"image": "toolreg/base", "command": ["sh", "-c", script], "limits": limits},
    }


def warm_count(running: Running, name: str) -> int:
    assert running.app.pools is not None
    return running.app.pools.stats().warm.get(name, 0)


def wait_warm(running: Running, name: str, count: int) -> None:
    deadline = time.monotonic() + WAIT_FOR_POOL_S
    while warm_count(running, name) < count:
        assert time.monotonic() < deadline, f"pool of {name} never reached {count}"
        time.sleep(0.1)


def executions(running: Running) -> list[dict[str, Any]]:
    running.app.backend.flush()
    return [
        json.loads(r) for _, _, r in store_file.audit_rows(running.app.config.data_dir, "execution")
    ]


ARGS = {
    "echo": {"message": "hello, pool"},
    "word_count": {"text": "one two\nthree"},
    "run_python": {"code": "import sys; print(sum(range(100)), file=sys.stdout)"},
    "write_file": {"path": "pool/out.txt", "content": "pooled"},
}


# Workspace tools get a host mount, given only to an approved call: never pooled.
UNPOOLED = {"write_file"}


def test_pooled_calls_answer_like_cold_ones_for_every_example(pooled: Running) -> None:
    for name in ARGS:
        manifest = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
        register(pooled, manifest)  # cold
        register(pooled, {**manifest, "name": f"{name}_warm", "warm_pool": 1})
    for name in set(ARGS) - UNPOOLED:
        wait_warm(pooled, f"{name}_warm", 1)
    for name, args in ARGS.items():
        cold = execute(pooled, name, json.dumps(args))
        warm = execute(pooled, f"{name}_warm", json.dumps(args))
        assert warm.success and cold.success, (name, cold.error, warm.error)
        assert (warm.content, warm.data_json) == (cold.content, cold.data_json), name
    records = executions(pooled)
    assert {r["tool"] for r in records if r["warm"]} == {f"{n}_warm" for n in set(ARGS) - UNPOOLED}
    assert not any(r["warm"] for r in records if not r["tool"].endswith("_warm"))
    assert all(warm_count(pooled, f"{n}_warm") == 0 for n in UNPOOLED)


def test_400_calls_never_share_a_container(pooled: Running, engine: docker.DockerClient) -> None:
    register(pooled, shell_tool("pooled_echo", "cat", 4))
    wait_warm(pooled, "pooled_echo", 4)
    for i in range(200):
        # Paced by the refill (a race on two cores otherwise): every one warm.
        wait_warm(pooled, "pooled_echo", 1)
        result = execute(pooled, "pooled_echo", json.dumps({"i": i}))
        assert result.success and json.loads(result.content) == {"i": i}
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for i in range(offset, 200, 8):
                result = execute(pooled, "pooled_echo", json.dumps({"i": i}))
                assert result.success and json.loads(result.content) == {"i": i}
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    calls = [r for r in executions(pooled) if r["tool"] == "pooled_echo"]
    assert len(calls) == 400
    ids = [r["container_id"] for r in calls]
    assert len(set(ids)) == 400 and all(ids)  # one container per call, never reused
    assert all(r["warm"] for r in calls[:200])  # every sequential call was warm
    # Between calls only the pool's own containers exist: none of a finished call.
    live = set(containers_of(engine, pooled))
    assert live.isdisjoint(ids)


def test_pool_recovers_after_its_containers_are_killed(
    pooled: Running, engine: docker.DockerClient
) -> None:
    register(pooled, shell_tool("fragile", "cat", 2))
    wait_warm(pooled, "fragile", 2)
    for container_id in containers_of(engine, pooled):
        engine.api.kill(container_id)
    # What the pool checks before handing one out is its attach stream, which
    # the engine ends a moment after the kill returned (later on a busy machine).
    pools = pooled.app.pools
    assert pools is not None
    deadline = time.monotonic() + WAIT_FOR_POOL_S
    while any(w.prepared.alive() for w in list(pools._pools["fragile"].ready)):
        assert time.monotonic() < deadline, "a killed warm container still reads as alive"
        time.sleep(0.1)
    result = execute(pooled, "fragile", '{"after": "kill"}')
    assert result.success and result.content == '{"after":"kill"}'
    wait_warm(pooled, "fragile", 2)
    result = execute(pooled, "fragile", '{"again": 1}')
    assert result.success
    assert executions(pooled)[-1]["warm"] is True


def test_replacing_a_tool_drains_its_pool(pooled: Running, engine: docker.DockerClient) -> None:
    register(pooled, shell_tool("changing", "cat", 2))
    wait_warm(pooled, "changing", 2)
    old = set(containers_of(engine, pooled))
    register(pooled, shell_tool("changing", "cat; echo v2", 2))
    wait_warm(pooled, "changing", 2)
    pooled.app.backend.flush()
    now = set(containers_of(engine, pooled))
    assert old.isdisjoint(now)  # every container made from the old definition is gone
    assert execute(pooled, "changing", "{}").content == "{}v2\n"


def test_timeout_of_a_pooled_call_counts_from_the_call(pooled: Running) -> None:
    register(pooled, shell_tool("patient", "cat >/dev/null; echo ok", 1, timeout_ms=1000))
    register(pooled, shell_tool("slowpoke", "cat >/dev/null; sleep 5", 1, timeout_ms=1000))
    wait_warm(pooled, "patient", 1)
    wait_warm(pooled, "slowpoke", 1)
    time.sleep(2.5)  # much longer than the 1 s timeout: waiting in the pool does not count
    ok = execute(pooled, "patient", "{}")
    assert ok.success and ok.content == "ok\n"
    started = time.monotonic()
    slow = execute(pooled, "slowpoke", "{}")
    assert slow.status == pb.EXECUTION_STATUS_TIMEOUT
    assert 1.0 <= time.monotonic() - started < 4
    assert [r["warm"] for r in executions(pooled)[-2:]] == [True, True]


def test_dangerous_pooled_call_still_needs_approval(pooled: Running) -> None:
    register(pooled, {**shell_tool("risky_pooled", "cat", 1), "safety_level": "dangerous"})
    wait_warm(pooled, "risky_pooled", 1)
    asked = pooled.stub.ExecuteTool(pb.ExecuteToolRequest(name="risky_pooled", arguments_json="{}"))
    assert asked.status == pb.EXECUTION_STATUS_APPROVAL_REQUIRED
    assert warm_count(pooled, "risky_pooled") == 1  # nothing was handed out
    approved = execute(pooled, "risky_pooled", "{}")  # signs, then runs (under gVisor)
    assert approved.success
    record = executions(pooled)[-1]
    assert record["warm"] and record["runtime"] == "runsc" and record["decision"] == "approved"


def test_pool_that_cannot_refill_falls_back_to_cold(
    pooled: Running, caplog: pytest.LogCaptureFixture
) -> None:
    manifest = shell_tool("imageless", "cat", 2)
    manifest["sandbox"]["image"] = "toolreg/not-built"
    register(pooled, manifest)
    assert pooled.app.pools is not None
    deadline = time.monotonic() + WAIT_FOR_POOL_S
    while pooled.app.pools.stats().refill_failures == 0:
        assert time.monotonic() < deadline, "the refill failure was never counted"
        time.sleep(0.1)
    assert any("cannot refill" in r.getMessage() for r in caplog.records)
    result = execute(pooled, "imageless", "{}")  # cold: the engine's own error, as a result
    assert (
        result.status == pb.EXECUTION_STATUS_SANDBOX_ERROR and "toolreg/not-built" in result.error
    )
    assert pooled.app.pools.stats().misses >= 1
    register(pooled, shell_tool("healthy", "cat", 1))  # other pools are unaffected
    wait_warm(pooled, "healthy", 1)
