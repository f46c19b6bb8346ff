"""The egress proxy in-process on loopback: a control socket in tmp_path, real
upstream servers on 127.0.0.1 under made-up names (the proxy's resolver is
injected), raw sockets as the hostile client."""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from sandbox_runner.egress.proxy import EgressProxy, Masker, ProxyThread
from tests.certs import CertificateAuthority

SECRET = "s3cr3t-Zq9"
BIG_BYTES = 2 * 1024 * 1024  # bytes of the /big download
TIMEOUT_S = 5.0  # seconds any client socket operation may take


# --- upstreams -------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    server: _Upstream

    def do_GET(self) -> None:
        self.server.seen.append((self.path, list(self.headers.items())))
        if self.path == "/big":
            body = b"x" * BIG_BYTES
        elif self.path == "/echo":
            body = ("you sent: " + self.headers.get("Authorization", "")).encode()
        else:
            body = b"hello " + self.path.encode()
        try:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            pass

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Upstream(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[tuple[str, list[tuple[str, str]]]] = []

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients the proxy cuts off are expected here


@contextlib.contextmanager
def _serve(server: _Upstream) -> Iterator[_Upstream]:
    # A short poll keeps teardown (shutdown waits one poll) fast.
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


class _Echo:
    """A raw TCP echo server: tunnels that stay open as long as the client wants."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)


@dataclass
class World:
    proxy: EgressProxy
    http: _Upstream
    https: _Upstream
    echo: _Echo
    upstream_ca: CertificateAuthority
    intercept_ca: CertificateAuthority
    answers: dict[str, list[str]]
    resolved: list[str] = field(default_factory=list)
    tokens: int = 0

    # control channel --------------------------------------------------------

    def control_lines(self, *lines: bytes) -> list[dict[str, Any]]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(TIMEOUT_S)
            sock.connect(str(self.proxy.control_path))
            reader = sock.makefile("rb")
            sock.sendall(b"".join(lines))
            return [json.loads(reader.readline()) for _ in lines]

    def control(self, request: dict[str, Any]) -> dict[str, Any]:
        return self.control_lines(json.dumps(request).encode() + b"\n")[0]

    def open(self, egress: list[str], **extra: Any) -> str:
        self.tokens += 1
        token = f"tok-{self.tokens}"
        extra.setdefault("allow_private", ["127.0.0.0/8"])
        request = {
            "op": "open",
            "token": token,
            "execution_id": "e1",
            "tool": "t",
            "egress": egress,
            **extra,
        }
        assert self.control(request) == {"ok": True}
        return token

    def close(self, token: str) -> dict[str, Any]:
        response = self.control({"op": "close", "token": token})
        assert response["ok"], response
        return response

    def inject_rule(self, host: str, port: int) -> dict[str, Any]:
        leaf = self.intercept_ca.issue(host)
        return {
            "host": host,
            "port": port,
            "header": "Authorization",
            "value": f"Bearer {SECRET}",
            "mask": [SECRET, f"Bearer {SECRET}"],
            "cert_pem": leaf.cert_pem.decode(),
            "key_pem": leaf.key_pem.decode(),
        }

    # client side -------------------------------------------------------------

    def connect(self, target: str, token: str | None) -> tuple[int, socket.socket, bytes]:
        """CONNECT; the status, the socket and (on refusal) the body."""
        sock = socket.create_connection(("127.0.0.1", self.proxy.port), timeout=TIMEOUT_S)
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{_auth(token)}\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(1)
            if not chunk:
                break
            head += chunk
        status = int(head.split(b" ", 2)[1]) if head else 0
        body = b"" if status == 200 else _read_all(sock)
        return status, sock, body

    def get(self, url: str, token: str | None, extra: str = "") -> tuple[int, bytes, bytes]:
        """An absolute-form request; status, head and body."""
        with socket.create_connection(("127.0.0.1", self.proxy.port), timeout=TIMEOUT_S) as sock:
            sock.sendall(
                f"GET {url} HTTP/1.1\r\nHost: ignored.test\r\n{_auth(token)}{extra}\r\n".encode()
            )
            return _split(_read_all(sock))

    def tls_get(
        self,
        sock: socket.socket,
        ca: CertificateAuthority,
        server_name: str,
        path: str,
        extra: str = "",
    ) -> tuple[int, bytes, bytes]:
        context = ssl.create_default_context(cadata=ca.pem.decode())
        with context.wrap_socket(sock, server_hostname=server_name) as tls:
            tls.sendall(
                f"GET {path} HTTP/1.1\r\nHost: {server_name}\r\n{extra}Connection: close\r\n\r\n".encode()
            )
            return _split(_read_all(tls))


def _auth(token: str | None) -> str:
    if token is None:
        return ""
    return (
        "Proxy-Authorization: Basic "
        + base64.b64encode(f"toolreg:{token}".encode()).decode()
        + "\r\n"
    )


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (ConnectionResetError, ssl.SSLError):
        pass
    return data


def _split(response: bytes) -> tuple[int, bytes, bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    return status, head, body


def _headers(seen: tuple[str, list[tuple[str, str]]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name, value in seen[1]:
        out.setdefault(name.lower(), []).append(value)
    return out


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    upstream_ca = CertificateAuthority("upstream CA")
    intercept_ca = CertificateAuthority("toolreg egress CA")
    (tmp_path / "upstream-ca.pem").write_bytes(upstream_ca.pem)
    issued = upstream_ca.issue("api.upstream.test")  # CN only: hostname checks fall back to it
    (tmp_path / "up.crt").write_bytes(issued.cert_pem)
    (tmp_path / "up.key").write_bytes(issued.key_pem)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(tmp_path / "up.crt", tmp_path / "up.key")
    https = _Upstream()
    https.socket = server_tls.wrap_socket(https.socket, server_side=True)

    answers = {
        name: ["127.0.0.1"]
        for name in (
            "api.upstream.test",
            "other.upstream.test",
            "plain.upstream.test",
            "wrong.upstream.test",
            "echo.upstream.test",
        )
    }
    answers["mixed.test"] = ["93.184.216.34", "10.1.2.3"]
    resolved: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        resolved.append(host)
        if host == "rebind.test":
            # Allowed once, then the metadata service on every later lookup.
            return ["127.0.0.1"] if resolved.count(host) == 1 else ["169.254.169.254"]
        if host not in answers:
            raise OSError("no such name")
        return answers[host]

    with contextlib.ExitStack() as stack:
        http = stack.enter_context(_serve(_Upstream()))
        stack.enter_context(_serve(https))
        echo = _Echo()
        stack.callback(echo.sock.close)
        proxy = stack.enter_context(
            ProxyThread(
                control_path=tmp_path / "control.sock",
                upstream_ca=tmp_path / "upstream-ca.pem",
                resolve=resolve,
                resolve_timeout=2,
                connect_timeout=2,
            )
        )
        yield World(proxy, http, https, echo, upstream_ca, intercept_ca, answers, resolved)


# --- tests -----------------------------------------------------------------


def test_masker_masks_secrets_split_across_chunks() -> None:
    masker = Masker([b"s3cr3t", b"Bearer s3cr3t"])
    stream = b"a Bearer s3cr3t b s3cr3t c s3cr3"
    out = b""
    for i in range(0, len(stream), 3):
        out += masker.feed(stream[i : i + 3])
    out += masker.flush()
    assert out == b"a ************* b ****** c s3cr3"
    assert len(out) == len(stream)


def test_control_survives_malformed_lines(world: World) -> None:
    replies = world.control_lines(
        b"not json\n",
        b"[1, 2]\n",
        b'{"op": "nope"}\n',
        b'{"op": "close", "token": "unknown"}\n',
        b'{"op": "open", "token": "x", "egress": ["1.2.3.4:80"]}\n',
        b'{"op": "open", "token": "x", "egress": [], "max_bytes": true}\n',
        b'{"op": "open"}\n',
        b"x" * (1024 * 1024 + 10) + b"\n",
        b'{"op": "ping"}\n',
    )
    assert all(r["ok"] is False and r["error"] for r in replies[:-1]), replies
    assert replies[-1] == {"ok": True}
    assert world.control({"op": "ping"}) == {"ok": True}


def test_missing_or_bad_token_gets_407_and_no_record(world: World) -> None:
    token = world.open([f"plain.upstream.test:{world.http.server_port}"])
    url = f"http://plain.upstream.test:{world.http.server_port}/x"
    for bad in (None, "wrong", token + "x"):
        status, head, _ = world.get(url, bad)
        assert status == 407
        assert b'Proxy-Authenticate: Basic realm="toolreg"' in head
    status, sock, _ = world.connect(f"plain.upstream.test:{world.http.server_port}", None)
    sock.close()
    assert status == 407
    assert world.close(token)["connections"] == []
    assert world.get(url, token)[0] == 407  # a closed call's token is dead


def test_a_token_opens_nothing_on_another_calls_network(world: World) -> None:
    """A call registered with the proxy's address on its own network: its token
    leaked to a tool on another call's network (which reaches the proxy at another
    address) gets 407 and leaves no record; the control socket refuses a bad address."""
    target = f"plain.upstream.test:{world.http.server_port}"
    url = f"http://{target}/x"
    here = world.open([target], address="127.0.0.1")  # the listener's address
    elsewhere = world.open([target], address="127.0.0.2")  # another call's network
    assert world.get(url, elsewhere)[0] == 407
    status, sock, _ = world.connect(target, elsewhere)
    sock.close()
    assert status == 407
    assert world.get(url, here)[:3:2] == (200, b"hello /x")
    assert world.close(elsewhere)["connections"] == []
    assert len(world.close(here)["connections"]) == 1
    for bad in ("10.0.0", "::1%eth0x" * 10, 7):
        request = {"op": "open", "token": "t-bad", "egress": [target], "address": bad}
        reply = world.control(request)
        assert reply["ok"] is False and "address" in reply["error"], (bad, reply)


def test_plain_http_and_connect_tunnel(world: World) -> None:
    port = world.http.server_port
    token = world.open([f"plain.upstream.test:{port}"])
    status, _, body = world.get(
        f"http://plain.upstream.test:{port}/hello?q=1",
        token,
        "Proxy-Connection: keep-alive\r\nX-Mine: 1\r\n",
    )
    assert (status, body) == (200, b"hello /hello?q=1")
    headers = _headers(world.http.seen[-1])
    assert world.http.seen[-1][0] == "/hello?q=1"
    assert "proxy-authorization" not in headers and "proxy-connection" not in headers
    assert headers["connection"] == ["close"] and headers["x-mine"] == ["1"]
    assert headers["host"] == [f"plain.upstream.test:{port}"]

    status, sock, _ = world.connect(f"plain.upstream.test:{port}", token)
    with sock:
        assert status == 200
        sock.sendall(b"GET /tunnel HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert _split(_read_all(sock))[2] == b"hello /tunnel"

    records = world.close(token)["connections"]
    assert [(r["method"], r["allowed"], r["reason"], r["address"], r["host"]) for r in records] == [
        ("GET", True, "", "127.0.0.1", "plain.upstream.test"),
        ("CONNECT", True, "", "127.0.0.1", "plain.upstream.test"),
    ]
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 and r["port"] == port for r in records)


def test_refusals(world: World) -> None:
    port = world.http.server_port
    token = world.open([f"plain.upstream.test:{port}", f"mixed.test:{port}"])
    cases = [
        (f"other.upstream.test:{port}", "not in the allow-list"),
        (f"plain.upstream.test:{port + 1 if port < 65535 else port - 1}", "not in the allow-list"),
        (f"127.0.0.1:{port}", "raw IP addresses are not allowed"),
        (f"[::1]:{port}", "raw IP addresses are not allowed"),
        (f"bad_host!:{port}", "not a host name"),
        (f"mixed.test:{port}", "address 10.1.2.3 is private"),
    ]
    for target, reason in cases:
        status, sock, body = world.connect(target, token)
        sock.close()
        assert (status, body.decode()) == (403, reason + "\n"), target
    status, _, _ = _split_get(world, token)
    assert status == 405
    records = world.close(token)["connections"]
    assert [r["reason"] for r in records] == [c[1] for c in cases] + [records[-1]["reason"]]
    assert not any(r["allowed"] for r in records)
    assert records[-1]["method"] == "GET" and records[2]["host"] == "127.0.0.1"


def _split_get(world: World, token: str) -> tuple[int, bytes, bytes]:
    with socket.create_connection(("127.0.0.1", world.proxy.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(f"GET /relative HTTP/1.1\r\nHost: x\r\n{_auth(token)}\r\n".encode())
        return _split(_read_all(sock))


def test_loopback_refused_without_allow_private(world: World) -> None:
    port = world.http.server_port
    token = world.open([f"plain.upstream.test:{port}"], allow_private=[])
    status, _, body = world.get(f"http://plain.upstream.test:{port}/", token)
    assert (status, body) == (403, b"address 127.0.0.1 is loopback\n")
    assert world.close(token)["connections"][0]["address"] == "127.0.0.1"
    assert world.http.seen == []


def test_rebinding_name_is_pinned_to_the_checked_address(world: World) -> None:
    token = world.open([f"rebind.test:{world.echo.port}"])
    status, sock, _ = world.connect(f"rebind.test:{world.echo.port}", token)
    with sock:
        assert status == 200
        sock.sendall(b"ping")
        assert sock.recv(4) == b"ping"
        assert world.resolved.count("rebind.test") == 1
    status, sock, body = world.connect(f"rebind.test:{world.echo.port}", token)
    sock.close()
    assert (status, body) == (403, b"address 169.254.169.254 is the cloud metadata service\n")
    assert world.resolved.count("rebind.test") == 2
    first, second = world.close(token)["connections"]
    assert (first["address"], first["allowed"]) == ("127.0.0.1", True)
    assert (second["address"], second["allowed"]) == ("169.254.169.254", False)


def test_injection_masking_and_plain_tunnels_without_the_secret(world: World) -> None:
    port = world.https.server_port
    token = world.open(
        [f"api.upstream.test:{port}", f"other.upstream.test:{port}"],
        inject=[world.inject_rule("api.upstream.test", port)],
    )
    status, sock, _ = world.connect(f"api.upstream.test:{port}", token)
    assert status == 200
    status, _, body = world.tls_get(
        sock,
        world.intercept_ca,
        "api.upstream.test",
        "/echo",
        "Authorization: Bearer the-tools-own\r\nauthorization: again\r\nAccept-Encoding: gzip\r\n",
    )
    assert status == 200
    assert body == b"you sent: " + b"*" * len(f"Bearer {SECRET}")
    headers = _headers(world.https.seen[-1])
    assert headers["authorization"] == [f"Bearer {SECRET}"]
    assert headers["accept-encoding"] == ["identity"]
    assert headers["connection"] == ["close"]

    # Another allowed host is a plain tunnel: the tool's own TLS, no secret added.
    status, sock, _ = world.connect(f"other.upstream.test:{port}", token)
    assert status == 200
    status, _, body = world.tls_get(sock, world.upstream_ca, "api.upstream.test", "/echo")
    assert (status, body) == (200, b"you sent: ")
    assert "authorization" not in _headers(world.https.seen[-1])

    response = world.close(token)
    assert [(r["host"], r["injected"], r["allowed"]) for r in response["connections"]] == [
        ("api.upstream.test", True, True),
        ("other.upstream.test", False, True),
    ]
    assert SECRET not in json.dumps(response)


def test_upstream_tls_verification_failure(world: World) -> None:
    port = world.https.server_port
    token = world.open(
        [f"wrong.upstream.test:{port}"], inject=[world.inject_rule("wrong.upstream.test", port)]
    )
    status, sock, body = world.connect(f"wrong.upstream.test:{port}", token)
    sock.close()
    assert status == 502 and b"upstream TLS verification failed" in body
    (record,) = world.close(token)["connections"]
    assert (record["reason"], record["allowed"]) == ("upstream TLS verification failed", False)


def test_byte_cap_cuts_one_call_only(world: World) -> None:
    port = world.http.server_port
    cap = 256 * 1024
    capped = world.open([f"plain.upstream.test:{port}"], max_bytes=cap)
    other = world.open([f"plain.upstream.test:{port}"])
    status, _, body = world.get(f"http://plain.upstream.test:{port}/big", capped)
    assert len(body) < BIG_BYTES
    assert world.get(f"http://plain.upstream.test:{port}/small", other)[2] == b"hello /small"
    status, _, body = world.get(f"http://plain.upstream.test:{port}/small", capped)
    assert (status, body) == (403, b"byte cap reached\n")
    first, second = world.close(capped)["connections"]
    assert (first["reason"], first["allowed"]) == ("byte cap reached", True)
    assert first["bytes_up"] + first["bytes_down"] == cap
    assert (second["reason"], second["allowed"]) == ("byte cap reached", False)
    assert world.close(other)["connections"][0]["reason"] == ""


def test_connection_cap(world: World) -> None:
    port = world.http.server_port
    token = world.open([f"plain.upstream.test:{port}"], max_connections=2)
    url = f"http://plain.upstream.test:{port}/"
    assert world.get(url, token)[0] == 200
    assert world.get(url, token)[0] == 200
    assert world.get(url, token)[:3:2] == (403, b"connection cap reached\n")
    assert [r["reason"] for r in world.close(token)["connections"]] == [
        "",
        "",
        "connection cap reached",
    ]


def test_close_cuts_live_tunnels_and_reports_bytes(world: World) -> None:
    token = world.open([f"echo.upstream.test:{world.echo.port}"])
    status, sock, _ = world.connect(f"echo.upstream.test:{world.echo.port}", token)
    with sock:
        assert status == 200
        sock.sendall(b"hello")
        assert sock.recv(5) == b"hello"
        (record,) = world.close(token)["connections"]
        assert (record["bytes_up"], record["bytes_down"], record["allowed"]) == (5, 5, True)
        assert record["duration_ms"] >= 0
        assert _read_all(sock) == b""  # closed by the proxy, not by a timeout
