"""The servers of the egress tests' private internet, run inside `toolreg/python`.

Standard library only (the image has no pip packages). Run as:

    python3 upstream.py http  --name plain.world.test --port 80  --log /log/plain.world.test.jsonl
    python3 upstream.py https --name api.world.test   --port 443 --log /log/api.world.test.jsonl \\
        --cert /certs/api.world.test.pem --key /certs/api.world.test.key
    python3 upstream.py dns   --port 53 --zone /etc/world/zone.json --log /log/dns.jsonl

HTTP(S): every method and path gets 200 with JSON `{"host", "path", "ok": true}`, and
each request appends one JSON line `{"method", "path", "headers", "body_len"}` (plus
"sni" for HTTPS) to the log before it is answered. Special paths:

    /big?bytes=N                   N bytes of "x" (Content-Length N), streamed
    /echo-header?name=Authorization  the body carries that request header's value
    /slow?s=N                      answers after N seconds

DNS: UDP, one question per query. zone.json maps a lowercase name to a list of IPv4
addresses, or to {"rebind": [A, B]}: A for the name's first A query, B for every later
one. Known names: A records; AAAA and other types an empty NOERROR. Unknown names:
NXDOMAIN. Each query logs `{"name", "type", "answer", "rcode"}`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import socketserver
import ssl
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


class JsonLog:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (lives with the process)
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, ensure_ascii=False)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()


# --- HTTP / HTTPS ----------------------------------------------------------------------


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "world-upstream"
    sys_version = ""
    timeout = 60
    server: WorldHTTPServer

    def __getattr__(self, name: str) -> Any:
        # BaseHTTPRequestHandler dispatches to do_<METHOD>: answer every method.
        if name.startswith("do_"):
            return self._answer
        raise AttributeError(name)

    def setup(self) -> None:
        super().setup()
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _read_body(self) -> int:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            total = 0
            while True:
                size_line = self.rfile.readline(1024)
                if not size_line:
                    break
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline(1024).strip():  # trailers
                        pass
                    break
                total += len(self.rfile.read(size))
                self.rfile.readline(1024)  # CRLF after the chunk
            return total
        length = int(self.headers.get("Content-Length") or 0)
        remaining, total = length, 0
        while remaining > 0:
            chunk = self.rfile.read(min(remaining, 65536))
            if not chunk:
                break
            total += len(chunk)
            remaining -= len(chunk)
        return total

    def _headers_dict(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, value in self.headers.items():
            out[name] = f"{out[name]}, {value}" if name in out else value
        return out

    def _answer(self) -> None:
        body_len = self._read_body()
        record: dict[str, Any] = {
            "method": self.command,
            "path": self.path,
            "headers": self._headers_dict(),
            "body_len": body_len,
        }
        if isinstance(self.connection, ssl.SSLSocket):
            record["sni"] = getattr(self.connection, "world_sni", None)
        self.server.log.write(record)

        url = urlsplit(self.path)
        query = parse_qs(url.query)
        route = url.path
        if route == "/big":
            self._send_big(int(query.get("bytes", ["0"])[0]))
            return
        payload: dict[str, Any] = {"host": self.server.name, "path": self.path, "ok": True}
        if route == "/echo-header":
            name = query.get("name", ["Authorization"])[0]
            payload["header"] = name
            payload["value"] = self.headers.get(name)
        elif route == "/slow":
            time.sleep(float(query.get("s", ["1"])[0]))
        self._send(json.dumps(payload, ensure_ascii=False).encode())

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_big(self, n: int) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(n))
        self.end_headers()
        if self.command == "HEAD":
            return
        block = b"x" * 65536
        while n > 0:
            part = block[: min(n, len(block))]
            self.wfile.write(part)
            n -= len(part)


class WorldHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, port: int, name: str, log: JsonLog, tls: ssl.SSLContext | None) -> None:
        self.name = name
        self.log = log
        self.tls = tls
        super().__init__(("0.0.0.0", port), Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = self.socket.accept()
        if self.tls is not None:
            # The handshake runs in the handler's thread (Handler.setup), not here.
            sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        print(f"{self.name}: {client_address}: {exc!r}", file=sys.stderr, flush=True)


def tls_context(cert: str, key: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)

    def remember_sni(sock: Any, server_name: str | None, _ctx: ssl.SSLContext) -> None:
        with contextlib.suppress(AttributeError):
            sock.world_sni = server_name

    ctx.sni_callback = remember_sni
    return ctx


# --- DNS -------------------------------------------------------------------------------

QTYPES = {1: "A", 2: "NS", 5: "CNAME", 6: "SOA", 12: "PTR", 15: "MX", 16: "TXT", 28: "AAAA"}
NOERROR, FORMERR, NXDOMAIN, NOTIMP = 0, 1, 3, 4
RCODES = {NOERROR: "NOERROR", FORMERR: "FORMERR", NXDOMAIN: "NXDOMAIN", NOTIMP: "NOTIMP"}


def parse_question(packet: bytes) -> tuple[str, int, int, int]:
    """(name, qtype, qclass, end offset of the question) of a query's first question."""
    labels: list[str] = []
    i = 12
    while True:
        length = packet[i]
        if length == 0:
            i += 1
            break
        if length & 0xC0:
            raise ValueError("compressed name in a question")
        labels.append(packet[i + 1 : i + 1 + length].decode("ascii", "replace"))
        i += 1 + length
    if len(packet) < i + 4:
        raise ValueError("truncated question")
    qtype, qclass = struct.unpack("!HH", packet[i : i + 4])
    return ".".join(labels).lower(), qtype, qclass, i + 4


