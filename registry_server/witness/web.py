"""The witness over HTTP (c2sp.org/tlog-witness): ``POST <prefix>/add-checkpoint``
under uvicorn, as the client side's other web endpoints are served
(web/listener.py: the socket, uvicorn's limits, the signals).

Requests are not authenticated (the spec has none beyond the checkpoint's
signature, and nothing a witness answers is secret). What is checked before
the witness decides: the Host header names this listener (DNS rebinding),
the method and path, and the body's size (413 beyond ``MAX_REQUEST_BYTES``,
read no further). The decision runs on a worker thread: it may wait for
another request on the same log, and it writes the state file to disk.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from registry_server.domain.errors import ConfigError
from registry_server.signing.tlog_witness import ADD_CHECKPOINT, MAX_REQUEST_BYTES
from registry_server.web.listener import (
    ListenerServer,
    bind,
    is_loopback,
    is_unspecified,
    listener_hosts,
    shown_url,
    uvicorn_config,
)
from registry_server.witness.core import Witness

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:7380"  # loopback unless told otherwise


class HostCheck:
    """Answer 421 to a request whose Host header does not name this listener."""

    def __init__(self, app: ASGIApp, hosts: frozenset[str]) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if host not in self.hosts:
                response = PlainTextResponse("this witness does not answer to that Host\n", 421)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def check_prefix(prefix: str) -> str:
    """The submission prefix: empty, or a path starting with '/' and not ending in one."""
    if prefix and (not prefix.startswith("/") or prefix.endswith("/") or "//" in prefix):
        raise ConfigError(f"--prefix {prefix!r}: a path like /witness, or nothing")
    return prefix


def build_app(witness: Witness, *, prefix: str, hosts: frozenset[str]) -> ASGIApp:
    async def add_checkpoint(request: Request) -> Response:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > MAX_REQUEST_BYTES):
            return PlainTextResponse(f"request larger than {MAX_REQUEST_BYTES} bytes\n", 413)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_REQUEST_BYTES:
                return PlainTextResponse(f"request larger than {MAX_REQUEST_BYTES} bytes\n", 413)
        answer = await run_in_threadpool(witness.add_checkpoint, bytes(body))
        # The type as given: Starlette would add a charset to text/x.tlog.size.
        return Response(answer.body, answer.status, headers={"content-type": answer.content_type})

    app = Starlette(routes=[Route(prefix + ADD_CHECKPOINT, add_checkpoint, methods=["POST"])])
    return HostCheck(app, hosts)


def serve_witness(
    witness: Witness,
    *,
    host: str,
    port: int,
    prefix: str = "",
    allowed_hosts: tuple[str, ...] = (),
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (blocking). ``announce`` gets the submission
    URL once the socket listens (default: a line on stderr)."""
    check_prefix(prefix)
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together")
    if is_unspecified(host) and not allowed_hosts:
        raise ConfigError(
            f"listening on {host} (every interface) needs --allow-host NAME:PORT, the Host"
            " header logs send (checked against DNS rebinding)"
        )
    tls = tls_cert is not None
    sock = bind(host, port)
    port = int(sock.getsockname()[1])
    hosts = frozenset([*listener_hosts(host, port, tls=tls), *allowed_hosts])
    app = build_app(witness, prefix=prefix, hosts=hosts)
    server = ListenerServer(uvicorn_config(app, tls_cert=tls_cert, tls_key=tls_key))
    url = shown_url(host, port, tls=tls, path=prefix)
    log.info(
        "witness %s (%s) for %d log(s): %s%s", witness.cosigner.name, witness.cosigner.verifier,
        len(witness.origins), ", ".join(witness.origins),
        "" if is_loopback(host) or tls else "; plain HTTP beyond loopback",
    )  # fmt: skip
    (announce or _announce)(url)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


def _announce(url: str) -> None:
    print(f"toolreg witness: serving on {url}", file=sys.stderr, flush=True)
