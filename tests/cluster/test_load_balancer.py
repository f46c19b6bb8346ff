"""Three servers on one PostgreSQL behind a real HAProxy (Debian's, started
per test with the config scripts/haproxy_config.py writes), driven through it
by the Python client and by the Node.js interop suite. One server leaves under
steady load and no call fails: it says NOT_SERVING while still serving for
TOOLREG_DRAIN_S, HAProxy takes it out, and only then does it stop accepting and
drain its calls in flight (docs/how-to/scaling.md, "Leaving without a failed call")."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from registry_server.api.health_monitor import LIVENESS_SERVICE
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import RegistryClient, open_channel
from registry_server.signing.keys import generate_keypair
from scripts import haproxy_config
from tests.cluster.conftest import EXAMPLES, HEALTH_INTERVAL_S, ROOT, STOP_TIMEOUT_S, wait_for
from tests.factories import tool
from tests.integration.test_interop_node import TOKENS, run_node_suite, write_policy

# Seconds a leaving server says NOT_SERVING while still serving: twice what HAProxy
# needs at most to take it out of the rotation (here 2 s; the default is 10 s).
DRAIN_S = 2 * haproxy_config.out_of_rotation_s()
SLOW_S = 2  # seconds the slow tool sleeps: it is still running when its server stops accepting
LOAD_WAIT_S = 30.0  # seconds for the load's threads to get a first call and write through
SLOW_TOOL = tool(
    name="slow_echo",
    description="Sleeps, then returns its arguments.",
    sandbox={"image": "toolreg/base", "command": ["sh", "-c", f"sleep {SLOW_S}; cat"]},
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def health(address: str, service: str = "") -> int:
    channel = grpc.insecure_channel(address)
    try:
        answer = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2
        )
        return int(answer.status)
    finally:
        channel.close()


class Balanced:
    def __init__(
        self, servers: list[ServerProcess], proxy: subprocess.Popen[str], port: int, stats: int
    ) -> None:
        self.servers = servers
        self.proxy = proxy
        self.address = f"127.0.0.1:{port}"
        self.stats = f"http://127.0.0.1:{stats}/;csv"

    def client(self, who: str, address: str | None = None) -> RegistryClient:
        address = address or self.address
        return RegistryClient(address, channel=open_channel(address, token=TOKENS[who]))

    def serving_through_proxy(self) -> bool:
        try:
            return health(self.address) == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def status_in_proxy(self, index: int) -> str:
        """What HAProxy's stats page says of server ``index`` (UP, DOWN, ...)."""
        with urllib.request.urlopen(self.stats, timeout=5) as answer:
            rows = answer.read().decode().splitlines()
        header = rows[0].lstrip("# ").split(",")
        for row in rows[1:]:
            fields = dict(zip(header, row.split(","), strict=False))
            if fields["pxname"] == "toolreg_grpc" and fields["svname"] == f"s{index + 1}":
                return fields["status"]
        raise AssertionError(f"no s{index + 1} in HAProxy's stats:\n" + "\n".join(rows))


