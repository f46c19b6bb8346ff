"""A person signs in at the organization's identity provider, for the CLI
(``toolreg login``): OAuth 2.0 authorization code with PKCE (RFC 7636, S256)
for a native app on a loopback redirect (RFC 8252 section 7.3), asking for the
registry as the resource (RFC 8707), so the access token is the registry's.

* The provider's endpoints come from its discovery document, read over https
  from the issuer; its ``issuer`` must be the one asked for (RFC 8414 3.3).
* The redirect is ``http://127.0.0.1:<port>/callback``, served by a one-shot
  listener on loopback only, for a limited time. Its ``state`` must be the one
  sent (compared in constant time), and ``iss``, when the provider sends one
  (RFC 9207), the issuer; anything else ends the sign-in with nothing stored.
* The ID token is read for the name shown only ("signed in as"); the access
  token is what the registry checks.

No token, code, verifier or state is printed or logged; an error names the
step and, from the provider, its OAuth ``error`` code only.
"""

from __future__ import annotations

import base64
import hmac
import html
import json
import secrets
import socketserver
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlencode, urlsplit

from registry_server.client.idp_tokens import (
    MAX_ANSWER_BYTES,
    TokenAnswer,
    check_endpoint,
    s256,
    token_request,
)

if TYPE_CHECKING:
    import httpx

# httpx is imported where a provider is spoken to (idp_tokens.py says why).

CALLBACK_PATH = "/callback"
LOOPBACK_HOST = "127.0.0.1"
REQUEST_TIMEOUT_S = 10.0  # seconds the listener waits for one request's bytes
DEFAULT_SCOPE = "openid offline_access"


class LoginError(Exception):
    """The sign-in did not happen (no token, code or secret in the message)."""


@dataclass(frozen=True)
class Discovery:
    """What the sign-in needs of the provider's discovery document."""

    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    revocation_endpoint: str | None = None
    iss_parameter: bool = False  # the provider sends iss with the code (RFC 9207)


def discover(http: httpx.Client, issuer: str) -> Discovery:
    """The provider's endpoints, from ``<issuer>/.well-known/openid-configuration``."""
    import httpx

    try:
        check_endpoint(issuer, "--issuer")
    except ValueError as exc:
        raise LoginError(str(exc)) from None
    url = f"{issuer.rstrip('/')}/.well-known/openid-configuration"
    raw = b""
    try:
        with http.stream("GET", url) as answer:  # read up to the cap, as it comes
            if answer.status_code != 200:
                raise LoginError(f"{url} answered HTTP {answer.status_code}")
            for chunk in answer.iter_bytes():
                raw += chunk
                if len(raw) > MAX_ANSWER_BYTES:
                    raise LoginError(f"{url} is too large")
    except httpx.HTTPError as exc:
        raise LoginError(f"cannot read {url} ({type(exc).__name__}: {exc})") from None
    try:
        doc = json.loads(raw)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise LoginError(f"{url} is not a JSON object")
    if not isinstance(doc.get("issuer"), str) or doc["issuer"].rstrip("/") != issuer.rstrip("/"):
        raise LoginError(f"{url} names another issuer than {issuer}")
    endpoints = {}
    for name in ("authorization_endpoint", "token_endpoint", "revocation_endpoint"):
        value = doc.get(name)
        if value is None and name == "revocation_endpoint":
            continue
        if not isinstance(value, str):
            raise LoginError(f"{url} has no {name}")
        try:
            check_endpoint(value, name)
        except ValueError as exc:
            raise LoginError(f"{url}: {exc}") from None
        endpoints[name] = value
    methods = doc.get("code_challenge_methods_supported")
    if isinstance(methods, list) and "S256" not in methods:
        raise LoginError(f"{issuer} does not support PKCE with S256")
    return Discovery(
        issuer=doc["issuer"],
        iss_parameter=doc.get("authorization_response_iss_parameter_supported") is True,
        **endpoints,
    )


