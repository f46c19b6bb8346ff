"""Three servers on one PostgreSQL behind a real HAProxy (Debian's, started
per test with the config scripts/haproxy_config.py writes), driven through it
by the Python client and by the Node.js interop suite; one server stopped in
the middle loses no acknowledged write, and clients see only retryable errors."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import RegistryClient, open_channel
from registry_server.signing.keys import generate_keypair
from scripts import haproxy_config
from tests.cluster.conftest import EXAMPLES, HEALTH_INTERVAL_S, ROOT, wait_for
from tests.factories import tool
from tests.integration.test_interop_node import TOKENS, run_node_suite, write_policy

RETRYABLE = {grpc.StatusCode.UNAVAILABLE}  # what a client may see while a server goes away


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Balanced:
    def __init__(self, servers: list[ServerProcess], proxy: subprocess.Popen[str], port: int):
        self.servers = servers
        self.proxy = proxy
        self.address = f"127.0.0.1:{port}"

    def client(self, who: str) -> RegistryClient:
        return RegistryClient(self.address, channel=open_channel(self.address, token=TOKENS[who]))

    def serving_through_proxy(self) -> bool:
        channel = grpc.insecure_channel(self.address)
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
            return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.RpcError:
            return False
        finally:
            channel.close()


@pytest.fixture
def balanced(
    database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Balanced, bytes]]:
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not Path(haproxy).exists():
        pytest.fail("haproxy is not installed: run `make test` (it installs it)")
    monkeypatch.setenv("TOOLREG_HEALTH_INTERVAL_S", HEALTH_INTERVAL_S)
    alice_private, alice_public = generate_keypair()
    _, bob_public = generate_keypair()
    policy = tmp_path / "policy.yaml"
    write_policy(policy, {"alice": alice_public, "bob": bob_public})
    args = ["--store-url", database, "--policy", str(policy), "--tools", str(EXAMPLES)]
    servers = [spawn_server(tmp_path / f"server{i}", *args, cwd=ROOT) for i in range(3)]
    port = free_port()
    backends = [(s.address.rsplit(":", 1)[0], int(s.address.rsplit(":", 1)[1])) for s in servers]
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config.render(port, backends))
    proxy = subprocess.Popen(
        [haproxy, "-f", str(config), "-db"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    balanced = Balanced(servers, proxy, port)
    try:
        wait_for("HAProxy answers SERVING", balanced.serving_through_proxy, 15)
        yield balanced, alice_private
    finally:
        proxy.terminate()
        try:
            proxy.wait(10)
        except subprocess.TimeoutExpired:
            proxy.kill()
        for server in servers:
            server.stop()


def test_the_python_client_through_the_load_balancer_survives_a_server_leaving(
    balanced: tuple[Balanced, bytes],
) -> None:
    lb, _ = balanced
    acknowledged: list[str] = []
    refused: list[grpc.StatusCode] = []
    executed = 0
    stop = threading.Event()

    def writer() -> None:
        with lb.client("admin") as admin:
            n = 0
            while not stop.is_set():
                name = f"lb_tool_{n}"
                n += 1
                try:
                    admin.register_tool(tool(name=name))
                except grpc.RpcError as err:
                    refused.append(err.code())
                    continue
                acknowledged.append(name)

    def caller() -> None:
        nonlocal executed
        with lb.client("agent") as agent:
            while not stop.is_set():
                try:
                    result = agent.execute_tool("echo", {"message": "through the proxy"})
                except grpc.RpcError as err:
                    refused.append(err.code())
                    continue
                assert result.success, result.error
                executed += 1

    threads = [threading.Thread(target=writer), threading.Thread(target=caller)]
    for thread in threads:
        thread.start()
    time.sleep(3)
    leaving = lb.servers[1]
    assert leaving.stop() == 0  # SIGTERM: drains, says NOT_SERVING, exits
    time.sleep(4)
    stop.set()
    for thread in threads:
        thread.join(60)
    assert len(acknowledged) > 20 and executed > 5
    assert set(refused) <= RETRYABLE, refused
    # Every acknowledged write is there, on every server still running.
    for server in (lb.servers[0], lb.servers[2]):
        with RegistryClient(server.address, channel=open_channel(server.address,
                            token=TOKENS["agent"])) as direct:  # fmt: skip
            names = {t.name for t in direct.list_tool_definitions()}
        assert set(acknowledged) <= names


def test_the_node_suite_through_the_load_balancer(balanced: tuple[Balanced, bytes]) -> None:
    lb, alice_private = balanced
    done = run_node_suite(lb.address, alice_private)
    output = done.stdout + done.stderr
    print(output)
    assert done.returncode == 0, f"node --test tests/interop/ through HAProxy failed:\n{output}"
