"""The egress tests' private internet works on its own: upstreams answer over real TLS
from the test CA, log what they receive, and the world's DNS serves its zone (rebinding
names included)."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import socket
import ssl
import subprocess
import uuid
from collections.abc import Iterator

import docker
import docker.errors
import pytest

from sandbox_runner.ownership import OwnerIdentity, process_start_ticks
from tests.egress_world import LABELS, PREFIX, UpstreamWorld


@pytest.fixture(scope="module")
def world() -> Iterator[UpstreamWorld]:
    with UpstreamWorld() as w:
        yield w


def _https(world: UpstreamWorld, name: str, path: str) -> tuple[int, bytes]:
    """GET https://<name><path>, connecting to the upstream's IP (the host has no DNS
    for the world) but verifying, and sending SNI and Host for, `name`."""
    ctx = ssl.create_default_context(cafile=str(world.ca_file))
    raw = socket.create_connection((world.ip(name), 443), timeout=10)
    conn = http.client.HTTPSConnection(name, 443, timeout=10, context=ctx)
    conn.sock = ctx.wrap_socket(raw, server_hostname=name)
    try:
        conn.request("GET", path, headers={"Authorization": "Bearer s3cret"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_https_upstream_answers_and_logs(world: UpstreamWorld) -> None:
    status, body = _https(world, "api.world.test", "/x")
    assert status == 200
    assert json.loads(body) == {"host": "api.world.test", "path": "/x", "ok": True}
    [seen] = [r for r in world.requests("api.world.test") if r["path"] == "/x"]
    assert seen["method"] == "GET"
    assert seen["headers"]["Host"] == "api.world.test"
    assert seen["sni"] == "api.world.test"
    assert seen["body_len"] == 0
    assert world.requests("forbidden.world.test") == []


def test_upstream_certificate_is_only_good_for_its_name(world: UpstreamWorld) -> None:
    ctx = ssl.create_default_context(cafile=str(world.ca_file))
    with (
        socket.create_connection((world.ip("api.world.test"), 443), timeout=10) as raw,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        ctx.wrap_socket(raw, server_hostname="other.world.test")


def test_big_and_echo_header(world: UpstreamWorld) -> None:
    status, body = _https(world, "api.world.test", "/big?bytes=100000")
    assert status == 200
    assert body == b"x" * 100000
    status, body = _https(world, "other.world.test", "/echo-header?name=Authorization")
    assert status == 200
    assert json.loads(body)["value"] == "Bearer s3cret"


def test_plain_http_upstream(world: UpstreamWorld) -> None:
    conn = http.client.HTTPConnection(world.ip("plain.world.test"), 80, timeout=10)
    try:
        conn.request("POST", "/p", body=b"12345", headers={"Host": "plain.world.test"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert json.loads(resp.read())["host"] == "plain.world.test"
    finally:
        conn.close()
    [seen] = world.requests("plain.world.test")
    assert (seen["method"], seen["path"], seen["body_len"]) == ("POST", "/p", 5)


def test_dns_zone_and_rebinding(world: UpstreamWorld) -> None:
    api = world.ip("api.world.test")
    assert world.resolve("api.world.test") == ("NOERROR", [api])
    assert world.resolve("API.World.Test.") == ("NOERROR", [api])
    assert world.resolve("api.world.test", "AAAA") == ("NOERROR", [])
    assert world.resolve("nowhere.world.test") == ("NXDOMAIN", [])
    assert world.resolve("metadata.world.test") == ("NOERROR", ["169.254.169.254"])
    assert world.resolve("rebind.world.test") == ("NOERROR", [api])
    assert world.resolve("rebind.world.test") == ("NOERROR", ["127.0.0.1"])
    assert world.resolve("rebind.world.test") == ("NOERROR", ["127.0.0.1"])
    assert world.resolve("rebind-first-bad.world.test") == ("NOERROR", ["127.0.0.1"])
    assert world.resolve("rebind-first-bad.world.test") == ("NOERROR", [api])
    queries = world.dns_queries()
    assert [q["name"] for q in queries[:2]] == ["api.world.test", "api.world.test"]
    assert queries[2] == {
        "name": "api.world.test",
        "type": "AAAA",
        "answer": [],
        "rcode": "NOERROR",
    }
    assert queries[3]["rcode"] == "NXDOMAIN"
    assert [q["answer"] for q in queries if q["name"] == "rebind.world.test"] == [
        [api],
        ["127.0.0.1"],
        ["127.0.0.1"],
    ]


def _world_of(client: docker.DockerClient, owner: OwnerIdentity) -> tuple[str, str]:
    """A world's network and one container on it, as a test run of ``owner`` leaves them."""
    run = f"{PREFIX}{uuid.uuid4().hex[:8]}"
    labels = {**LABELS, **owner.labels()}
    network = client.api.create_network(run, labels=labels)["Id"]
    container = client.api.create_container(
        "toolreg/base", ["true"], name=f"{run}-dns", labels=labels,
        host_config=client.api.create_host_config(network_mode=run),
    )["Id"]  # fmt: skip
    return network, container


def _owner(proc: subprocess.Popen[bytes]) -> OwnerIdentity:
    ticks = process_start_ticks(proc.pid)
    assert ticks is not None
    return dataclasses.replace(OwnerIdentity.current(), pid=proc.pid, start_ticks=ticks)


def test_a_new_world_removes_the_worlds_of_killed_test_runs_only() -> None:
    """A run killed before its close leaves its world; the next world removes it,
    never one whose owner is alive (another run on the same engine)."""
    client = docker.from_env()
    dead, alive = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    made: list[tuple[str, str]] = []
    try:
        made.append(left := _world_of(client, _owner(dead)))
        made.append(kept := _world_of(client, _owner(alive)))
        dead.kill()
        dead.wait()
        with UpstreamWorld(client):
            pass
        with pytest.raises(docker.errors.NotFound):
            client.api.inspect_container(left[1])
        with pytest.raises(docker.errors.NotFound):
            client.api.inspect_network(left[0])
        client.api.inspect_container(kept[1])
        client.api.inspect_network(kept[0])
    finally:
        alive.kill()
        dead.kill()
        for network, container in made:
            with contextlib.suppress(docker.errors.NotFound):
                client.api.remove_container(container, force=True)
            with contextlib.suppress(docker.errors.NotFound):
                client.api.remove_network(network)
        client.close()
