"""Several servers on PostgreSQL against one on SQLite, all measured in this
run through the same HAProxy set-up (scripts/haproxy_config.py):

* registry reads: GetTool calls per second at concurrency 8;
* approved calls: a dangerous tool, each call with a freshly signed token
  (verify, spend the jti, audit, a sandbox), calls per second at concurrency 4;
* the store's cost per call: p50 of an audited refusal (an unknown tool: one
  audit write, no sandbox) and of a safe call, straight to one server.

Ratios are against "1 server, SQLite" measured in the same run."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psycopg

from bench.common import (
    APPROVER,
    OUR_PIDS,
    PAYLOAD,
    RPC_TIMEOUT_S,
    TOKEN_TTL_S,
    definition,
    summary,
    timed_ms,
)
from bench.throughput import cell
from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from scripts import haproxy_config

ROOT = Path(__file__).resolve().parents[1]

READ_CONCURRENCY = 8
CALL_CONCURRENCY = 4
SETUPS = (("1 server, SQLite", 1, False), ("1 server, PostgreSQL", 1, True),
          ("3 servers, PostgreSQL", 3, True))  # fmt: skip
DANGEROUS = "bench_dangerous"
SAFE = "bench_safe"


@dataclass
class Setup:
    name: str
    servers: list[ServerProcess]
    proxy: subprocess.Popen[bytes]
    address: str  # HAProxy's
    key: bytes
    data: Path

    def stub(self, address: str | None = None) -> pb_grpc.ToolRegistryStub:
        return pb_grpc.ToolRegistryStub(grpc.insecure_channel(address or self.address))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _database() -> str:
    url = subprocess.run(
        ["bash", str(ROOT / "scripts" / "ensure_postgres.sh")],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout.strip()  # fmt: skip
    name = f"toolreg_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return url.rsplit("/", 1)[0] + f"/{name}"


def _drop(url: str) -> None:
    admin = url.rsplit("/", 1)[0] + "/toolreg"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]} WITH (FORCE)")


@contextlib.contextmanager
def _setup(name: str, count: int, postgres: bool) -> Iterator[Setup]:
    data = Path(tempfile.mkdtemp(prefix="toolreg-bench-cluster-"))
    private, public = generate_keypair()
    store = _database() if postgres else f"sqlite:///{data / 'toolreg.db'}"
    servers: list[ServerProcess] = []
    proxy: subprocess.Popen[bytes] | None = None
    try:
        for i in range(count):
            (data / f"s{i}" / "approvers").mkdir(parents=True)
            (data / f"s{i}" / "approvers" / f"{APPROVER}.pub").write_text(public)
            servers.append(spawn_server(data / f"s{i}", "--store-url", store))
            OUR_PIDS.add(servers[-1].pid)
        port = _free_port()
        backends = [
            (s.address.rsplit(":", 1)[0], int(s.address.rsplit(":", 1)[1])) for s in servers
        ]
        (data / "haproxy.cfg").write_text(haproxy_config.render(port, backends))
        haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
        proxy = subprocess.Popen([haproxy, "-f", str(data / "haproxy.cfg"), "-db"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        setup = Setup(name, servers, proxy, f"127.0.0.1:{port}", private, data)
        _wait_ready(setup)
        yield setup
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        for s in servers:
            s.stop()
        if postgres:
            _drop(store)
        shutil.rmtree(data, ignore_errors=True)


def _wait_ready(setup: Setup) -> None:
    stub = setup.stub(setup.servers[0].address)
    stub.RegisterTool(pb.RegisterToolRequest(tool=definition(SAFE), replace=True))
    stub.RegisterTool(
        pb.RegisterToolRequest(tool=definition(DANGEROUS, level="dangerous"), replace=True)
    )
    deadline = time.monotonic() + 30
    through = setup.stub()
    while time.monotonic() < deadline:
        try:
            if all(
                setup.stub(s.address).GetTool(pb.GetToolRequest(name=DANGEROUS), timeout=2)
                for s in setup.servers
            ) and through.GetTool(pb.GetToolRequest(name=SAFE), timeout=2):
                return
        except grpc.RpcError:
            time.sleep(0.2)
    raise RuntimeError(f"{setup.name}: not ready through HAProxy within 30 s")


def _approved_call(setup: Setup) -> Callable[[], bytes]:
    stub = setup.stub()
    probe = stub.ExecuteTool(
        pb.ExecuteToolRequest(name=DANGEROUS, arguments_json=PAYLOAD.decode()),
        timeout=RPC_TIMEOUT_S,
    )
    if probe.status != pb.EXECUTION_STATUS_APPROVAL_REQUIRED:
        raise RuntimeError(f"expected APPROVAL_REQUIRED, got {probe.error}")
    key = load_private_key(setup.key)

    def call() -> bytes:
        token = mint_for(key, issuer=APPROVER, request=probe.approval_request, ttl_s=TOKEN_TTL_S)
        result = stub.ExecuteTool(
            pb.ExecuteToolRequest(
                name=DANGEROUS, arguments_json=PAYLOAD.decode(), approval_tokens=[token]
            ),
            timeout=RPC_TIMEOUT_S,
        )
        if not result.success:
            raise RuntimeError(result.error)
        return result.content.encode()

    return call


def _read(setup: Setup) -> Callable[[], bytes]:
    stub = setup.stub()

    def read() -> bytes:
        stub.GetTool(pb.GetToolRequest(name=SAFE), timeout=RPC_TIMEOUT_S)
        return PAYLOAD

    return read


def _store_cost(setup: Setup, runs: int) -> dict[str, Any]:
    stub = setup.stub(setup.servers[0].address)  # straight to one server

    def refused() -> None:
        stub.ExecuteTool(pb.ExecuteToolRequest(name="no_such_tool"), timeout=RPC_TIMEOUT_S)

    def safe() -> None:
        result = stub.ExecuteTool(
            pb.ExecuteToolRequest(name=SAFE, arguments_json=PAYLOAD.decode()),
            timeout=RPC_TIMEOUT_S,
        )
        if not result.success:
            raise RuntimeError(result.error)

    for _ in range(3):
        refused()
        safe()
    return {
        "audited_refusal": summary([timed_ms(refused) for _ in range(runs)]),
        "safe_call": summary([timed_ms(safe) for _ in range(max(5, runs // 4))]),
    }


def run(cell_seconds: float, runs: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for name, count, postgres in SETUPS:
        print(f"   {name}", flush=True)
        with _setup(name, count, postgres) as setup:
            rows.append(
                {
                    "setup": name,
                    "servers": count,
                    "reads": cell(_read(setup), READ_CONCURRENCY, cell_seconds),
                    "approved_calls": cell(_approved_call(setup), CALL_CONCURRENCY, cell_seconds),
                    "store_cost": _store_cost(setup, runs),
                }
            )
    base = rows[0]
    for row in rows:
        for key in ("reads", "approved_calls"):
            rate = base[key]["calls_per_s"]
            row[key]["ratio"] = round(row[key]["calls_per_s"] / rate, 2) if rate else None
    return {
        "rows": rows,
        "read_concurrency": READ_CONCURRENCY,
        "call_concurrency": CALL_CONCURRENCY,
        "cores": os.cpu_count(),
    }
