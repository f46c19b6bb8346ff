"""Render an HAProxy 2.6 config that load-balances toolreg's gRPC servers (cleartext HTTP/2).

For tests: the config runs in the foreground as any user (`haproxy -f CFG -db`: no daemon,
chroot or user switch), logs to stderr, and health-checks every server through the standard
gRPC health service (grpc.health.v1.Health/Check, service ""): a server is in rotation only
while it answers SERVING, so a toolreg server whose engine fails leaves it within
out_of_rotation_s() (2 s). One that leaves on SIGTERM says NOT_SERVING and keeps serving for
TOOLREG_DRAIN_S (10 s by default, at least out_of_rotation_s()) before it stops accepting
calls, so HAProxy has taken it out by then and no call is sent to a server that refuses it.

Why the health check is a raw `tcp-check` and not `option httpchk` + `check-proto h2`:
a gRPC request must carry a 5-byte message frame (for Check: 00 00 00 00 00), and HAProxy 2.6's
`http-check send` cannot put a NUL byte in a body: `body "\\x00..."` is refused as an empty
string, and `body-lf "%[bin(0000000000)]"` is cut at the first NUL, so the server gets no
message and answers UNIMPLEMENTED ("requires exactly one request message"). The response side
would work (`http-check expect rstring '^\\x00\\x00\\x00\\x00\\x02\\x08\\x01$'` matches a SERVING
body, checked against a fake server that accepts an empty request), but no real gRPC server
accepts that request. So the check speaks HTTP/2 itself: the client preface, an empty SETTINGS
frame, one HEADERS frame (HPACK literals, no Huffman, no dynamic table) and one DATA frame with
the request, on a fresh connection each time; then it waits for the end of the response (a
HEADERS frame with END_STREAM on stream 1) and passes only when the DATA frame holding the
message `status: SERVING` (08 01) is there. NOT_SERVING (08 02), SERVICE_UNKNOWN (08 03), an
error status or no answer all fail.

Retries: every gRPC call is a POST, so HAProxy cannot tell which ones are safe to replay. A
call is retried on another server when the connection failed before it was sent
(`conn-failure`, safe for every call); one that reached a server which then closed without
answering (`empty-response`) is retried only for the read-only methods in READ_ONLY_METHODS.
ExecuteTool and the other writes are never replayed (that could run a tool twice).

Usage: haproxy_config.py --port 50050 --server 127.0.0.1:50051 --server 127.0.0.1:50052
       [--stats-port 50060] [-o haproxy.cfg]
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from collections.abc import Sequence

HEALTH_PATH = "/grpc.health.v1.Health/Check"
# Unary read-only methods: replaying one after the server saw it changes nothing.
READ_ONLY_METHODS = (
    HEALTH_PATH,
    "/toolregistry.v1.ToolRegistry/GetTool",
    "/toolregistry.v1.ToolRegistry/ListTools",
    "/toolregistry.v1.ToolRegistry/GetToolSchemas",
    "/toolregistry.v1.ToolRegistry/ListApprovalRequests",
    "/toolregistry.v1.ToolRegistry/GetApprovalRequest",
)
# Seconds: the longest gRPC call (or silence inside a streamed one) the proxy waits for,
# plus a margin so the client's own deadline fires first and reports DEADLINE_EXCEEDED.
CALL_TIMEOUT_S = 65
CHECK_INTER_S = 0.5  # seconds between two health checks of one server
CHECK_FALL = 2  # failed checks in a row before a server leaves the rotation
CHECK_RISE = 2  # passed checks in a row before it comes back
CHECK_TIMEOUT_S = 1  # seconds for one check's answer, once connected

_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_FRAME_DATA, _FRAME_HEADERS, _FRAME_SETTINGS = 0x0, 0x1, 0x4
_FLAG_END_STREAM, _FLAG_END_HEADERS = 0x1, 0x4
_STREAM = 1  # the check's only stream


def out_of_rotation_s() -> float:
    """Seconds at most from a server's first NOT_SERVING to HAProxy taking it out of the
    rotation: the next check starts within one interval, CHECK_FALL of them must fail, and
    the last may take its whole timeout. A leaving server's TOOLREG_DRAIN_S must be longer."""
    return CHECK_INTER_S * CHECK_FALL + CHECK_TIMEOUT_S


def _frame(ftype: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big")
        + bytes([ftype, flags])
        + stream.to_bytes(4, "big")
        + payload
    )


def _hpack_str(value: bytes) -> bytes:
    if len(value) >= 127:  # one-byte length prefix only
        raise ValueError(f"HPACK literal too long for this encoder: {value[:20]!r}...")
    return bytes([len(value)]) + value


def _grpc_message(payload: bytes) -> bytes:
    # uncompressed flag, 4-byte big-endian length, the protobuf message
    return b"\x00" + len(payload).to_bytes(4, "big") + payload


def health_check_request(service: str = "", authority: str = "toolreg") -> bytes:
    """The bytes of one grpc.health.v1.Health/Check call on a new HTTP/2 connection."""
    name = service.encode()
    if len(name) > 127:
        raise ValueError("health service name longer than 127 bytes")
    # HealthCheckRequest{service}: field 1, wire type 2 (0x0a), omitted when empty (proto3)
    message = b"\x0a" + bytes([len(name)]) + name if name else b""
    headers = b"".join(
        [
            b"\x83",  # :method POST (static table 3)
            b"\x86",  # :scheme http (static table 6)
            b"\x04" + _hpack_str(HEALTH_PATH.encode()),  # :path, literal without indexing
            b"\x01" + _hpack_str(authority.encode()),  # :authority (gRPC servers require it)
            b"\x0f\x10" + _hpack_str(b"application/grpc"),  # content-type (static table 31)
            b"\x00" + _hpack_str(b"te") + _hpack_str(b"trailers"),  # literal name and value
        ]
    )
    return (
        _H2_PREFACE
        + _frame(_FRAME_SETTINGS, 0, 0, b"")
        + _frame(_FRAME_HEADERS, _FLAG_END_HEADERS, _STREAM, headers)
        + _frame(_FRAME_DATA, _FLAG_END_STREAM, _STREAM, _grpc_message(message))
    )