@pytest.fixture
def balanced(
    database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Balanced, bytes]]:
    haproxy = shutil.which("haproxy") or "/usr/sbin/haproxy"
    if not Path(haproxy).exists():
        pytest.fail("haproxy is not installed: run `make test` (it installs it)")
    monkeypatch.setenv("TOOLREG_HEALTH_INTERVAL_S", HEALTH_INTERVAL_S)
    monkeypatch.setenv("TOOLREG_DRAIN_S", str(DRAIN_S))
    alice_private, alice_public = generate_keypair()
    _, bob_public = generate_keypair()
    policy = tmp_path / "policy.yaml"
    write_policy(policy, {"alice": alice_public, "bob": bob_public})
    args = ["--store-url", database, "--policy", str(policy), "--tools", str(EXAMPLES)]
    servers = [spawn_server(tmp_path / f"server{i}", *args, cwd=ROOT) for i in range(3)]
    port, stats = free_port(), free_port()
    backends = [(s.address.rsplit(":", 1)[0], int(s.address.rsplit(":", 1)[1])) for s in servers]
    config = tmp_path / "haproxy.cfg"
    config.write_text(haproxy_config.render(port, backends, stats_port=stats))
    proxy = subprocess.Popen(
        [haproxy, "-f", str(config), "-db"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    balanced = Balanced(servers, proxy, port, stats)
    try:
        wait_for("HAProxy answers SERVING", balanced.serving_through_proxy, 15)
        wait_for("HAProxy has every server UP", lambda: all(
            balanced.status_in_proxy(i) == "UP" for i in range(len(servers))), 15)  # fmt: skip
        yield balanced, alice_private
    finally:
        proxy.terminate()
        try:
            proxy.wait(10)
        except subprocess.TimeoutExpired:
            proxy.kill()
        for server in servers:  # all at once: each may drain for DRAIN_S
            if server.proc.poll() is None:
                server.proc.terminate()
        for server in servers:
            server.stop(STOP_TIMEOUT_S)


@pytest.mark.serial  # timed: HAProxy's checks against a server's drain window, under load
def test_a_server_leaving_under_load_behind_the_load_balancer_fails_no_call(
    balanced: tuple[Balanced, bytes],
) -> None:
    lb, _ = balanced
    leaving = lb.servers[1]
    with lb.client("admin") as admin:
        admin.register_tool(SLOW_TOOL)
    acknowledged: list[str] = []
    failed: list[str] = []  # every call that did not succeed, through the proxy or direct
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
                    failed.append(f"RegisterTool {name}: {err.code()} {err.details()}")
                    continue
                acknowledged.append(name)

    def caller() -> None:
        nonlocal executed
        with lb.client("agent") as agent:
            while not stop.is_set():
                try:
                    result = agent.execute_tool("echo", {"message": "through the proxy"})
                except grpc.RpcError as err:
                    failed.append(f"ExecuteTool echo: {err.code()} {err.details()}")
                    continue
                if not result.success:
                    failed.append(f"ExecuteTool echo: {result.error}")
                executed += 1

    threads = [threading.Thread(target=f) for f in (writer, caller, caller)]
    for thread in threads:
        thread.start()
    time.sleep(3)
    # The load's threads make their first call and write as a busy machine lets
    # them (a cold start alone can take seconds): wait for both, then go on.
    deadline = time.monotonic() + LOAD_WAIT_S
    while not (executed > 0 and acknowledged):
        assert time.monotonic() < deadline, ("no call or no write within the wait", failed)
        time.sleep(0.05)
    assert executed > 0 and acknowledged, failed

    leaving.proc.terminate()  # SIGTERM
    signalled = time.monotonic()
    wait_for("the leaving server says NOT_SERVING", lambda: (
        health(leaving.address) == health_pb2.HealthCheckResponse.NOT_SERVING), 2)  # fmt: skip
    # ... while it still lives and serves: liveness, and a new call made to it directly.
    assert health(leaving.address, LIVENESS_SERVICE) == health_pb2.HealthCheckResponse.SERVING
    with lb.client("agent", leaving.address) as direct:
        assert direct.execute_tool("echo", {"message": "while leaving"}).success
    # HAProxy takes it out well before it stops accepting.
    wait_for("HAProxy marks the leaving server DOWN", lambda: (
        lb.status_in_proxy(1).startswith("DOWN")), haproxy_config.out_of_rotation_s() + 1)  # fmt: skip
    out_after = time.monotonic() - signalled
    assert out_after < DRAIN_S, (out_after, DRAIN_S)
    assert leaving.proc.poll() is None

    # A call started on it shortly before the window ends is still running when it stops
    # accepting, and is drained: it succeeds.
    time.sleep(max(0.0, DRAIN_S - 1.0 - (time.monotonic() - signalled)))
    with lb.client("agent", leaving.address) as direct:
        slow = direct.execute_tool(SLOW_TOOL.name, {"message": "drained"})
    slow_ended = time.monotonic() - signalled
    assert slow.success, slow.error
    assert slow_ended > DRAIN_S, (slow_ended, DRAIN_S)  # it was in flight past the window

    assert leaving.proc.wait(STOP_TIMEOUT_S) == 0
    # A thread reads its stderr: its last lines reach leaving.log after it exited.
    wait_for("the leaving server's drain lines in its log", lambda: all(
        line in "".join(leaving.log)
        for line in ("still serving calls for", "no longer accepting calls")))  # fmt: skip
    log = "".join(leaving.log)
    assert "still serving calls for" in log and "no longer accepting calls" in log, log[-3000:]
    time.sleep(2)  # the load goes on, on the two servers left
    stop.set()
    for thread in threads:
        thread.join(60)
    assert failed == [], failed
    assert len(acknowledged) > 20 and executed > 5, (len(acknowledged), executed)
    # Every acknowledged write is there, on every server still running.
    for server in (lb.servers[0], lb.servers[2]):
        with lb.client("agent", server.address) as direct:
            names = {t.name for t in direct.list_tool_definitions()}
        assert set(acknowledged) <= names


def test_the_node_suite_through_the_load_balancer(balanced: tuple[Balanced, bytes]) -> None:
    lb, alice_private = balanced
    done = run_node_suite(lb.address, alice_private)
    output = done.stdout + done.stderr
    print(output)
    assert done.returncode == 0, f"node --test tests/interop/ through HAProxy failed:\n{output}"
