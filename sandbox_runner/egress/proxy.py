"""The egress proxy: the only way out for a sandbox whose tool may reach named hosts.

The sandbox's tool code is the client and is hostile; the server, on the
control socket, is trusted. Every tool call is registered with its token, its
allow-list and its caps; every client connection names a call by its token
(Proxy-Authorization) and is checked against that call only. A call registered
with an ``address`` (the proxy's own address on that call's network) is found
only by a connection that reached the proxy there: a token leaked to a tool on
another call's network opens nothing.

The proxy resolves names itself, refuses any answer holding an address that is
not public (unless the call's policy names that network), and connects to the
address it checked: a DNS answer that changes between check and use (rebinding)
gains nothing. For hosts with an ``inject`` rule it terminates TLS with a leaf
certificate from the server's CA, adds the credential header the tool must never
see, and masks that credential in whatever the upstream sends back.

Standard library only: this directory runs as the package ``egress`` in a
container with nothing but python3 (``python3 -m egress.proxy``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import rules

CHUNK_BYTES = 64 * 1024  # bytes read per relay step
MAX_HEAD_BYTES = 16 * 1024  # bytes of one HTTP request head
HEAD_TIMEOUT_S = 10.0  # seconds for a request head to arrive
MAX_CONTROL_LINE_BYTES = 1024 * 1024  # bytes of one control request line
MAX_RECORDS = 256  # connection records kept per call
REPLY_TIMEOUT_S = 5.0  # seconds to hand an error reply to a client that may not read
TLS_HANDSHAKE_TIMEOUT_S = 10.0  # seconds for a TLS handshake, either side
CLOSE_WAIT_S = 2.0  # seconds a call's close waits for its connections to wind down
DEFAULT_RESOLVE_TIMEOUT_S = 5.0  # seconds for a name to resolve
DEFAULT_CONNECT_TIMEOUT_S = 10.0  # seconds to connect upstream (TLS included)
DEFAULT_MAX_BYTES = 16 * 1024 * 1024  # bytes per call, both directions, all connections
DEFAULT_MAX_CONNECTIONS = 32  # connections per call
MAX_TOKEN_CHARS = 512  # characters of a call token
MAX_LABEL_CHARS = 256  # characters of an execution id or tool name
MAX_METHOD_CHARS = 32  # characters of a method kept in a record
PROXY_USER = "toolreg"  # the user name in Proxy-Authorization: Basic

_TOKEN_CHARS = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 token
# Headers that concern this hop only; the proxy forwards none of them.
_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "proxy-authorization", "proxy-authenticate", "proxy-connection"}
)

log = logging.getLogger("egress.proxy")

Resolver = Callable[[str, int], Awaitable[list[str]]]
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class ControlError(Exception):
    """A control request the proxy refuses; the message goes back to the server."""


class _Reply(Exception):
    """Answer the client with ``status`` and close; recorded when the client named a call."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


_STATUS_TEXT = {
    400: "Bad Request",
    403: "Forbidden",
    405: "Method Not Allowed",
    407: "Proxy Authentication Required",
    408: "Request Timeout",
    502: "Bad Gateway",
}


@dataclass(slots=True)
class Record:
    """What one client connection asked for and what became of it."""

    host: str = ""
    port: int = 0
    address: str = ""
    allowed: bool = False
    reason: str = ""
    bytes_up: int = 0
    bytes_down: int = 0
    method: str = ""
    injected: bool = False
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None

    def as_json(self) -> dict[str, Any]:
        end = self.ended if self.ended is not None else time.monotonic()
        return {
            "host": self.host,
            "port": self.port,
            "address": self.address,
            "allowed": self.allowed,
            "reason": self.reason,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "duration_ms": int((end - self.started) * 1000),
            "method": self.method,
            "injected": self.injected,
        }


@dataclass(slots=True)
class Inject:
    """TLS interception for one host:port: the credential header and what to mask."""

    host: str
    port: int
    header: str
    value: str
    masks: tuple[bytes, ...]
    context: ssl.SSLContext  # the client-facing side, holding the call's leaf certificate


