"""The MCP bridge over Streamable HTTP (``toolreg mcp --http HOST:PORT``).

The MCP SDK's own parts serve it: its ``StreamableHTTPSessionManager`` at
``/mcp`` (sessions, SSE streams for progress), its bearer-auth middleware and
its transport security settings (Host/Origin), run under uvicorn. This module
decides who may use it and how much:

* **Who.** Every request carries ``Authorization: Bearer T``; T must be the
  token of a client of the policy (``--policy``, the file ``toolreg serve``
  reads), checked by the policy's own constant-time sha256 compare
  (``Policy.client_by_token``, as the server's interceptor does). Anything else
  is 401 with ``WWW-Authenticate: Bearer``, before the body is read or
  anything of the request is logged. T is then the registry bearer for that
  request: each MCP client is its own registry client, with its own roles,
  level cap and approvals, and a session answers only to the client that
  opened it (the SDK binds it to the client id). Registry connections are made
  per policy client on first use, so there are never more than the policy has
  clients.
* **Development.** Without a policy the bridge refuses to serve HTTP, unless
  ``--insecure-dev`` says so and it listens on loopback: then there is no
  bearer check, and every MCP client is the bridge's own registry identity
  (``--token``, or none), as with stdio.
* **Where.** Beyond loopback it needs a policy and TLS (``--http-tls-cert``,
  ``--http-tls-key``): bearer tokens must not cross a network in clear.
  DNS rebinding: the Host header must name this listener (loopback names on
  loopback, or ``--allow-host`` values); a browser's Origin must be one given
  with ``--allow-origin``; requests without Origin (not from a browser) pass.
* **How much.** Request bodies are capped before parsing (413), open sessions
  are capped (503 for more) and closed after an idle period, connections are
  capped (uvicorn answers 503 beyond), and a session's requests are the SDK's.

Order of checks on a request: bearer token (401), then body size (413), then
Host (421) / Origin (403), then the MCP session and message.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mcp.server.auth.middleware.bearer_auth import (
    AuthenticatedUser,
    BearerAuthBackend,
    RequireAuthMiddleware,
)
from mcp.server.auth.provider import AccessToken
from mcp.server.context import ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp.types import INVALID_REQUEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp

from registry_server.client.http_listener import (
    ListenerServer,
    bind,
    check_exposure,
    is_loopback,
    listener_hosts,
    parse_endpoint,
    shown_url,
    uvicorn_config,
)
from registry_server.client.mcp_bridge import Bridge, build_server
from registry_server.client.registry_client import RegistryClient
from registry_server.domain.arguments import MAX_ARGUMENTS_BYTES
from registry_server.domain.errors import ConfigError
from registry_server.domain.models import SafetyLevel
from registry_server.policy.loader import load_policy
from registry_server.policy.model import Policy, PolicyError

log = logging.getLogger("toolreg.mcp")

MCP_PATH = "/mcp"  # the conventional Streamable HTTP endpoint
# bytes of one request body: the largest arguments the registry accepts, plus
# room for the JSON-RPC envelope around them
DEFAULT_MAX_BODY_BYTES = MAX_ARGUMENTS_BYTES + 64 * 1024
DEFAULT_MAX_SESSIONS = 64  # MCP sessions open at once; the next gets 503 until one ends
DEFAULT_SESSION_IDLE_S = 600.0  # seconds without a request before a session is closed


@dataclass(frozen=True)
class HttpSettings:
    """What ``--http`` serves, checked by ``check_settings`` before anything binds."""

    host: str
    port: int
    policy: Policy | None  # None only with insecure_dev
    insecure_dev: bool = False
    allowed_hosts: tuple[str, ...] = ()  # Host header values beyond this listener's own
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed to call
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_sessions: int = DEFAULT_MAX_SESSIONS
    session_idle_s: float = DEFAULT_SESSION_IDLE_S
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_level: SafetyLevel | None = None
    categories: tuple[str, ...] = ()

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None


def check_settings(settings: HttpSettings) -> None:
    """Fail closed: refuse what would expose the registry (ConfigError)."""
    loopback = is_loopback(settings.host)
    if settings.policy is None and not settings.insecure_dev:
        raise ConfigError(
            "--http needs --policy FILE: the policy whose clients' bearer tokens it accepts"
            " (the file `toolreg serve` reads); for development on loopback only,"
            " --insecure-dev serves without authentication"
        )
    if settings.policy is not None and settings.insecure_dev:
        raise ConfigError("--insecure-dev and --policy exclude each other")
    if settings.insecure_dev and not loopback:
        raise ConfigError(
            f"refusing to serve MCP on {settings.host} with --insecure-dev: without"
            " authentication it listens on loopback only (127.0.0.1, ::1, localhost)"
        )
    if settings.policy is not None and not any(c.token_sha256 for c in settings.policy.clients):
        raise ConfigError(
            f"{settings.policy.source}: no client has a token_sha256, so no MCP client could"
            " authenticate over HTTP"
        )
    check_exposure(
        settings.host, tls_cert=settings.tls_cert, tls_key=settings.tls_key,
        allowed_hosts=settings.allowed_hosts, serving="MCP",
    )  # fmt: skip
    if settings.max_sessions <= 0 or settings.session_idle_s <= 0 or settings.max_body_bytes <= 0:
        raise ConfigError("--max-sessions, --session-idle-s and --max-body-bytes must be positive")


def http_settings(
    endpoint: str,
    *,
    policy_file: Path | None,
    insecure_dev: bool = False,
    allowed_hosts: Sequence[str] = (),
    allowed_origins: Sequence[str] = (),
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    max_sessions: int | None = None,
    session_idle_s: float | None = None,
    max_body_bytes: int | None = None,
    max_level: SafetyLevel | None = None,
    categories: Sequence[str] = (),
) -> HttpSettings:
    """The CLI's options as checked settings (None = the default); ConfigError
    names the first problem, PolicyError's lines included."""
    host, port = parse_endpoint(endpoint)
    policy = None
    if policy_file is not None:
        try:
            policy = load_policy(policy_file)
        except PolicyError as exc:
            raise ConfigError(str(exc)) from None
    settings = HttpSettings(
        host=host,
        port=port,
        policy=policy,
        insecure_dev=insecure_dev,
        allowed_hosts=tuple(allowed_hosts),
        allowed_origins=tuple(allowed_origins),
        tls_cert=tls_cert,
        tls_key=tls_key,
        max_sessions=DEFAULT_MAX_SESSIONS if max_sessions is None else max_sessions,
        session_idle_s=DEFAULT_SESSION_IDLE_S if session_idle_s is None else session_idle_s,
        max_body_bytes=DEFAULT_MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes,
        max_level=max_level,
        categories=tuple(categories),
    )
    check_settings(settings)
    return settings


