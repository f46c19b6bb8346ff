"""``toolreg mcp --http`` as an OAuth 2.1 resource server, as the MCP
authorization specification (2025-11-25) asks (docs/how-to/identity.md, "MCP hosts"):

* **Discovery.** RFC 9728 Protected Resource Metadata at
  ``/.well-known/oauth-protected-resource/mcp`` (and at the bare well-known
  path): this resource, the identity provider as its authorization server,
  the scopes it wants. A request without a usable token gets 401 with
  ``WWW-Authenticate: Bearer resource_metadata="...", scope="..."``; a token
  without the scopes gets 403 ``insufficient_scope``.
* **Audience.** A host's token is checked as the registry checks IdP tokens
  (``api.auth.access_tokens``: issuer, keys, algorithms, expiry), with one
  difference: its audience must be this bridge's own resource URL (RFC 8707),
  so a token minted for any other service is refused here.
* **No passthrough.** The host's token never reaches the registry. For each
  person, the bridge exchanges it at the identity provider (RFC 8693 token
  exchange, as the bridge's own confidential client) for a token whose
  audience is the registry, for the same person, with the bridge as actor
  (``act``). The registry checks it like any IdP token, applies the person's
  policy, and audits both the person and the bridge. Why token exchange and
  not a delegation the registry verifies: the registry then accepts one kind
  of credential, each bound to its own audience, and the identity provider,
  which already decides who may act for whom, stays the one place that does.

Nothing here logs a token, a client secret or an answer of the token endpoint.
"""

from __future__ import annotations

import hashlib
import logging
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import anyio.to_thread
import httpx
from mcp.server.auth.middleware.bearer_auth import RequireAuthMiddleware
from mcp.server.auth.provider import AccessToken
from pydantic import AnyHttpUrl
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Send

from registry_server.api.auth.access_tokens import AccessTokens, TokenRefused
from registry_server.api.auth.jwks import FetchError, HttpFetcher
from registry_server.client.idp_tokens import TokenError, token_request
from registry_server.client.registry_client import RegistryClient
from registry_server.mcp.http_settings import OAuthSettings
from registry_server.policy.identity import check_provider_url
from registry_server.policy.model import Policy

log = logging.getLogger("toolreg.mcp")

TOKEN_EXCHANGE = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"
EXCHANGE_MARGIN_S = 30.0  # seconds before expiry when a registry token is exchanged again
EXCHANGE_TIMEOUT_S = 10.0  # seconds for one token exchange
MAX_PEOPLE = 256  # registry connections kept for people (least recently used closed)


def bridge_provider(policy: Policy, settings: OAuthSettings) -> Policy:
    """The policy as the bridge checks hosts' tokens: the provider's audience
    is the bridge's own resource URL, and no other provider is trusted here."""
    provider = replace(settings.provider, audiences=(settings.resource_url,), actors=frozenset())
    return replace(policy, identity_providers=(provider,), clients=())


class IdpTokenVerifier:
    """The MCP SDK's ``TokenVerifier`` for hosts' IdP access tokens."""

    def __init__(self, policy: Policy, settings: OAuthSettings) -> None:
        self._policy = bridge_provider(policy, settings)
        self._tokens = AccessTokens()

    async def verify_token(self, token: str) -> AccessToken | None:
        token = token.strip()
        try:
            # The first token may fetch the provider's keys: not on the event loop.
            verified, claims = await anyio.to_thread.run_sync(self._verify, token)
        except TokenRefused:
            return None  # logged by AccessTokens, by reason, without the token
        scope = claims.get("scope")
        return AccessToken(
            token=token, client_id=verified.client.id,
            scopes=scope.split() if isinstance(scope, str) else [],
            expires_at=int(claims["exp"]), resource=_audience(claims), subject=verified.subject,
        )  # fmt: skip

    def _verify(self, token: str) -> tuple[Any, dict[str, Any]]:
        import jwt

        verified = self._tokens.verify(self._policy, token)
        # Verified above; read again only for the fields the SDK wants.
        return verified, jwt.decode(token, options={"verify_signature": False})

    def close(self) -> None:
        self._tokens.close()


def _audience(claims: dict[str, Any]) -> str | None:
    aud = claims.get("aud")
    return aud if isinstance(aud, str) else (aud[0] if isinstance(aud, list) and aud else None)


class ScopedRequireAuth(RequireAuthMiddleware):
    """The SDK's middleware, whose 401 also names the scope to ask for (the
    MCP authorization spec: ``WWW-Authenticate`` with ``scope``)."""

    def __init__(self, app: Any, scopes: list[str], metadata_url: str) -> None:
        super().__init__(
            app, required_scopes=scopes, resource_metadata_url=AnyHttpUrl(metadata_url)
        )
        self._scope = " ".join(scopes)

    async def _send_auth_error(
        self, send: Send, status_code: int, error: str, description: str
    ) -> None:
        if not self._scope:
            await super()._send_auth_error(send, status_code, error, description)
            return

        async def with_scope(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v + f', scope="{self._scope}"'.encode() if k == b"www-authenticate" else v)
                    for k, v in message["headers"]
                ]
                message = {**message, "headers": headers}
            await send(message)

        await super()._send_auth_error(with_scope, status_code, error, description)


