"""One HTTP listener under uvicorn, as the client side's web endpoints serve it
(``toolreg mcp --http`` in ``registry_server.mcp.http``, ``toolreg console`` in
``registry_server.console``).

What they share is where they listen and how the process behaves, not what
they answer: ``HOST:PORT`` parsing, which hosts count as loopback (plain HTTP
is allowed there only), the Host header values that name the listener (the
DNS rebinding check), a socket bound before uvicorn starts (so ``:0`` has a
known port for that check and early clients wait in the backlog), uvicorn's
limits, and SIGINT/SIGTERM ending the process with exit 0.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

from registry_server.domain.errors import ConfigError

MAX_SECRET_BYTES = 4_096  # bytes of a client secret file
MAX_CONNECTIONS = 256  # HTTP connections and requests at once (uvicorn answers 503 beyond)
MAX_HEADER_BYTES = 16 * 1024  # bytes of a request's line and headers (h11 answers 400 beyond)
KEEP_ALIVE_S = 5  # seconds an idle keep-alive connection stays open
SHUTDOWN_GRACE_S = 5  # seconds open streams get to finish at shutdown
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")  # Host names of a loopback listener


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); ConfigError if not."""
    host, sep, port_text = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"--http: expected HOST:PORT (e.g. 127.0.0.1:8765), got {text!r}")
    return host, int(port_text)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def check_listener(
    host: str,
    *,
    tls_cert: Path | None,
    tls_key: Path | None,
    allowed_hosts: tuple[str, ...],
    serving: str,
    caps: tuple[float, float, float],
) -> None:
    """Fail closed where a listener would expose what its clients send
    (bearer tokens, sessions): plain HTTP beyond loopback, and every interface
    with no name for the Host check; and refuse caps that are not positive
    (``caps``: max sessions, session idle seconds, max body bytes). ConfigError."""
    if min(caps) <= 0:
        raise ConfigError("--max-sessions, --session-idle-s and --max-body-bytes must be positive")
    if (tls_cert is None) != (tls_key is None):
        raise ConfigError("--http-tls-cert and --http-tls-key go together")
    if not is_loopback(host) and tls_cert is None:
        raise ConfigError(
            f"refusing to serve {serving} on {host} without TLS: bearer tokens would cross"
            " the network in clear; give --http-tls-cert and --http-tls-key"
        )
    if is_unspecified(host) and not allowed_hosts:
        raise ConfigError(
            f"listening on {host} (every interface) needs --allow-host NAME:PORT,"
            " the Host header clients send (checked against DNS rebinding)"
        )


def listener_hosts(host: str, port: int, *, tls: bool) -> list[str]:
    """The Host header values that name this listener: the loopback names on
    loopback, else the address itself (bracketed for IPv6), with the port, and
    also without it when it is the scheme's default (clients leave it out)."""
    if is_loopback(host):
        names: list[str] = list(LOOPBACK_NAMES)
    elif ":" in host:
        names = [f"[{host}]"]
    else:
        names = [host]
    hosts = [f"{name}:{port}" for name in names]
    if port == (443 if tls else 80):
        hosts += names
    return hosts


def shown_url(host: str, port: int, *, tls: bool, path: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{'https' if tls else 'http'}://{shown}:{port}{path}"


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so the real port (for ``:0``) is known
    before the Host allow-list is made."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ConfigError(f"--http {host}:{port}: {exc}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        # Listening now, not when uvicorn starts: a client that read the
        # announced URL waits in the backlog instead of being refused.
        sock.listen(MAX_CONNECTIONS)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--http {host}:{port}: cannot listen: {exc.strerror or exc}") from None
    return sock


def uvicorn_config(app: ASGIApp, *, tls_cert: Path | None, tls_key: Path | None) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        log_config=None,  # keep the process's own logging
        access_log=False,  # request lines name paths and peers; the apps log what matters
        proxy_headers=False,  # no X-Forwarded-* trusted: nothing sits in front by default
        server_header=False,
        http="h11",  # named, so the header cap below holds whatever else is installed
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        ws="none",
        lifespan="on",
        limit_concurrency=MAX_CONNECTIONS,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
    )


class ListenerServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, without raising the signal again after its graceful
        shutdown: that would kill the process before it closes its registry
        connections. SIGTERM and SIGINT stop it with exit 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def read_client_secret(env: str, path: Path | None, option: str) -> str:
    """A client secret at an identity provider, from ``$env`` or the file
    ``option`` names (one, not both; "" with neither): never an argument,
    where other users of the host would see it."""
    from_env = os.environ.get(env)
    if from_env is not None and path is not None:
        raise ConfigError(f"the client secret: ${env} or {option}, not both")
    if path is None:
        return (from_env or "").strip()
    try:
        data = path.read_bytes()[: MAX_SECRET_BYTES + 1]
    except OSError as exc:
        raise ConfigError(f"{option} {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_SECRET_BYTES:
        raise ConfigError(f"{option} {path}: over {MAX_SECRET_BYTES} bytes")
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{option} {path}: not UTF-8 text") from None