@dataclass(frozen=True)
class Request:
    """One sign-in's secrets, kept in this process only."""

    state: str
    verifier: str

    @classmethod
    def new(cls) -> Request:
        return cls(state=secrets.token_urlsafe(32), verifier=secrets.token_urlsafe(64))

    @property
    def challenge(self) -> str:
        return s256(self.verifier)

    def url(
        self, provider: Discovery, client_id: str, redirect_uri: str, *, scope: str, resource: str
    ) -> str:
        """The authorization request the person's browser opens."""
        query = urlencode({
            "response_type": "code", "client_id": client_id, "redirect_uri": redirect_uri,
            "scope": scope, "state": self.state, "code_challenge": self.challenge,
            "code_challenge_method": "S256", "resource": resource,
        })  # fmt: skip
        endpoint = provider.authorization_endpoint
        return f"{endpoint}{'&' if '?' in endpoint else '?'}{query}"

    def code_from(self, query: str, provider: Discovery) -> str:
        """The authorization code of a callback's query; LoginError for any
        other answer (the provider's error, a wrong state or issuer)."""
        params = {k: v[0] for k, v in parse_qs(query, keep_blank_values=True).items()}
        state = params.get("state", "")
        if not hmac.compare_digest(state.encode(), self.state.encode()):
            raise LoginError("the callback's state is not this sign-in's; nothing was stored")
        iss = params.get("iss")
        if (iss is not None or provider.iss_parameter) and iss != provider.issuer:
            raise LoginError("the callback names another issuer; nothing was stored")
        if "error" in params:
            code = params["error"]
            shown = code if code.replace("_", "").isalnum() else "no error code"
            raise LoginError(f"the identity provider refused the sign-in ({shown})")
        if not params.get("code"):
            raise LoginError("the callback has no authorization code")
        return params["code"]

    def exchange(
        self,
        http: httpx.Client,
        provider: Discovery,
        client_id: str,
        code: str,
        redirect_uri: str,
        resource: str,
    ) -> TokenAnswer:
        """The code for tokens at the token endpoint (a public client: no secret)."""
        form = {
            "grant_type": "authorization_code", "code": code, "redirect_uri": redirect_uri,
            "client_id": client_id, "code_verifier": self.verifier, "resource": resource,
        }  # fmt: skip
        return token_request(http, provider.token_endpoint, form)


class _Server(HTTPServer):
    def server_bind(self) -> None:
        socketserver.TCPServer.server_bind(self)  # no reverse DNS lookup of the host
        self.server_name, self.server_port = LOOPBACK_HOST, int(self.server_address[1])


class CallbackListener:
    """The loopback redirect's one-shot listener: the first request to
    ``/callback`` decides (other paths get 404 and are ignored)."""

    def __init__(self, port: int = 0) -> None:
        self._server = _Server((LOOPBACK_HOST, port), _CallbackHandler)
        self._server.query = None  # type: ignore[attr-defined]
        self._server.verdict = None  # type: ignore[attr-defined]
        self.port = int(self._server.server_address[1])
        self.redirect_uri = f"http://{LOOPBACK_HOST}:{self.port}{CALLBACK_PATH}"

    def wait(self, timeout_s: float, decide: Any) -> str:
        """The code, once the callback comes and ``decide(query)`` accepts it;
        LoginError when it refuses it, or nothing came in ``timeout_s``."""
        self._server.decide = decide  # type: ignore[attr-defined]
        deadline = time.monotonic() + timeout_s
        while self._server.verdict is None:  # type: ignore[attr-defined]
            left = deadline - time.monotonic()
            if left <= 0:
                raise LoginError(f"no sign-in came back in {timeout_s:g} s; nothing was stored")
            self._server.timeout = left
            self._server.handle_request()
        verdict: str | LoginError = self._server.verdict  # type: ignore[attr-defined]
        if isinstance(verdict, LoginError):
            raise verdict
        return verdict

    def close(self) -> None:
        self._server.server_close()


class _CallbackHandler(BaseHTTPRequestHandler):
    timeout = REQUEST_TIMEOUT_S  # a connection that sends nothing is dropped
    server_version = "toolreg-login"
    sys_version = ""

    def do_GET(self) -> None:  # http.server's name
        url = urlsplit(self.path)
        if url.path != CALLBACK_PATH or self.server.verdict is not None:  # type: ignore[attr-defined]
            self._page(404, "Not found", "This is toolreg's sign-in callback.")
            return
        try:
            self.server.verdict = self.server.decide(url.query)  # type: ignore[attr-defined]
        except LoginError as exc:
            self.server.verdict = exc  # type: ignore[attr-defined]
            self._page(400, "Not signed in", f"{exc}. Run toolreg login again.")
            return
        self._page(200, "Signed in", "toolreg has your sign-in: you may close this window.")

    def _page(self, status: int, title: str, text: str) -> None:
        body = (
            f"<!doctype html><meta charset=utf-8><title>{html.escape(title)}</title>"
            f"<h1>{html.escape(title)}</h1><p>{html.escape(text)}</p>"
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Content-Security-Policy", "default-src 'none'")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Nothing: a request line holds the code and the state."""


def signed_in_as(id_token: str | None) -> str | None:
    """The name to show from an ID token the token endpoint just gave over TLS
    (OIDC Core 3.1.3.7 lets a client skip its signature then); shown, never trusted."""
    if not id_token or id_token.count(".") != 2:
        return None
    payload = id_token.split(".")[1]
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    except ValueError:
        return None
    if not isinstance(claims, dict):
        return None
    for name in ("preferred_username", "email", "sub"):
        value = claims.get(name)
        if isinstance(value, str) and value.isprintable() and len(value) <= 200:
            return value
    return None


def revoke(
    http: httpx.Client, endpoint: str, token: str, client_id: str, hint: str = "refresh_token"
) -> str | None:
    """Revokes a token at the provider (RFC 7009); None, or why it failed."""
    import httpx

    form = {"token": token, "token_type_hint": hint, "client_id": client_id}
    try:
        answer = http.post(endpoint, data=form)
    except httpx.HTTPError as exc:
        return f"unreachable ({type(exc).__name__})"
    return None if answer.status_code == 200 else f"HTTP {answer.status_code}"