def transport_security(settings: HttpSettings, port: int) -> TransportSecuritySettings:
    """The Host and Origin values the SDK admits (DNS rebinding protection)."""
    hosts = listener_hosts(settings.host, port, tls=settings.tls)
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[*hosts, *settings.allowed_hosts],
        allowed_origins=list(settings.allowed_origins),
    )


class PolicyTokenVerifier:
    """The SDK's ``TokenVerifier`` over the policy: a bearer token is a client's
    if ``Policy.client_by_token`` (constant-time, every client compared) says so."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy

    async def verify_token(self, token: str) -> AccessToken | None:
        token = token.strip()  # as the server reads "Bearer  T"
        client = self._policy.client_by_token(token)
        if client is None:
            return None
        return AccessToken(token=token, client_id=client.id, scopes=[])


class Identities:
    """The registry client of each MCP request.

    With a policy: one registry connection per policy client, made on first
    use with that client's own token (so at most as many as the policy has
    clients), chosen by the client the request's bearer token proved to be.
    Without (``--insecure-dev``): the bridge's own connection for everyone."""

    def __init__(self, connect: Callable[[str | None], RegistryClient], policy: Policy | None):
        self._connect = connect
        self._shared = connect(None) if policy is None else None
        self._by_client: dict[str, RegistryClient] = {}

    def client_for(self, ctx: ServerRequestContext[Any]) -> RegistryClient:
        if self._shared is not None:
            return self._shared
        request = ctx.request
        user = request.scope.get("user") if isinstance(request, Request) else None
        if not isinstance(user, AuthenticatedUser):
            # Unreachable behind RequireAuthMiddleware; never fall back to anyone.
            raise MCPError(INVALID_REQUEST, "no authenticated client for this request")
        token = user.access_token
        client = self._by_client.get(token.client_id)
        if client is None:
            # No await between the look-up and the store: one event loop, no race.
            client = self._connect(token.token)
            self._by_client[token.client_id] = client
        return client

    def close(self) -> None:
        for client in [*self._by_client.values(), *([self._shared] if self._shared else [])]:
            client.close()
        self._by_client.clear()


def build_app(bridge: Bridge, settings: HttpSettings, port: int) -> Starlette:
    """The ASGI app: the SDK's session manager at ``/mcp``, behind bearer auth."""
    manager = StreamableHTTPSessionManager(
        app=build_server(bridge),
        security_settings=transport_security(settings, port),
        max_request_body_size=settings.max_body_bytes,
        session_idle_timeout=settings.session_idle_s,
        max_sessions=settings.max_sessions,
    )
    endpoint: ASGIApp = StreamableHTTPASGIApp(manager)
    middleware: list[Middleware] = []
    if settings.policy is not None:
        # Outermost, so a request without a known token is answered 401 before
        # its body is read (the size cap and parsing sit inside the manager).
        endpoint = RequireAuthMiddleware(endpoint, required_scopes=[])
        backend = BearerAuthBackend(PolicyTokenVerifier(settings.policy))
        middleware.append(Middleware(AuthenticationMiddleware, backend=backend))
    return Starlette(
        routes=[Route(MCP_PATH, endpoint=endpoint)],
        middleware=middleware,
        lifespan=lambda app: manager.run(),
    )


def serve_http(
    connect: Callable[[str | None], RegistryClient],
    settings: HttpSettings,
    *,
    address: str,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve MCP over Streamable HTTP until SIGINT/SIGTERM (blocking).

    ``connect(token)`` opens a registry client whose bearer is ``token`` (None:
    the bridge's own). ``announce`` gets the URL once the socket listens
    (default: a line on stderr, which scripts and tests read)."""
    check_settings(settings)
    sock = bind(settings.host, settings.port)
    port = int(sock.getsockname()[1])
    identities = Identities(connect, settings.policy)
    bridge = Bridge(
        identities.client_for, max_level=settings.max_level, categories=settings.categories
    )
    app = build_app(bridge, settings, port)
    server = ListenerServer(
        uvicorn_config(app, tls_cert=settings.tls_cert, tls_key=settings.tls_key)
    )
    url = shown_url(settings.host, port, tls=settings.tls, path=MCP_PATH)
    mode = (
        f"bearer tokens of {settings.policy.source}"
        if settings.policy is not None
        else "INSECURE DEVELOPMENT MODE: no authentication, loopback only"
    )
    log.info("MCP bridge to toolreg at %s over Streamable HTTP (%s)", address, mode)
    (announce or _announce)(url)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        identities.close()


def _announce(url: str) -> None:
    print(f"toolreg mcp: serving MCP on {url}", file=sys.stderr, flush=True)
