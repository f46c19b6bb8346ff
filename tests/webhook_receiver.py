"""The tests' own webhook receiver: HTTP or HTTPS on loopback, verifying
every delivery with the standardwebhooks library (``Webhook.verify``), as a
real receiver would. It can be slow (``delay_s``), answer an error
(``status``), or be down (``down()``: nothing listens on its port, so the
sender gets a refused connection) and come back on the same port."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from standardwebhooks.webhooks import Webhook, WebhookVerificationError


@dataclass(frozen=True)
class Delivery:
    webhook_id: str
    body: dict[str, Any]  # parsed, after verification
    raw: bytes
    headers: dict[str, str]
    at: float  # time.time() when it arrived


@dataclass
class Receiver:
    secret: str
    cert_file: Path | None = None  # with key_file: HTTPS
    key_file: Path | None = None
    delay_s: float = 0.0  # seconds each answer waits
    status: int = 200
    host: str = "127.0.0.1"
    port: int = 0
    received: list[Delivery] = field(default_factory=list)
    forged: int = 0  # deliveries whose signature did not verify
    arrived: int = 0  # deliveries verified, counted before their answer's delay
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        scheme = "https" if self.cert_file else "http"
        host = "localhost" if self.cert_file else self.host  # the test CA names localhost
        return f"{scheme}://{host}:{self.port}/hook"

    def reserve_port(self) -> Receiver:
        """Pick a free port without listening on it yet (a receiver down from the start)."""
        with socket.socket() as s:
            s.bind((self.host, 0))
            self.port = int(s.getsockname()[1])
        return self

    def up(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", "0")))
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    body = Webhook(receiver.secret).verify(raw, headers)
                except WebhookVerificationError:
                    with receiver._lock:
                        receiver.forged += 1
                    self.send_response(400)
                    self.end_headers()
                    return
                delivery = Delivery(headers["webhook-id"], body, raw, headers, time.time())
                with receiver._lock:
                    receiver.arrived += 1
                time.sleep(receiver.delay_s)
                with receiver._lock:
                    receiver.received.append(delivery)
                self.send_response(receiver.status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer((self.host, self.port), Handler)
        server.daemon_threads = True  # a sleeping answer never holds up down()
        if self.cert_file is not None and self.key_file is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(self.cert_file, self.key_file)
            server.socket = context.wrap_socket(server.socket, server_side=True)
        self.port = int(server.server_address[1])
        self._server = server
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def down(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def ids(self) -> list[str]:
        with self._lock:
            return [d.webhook_id for d in self.received]

    def bodies(self) -> list[dict[str, Any]]:
        with self._lock:
            return [d.body for d in self.received]

    def wait_for(
        self, what: str, check: Callable[[Receiver], bool], timeout_s: float = 20.0
    ) -> float:
        started = time.monotonic()
        while not check(self):
            if time.monotonic() - started > timeout_s:
                got = json.dumps([b.get("type", "slack") for b in self.bodies()])
                raise AssertionError(f"{what}: not within {timeout_s} s; received {got}")
            time.sleep(0.02)
        return time.monotonic() - started
