"""Re-attaching across servers on one PostgreSQL (execution/call_relay.py): a
call running on server A is followed through server B to its result; a call
whose server was SIGKILLed ends, when attached, with a clear status."""

from __future__ import annotations

import subprocess
import time

import grpc
import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.client.registry_client import RegistryClient
from registry_server.domain.models import parse_definition
from registry_server.execution.call_relay import DEAD_AFTER_S, SERVER_GONE
from registry_server.store.postgres import PostgresStore
from tests.cluster.conftest import CLIENTS, Cluster, StartCluster, wait_for
from tests.factories import collect_events

pytestmark = pytest.mark.timeout(120)
WAIT_S = 30.0  # seconds for the relay's first publication of a call, on a busy machine

TALKER = {
    "name": "cluster_talker",
    "description": "Prints, sleeps, prints.",
    "safety_level": "safe",
    "parameters": {"type": "object"},
    "sandbox": {
        "image": "toolreg/base",
        "command": ["sh", "-c", "echo one; sleep 2; echo two >&2; sleep 1; echo three"],
        "limits": {"timeout_ms": 30_000},
    },
}


def wait_published(cluster: Cluster, execution_id: str) -> None:
    """Until the call's row is in the shared store: the running server's relay
    thread publishes it, never the call's own path."""
    store = PostgresStore(cluster.store_url, must_exist=True)

    def published() -> bool:
        with store.reading() as reads:
            return reads.kept_call(execution_id) is not None

    try:
        wait_for(f"call {execution_id} published", published, WAIT_S)
    finally:
        store.close()


def _client(address: str, who: str) -> RegistryClient:
    return RegistryClient.connect(address, token=CLIENTS[who][0])


def test_a_call_on_one_server_is_attached_through_another(start_cluster: StartCluster) -> None:
    cluster = start_cluster(2)
    a, b = (s.address for s in cluster.servers)
    with _client(a, "team") as team:
        team.register_tool(parse_definition(TALKER))
    caller = _client(a, "agent")
    events = caller.stream("cluster_talker", timeout=60)
    execution_id = next(events).started.execution_id
    assert next(events).stdout == b"one\n"
    caller.close()  # the stream to A is gone; the call runs on
    with _client(b, "agent2") as stranger:
        with pytest.raises(grpc.RpcError) as info:
            list(stranger.attach(execution_id, timeout=10))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with _client(b, "agent") as again:
        stdout, stderr, result = collect_events(again.attach(execution_id, 4, 0, timeout=30))
    assert (stdout, stderr) == (b"three\n", b"two\n")
    assert result is not None and result.success and result.content == "one\nthree\n"
    assert result.execution_id == execution_id

    # The same call's server killed before the call ends: a clear status.
    with _client(a, "agent") as doomed:
        events = doomed.stream("cluster_talker", timeout=60)
        execution_id = next(events).started.execution_id
        # Killed before its first publication, the other server would have
        # nothing of the call to follow.
        wait_published(cluster, execution_id)
        pid = cluster.servers[0].pid
        cluster.servers[0].kill()  # SIGKILL: no result is ever written
    started = time.monotonic()
    try:
        with _client(b, "agent") as again:
            _, _, result = collect_events(again.attach(execution_id, timeout=DEAD_AFTER_S + 20))
        assert result is not None and not result.success
        assert result.status == pb.EXECUTION_STATUS_SANDBOX_ERROR
        assert result.error == SERVER_GONE and result.execution_id == execution_id
        assert time.monotonic() - started < DEAD_AFTER_S + 5
    finally:
        leftovers = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=io.toolreg.owner-pid={pid}"],
            capture_output=True, text=True, check=False,
        ).stdout.split()  # fmt: skip
        if leftovers:
            subprocess.run(["docker", "rm", "-f", *leftovers], capture_output=True, check=False)
