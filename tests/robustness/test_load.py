"""Load: 16 concurrent clients for 60 s with a mix of ListTools, GetToolSchemas
and ExecuteTool (cold and pooled) against a `toolreg serve` process. Zero
unexpected errors, p95 per RPC reported, and the server's RSS grows less than
10 % between the second ten seconds and the last ten."""

from __future__ import annotations

import json
import statistics
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
from tests.security.conftest import engine, labelled  # noqa: F401

pytestmark = pytest.mark.load

CLIENTS = 16
DURATION_S = 60.0
WINDOW_S = 10.0  # RSS: the second WINDOW_S seconds against the last WINDOW_S
MAX_RSS_GROWTH = 0.10
RSS_SAMPLE_S = 0.5
EXECUTE_EVERY = 4  # one call in EXECUTE_EVERY is an ExecuteTool, the rest are reads
TOOLS = 5  # "echo" (cold), "pooled" (warm pool of 2) and fillers
SERVER_ENV = {
    # Enough slots and queue for 16 clients: any refusal here is an unexpected error.
    "TOOLREG_MAX_SANDBOXES": "8",
    "TOOLREG_MAX_QUEUED": "32",
    "TOOLREG_MAX_WARM": "2",
}


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


def _tool(name: str, warm: int) -> pb.Tool:
    return convert.tool_to_pb(
        parse_definition(
            {
                "name": name,
                "description": "echoes its arguments",
                "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
                "categories": ["load"],
                "sandbox": {"image": "toolreg/base", "command": ["cat"]},
                "warm_pool": warm,
            }
        )
    )


def test_sustained_mixed_load(
    engine: docker.DockerClient,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in SERVER_ENV.items():
        monkeypatch.setenv(key, value)
    server = spawn_server(tmp_path / "data")
    channel = grpc.insecure_channel(server.address)
    try:
        stub = pb_grpc.ToolRegistryStub(channel)
        names = ["echo", "pooled"] + [f"filler_{i}" for i in range(TOOLS - 2)]
        for name in names:
            stub.RegisterTool(
                pb.RegisterToolRequest(tool=_tool(name, 2 if name == "pooled" else 0))
            )

        latencies: dict[str, list[float]] = {
            "ListTools": [], "GetToolSchemas": [], "ExecuteTool": [],
        }  # fmt: skip
        errors: list[str] = []
        rss: list[tuple[float, int]] = []  # (seconds since start, kB)
        lock = threading.Lock()
        start = time.monotonic()
        end = start + DURATION_S

        def one_call(kind: str, n: int) -> bool:
            if kind == "ListTools":
                return len(stub.ListTools(pb.ListToolsRequest(), timeout=30).tools) == TOOLS
            if kind == "GetToolSchemas":
                req = pb.GetToolSchemasRequest(format=pb.SCHEMA_FORMAT_ANTHROPIC)
                return len(json.loads(stub.GetToolSchemas(req, timeout=30).schemas_json)) == TOOLS
            tool = "pooled" if n % 2 else "echo"
            result = stub.ExecuteTool(
                pb.ExecuteToolRequest(name=tool, arguments_json=json.dumps({"n": n})), timeout=60
            )
            if not result.success:
                raise AssertionError(
                    f"{tool}: {pb.ExecutionStatus.Name(result.status)} {result.error}"
                )
            return bool(json.loads(result.content) == {"n": n})

        def client(index: int) -> None:
            i = 0
            while time.monotonic() < end and i < 100_000:  # bounded by time and count
                i += 1
                if (i + index) % EXECUTE_EVERY == 0:
                    kind = "ExecuteTool"
                else:
                    kind = "ListTools" if i % 2 else "GetToolSchemas"
                began = time.monotonic()
                try:
                    ok = one_call(kind, index * 100_000 + i)
                except (grpc.RpcError, AssertionError) as err:
                    with lock:
                        errors.append(f"{kind}: {err}")
                    continue
                with lock:
                    if ok:
                        latencies[kind].append(time.monotonic() - began)
                    else:
                        errors.append(f"{kind}: unexpected answer")

        def sample_rss() -> None:
            while (now := time.monotonic()) < end:
                rss.append((now - start, _rss_kb(server.pid)))
                time.sleep(RSS_SAMPLE_S)

        threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
        threads.append(threading.Thread(target=sample_rss))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=DURATION_S + 120)
        assert not any(t.is_alive() for t in threads)
        assert server.proc.poll() is None, "the server died under load"

        for kind, values in latencies.items():
            p50 = statistics.median(values) if values else float("nan")
            p95 = statistics.quantiles(values, n=20)[-1] if len(values) >= 2 else float("nan")
            print(f"{kind}: {len(values)} calls, p50 {p50 * 1000:.1f} ms, p95 {p95 * 1000:.1f} ms")
        second = [kb for t, kb in rss if WINDOW_S <= t < 2 * WINDOW_S]
        last = [kb for t, kb in rss if t >= DURATION_S - WINDOW_S]
        growth = (statistics.median(last) - statistics.median(second)) / statistics.median(second)
        print(
            f"server RSS median {statistics.median(second):.0f} kB in seconds 10-20, "
            f"{statistics.median(last):.0f} kB in the last 10 s ({growth:+.1%}); "
            f"peak {max(kb for _, kb in rss)} kB"
        )

        assert errors == [], errors[:10]
        assert all(len(v) > 100 for v in latencies.values()), {
            k: len(v) for k, v in latencies.items()
        }  # fmt: skip
        assert second and last, rss
        assert growth < MAX_RSS_GROWTH, f"server RSS grew {growth:.1%}"
    finally:
        channel.close()
        assert server.stop() == 0
    left = labelled(engine, f"io.toolreg.owner-pid={server.pid}")
    assert left == [], "containers left behind"
