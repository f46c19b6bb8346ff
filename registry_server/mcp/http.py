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
* **Resuming.** SSE events carry ids; a client whose stream dropped resumes
  it with ``Last-Event-ID`` in the same session, as the same principal, from
  a bounded in-memory store (``mcp_event_store``, ``mcp_resume``).

* **OAuth.** With ``--oauth-provider`` (one of the policy's identity
  providers), the bridge is also an OAuth 2.1 resource server for MCP hosts:
  RFC 9728 metadata, ``WWW-Authenticate`` with ``resource_metadata``, tokens
  for this bridge's own resource URL only, and each person's calls made with
  a registry token exchanged for them at the provider (``mcp_oauth``).

Order of checks on a request: bearer token (401), then body size (413), then
Host (421) / Origin (403), then the MCP session and message (a resume whose
events are no longer held: 410, in the caller's own open session only). The settings and
the checks made before anything listens: ``http_settings.py``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from mcp.server.auth.middleware.bearer_auth import (
    AuthenticatedUser,
    BearerAuthBackend,
    RequireAuthMiddleware,
)
from mcp.server.auth.provider import AccessToken
from mcp.server.context import ServerRequestContext
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp.types import INVALID_REQUEST
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.authentication import AuthenticationMiddleware
from starlette.requests import Request
from starlette.routing import Route
from starlette.types import ASGIApp

from registry_server.api.auth.access_tokens import looks_like_jwt
from registry_server.client.registry_client import RegistryClient, TokenProvider
from registry_server.mcp.bridge import Bridge, build_server
from registry_server.mcp.event_store import ResumableEvents
from registry_server.mcp.http_settings import HttpSettings, check_settings
from registry_server.mcp.oauth import (
    IdpTokenVerifier,
    People,
    ScopedRequireAuth,
    TokenExchange,
    metadata_routes,
)
from registry_server.mcp.resume import ResumableSessionManager, ResumeGuard
from registry_server.policy.model import Policy
from registry_server.web.listener import (
    ListenerServer,
    bind,
    listener_hosts,
    shown_url,
    uvicorn_config,
)

log = logging.getLogger("toolreg.mcp")

MCP_PATH = "/mcp"  # the conventional Streamable HTTP endpoint


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
    if ``Policy.client_by_token`` (constant-time, every client compared) says so;
    else, with OAuth, an identity provider's token for this bridge (``mcp_oauth``).
    A policy token carries the scopes the bridge asks for: it is a client of the
    policy, which scopes do not narrow."""

    def __init__(
        self, policy: Policy, oauth: IdpTokenVerifier | None = None, scopes: Sequence[str] = ()
    ) -> None:
        self._policy = policy
        self._oauth = oauth
        self._scopes = list(scopes)

    async def verify_token(self, token: str) -> AccessToken | None:
        token = token.strip()  # as the server reads "Bearer  T"
        client = self._policy.client_by_token(token)
        if client is not None:
            return AccessToken(token=token, client_id=client.id, scopes=self._scopes)
        if self._oauth is not None and looks_like_jwt(token):
            return await self._oauth.verify_token(token)
        return None


class Identities:
    """The registry client of each MCP request.

    With a policy: one registry connection per policy client, made on first
    use with that client's own token (so at most as many as the policy has
    clients), chosen by the client the request's bearer token proved to be.
    Without (``--insecure-dev``): the bridge's own connection for everyone."""

    def __init__(
        self,
        connect: Callable[[str | None], RegistryClient],
        policy: Policy | None,
        people: People | None = None,
    ):
        self._connect = connect
        self._shared = connect(None) if policy is None else None
        self._by_client: dict[str, RegistryClient] = {}
        self._people = people  # with OAuth: the registry connections of IdP-signed-in people

    def client_for(self, ctx: ServerRequestContext[Any]) -> RegistryClient:
        if self._shared is not None:
            return self._shared
        request = ctx.request
        user = request.scope.get("user") if isinstance(request, Request) else None
        if not isinstance(user, AuthenticatedUser):
            # Unreachable behind RequireAuthMiddleware; never fall back to anyone.
            raise MCPError(INVALID_REQUEST, "no authenticated client for this request")
        token = user.access_token
        if token.subject is not None and self._people is not None:
            # An identity provider's token (policy tokens carry no subject here).
            return self._people.client_for(token.client_id, token.token)
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
        if self._people is not None:
            self._people.close()