@dataclass(eq=False, slots=True)
class Call:
    token: str
    execution_id: str
    tool: str
    address: str  # the only local address its connections may arrive at ("": any)
    entries: tuple[rules.Entry, ...]
    allow_private: tuple[Network, ...]
    injects: dict[tuple[str, int], Inject]
    max_bytes: int
    max_connections: int
    records: list[Record] = field(default_factory=list)
    unrecorded: int = 0
    admitted: int = 0  # connections past the connection cap check, live or past
    bytes_total: int = 0
    exhausted: bool = False
    closed: bool = False
    live: set[Connection] = field(default_factory=set)

    def keep(self, record: Record) -> None:
        if len(self.records) < MAX_RECORDS:
            self.records.append(record)
        else:
            self.unrecorded += 1


@dataclass(eq=False, slots=True)
class Connection:
    """One client connection and, once connected, its upstream."""

    client: asyncio.StreamWriter
    task: asyncio.Task[Any] | None
    call: Call | None = None
    record: Record | None = None
    upstream: asyncio.StreamWriter | None = None
    cut: bool = False

    def abort(self, reason: str = "") -> None:
        """End the connection now, from anywhere on the loop."""
        self.cut = True
        if reason and self.record is not None and not self.record.reason:
            self.record.reason = reason
        for writer in (self.client, self.upstream):
            if writer is not None:
                writer.transport.abort()
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()


class Masker:
    """Replaces every exact occurrence of a secret in a byte stream by as many
    ``*``, occurrences split across chunks included, so lengths and HTTP framing stay valid."""

    def __init__(self, secrets: Iterable[bytes]) -> None:
        self._secrets = tuple(sorted({s for s in secrets if s}, key=len, reverse=True))
        # An occurrence not wholly inside the buffer starts in its last keep bytes.
        self._keep = max((len(s) for s in self._secrets), default=1) - 1
        self._raw_tail = b""  # unmasked, to find occurrences that continue in the next chunk
        self._masked_tail = b""  # the same bytes masked, for what is emitted

    def feed(self, data: bytes) -> bytes:
        raw = self._raw_tail + data
        out = bytearray(self._masked_tail + data)
        for secret in self._secrets:
            start = raw.find(secret)
            while start != -1:
                out[start : start + len(secret)] = b"*" * len(secret)
                start = raw.find(secret, start + 1)
        cut = max(len(raw) - self._keep, 0)
        self._raw_tail, self._masked_tail = raw[cut:], bytes(out[cut:])
        return bytes(out[:cut])

    def flush(self) -> bytes:
        tail, self._raw_tail, self._masked_tail = self._masked_tail, b"", b""
        return tail


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]


