"""Re-attaching to a running call (AttachExecution) against a real `toolreg
serve` with a policy, real containers: a client whose stream is cut mid-call
gets every byte once and the result, by hand and through the Python client's
own re-attachment; nobody else may attach; kept calls expire."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml

from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import RegistryClient
from tests.factories import collect_events, token_client

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 2.0  # the server's TOOLREG_ATTACH_GRACE_S here
AGENT, OTHER = "reattach-agent", "reattach-other"
# Prints, pauses, prints: the stream is cut during the first pause.
TALKER = {
    "name": "talker",
    "description": "Prints, sleeps, prints.",
    "safety_level": "safe",
    "parameters": {"type": "object"},
    "sandbox": {
        "image": "toolreg/base",
        "command": ["sh", "-c", "echo one; sleep 1.5; echo two >&2; sleep 1; echo three"],
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    base = tmp_path_factory.mktemp("reattach")
    tools = base / "tools"
    tools.mkdir()
    (tools / "talker.yaml").write_text(yaml.safe_dump(TALKER))
    clients = [
        token_client("agent", AGENT, ["execute"]),
        token_client("other", OTHER, ["execute"]),
    ]
    policy = base / "policy.yaml"
    policy.write_text(yaml.safe_dump({"audience": "toolreg-reattach", "clients": clients}))
    env = {**os.environ, "TOOLREG_ATTACH_GRACE_S": str(GRACE_S)}
    running = spawn_server(
        base / "data", "--policy", str(policy), "--tools", str(tools), cwd=ROOT, env=env
    )
    yield running
    running.kill()


def test_a_cut_stream_is_reattached_by_hand(server: ServerProcess) -> None:
    first = RegistryClient.connect(server.address, token=AGENT)
    events = first.stream("talker", timeout=60)
    started = next(events)
    assert started.WhichOneof("event") == "started"
    execution_id = started.started.execution_id
    chunk = next(events)
    assert chunk.stdout == b"one\n"
    first.close()  # the stream is cut while the tool sleeps
    with RegistryClient.connect(server.address, token=AGENT) as again:
        stdout, stderr, result = collect_events(again.attach(execution_id, len(chunk.stdout), 0))
    assert stdout == b"three\n" and stderr == b"two\n"
    assert result is not None and result.success and result.execution_id == execution_id
    assert result.content == "one\nthree\n"


def test_another_client_cannot_attach_and_bad_requests_are_refused(
    server: ServerProcess,
) -> None:
    with RegistryClient.connect(server.address, token=AGENT) as agent:
        events = agent.stream("talker", timeout=60)
        execution_id = next(events).started.execution_id
        with RegistryClient.connect(server.address, token=OTHER) as other:
            for attempt in (execution_id, "0" * 32):
                with pytest.raises(grpc.RpcError) as info:
                    list(other.attach(attempt, timeout=10))
                assert info.value.code() == grpc.StatusCode.NOT_FOUND
        for bad_id, offset in (("not-an-id", 0), ("x" * 5000, 0), (execution_id, -1)):
            with pytest.raises(grpc.RpcError) as info:
                list(agent.attach(bad_id, offset, timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "x" * 100 not in (info.value.details() or "")
        _, _, result = collect_events(events)
        assert result is not None and result.success


def test_an_ended_call_is_kept_for_the_grace_period_only(server: ServerProcess) -> None:
    with RegistryClient.connect(server.address, token=AGENT) as agent:
        events = list(agent.stream("talker", timeout=60))
        execution_id = events[0].started.execution_id
        stdout, stderr, result = collect_events(agent.attach(execution_id, timeout=10))
        assert (stdout, stderr) == (b"one\nthree\n", b"two\n") and result is not None
        assert result.success
        time.sleep(GRACE_S + 0.5)
        with pytest.raises(grpc.RpcError) as info:
            list(agent.attach(execution_id, timeout=10))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


class CuttingProxy:
    """A loopback TCP proxy whose open connections the test can cut at once
    (as a dropped network path would), while new ones still go through."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._open: list[socket.socket] = []
        self.connections = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self._target)
            with self._lock:
                self._open += [client, upstream]
                self.connections += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            cut, self._open = self._open, []
        for s in cut:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self._listener.close()
        self.cut()


def test_the_client_reattaches_on_its_own_when_the_stream_breaks(
    server: ServerProcess,
) -> None:
    proxy = CuttingProxy(server.address)
    try:
        with RegistryClient.connect(proxy.address, token=AGENT) as agent:
            stdout, stderr, result = b"", b"", None
            for event in agent.stream_tool("talker", timeout=60):
                if event.stdout == b"one\n":
                    proxy.cut()  # mid-call: the tool is sleeping
                stdout += event.stdout
                stderr += event.stderr
                result = event.result or result
        assert proxy.connections >= 2  # the stream was cut, and came back
    finally:
        proxy.close()
    assert (stdout, stderr) == (b"one\nthree\n", b"two\n")
    assert result is not None and result.success and result.content == "one\nthree\n"