def serving_response_frame() -> bytes:
    """The DATA frame of a SERVING answer: HealthCheckResponse{status: SERVING} is 08 01."""
    return _frame(_FRAME_DATA, 0, _STREAM, _grpc_message(b"\x08\x01"))


def _end_of_response_regex() -> str:
    # rbinary matches the hex form of what was received: a HEADERS frame with END_STREAM and
    # END_HEADERS on the check's stream (the trailers, or a trailers-only error answer).
    flags = _FLAG_END_STREAM | _FLAG_END_HEADERS
    tail = bytes([_FRAME_HEADERS, flags]) + _STREAM.to_bytes(4, "big")
    return "[0-9A-Fa-f]{6}" + tail.hex()


def _address(host: str, port: int) -> str:
    if not 1 <= port <= 65535:
        raise ValueError(f"port out of range: {port}")
    host = host.strip("[]")
    if not host or any(c.isspace() or c in "#'\"\\" for c in host):
        raise ValueError(f"bad host: {host!r}")
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"ipv6@{host}:{port}"
    except ValueError:
        pass  # a host name: resolved once at start-up
    return f"{host}:{port}"


def render(
    frontend_port: int,
    servers: list[tuple[str, int]],
    *,
    stats_port: int | None = None,
    bind_host: str = "127.0.0.1",
    health_service: str = "",
    log_level: str = "notice",
) -> str:
    """An HAProxy 2.6 config: gRPC on bind_host:frontend_port, round-robin over servers.

    stats_port: also serve HAProxy's stats page there (GET /;csv gives each server's
    status: UP, DOWN, ...). log_level "info" also logs every request."""
    if not servers:
        raise ValueError("at least one server is needed")
    if log_level not in ("emerg", "alert", "crit", "err", "warning", "notice", "info", "debug"):
        raise ValueError(f"bad log level: {log_level!r}")
    frontend = _address(bind_host, frontend_port)
    stats = _address(bind_host, stats_port) if stats_port is not None else None
    server_lines = [f"    server s{i} {_address(h, p)}" for i, (h, p) in enumerate(servers, 1)]
    check_hex = health_check_request(health_service).hex()
    serving_hex = serving_response_frame().hex()
    read_only = " ".join(READ_ONLY_METHODS)

    lines = [
        "# Generated by toolreg's scripts/haproxy_config.py for HAProxy 2.6.",
        "# Run in the foreground as any user: haproxy -f THIS_FILE -db",
        "global",
        f"    log stderr format short local0 {log_level}",
        "    maxconn 4096",
        "    hard-stop-after 15s",
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    option dontlognull",
        "    timeout connect 2s",
        f"    timeout client {CALL_TIMEOUT_S}s",
        f"    timeout server {CALL_TIMEOUT_S}s",
        f"    timeout http-keep-alive {CALL_TIMEOUT_S}s",
        "    timeout http-request 10s",
        "    timeout queue 5s",
        f"    timeout check {CHECK_TIMEOUT_S}s",
        "",
        "frontend grpc_in",
        f"    bind {frontend} proto h2",
        "    default_backend toolreg_grpc",
        "",
        "backend toolreg_grpc",
        "    balance roundrobin",
        "    # A call whose connection failed goes to the next server (every retry redispatches).",
        "    retries 3",
        "    option redispatch 1",
        "    retry-on conn-failure empty-response",
        "    # ... but only read-only calls are replayed once a server has seen them.",
        f"    acl grpc_read_only path {read_only}",
        "    http-request disable-l7-retry unless grpc_read_only",
        "    # gRPC health: one Check call in raw HTTP/2 frames (see scripts/haproxy_config.py",
        "    # for why not option httpchk), in rotation only while it answers SERVING.",
        "    option tcp-check",
        "    tcp-check comment gRPC\\ health\\ Check",
        "    tcp-check connect",
        f"    tcp-check send-binary {check_hex}",
        "    tcp-check expect comment no\\ complete\\ gRPC\\ answer"
        f" rbinary {_end_of_response_regex()}",
        "    tcp-check expect min-recv 0 comment health\\ status\\ is\\ not\\ SERVING"
        f" binary {serving_hex}",
        f"    default-server proto h2 check inter {round(CHECK_INTER_S * 1000)}ms"
        f" fall {CHECK_FALL}"
        f" rise {CHECK_RISE}",
        *server_lines,
    ]
    if stats is not None:
        lines += [
            "",
            "frontend stats",
            f"    bind {stats}",
            "    stats enable",
            "    stats uri /",
            "    stats refresh 2s",
            "    stats show-legends",
        ]
    return "\n".join(lines) + "\n"


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--port", type=int, required=True, help="the frontend's port")
    parser.add_argument(
        "--server", type=_host_port, action="append", required=True, help="HOST:PORT (repeat)"
    )
    parser.add_argument("--stats-port", type=int, help="also serve the stats page on this port")
    parser.add_argument("--bind", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--log-level", default="notice", help="notice, or info to log requests")
    parser.add_argument("-o", "--output", help="write here instead of stdout")
    args = parser.parse_args(argv)
    try:
        text = render(
            args.port,
            args.server,
            stats_port=args.stats_port,
            bind_host=args.bind,
            log_level=args.log_level,
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
