"""The egress tests' private internet works on its own: upstreams answer over real TLS
from the test CA, log what they receive, and the world's DNS serves its zone (rebinding
names included)."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
from collections.abc import Iterator

import pytest

from tests.egress_world import UpstreamWorld


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
