"""Access tokens from the organization's identity provider, for clients
(docs/how-to/identity.md): an agent's, by the OAuth 2.0 client-credentials grant,
with the registry as the resource (RFC 8707), kept and fetched again before
it expires; a person's, from ``toolreg login`` (authorization code with
PKCE), kept in the token store and refreshed with its refresh token. Pass one
as ``token=`` to ``RegistryClient.connect``.

The client secret and the tokens are never logged or put in an error: a
failed fetch says which endpoint refused, with the HTTP status and the
provider's OAuth ``error`` code only.
"""

from __future__ import annotations

import base64
import hashlib
import json
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from registry_server.client.token_store import StoredLogin, StoreError, TokenStore
from registry_server.policy.identity import check_provider_url

if TYPE_CHECKING:
    import httpx

# httpx (about 50 ms to import) is imported where a provider is spoken to:
# every `toolreg` command loads this module, few sign in.

REFRESH_MARGIN_S = 30.0  # seconds before expiry when a token is fetched again
DEFAULT_LIFETIME_S = 60.0  # seconds assumed when the answer names no expires_in
FETCH_TIMEOUT_S = 10.0  # seconds for one token request
MAX_ANSWER_BYTES = 64 * 1024  # bytes of a token endpoint's answer
MAX_TOKEN_CHARS = 8_192  # characters of an access, refresh or ID token kept from an answer


class TokenError(Exception):
    """The identity provider did not give a token (no secret in the message);
    ``unreachable``: no answer at all (worth trying again), not a refusal."""

    def __init__(self, message: str, *, unreachable: bool = False) -> None:
        super().__init__(message)
        self.unreachable = unreachable