def _parse_head(head: bytes) -> _Request:
    text = head.decode("latin-1")
    if not text.endswith("\r\n\r\n"):
        raise _Reply(400, "malformed request head")
    lines = text[:-4].split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _TOKEN_CHARS.match(parts[0]):
        raise _Reply(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1") or not target:
        raise _Reply(400, "malformed request line")
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        # Bare CR/LF or NUL inside a head is how requests get smuggled past a proxy.
        if not sep or not _TOKEN_CHARS.match(name) or any(c in value for c in "\r\n\0"):
            raise _Reply(400, "malformed header")
        headers.append((name, value.strip(" \t")))
    return _Request(method, target, version, headers)


def _printable(text: str, limit: int = rules.MAX_HOST_CHARS) -> str:
    """Untrusted text fit for a record or a log line."""
    return "".join(c if c.isprintable() and c.isascii() else "?" for c in text[:limit])


def _split_authority(text: str) -> tuple[str, str | None]:
    """``host[:port]`` into host text and port text (None: no port given)."""
    if text.startswith("[") and "]" in text:
        end = text.index("]") + 1
        rest = text[end:]
        if not rest:
            return text[:end], None
        return text[:end], rest[1:] if rest.startswith(":") else ""
    host, sep, port = text.rpartition(":")
    return (host, port) if sep else (text, None)


def _parse_port(text: str | None, default: int | None) -> int | None:
    if text is None:
        return default
    if not text.isascii() or not text.isdigit() or len(text) > 5:
        return None
    port = int(text)
    return port if 1 <= port <= 65535 else None


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


def _host_header(host: str, port: int, default_port: int) -> str:
    return host if port == default_port else f"{host}:{port}"


def _encode_head(lines: Sequence[str]) -> bytes:
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _getaddrinfo(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class EgressProxy:
    """The proxy listener (TCP) and the control listener (Unix socket) on one event loop."""

    def __init__(
        self,
        *,
        control_path: str | Path,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        upstream_ca: str | Path | None = None,
        resolve: Resolver | None = None,
        resolve_timeout: float = DEFAULT_RESOLVE_TIMEOUT_S,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        self._listen_host = listen_host
        self._listen_port = listen_port
        self._control_path = Path(control_path)
        self._upstream_ca = None if upstream_ca is None else str(upstream_ca)
        self._resolve: Resolver = resolve or _getaddrinfo
        self._resolve_timeout = resolve_timeout
        self._connect_timeout = connect_timeout
        self._calls: dict[str, Call] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._proxy_server: asyncio.Server | None = None
        self._control_server: asyncio.Server | None = None
        self._upstream_tls: ssl.SSLContext | None = None
        self._port = 0

    @property
    def port(self) -> int:
        """The TCP port the proxy listener is bound to (useful with listen_port 0)."""
        return self._port

    @property
    def control_path(self) -> Path:
        return self._control_path

    async def start(self) -> None:
        self._upstream_tls = ssl.create_default_context(cafile=self._upstream_ca)
        # The masker and the header rewrite understand HTTP/1.1 only.
        self._upstream_tls.set_alpn_protocols(["http/1.1"])
        with contextlib.suppress(FileNotFoundError):
            self._control_path.unlink()  # a socket left by a previous run
        self._control_server = await asyncio.start_unix_server(
            self._on_control, path=str(self._control_path)
        )
        # limit bounds what readuntil buffers while looking for the end of a head.
        self._proxy_server = await asyncio.start_server(
            self._on_client, self._listen_host, self._listen_port, limit=MAX_HEAD_BYTES
        )
        self._port = int(self._proxy_server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        for server in (self._proxy_server, self._control_server):
            if server is not None:
                server.close()
        for call in list(self._calls.values()):
            self._end_call(call)
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
        for server in (self._proxy_server, self._control_server):
            if server is not None:
                await server.wait_closed()
        self._proxy_server = self._control_server = None
        with contextlib.suppress(FileNotFoundError):
            self._control_path.unlink()

    async def serve_forever(self) -> None:
        assert self._proxy_server is not None, "start() first"
        await self._proxy_server.serve_forever()

    # --- control channel -------------------------------------------------

    async def _on_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._track()
        buffer = bytearray()
        overlong = False  # inside a line already answered as too long
        try:
            while chunk := await reader.read(CHUNK_BYTES):
                buffer += chunk
                while (newline := buffer.find(b"\n")) != -1:
                    line = bytes(buffer[:newline])
                    del buffer[: newline + 1]
                    if overlong:
                        overlong = False
                        continue
                    writer.write(self._answer(line))
                    await writer.drain()
                if len(buffer) > MAX_CONTROL_LINE_BYTES and not overlong:
                    # Answer now and drop the rest of the line as it arrives.
                    overlong = True
                    buffer.clear()
                    writer.write(_control_reply({"ok": False, "error": "line over 1 MiB"}))
                    await writer.drain()
                elif overlong:
                    buffer.clear()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()

    def _answer(self, line: bytes) -> bytes:
        try:
            request = json.loads(line)
            if not isinstance(request, dict):
                raise ControlError("a request is a JSON object")
            response = self._dispatch(request)
        except ValueError:
            response = {"ok": False, "error": "not a JSON line"}
        except ControlError as error:
            response = {"ok": False, "error": str(error)}
        except Exception:  # one bad request must not stop the proxy
            log.exception("control request failed")
            response = {"ok": False, "error": "internal error"}
        return _control_reply(response)

    def _dispatch(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "ping":
            return {"ok": True}
        if op == "open":
            call = _parse_open(request)
            if call.token in self._calls:
                raise ControlError("token already open")
            self._calls[call.token] = call
            return {"ok": True}
        if op == "close":
            token = request.get("token")
            found = self._calls.get(token) if isinstance(token, str) else None
            if found is None:
                raise ControlError("unknown token")
            self._end_call(found)
            return {
                "ok": True,
                "connections": [r.as_json() for r in found.records],
                "unrecorded": found.unrecorded,
            }
        raise ControlError("op must be 'ping', 'open' or 'close'")

    def _end_call(self, call: Call) -> None:
        # Synchronous on purpose: the reply lists the records as they are now,
        # and no connection can attach to a call no longer in the table.
        self._calls.pop(call.token, None)
        call.closed = True
        for connection in list(call.live):
            if connection.record is not None and not connection.record.allowed:
                connection.abort("call closed")
            else:
                connection.abort()
            self._finish(connection)

    # --- proxy listener ----------------------------------------------------

    def _track(self) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._track()
        connection = Connection(client=writer, task=asyncio.current_task())
        try:
            await self._serve(connection, reader)
        except _Reply as reply:
            if connection.record is not None:
                connection.record.allowed = False
                connection.record.reason = reply.reason
                self._log_refusal(connection, reply.reason)
            await self._reply(writer, reply.status, reply.reason)
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._finish(connection)

    def _finish(self, connection: Connection) -> None:
        for writer in (connection.client, connection.upstream):
            if writer is not None:
                writer.transport.abort()
        record = connection.record
        if record is not None and record.ended is None:
            record.ended = time.monotonic()
        if connection.call is not None:
            connection.call.live.discard(connection)

    def _log_refusal(self, connection: Connection, reason: str) -> None:
        record, call = connection.record, connection.call
        if record is None or call is None:
            return
        log.info(
            "refused %s:%d for %s (%s): %s",
            record.host,
            record.port,
            _printable(call.tool, MAX_LABEL_CHARS),
            _printable(call.execution_id, MAX_LABEL_CHARS),
            reason,
        )

    async def _reply(self, writer: asyncio.StreamWriter, status: int, reason: str) -> None:
        body = (reason + "\n").encode("utf-8", "replace")
        lines = [
            f"HTTP/1.1 {status} {_STATUS_TEXT.get(status, 'Error')}",
            "Content-Type: text/plain; charset=utf-8",
            f"Content-Length: {len(body)}",
            "Connection: close",
        ]
        if status == 407:
            lines.insert(1, f'Proxy-Authenticate: Basic realm="{PROXY_USER}"')
        with contextlib.suppress(ConnectionError, OSError, TimeoutError):
            writer.write(_encode_head(lines) + body)
            await asyncio.wait_for(writer.drain(), REPLY_TIMEOUT_S)

    async def _read_head(self, reader: asyncio.StreamReader) -> bytes:
        try:
            return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
        except TimeoutError:
            raise _Reply(408, "request head took too long") from None
        except asyncio.LimitOverrunError:
            raise _Reply(400, "request head too large") from None

    def _authenticate(self, headers: list[tuple[str, str]]) -> Call | None:
        values = [v for n, v in headers if n.lower() == "proxy-authorization"]
        if len(values) != 1:
            return None
        scheme, _, credentials = values[0].partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            decoded = base64.b64decode(credentials.strip(), validate=True)
        except (binascii.Error, ValueError):
            return None
        user, sep, token = decoded.partition(b":")
        if user != PROXY_USER.encode() or not sep or not token:
            return None
        found = None
        for call in self._calls.values():
            # Every open token is compared, in constant time each.
            if hmac.compare_digest(call.token.encode(), token):
                found = call
        return found

    async def _serve(self, connection: Connection, reader: asyncio.StreamReader) -> None:
        try:
            head = await self._read_head(reader)
        except asyncio.IncompleteReadError:
            return
        request = _parse_head(head)
        call = self._authenticate(request.headers)
        if call is not None and not _arrived_at(connection.client, call.address):
            log.warning(
                "the token of %s came from another network; refused",
                _printable(call.execution_id, MAX_LABEL_CHARS),
            )
            call = None
        if call is None or call.closed:
            raise _Reply(407, "proxy authentication required")
        record = Record(method=_printable(request.method, MAX_METHOD_CHARS))
        connection.call, connection.record = call, record
        call.keep(record)
        call.live.add(connection)

        # 1. The request form.
        if request.method == "CONNECT":
            host_text, port_text = _split_authority(request.target)
            port = _parse_port(port_text, None)
            path = ""
        elif request.target[:7].lower() == "http://":
            rest = request.target[7:]
            cut = min((i for i in (rest.find(c) for c in "/?#") if i != -1), default=len(rest))
            host_text, port_text = _split_authority(rest[:cut])
            port = _parse_port(port_text, 80)
            path = rest[cut:].split("#", 1)[0]
            path = path if path.startswith("/") else "/" + path
        else:
            raise _Reply(405, "only CONNECT and absolute-form http:// requests are proxied")
        record.host, record.port = _printable(host_text), port or 0

        # 2. The call's caps.
        if call.exhausted:
            raise _Reply(403, "byte cap reached")
        if call.admitted >= call.max_connections:
            raise _Reply(403, "connection cap reached")
        call.admitted += 1

        # 3. The host.
        if port is None:
            raise _Reply(403, "invalid port")
        if _is_address(host_text):
            raise _Reply(403, "raw IP addresses are not allowed")
        host = rules.normalize_host(host_text) if "@" not in host_text else None
        if host is None:
            raise _Reply(403, "not a host name")
        record.host = host

        # 4. The allow-list.
        if rules.first_match(call.entries, host, port) is None:
            raise _Reply(403, "not in the allow-list")

        # 5. Resolve once, check every answer.
        address = await self._resolve_checked(call, record, host, port)

        # 6. Connect to the address checked, never to a fresh answer.
        inject = call.injects.get((host, port)) if request.method == "CONNECT" else None
        upstream_reader, upstream_writer = await self._connect(address, port, host, inject)
        connection.upstream = upstream_writer
        if connection.cut:
            return
        record.allowed = True

        # 7. Relay.
        client = connection.client
        if request.method != "CONNECT":
            self._send_up(connection, upstream_writer, self._plain_head(request, host, port, path))
            await self._relay(connection, reader, upstream_reader, upstream_writer, None)
            return
        client.write(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        await client.drain()
        if inject is None:
            await self._relay(connection, reader, upstream_reader, upstream_writer, None)
            return
        await self._intercept(connection, reader, upstream_reader, upstream_writer, inject)

    async def _resolve_checked(self, call: Call, record: Record, host: str, port: int) -> str:
        try:
            answer = await asyncio.wait_for(self._resolve(host, port), self._resolve_timeout)
        except (OSError, TimeoutError, UnicodeError, ValueError):
            answer = []
        addresses = list(dict.fromkeys(answer))
        if not addresses:
            raise _Reply(403, "could not resolve")
        for address in addresses:
            # One bad address in an answer is an attack signal, not noise to skip.
            why = rules.refused_address(address, call.allow_private)
            if why is not None:
                record.address = _printable(address, 64)
                raise _Reply(403, why)
        record.address = addresses[0]
        return addresses[0]

    async def _connect(
        self, address: str, port: int, host: str, inject: Inject | None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            if inject is None:
                return await asyncio.wait_for(
                    asyncio.open_connection(address, port), self._connect_timeout
                )
            return await asyncio.wait_for(
                asyncio.open_connection(
                    address,
                    port,
                    ssl=self._upstream_tls,
                    server_hostname=host,
                    ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S,
                ),
                self._connect_timeout,
            )
        except ssl.SSLCertVerificationError:
            raise _Reply(502, "upstream TLS verification failed") from None
        except ssl.SSLError:
            raise _Reply(502, "upstream TLS handshake failed") from None
        except (OSError, TimeoutError):
            raise _Reply(502, "could not connect") from None

    def _plain_head(self, request: _Request, host: str, port: int, path: str) -> bytes:
        lines = [f"{request.method} {path} {request.version}"]
        # The Host the client wrote could name another site behind the same address.
        lines.append(f"Host: {_host_header(host, port, 80)}")
        lines += [
            f"{n}: {v}" for n, v in request.headers if n.lower() not in _HOP_HEADERS | {"host"}
        ]
        lines.append("Connection: close")
        return _encode_head(lines)

    async def _intercept(
        self,
        connection: Connection,
        reader: asyncio.StreamReader,
        upstream_reader: asyncio.StreamReader,
        upstream_writer: asyncio.StreamWriter,
        inject: Inject,
    ) -> None:
        record = connection.record
        assert record is not None
        record.injected = True
        try:
            await asyncio.wait_for(
                connection.client.start_tls(
                    inject.context, ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S
                ),
                TLS_HANDSHAKE_TIMEOUT_S + 1,
            )
        except (ssl.SSLError, OSError, TimeoutError):
            record.reason = "client TLS handshake failed"
            return
        try:
            head = await self._read_head(reader)
            request = _parse_head(head)
            if not request.target.startswith("/") or request.method == "CONNECT":
                raise _Reply(400, "origin-form request expected")
        except (_Reply, asyncio.IncompleteReadError) as error:
            reason = error.reason if isinstance(error, _Reply) else "no request"
            record.reason = reason
            if isinstance(error, _Reply):
                await self._reply(connection.client, error.status, error.reason)
            return
        dropped = _HOP_HEADERS | {"host", "accept-encoding", inject.header.lower()}
        lines = [
            f"{request.method} {request.target} {request.version}",
            f"Host: {_host_header(inject.host, inject.port, 443)}",
        ]
        lines += [f"{n}: {v}" for n, v in request.headers if n.lower() not in dropped]
        lines += [
            f"{inject.header}: {inject.value}",
            "Accept-Encoding: identity",
            "Connection: close",
        ]
        self._send_up(connection, upstream_writer, _encode_head(lines))
        await self._relay(
            connection, reader, upstream_reader, upstream_writer, Masker(inject.masks)
        )

    def _send_up(self, connection: Connection, writer: asyncio.StreamWriter, data: bytes) -> None:
        data = self._charge(connection, data, up=True)
        if data:
            writer.write(data)

    def _charge(self, connection: Connection, data: bytes, *, up: bool) -> bytes:
        """Count ``data`` against the call's byte cap; what may pass of it."""
        call, record = connection.call, connection.record
        assert call is not None and record is not None
        room = max(call.max_bytes - call.bytes_total, 0)
        over = len(data) > room
        if over:
            data = data[:room]
        call.bytes_total += len(data)
        if up:
            record.bytes_up += len(data)
        else:
            record.bytes_down += len(data)
        if over:
            call.exhausted = True
            record.reason = "byte cap reached"
            connection.cut = True
            for other in list(call.live):
                if other is not connection:
                    other.abort("byte cap reached")
        return data

    async def _relay(
        self,
        connection: Connection,
        client_reader: asyncio.StreamReader,
        upstream_reader: asyncio.StreamReader,
        upstream_writer: asyncio.StreamWriter,
        masker: Masker | None,
    ) -> None:
        up = asyncio.create_task(self._pump(connection, client_reader, upstream_writer, True, None))
        down = asyncio.create_task(
            self._pump(connection, upstream_reader, connection.client, False, masker)
        )
        try:
            done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            # The client finishing its request is normal; the upstream's answer still comes.
            if up in done and up.result() and not connection.cut:
                await down
        finally:
            for task in (up, down):
                task.cancel()
            await asyncio.gather(up, down, return_exceptions=True)

    async def _pump(
        self,
        connection: Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        up: bool,
        masker: Masker | None,
    ) -> bool:
        """Copy until end of stream; True when the source ended cleanly."""
        try:
            while not connection.cut:
                data = await reader.read(CHUNK_BYTES)
                if not data:
                    if masker is not None:
                        writer.write(masker.flush())
                    if writer.can_write_eof():
                        writer.write_eof()
                    await writer.drain()
                    return True
                data = self._charge(connection, data, up=up)
                if masker is not None:
                    data = masker.feed(data)
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError, ssl.SSLError):
            pass
        return False


def _control_reply(response: dict[str, Any]) -> bytes:
    return json.dumps(response, separators=(",", ":")).encode() + b"\n"


def _text(request: dict[str, Any], key: str, *, limit: int, required: bool = True) -> str:
    value = request.get(key, None if required else "")
    if not isinstance(value, str) or (required and not value) or len(value) > limit:
        raise ControlError(f"{key} must be a string of 1 to {limit} characters")
    return value


def _count(request: dict[str, Any], key: str, default: int) -> int:
    value = request.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ControlError(f"{key} must be a positive integer")
    return value


def _strings(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ControlError(f"{what} must be a list of strings")
    return value


def _arrived_at(client: asyncio.StreamWriter, address: str) -> bool:
    """Whether the connection reached the proxy at ``address`` (always, for "")."""
    if not address:
        return True
    local = client.get_extra_info("sockname")
    try:
        return ipaddress.ip_address(local[0]) == ipaddress.ip_address(address)
    except (TypeError, IndexError, ValueError):
        return False


def _parse_open(request: dict[str, Any]) -> Call:
    token = _text(request, "token", limit=MAX_TOKEN_CHARS)
    if not token.isascii() or not token.isprintable():
        raise ControlError("token must be printable ASCII")
    address = _text(request, "address", limit=64, required=False)
    if address:
        try:
            ipaddress.ip_address(address)
        except ValueError:
            raise ControlError("address must be an IP address") from None
    try:
        entries = rules.parse_entries(_strings(request.get("egress"), "egress"))
    except ValueError as error:
        raise ControlError(f"egress: {error}") from None
    try:
        networks = rules.parse_networks(_strings(request.get("allow_private"), "allow_private"))
    except ValueError as error:
        raise ControlError(f"allow_private: {error}") from None
    raw_injects = request.get("inject") or []
    if not isinstance(raw_injects, list):
        raise ControlError("inject must be a list")
    injects: dict[tuple[str, int], Inject] = {}
    for index, raw in enumerate(raw_injects):
        inject = _parse_inject(raw, index)
        if rules.first_match(entries, inject.host, inject.port) is None:
            raise ControlError(f"inject[{index}]: host:port is not in the egress list")
        injects[(inject.host, inject.port)] = inject
    return Call(
        token=token,
        execution_id=_text(request, "execution_id", limit=MAX_LABEL_CHARS, required=False),
        tool=_text(request, "tool", limit=MAX_LABEL_CHARS, required=False),
        address=address,
        entries=entries,
        allow_private=networks,
        injects=injects,
        max_bytes=_count(request, "max_bytes", DEFAULT_MAX_BYTES),
        max_connections=_count(request, "max_connections", DEFAULT_MAX_CONNECTIONS),
    )


def _parse_inject(raw: Any, index: int) -> Inject:
    where = f"inject[{index}]"
    if not isinstance(raw, dict):
        raise ControlError(f"{where} must be an object")
    host = rules.normalize_host(raw.get("host", "")) if isinstance(raw.get("host"), str) else None
    port = raw.get("port")
    if host is None or isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ControlError(f"{where}: host must be a DNS name and port 1 to 65535")
    header, value = raw.get("header"), raw.get("value")
    if not isinstance(header, str) or not _TOKEN_CHARS.match(header):
        raise ControlError(f"{where}: header must be a header name")
    if header.lower() in _HOP_HEADERS | {"host", "accept-encoding", "content-length"}:
        raise ControlError(f"{where}: header {header!r} is managed by the proxy")
    # Never echo the value: it is the secret.
    if not isinstance(value, str) or not value or any(c in value for c in "\r\n\0"):
        raise ControlError(f"{where}: value must be a non-empty single-line string")
    try:
        value.encode("latin-1")
    except UnicodeEncodeError:
        raise ControlError(f"{where}: value must be latin-1 text") from None
    masks = _strings(raw.get("mask"), f"{where}.mask")
    cert_pem, key_pem = raw.get("cert_pem"), raw.get("key_pem")
    if not isinstance(cert_pem, str) or not isinstance(key_pem, str):
        raise ControlError(f"{where}: cert_pem and key_pem must be PEM strings")
    context = _server_context(cert_pem, key_pem, where)
    secrets = {value.encode("latin-1"), *(m.encode("utf-8") for m in masks)}
    return Inject(host, port, header, value, tuple(s for s in secrets if s), context)


def _server_context(cert_pem: str, key_pem: str, where: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # The request rewrite and the masker speak HTTP/1.1 only; keep clients off h2.
    context.set_alpn_protocols(["http/1.1"])
    # load_cert_chain reads files only; they live in a 0700 directory for as
    # long as loading takes, so the key is on disk as briefly as possible.
    directory = tempfile.mkdtemp(prefix="egress-")
    try:
        paths = []
        for name, text in (("cert.pem", cert_pem), ("key.pem", key_pem)):
            path = os.path.join(directory, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                file.write(text)
            paths.append(path)
        context.load_cert_chain(paths[0], paths[1])
    except (ssl.SSLError, OSError, ValueError):
        raise ControlError(f"{where}: cert_pem/key_pem do not load") from None
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return context


class ProxyThread:
    """An EgressProxy on its own event loop in a background thread (tests, tools).

    ``with ProxyThread(control_path=...) as proxy: proxy.port``
    """

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.proxy: EgressProxy | None = None

    def __enter__(self) -> EgressProxy:
        self._thread.start()
        self.proxy = EgressProxy(**self._kwargs)
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self._loop).result(10)
        return self.proxy

    def __exit__(self, *exc: object) -> None:
        if self.proxy is not None:
            asyncio.run_coroutine_threadsafe(self.proxy.close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def _parse_listen(text: str) -> tuple[str, int]:
    host, port_text = _split_authority(text)
    port = _parse_port(port_text, None)
    if port is None and port_text != "0":
        raise argparse.ArgumentTypeError("--listen must be host:port")
    return host.strip("[]"), port or 0


async def _main(args: argparse.Namespace) -> None:
    host, port = args.listen
    proxy = EgressProxy(
        control_path=args.control,
        listen_host=host,
        listen_port=port,
        upstream_ca=args.upstream_ca,
        resolve_timeout=args.resolve_timeout,
        connect_timeout=args.connect_timeout,
    )
    await proxy.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"READY {proxy.port}", flush=True)
    try:
        await stop.wait()
    finally:
        await proxy.close()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="egress.proxy", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", type=_parse_listen, required=True, help="host:port")
    parser.add_argument("--control", required=True, help="path of the control Unix socket")
    parser.add_argument("--upstream-ca", required=True, help="CA bundle for intercepted upstreams")
    parser.add_argument("--resolve-timeout", type=float, default=DEFAULT_RESOLVE_TIMEOUT_S)
    parser.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S)
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s: %(message)s")
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
