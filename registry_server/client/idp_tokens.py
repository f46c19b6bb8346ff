"""Access tokens from the organization's identity provider, for clients
(docs/identity.md): an agent's, by the OAuth 2.0 client-credentials grant,
with the registry as the resource (RFC 8707), kept and fetched again before
it expires. Pass one as ``token=`` to ``RegistryClient.connect``.

The client secret and the tokens are never logged or put in an error: a
failed fetch says which endpoint refused, with the HTTP status and the
provider's OAuth ``error`` code only.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Callable

import httpx

REFRESH_MARGIN_S = 30.0  # seconds before expiry when a token is fetched again
DEFAULT_LIFETIME_S = 60.0  # seconds assumed when the answer names no expires_in
FETCH_TIMEOUT_S = 10.0  # seconds for one token request
MAX_ANSWER_BYTES = 64 * 1024  # bytes of a token endpoint's answer


class TokenError(Exception):
    """The identity provider did not give a token (no secret in the message)."""


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
        if not token_endpoint.startswith("https://") and not _loopback_http(token_endpoint):
            raise ValueError("token_endpoint must be an https:// URL (http only to loopback)")
        self._endpoint = token_endpoint
        self._auth = (client_id, client_secret)
        self._form = {"grant_type": "client_credentials"}
        if resource:
            self._form["resource"] = resource
        if scope:
            self._form["scope"] = scope
        self._http = httpx.Client(
            verify=ssl.create_default_context(cafile=ca_file),
            timeout=FETCH_TIMEOUT_S,
            follow_redirects=False,
            trust_env=False,
        )
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
        try:
            answer = self._http.post(self._endpoint, data=self._form, auth=self._auth)
        except httpx.HTTPError as exc:
            raise TokenError(f"token endpoint unreachable ({type(exc).__name__})") from None
        if len(answer.content) > MAX_ANSWER_BYTES:
            raise TokenError("token endpoint's answer is too large")
        try:
            body = answer.json()
        except ValueError:
            body = {}
        if answer.status_code != 200 or not isinstance(body, dict):
            code = body.get("error") if isinstance(body, dict) else None
            shown = code if isinstance(code, str) and code.isidentifier() else "no error code"
            raise TokenError(f"token endpoint refused: HTTP {answer.status_code} ({shown})")
        token = body.get("access_token")
        if not isinstance(token, str) or not token:
            raise TokenError("token endpoint's answer has no access_token")
        lifetime = body.get("expires_in")
        if not isinstance(lifetime, int | float) or lifetime <= 0:
            lifetime = DEFAULT_LIFETIME_S
        return token, float(lifetime)

    def close(self) -> None:
        self._http.close()


def _loopback_http(url: str) -> bool:
    return url.startswith(("http://127.0.0.1:", "http://localhost:", "http://[::1]:"))
