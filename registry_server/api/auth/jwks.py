"""An identity provider's signing keys, fetched and cached (docs/how-to/identity.md).

The keys come from the provider's JWKS, found through OIDC discovery at its
issuer (or the policy's ``jwks_uri``), fetched with httpx and parsed by
PyJWT's ``PyJWKSet``. Fetching is bounded on every side, since a token's
``kid`` is chosen by whoever sends it:

* **How often.** An unknown ``kid`` refreshes the keys at most once per
  ``min_refresh_interval_s``, whatever number of forged kids arrive; between
  refreshes it is simply unknown (the token fails closed). Keys in use are
  refreshed every ``jwks_refresh_s`` in the background: no call waits on it.
* **How long.** A fetch has a timeout; while one runs, other callers that need
  a key wait for it under one lock rather than start their own.
* **How much.** Answers are read up to ``MAX_DOCUMENT_BYTES`` and hold at most
  ``MAX_KEYS`` keys; a larger one is refused whole.
* **Where.** https only (http to loopback only where the policy allows it),
  no redirects, no proxies or CAs from the environment, the system's CAs or
  the provider's ``ca_file``; the discovery document must name the issuer
  exactly (OpenID Connect Discovery 1.0, section 4.3).

When the provider cannot be reached, the cached keys keep working; with none
cached, every token of the provider fails closed. Nothing here logs a URL's
query or a document's content: a fetch failure is logged by provider id.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import jwt

from registry_server.policy.identity import IdentityProvider, check_provider_url

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 5.0  # seconds for one discovery or JWKS request
MAX_DOCUMENT_BYTES = 256 * 1024  # bytes of a discovery document or JWKS
MAX_KEYS = 64  # keys in one JWKS
USER_AGENT = "toolreg-jwks"
DISCOVERY_PATH = "/.well-known/openid-configuration"


class FetchError(Exception):
    """A discovery or JWKS fetch failed; the message names no URL content."""


Fetch = Callable[[str], dict[str, Any]]  # URL -> JSON object


class HttpFetcher:
    """GETs JSON documents from one provider (its TLS settings)."""

    def __init__(self, provider: IdentityProvider) -> None:
        verify: ssl.SSLContext
        try:
            verify = ssl.create_default_context(cafile=provider.ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise FetchError(f"ca_file: cannot load CA certificates ({exc})") from None
        self._provider = provider
        self.client = httpx.Client(
            verify=verify,
            timeout=httpx.Timeout(FETCH_TIMEOUT_S),
            follow_redirects=False,
            trust_env=False,
            headers={"user-agent": USER_AGENT, "accept": "application/json"},
        )

    def __call__(self, url: str) -> dict[str, Any]:
        try:
            check_provider_url(url, "url", self._provider.allow_http_loopback)
        except ValueError as exc:
            raise FetchError(str(exc)) from None
        try:
            with self.client.stream("GET", url) as answer:
                if answer.status_code != 200:
                    raise FetchError(f"HTTP {answer.status_code}")
                body = b""
                for chunk in answer.iter_bytes():
                    body += chunk
                    if len(body) > MAX_DOCUMENT_BYTES:
                        raise FetchError(f"answer larger than {MAX_DOCUMENT_BYTES} bytes")
        except httpx.HTTPError as exc:
            raise FetchError(f"{type(exc).__name__}: no usable answer") from None
        try:
            document = json.loads(body)
        except ValueError:
            raise FetchError("answer is not JSON") from None
        if not isinstance(document, dict):
            raise FetchError("answer is not a JSON object")
        return document

    def close(self) -> None:
        self.client.close()


class ProviderKeys:
    """The verification keys of one provider, refreshed within bounds."""

    def __init__(
        self,
        provider: IdentityProvider,
        fetch: Fetch,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.provider = provider
        self.fetch = fetch
        self._clock = clock
        self._lock = threading.Lock()  # one fetch at a time; waiters reuse its result
        # kid ("" for a key without one) -> the key for each algorithm it verifies
        self._keys: dict[str, _Key] = {}
        self._jwks_uri = provider.jwks_uri
        self._fetched_at: float | None = None  # last successful fetch
        self._attempted_at: float | None = None  # last fetch, successful or not
        self._background: threading.Thread | None = None
        self.fetches = 0  # fetches made (discovery and JWKS each count)

    def key_for(self, kid: str | None, alg: str) -> jwt.PyJWK | None:
        """The key that may verify a token with this header; None fails closed."""
        key = self._find(kid, alg)
        if key is not None:
            self._refresh_in_background_if_stale()
            return key
        with self._lock:
            key = self._find(kid, alg)  # another caller's fetch may have brought it
            if key is None and self._may_attempt():
                self._refresh_locked()
                key = self._find(kid, alg)
        return key

    def _find(self, kid: str | None, alg: str) -> jwt.PyJWK | None:
        keys = self._keys
        if kid is not None:
            key = keys.get(kid)
            return None if key is None else key.for_algorithm(alg)
        # No kid: only a provider with one usable key for this algorithm.
        fitting = [k for k in keys.values() if k.for_algorithm(alg) is not None]
        return fitting[0].for_algorithm(alg) if len(fitting) == 1 else None

    def _may_attempt(self) -> bool:
        now = self._clock()
        return (
            self._attempted_at is None
            or now - self._attempted_at >= self.provider.min_refresh_interval_s
        )

    def _refresh_in_background_if_stale(self) -> None:
        now = self._clock()
        stale = self._fetched_at is None or now - self._fetched_at >= self.provider.jwks_refresh_s
        if not stale or not self._may_attempt():
            return
        if self._background is not None and self._background.is_alive():
            return
        self._background = threading.Thread(
            target=self._refresh, name=f"jwks-{self.provider.id}", daemon=True
        )
        self._background.start()

    def _refresh(self) -> None:
        with self._lock:
            if self._may_attempt():
                self._refresh_locked()

    def _refresh_locked(self) -> None:
        self._attempted_at = self._clock()
        try:
            keys = self._fetch_keys()
        except FetchError as exc:
            log.warning(
                "identity provider %s: keys not refreshed (%s); %d cached key(s) stay in use",
                self.provider.id, exc, len(self._keys),
            )  # fmt: skip
            return
        self._keys = keys
        self._fetched_at = self._clock()
        log.info("identity provider %s: %d signing key(s) loaded", self.provider.id, len(keys))

    def _fetch_keys(self) -> dict[str, _Key]:
        if self._jwks_uri is None:
            self.fetches += 1
            discovery = self.fetch(self.provider.issuer.rstrip("/") + DISCOVERY_PATH)
            if discovery.get("issuer") != self.provider.issuer:
                raise FetchError("the discovery document names another issuer")
            uri = discovery.get("jwks_uri")
            if not isinstance(uri, str):
                raise FetchError("the discovery document has no jwks_uri")
            try:
                self._jwks_uri = check_provider_url(
                    uri, "jwks_uri", self.provider.allow_http_loopback
                )
            except ValueError as exc:
                raise FetchError(str(exc)) from None
        self.fetches += 1
        document = self.fetch(self._jwks_uri)
        raw = document.get("keys")
        if not isinstance(raw, list) or len(raw) > MAX_KEYS:
            raise FetchError(f"the JWKS must hold a list of at most {MAX_KEYS} keys")
        keys: dict[str, _Key] = {}
        for entry in raw:
            if not isinstance(entry, dict) or entry.get("use", "sig") != "sig":
                continue
            if any(part in entry for part in ("d", "p", "q", "k")):
                continue  # a private or symmetric key has no place in a JWKS
            key = _Key(entry)
            if key.for_algorithm(key.default_alg) is None:
                continue  # a key type this server cannot use: other keys still count
            kid = entry.get("kid")
            keys[kid if isinstance(kid, str) else ""] = key
        return keys


# The algorithms a key type may verify when the key names none.
FAMILIES = {"RSA": ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512"),
            "EC": ("ES256", "ES384", "ES512"), "OKP": ("EdDSA",)}  # fmt: skip


class _Key:
    """One JWK of the provider, as a PyJWK bound to each algorithm it may
    verify: its own ``alg`` when it names one, else its type's (an RSA key
    never verifies ES256)."""

    def __init__(self, entry: dict[str, Any]) -> None:
        self._entry = entry
        named = entry.get("alg")
        kty = entry.get("kty")
        self.algorithms = (named,) if isinstance(named, str) else FAMILIES.get(str(kty), ())
        self.default_alg = self.algorithms[0] if self.algorithms else ""
        self._built: dict[str, jwt.PyJWK | None] = {}

    def for_algorithm(self, alg: str) -> jwt.PyJWK | None:
        if alg not in self.algorithms:
            return None
        if alg not in self._built:
            try:
                self._built[alg] = jwt.PyJWK(self._entry, algorithm=alg)
            except (jwt.PyJWKError, jwt.InvalidKeyError, ValueError, TypeError):
                self._built[alg] = None
        return self._built[alg]