class ClientCredentials:
    """Client-credentials tokens for one client and resource, refreshed by
    the first call that finds the token within ``REFRESH_MARGIN_S`` of expiry
    (one fetch at a time; other callers wait for it)."""

    def __init__(
        self,
        token_endpoint: str,
        client_id: str,
        client_secret: str,
        *,
        resource: str | None = None,
        scope: str | None = None,
        ca_file: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_endpoint(token_endpoint, "token_endpoint")
        self._endpoint = token_endpoint
        self._auth = (client_id, client_secret)
        self._form = {"grant_type": "client_credentials"}
        if resource:
            self._form["resource"] = resource
        if scope:
            self._form["scope"] = scope
        self._http = https_client(ca_file)
        self._clock = clock
        self._lock = threading.Lock()
        self._token: str | None = None
        self._expires_at = 0.0
        self.fetches = 0

    def __call__(self) -> str:
        with self._lock:
            if self._token is None or self._clock() >= self._expires_at - REFRESH_MARGIN_S:
                self._token, lifetime = self._fetch()
                self._expires_at = self._clock() + lifetime
            return self._token

    def _fetch(self) -> tuple[str, float]:
        self.fetches += 1
        answer = token_request(self._http, self._endpoint, self._form, auth=self._auth)
        return answer.access_token, answer.lifetime

    def close(self) -> None:
        self._http.close()


class StoredLoginTokens:
    """A person's tokens from ``toolreg login`` for one registry address
    (``token_store``): the stored access token, refreshed with the refresh
    token by the first call that finds it within ``REFRESH_MARGIN_S`` of
    expiry, the rotated refresh token written back. The refresh holds the
    store's lock and reads the file again first, so a refresh another process
    just made is used rather than repeated. A refresh that fails raises
    TokenError: the person signs in again."""

    def __init__(
        self, store: TokenStore, address: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._store = store
        self._address = address
        self._clock = clock
        self._lock = threading.Lock()
        self._login: StoredLogin | None = None
        self.refreshes = 0

    def __call__(self) -> str:
        with self._lock:
            if self._login is None or self._due(self._login):
                self._login = self._current()
            return self._login.access_token

    def _due(self, login: StoredLogin) -> bool:
        return self._clock() >= login.expires_at - REFRESH_MARGIN_S

    def _current(self) -> StoredLogin:
        try:
            with self._store.locked(self._address):
                login = self._store.load(self._address)
                if login is None:
                    raise TokenError(f"no sign-in is stored for {self._address}")
                if self._due(login):
                    login = self._refresh(login)
                    self._store.save(login)
                return login
        except (StoreError, OSError) as exc:
            raise TokenError(str(exc)) from None

    def _refresh(self, login: StoredLogin) -> StoredLogin:
        if not login.refresh_token:
            raise TokenError("the access token expired and no refresh token was stored")
        try:
            check_endpoint(login.token_endpoint, "the stored token endpoint")
        except ValueError as exc:
            raise TokenError(str(exc)) from None
        form = {
            "grant_type": "refresh_token", "refresh_token": login.refresh_token,
            "client_id": login.client_id, "resource": login.resource,
        }  # fmt: skip
        self.refreshes += 1
        with https_client(login.ca_file) as http:
            answer = token_request(http, login.token_endpoint, form)
        return replace(
            login,
            access_token=answer.access_token,
            expires_at=self._clock() + answer.lifetime,
            refresh_token=answer.refresh_token or login.refresh_token,
        )


@dataclass(frozen=True)
class TokenAnswer:
    """A token endpoint's successful answer (RFC 6749 section 5.1)."""

    access_token: str = field(repr=False)
    lifetime: float  # seconds from now
    refresh_token: str | None = field(default=None, repr=False)
    id_token: str | None = field(default=None, repr=False)
    scope: str | None = None


def https_client(ca_file: str | None = None) -> httpx.Client:
    """An HTTP client for an identity provider: TLS verified against
    ``ca_file`` (else the system's CAs), no redirects, no proxy variables."""
    import httpx

    return httpx.Client(
        verify=ssl.create_default_context(cafile=ca_file),
        timeout=FETCH_TIMEOUT_S,
        follow_redirects=False,
        trust_env=False,
    )


def check_endpoint(url: str, what: str) -> None:
    """An identity provider's endpoint must be https (plain http only to a
    loopback host), with no user or password: parsed, never matched by prefix
    ("http://127.0.0.1:1@evil.example/" is evil.example)."""
    check_provider_url(url, what, allow_http_loopback=True)


def s256(verifier: str) -> str:
    """The PKCE S256 challenge of a verifier (RFC 7636, section 4.2)."""
    digest = hashlib.sha256(verifier.encode("ascii")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def token_request(
    http: httpx.Client,
    endpoint: str,
    form: Mapping[str, str],
    *,
    auth: tuple[str | bytes, str | bytes] | None = None,
) -> TokenAnswer:
    """POST one grant to a token endpoint; its answer, or TokenError naming
    only the HTTP status and the provider's OAuth ``error`` code."""
    import httpx

    raw = b""
    try:
        # Read as it comes, up to the cap: the answer's size is the provider's to choose.
        with http.stream(
            "POST", endpoint, data=dict(form), auth=auth or httpx.USE_CLIENT_DEFAULT
        ) as answer:
            for chunk in answer.iter_bytes():
                raw += chunk
                if len(raw) > MAX_ANSWER_BYTES:
                    raise TokenError("token endpoint's answer is too large")
            status = answer.status_code
    except httpx.HTTPError as exc:
        raise TokenError(
            f"token endpoint unreachable ({type(exc).__name__})", unreachable=True
        ) from None
    try:
        body = json.loads(raw)
    except ValueError:
        body = {}
    if status != 200 or not isinstance(body, dict):
        code = body.get("error") if isinstance(body, dict) else None
        shown = code if isinstance(code, str) and code.isidentifier() else "no error code"
        raise TokenError(f"token endpoint refused: HTTP {status} ({shown})")
    token = body.get("access_token")
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS:
        raise TokenError("token endpoint's answer has no usable access_token")
    lifetime = body.get("expires_in")
    if not isinstance(lifetime, int | float) or isinstance(lifetime, bool) or lifetime <= 0:
        lifetime = DEFAULT_LIFETIME_S

    def text(name: str) -> str | None:
        value = body.get(name)
        return value if isinstance(value, str) and value and len(value) <= MAX_TOKEN_CHARS else None

    return TokenAnswer(
        token, float(lifetime), text("refresh_token"), text("id_token"), text("scope")
    )