def metadata_routes(settings: OAuthSettings) -> list[Route]:
    """RFC 9728 metadata at the path-inserted well-known URL and the bare one.
    Served here, not by the SDK's route: its URL type adds a "/" to an issuer
    without a path, and a host compares issuer identifiers as exact strings
    (RFC 8414 section 3.3), so "https://idp" must stay "https://idp"."""
    document = {
        "resource": settings.resource_url,
        "authorization_servers": [settings.provider.issuer],
        "bearer_methods_supported": ["header"],
        "resource_name": "toolreg MCP bridge",
        **({"scopes_supported": list(settings.scopes)} if settings.scopes else {}),
    }

    async def metadata(request: Request) -> JSONResponse:
        return JSONResponse(document, headers={"cache-control": "public, max-age=3600"})

    path = urlsplit(settings.metadata_url).path
    bare = "/.well-known/oauth-protected-resource"
    return [Route(p, endpoint=metadata, methods=["GET"]) for p in dict.fromkeys((path, bare))]


class TokenExchange:
    """Registry tokens for people, by RFC 8693 token exchange at the provider
    (the bridge authenticates as its own confidential client); each is kept
    until shortly before it expires, keyed by the host's token's digest."""

    def __init__(self, settings: OAuthSettings, clock: Callable[[], float] = time.time) -> None:
        self._settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self._endpoint: str | None = None
        self._http = httpx.Client(
            verify=ssl.create_default_context(cafile=settings.provider.ca_file),
            timeout=EXCHANGE_TIMEOUT_S, follow_redirects=False, trust_env=False,
        )  # fmt: skip
        self.exchanges = 0

    def registry_token(self, subject_token: str) -> str:
        key = hashlib.sha256(subject_token.encode()).digest()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and self._clock() < cached[1] - EXCHANGE_MARGIN_S:
                return cached[0]
        # Not under the lock: one person's slow exchange must not hold up another's
        # calls (two calls of one person may both exchange, once).
        token, lifetime = self._exchange(subject_token)
        with self._lock:
            self._cache[key] = (token, self._clock() + lifetime)
            while len(self._cache) > MAX_PEOPLE * 4:
                self._cache.popitem(last=False)
        return token

    def _token_endpoint(self) -> str:
        if self._endpoint is None:
            fetch = HttpFetcher(self._settings.provider)
            try:
                issuer = self._settings.provider.issuer.rstrip("/")
                document = fetch(issuer + "/.well-known/openid-configuration")
            finally:
                fetch.close()
            endpoint = document.get("token_endpoint")
            if document.get("issuer") != self._settings.provider.issuer or not isinstance(
                endpoint, str
            ):
                raise FetchError("the discovery document names another issuer or no token endpoint")
            try:  # the bridge's secret and hosts' tokens go there: https only
                check_provider_url(
                    endpoint, "token_endpoint", self._settings.provider.allow_http_loopback
                )
            except ValueError as exc:
                raise FetchError(str(exc)) from None
            self._endpoint = endpoint
        return self._endpoint

    def _exchange(self, subject_token: str) -> tuple[str, float]:
        self.exchanges += 1
        settings = self._settings
        form = {
            "grant_type": TOKEN_EXCHANGE, "subject_token": subject_token,
            "subject_token_type": ACCESS_TOKEN_TYPE, "resource": settings.registry_resource,
            "requested_token_type": ACCESS_TOKEN_TYPE,
        }  # fmt: skip
        try:
            endpoint = self._token_endpoint()
        except FetchError as exc:
            raise TokenError(f"token exchange: no token endpoint ({exc})") from None
        auth = (settings.client_id, settings.client_secret)
        answer = token_request(self._http, endpoint, form, auth=auth)
        return answer.access_token, answer.lifetime

    def close(self) -> None:
        self._http.close()


class People:
    """A registry connection per person, whose bearer is that person's
    exchanged registry token (the person's latest host token, exchanged when
    needed, in the RPC's own thread); at most ``MAX_PEOPLE``, least recently
    used closed first."""

    def __init__(
        self, exchange: TokenExchange, connect: Callable[[Callable[[], str]], RegistryClient]
    ) -> None:
        self._exchange = exchange
        self._connect = connect
        self._latest: dict[str, str] = {}  # person's client id -> host token of their last request
        self._clients: OrderedDict[str, RegistryClient] = OrderedDict()

    def client_for(self, person: str, host_token: str) -> RegistryClient:
        # On the event loop: no await between these steps, so no race.
        self._latest[person] = host_token
        client = self._clients.get(person)
        if client is None:
            client = self._connect(lambda: self._exchange.registry_token(self._latest[person]))
            self._clients[person] = client
        self._clients.move_to_end(person)
        while len(self._clients) > MAX_PEOPLE:
            gone, old = self._clients.popitem(last=False)
            self._latest.pop(gone, None)
            old.close()
        return client

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