class Zone:
    def __init__(self, path: str) -> None:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        self.names: dict[str, Any] = {k.lower().rstrip("."): v for k, v in raw.items()}
        self.a_queries: dict[str, int] = {}
        self.lock = threading.Lock()

    def lookup_a(self, name: str) -> list[str]:
        entry = self.names[name]
        if isinstance(entry, dict) and "rebind" in entry:
            with self.lock:
                n = self.a_queries[name] = self.a_queries.get(name, 0) + 1
            first, later = entry["rebind"]
            return [first] if n == 1 else [later]
        return list(entry)


class DNSHandler(socketserver.BaseRequestHandler):
    server: WorldDNSServer

    def handle(self) -> None:
        packet, sock = self.request
        reply = self.server.answer(packet)
        if reply is not None:
            sock.sendto(reply, self.client_address)


class WorldDNSServer(socketserver.UDPServer):
    allow_reuse_address = True
    max_packet_size = 4096

    def __init__(self, port: int, zone: Zone, log: JsonLog) -> None:
        self.zone = zone
        self.log = log
        super().__init__(("0.0.0.0", port), DNSHandler)

    def answer(self, packet: bytes) -> bytes | None:
        if len(packet) < 12:
            return None
        qid, flags, qdcount = struct.unpack("!HHH", packet[:6])
        if flags & 0x8000:  # a response, not a query
            return None
        opcode = (flags >> 11) & 0xF
        rd = flags & 0x0100
        try:
            if qdcount < 1:
                raise ValueError("no question")
            name, qtype, qclass, end = parse_question(packet)
        except (ValueError, IndexError, struct.error):
            return self._reply(qid, opcode, rd, FORMERR, b"", 0, [])
        question = packet[12:end]
        answers: list[str] = []
        if opcode != 0:
            rcode = NOTIMP
        elif name not in self.zone.names:
            rcode = NXDOMAIN
        else:
            rcode = NOERROR
            if qtype == 1 and qclass == 1:
                answers = self.zone.lookup_a(name)
        self.log.write(
            {
                "name": name,
                "type": QTYPES.get(qtype, str(qtype)),
                "answer": answers,
                "rcode": RCODES[rcode],
            }
        )
        return self._reply(qid, opcode, rd, rcode, question, 1, answers)

    @staticmethod
    def _reply(
        qid: int, opcode: int, rd: int, rcode: int, question: bytes, qd: int, answers: list[str]
    ) -> bytes:
        flags = 0x8000 | (opcode << 11) | 0x0400 | rd | 0x0080 | rcode  # QR AA RD RA
        out = [struct.pack("!HHHHHH", qid, flags, qd, len(answers), 0, 0), question]
        for ip in answers:
            # Name: pointer to the question's name; type A, class IN, TTL 0.
            out.append(struct.pack("!HHHIH", 0xC00C, 1, 1, 0, 4) + socket.inet_aton(ip))
        return b"".join(out)


# --- main ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["http", "https", "dns"])
    parser.add_argument("--name", default="upstream")
    parser.add_argument("--port", type=int)
    parser.add_argument("--log", required=True)
    parser.add_argument("--cert")
    parser.add_argument("--key")
    parser.add_argument("--zone")
    args = parser.parse_args(argv)
    log = JsonLog(args.log)

    if args.mode == "dns":
        if not args.zone:
            parser.error("dns needs --zone")
        dns = WorldDNSServer(args.port or 53, Zone(args.zone), log)
        print(f"dns listening on udp/{dns.server_address[1]}", flush=True)
        dns.serve_forever()
        return

    tls = None
    if args.mode == "https":
        if not (args.cert and args.key):
            parser.error("https needs --cert and --key")
        tls = tls_context(args.cert, args.key)
    default_port = 443 if tls else 80
    http = WorldHTTPServer(args.port or default_port, args.name, log, tls)
    print(f"{args.mode} {args.name} listening on tcp/{http.server_address[1]}", flush=True)
    http.serve_forever()


if __name__ == "__main__":
    main()
