"""Several real `toolreg serve` processes on one real PostgreSQL (started by
scripts/ensure_postgres.sh, one fresh database per test), sharing the real
Docker engine, with a real policy."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import open_channel
from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.tokens import mint_for
from registry_server.store.base import Store
from registry_server.store.memory import MemoryStore
from registry_server.store.postgres import PostgresStore
from registry_server.store.sqlite import SqliteStore
from tests.factories import sha
from tests.pg_databases import fresh_database

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "tools"
ENSURE_POSTGRES = ROOT / "scripts" / "ensure_postgres.sh"
AUDIENCE = "toolreg-cluster"
CLIENTS = {  # id -> (bearer token, roles, extra policy fields)
    "agent": ("cluster-agent", ["execute"], {"max_safety_level": "dangerous"}),
    "agent2": ("cluster-agent2", ["execute"], {"max_safety_level": "dangerous"}),
    "team": ("cluster-team", ["register"], {}),
    "other-team": ("cluster-other-team", ["register"], {}),
    "alice": ("cluster-alice", ["approve"], {}),
    "admin": ("cluster-admin", ["admin"], {}),
}
STOP_TIMEOUT_S = 60  # seconds a server may take to stop after SIGTERM
HEALTH_INTERVAL_S = "0.5"  # seconds between each server's engine and store checks


def postgres(*args: str) -> str:
    done = subprocess.run(
        ["bash", str(ENSURE_POSTGRES), *args], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        pytest.fail(f"scripts/ensure_postgres.sh {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return done.stdout.strip()


@pytest.fixture(scope="session")
def pg_url() -> str:
    """The URL of the test cluster's maintenance database (make test starts it)."""
    return postgres()


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """Each store in turn: the same tests hold for every backend."""
    if request.param == "memory":
        made: Store = MemoryStore()
    elif request.param == "sqlite":
        made = SqliteStore(tmp_path / "toolreg.db")
    else:
        made = PostgresStore(request.getfixturevalue("database"))
    yield made
    made.close()


@pytest.fixture
def database(pg_url: str) -> Iterator[str]:
    """A fresh, empty database for one test; dropped after it."""
    with fresh_database(pg_url) as made:
        yield made
        postgres("start")  # a fault test may have stopped it


@dataclass
class Cluster:
    store_url: str
    policy: Path
    base: Path
    alice_key: bytes
    servers: list[ServerProcess] = field(default_factory=list)
    channels: list[grpc.Channel] = field(default_factory=list)

    def start(self, index: int) -> ServerProcess:
        server = spawn_server(
            self.base / f"server{index}", "--store-url", self.store_url, "--policy",
            str(self.policy), "--tools", str(EXAMPLES), cwd=ROOT,
        )  # fmt: skip
        if index < len(self.servers):
            self.servers[index] = server
        else:
            self.servers.append(server)
        return server

    def stub(self, index: int, client: str) -> pb_grpc.ToolRegistryStub:
        return self.stub_at(self.servers[index].address, client)

    def stub_at(self, address: str, client: str) -> pb_grpc.ToolRegistryStub:
        channel = open_channel(address, token=CLIENTS[client][0])
        self.channels.append(channel)
        return pb_grpc.ToolRegistryStub(channel)

    def health(self, index: int) -> int:
        channel = grpc.insecure_channel(self.servers[index].address)
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            return int(answer.status)
        finally:
            channel.close()

    def approve(self, index: int, request_id: str) -> pb.ApprovalRequest:
        """alice signs request ``request_id`` and submits it through server ``index``."""
        stub = self.stub(index, "alice")
        req = stub.GetApprovalRequest(pb.GetApprovalRequestRequest(id=request_id))
        token = mint_for(
            load_private_key(self.alice_key), issuer="alice", request=req, bind_request=True
        )
        return stub.SubmitApproval(pb.SubmitApprovalRequest(request_id=request_id, token=token))

    def inline_token(self, index: int, request_id: str) -> str:
        """alice's token for the call of ``request_id``, not bound to the request."""
        req = self.stub(index, "alice").GetApprovalRequest(
            pb.GetApprovalRequestRequest(id=request_id)
        )
        return mint_for(load_private_key(self.alice_key), issuer="alice", request=req)

    def stop(self) -> None:
        """All at once: SIGTERM to every server, then wait (a server that will not
        stop is killed and its log shown; clean shutdown is test_lifecycle's to prove)."""
        for channel in self.channels:
            channel.close()
        for server in self.servers:
            if server.proc.poll() is None:
                server.proc.terminate()
        for server in self.servers:
            try:
                server.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                print(f"server {server.address} did not stop in {STOP_TIMEOUT_S} s; killed:\n"
                      + "".join(server.log[-30:]))  # fmt: skip
                server.kill()


def write_policy(path: Path, alice_public: str) -> None:
    policy: dict[str, Any] = {
        "audience": AUDIENCE,
        "approvers": [{"id": "alice", "public_key": alice_public, "groups": ["security"]}],
        "approval_rules": [
            {"match": {"level": "dangerous"}, "approvals_required": 1, "max_token_ttl_s": 600}
        ],
        "clients": [
            {"id": cid, "token_sha256": sha(token), "roles": roles, **extra}
            for cid, (token, roles, extra) in CLIENTS.items()
        ],
    }
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


StartCluster = Callable[[int], Cluster]


@pytest.fixture
def start_cluster(
    database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[StartCluster]:
    monkeypatch.setenv("TOOLREG_HEALTH_INTERVAL_S", HEALTH_INTERVAL_S)
    # No load balancer here: a server that a test asked for health would otherwise say
    # NOT_SERVING for 10 s at the end before it stops (test_load_balancer.py tests that).
    monkeypatch.setenv("TOOLREG_DRAIN_S", "0")
    monkeypatch.delenv("TOOLREG_STORE_URL", raising=False)
    made: list[Cluster] = []

    def start(count: int) -> Cluster:
        private, public = generate_keypair()
        policy = tmp_path / "policy.yaml"
        write_policy(policy, public)
        cluster = Cluster(database, policy, tmp_path, private)
        made.append(cluster)
        for index in range(count):
            cluster.start(index)
        return cluster

    yield start
    for cluster in made:
        cluster.stop()


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 15.0) -> float:
    """Seconds until ``check()`` held; fails the test after ``timeout_s``."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s} s")
        time.sleep(0.05)
    return time.monotonic() - started