def build_app(
    bridge: Bridge, settings: HttpSettings, port: int, oauth: IdpTokenVerifier | None = None
) -> Starlette:
    """The ASGI app: the SDK's session manager at ``/mcp``, behind bearer auth
    (and, with OAuth, the RFC 9728 metadata the SDK's routes serve)."""
    security = transport_security(settings, port)
    events = ResumableEvents(settings.resume)
    manager = ResumableSessionManager(
        events=events,
        app=build_server(bridge),
        security_settings=security,
        max_request_body_size=settings.max_body_bytes,
        session_idle_timeout=settings.session_idle_s,
        max_sessions=settings.max_sessions,
    )
    # Inside the bearer check: a resume is judged only for an authenticated caller.
    endpoint: ASGIApp = ResumeGuard(StreamableHTTPASGIApp(manager), events, security)
    middleware: list[Middleware] = []
    routes: list[Route] = []
    if settings.policy is not None:
        # Outermost, so a request without a known token is answered 401 before
        # its body is read (the size cap and parsing sit inside the manager).
        scopes = list(settings.oauth.scopes) if settings.oauth is not None else []
        if settings.oauth is not None:
            endpoint = ScopedRequireAuth(endpoint, scopes, settings.oauth.metadata_url)
            routes += metadata_routes(settings.oauth)
        else:
            endpoint = RequireAuthMiddleware(endpoint, required_scopes=[])
        backend = BearerAuthBackend(PolicyTokenVerifier(settings.policy, oauth, scopes))
        middleware.append(Middleware(AuthenticationMiddleware, backend=backend))
    return Starlette(
        routes=[Route(MCP_PATH, endpoint=endpoint), *routes],
        middleware=middleware,
        lifespan=lambda app: manager.run(),
    )


def serve_http(
    connect: Callable[[str | TokenProvider | None], RegistryClient],
    settings: HttpSettings,
    *,
    address: str,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve MCP over Streamable HTTP until SIGINT/SIGTERM (blocking).

    ``connect(token)`` opens a registry client whose bearer is ``token``, a
    string or a provider asked per call (None: the bridge's own). ``announce``
    gets the URL once the socket listens (default: a line on stderr, which
    scripts and tests read)."""
    check_settings(settings)
    sock = bind(settings.host, settings.port)
    port = int(sock.getsockname()[1])
    oauth = people = exchange = None
    if settings.oauth is not None and settings.policy is not None:
        oauth = IdpTokenVerifier(settings.policy, settings.oauth)
        exchange = TokenExchange(settings.oauth)
        people = People(exchange, connect)
    identities = Identities(connect, settings.policy, people)
    bridge = Bridge(
        identities.client_for,
        max_level=settings.max_level,
        categories=settings.categories,
        identity_provider=settings.oauth.provider.id if settings.oauth is not None else None,
        console_url=settings.console_url,
        state_ttl_s=settings.approval_state_ttl_s,
    )
    app = build_app(bridge, settings, port, oauth)
    server = ListenerServer(
        uvicorn_config(app, tls_cert=settings.tls_cert, tls_key=settings.tls_key)
    )
    url = shown_url(settings.host, port, tls=settings.tls, path=MCP_PATH)
    mode = (
        f"bearer tokens of {settings.policy.source}"
        if settings.policy is not None
        else "INSECURE DEVELOPMENT MODE: no authentication, loopback only"
    )
    if settings.oauth is not None:
        mode += f", and OAuth tokens of identity provider {settings.oauth.provider.id}"

    log.info("MCP bridge to toolreg at %s over Streamable HTTP (%s)", address, mode)
    (announce or _announce)(url)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        identities.close()
        for part in (oauth, exchange):
            if part is not None:
                part.close()


def _announce(url: str) -> None:
    print(f"toolreg mcp: serving MCP on {url}", file=sys.stderr, flush=True)
