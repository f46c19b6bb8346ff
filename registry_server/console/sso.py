"""Console sign-in with the organization's SSO: OpenID Connect's
authorization code flow with PKCE (S256), ``state`` and ``nonce``
(docs/how-to/approvals.md, "Signing in with SSO").

The console is a confidential OAuth client of one identity provider the
policy trusts (``identity_providers``). A sign-in:

1. ``PendingLogins.begin``: a random ``state``, ``nonce`` and PKCE verifier,
   kept here (only the state and the verifier's S256 challenge travel), bound
   to the browser by a random value in a short-lived HttpOnly cookie (only its
   sha256 is kept). Pending logins expire (``PENDING_TTL_S``) and are capped,
   overall and per source address.
2. The browser goes to the provider's authorization endpoint, asking for
   ``openid`` plus the groups scope and for the registry as the resource
   (RFC 8707), so the token endpoint also gives an access token for the
   registry and a refresh token.
3. ``PendingLogins.take``: the callback's ``state`` is looked up and removed
   (single use, whatever follows), and the cookie must be the one it was
   bound to.
4. ``OidcClient.exchange``: the code and the verifier for tokens, with the
   console's client secret; ``OidcClient.verify_id_token``: the ID token's
   signature with the provider's published keys (``ProviderKeys``, as the
   registry fetches them), an algorithm the policy pins for the provider,
   ``iss`` exactly, ``aud`` the console's client id (``azp`` too when there
   are several), ``exp``/``iat`` within the clock skew, the ``nonce``; and
   the access token's ``sub`` must be the ID token's.
5. ``identity``: the client the ID token's claims make, by the same mapping
   the registry applies to the access token (a pinned subject, else its
   groups), and ``SsoBearer`` keeps the person's access token fresh with the
   refresh token for the registry connection.

Nothing here logs or returns a token, a code, a verifier, a nonce or the
client secret: errors carry fixed texts (``SsoRefused.reason``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import jwt

from registry_server.api.auth.jwks import DISCOVERY_PATH, FetchError, HttpFetcher, ProviderKeys
from registry_server.client.idp_tokens import (
    MAX_TOKEN_CHARS,
    TokenAnswer,
    TokenError,
    s256,
    token_request,
)
from registry_server.console.settings import SsoSettings
from registry_server.console.throttle import source_key
from registry_server.policy.clients import Client
from registry_server.policy.identity import IdentityProvider, check_provider_url
from registry_server.policy.model import Policy

log = logging.getLogger("toolreg.console")

LOGIN_PATH = "/auth/login"
PENDING_TTL_S = 600.0  # seconds a started sign-in may take at the provider
MAX_PENDING = 1_024  # pending sign-ins at once; beyond, a new one is refused
MAX_PENDING_PER_SOURCE = 16  # per source address; its oldest goes first
RANDOM_BYTES = 32  # of a state, a nonce and a browser binding (256 bits each)
VERIFIER_BYTES = 48  # of a PKCE code verifier: 64 characters (RFC 7636: 43 to 128)
REFRESH_MARGIN_S = 30.0  # seconds before its expiry when an access token is refreshed


class SsoRefused(Exception):
    """A sign-in that does not go on. ``reason`` is a fixed text for the log
    (never a token or code); ``kind`` tells the page which message to show;
    ``failure`` whether it counts against the sign-in throttle."""

    def __init__(self, kind: str, reason: str, *, failure: bool = True) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.failure = failure


# What the page is told (its own texts, by these keys): never the details.
STATE, IDP, EXCHANGE, TOKEN, UNAVAILABLE, FULL = (
    "state", "idp", "exchange", "token", "unavailable", "full",
)  # fmt: skip


def _random(n: int = RANDOM_BYTES) -> str:
    return secrets.token_urlsafe(n)


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


# ----------------------------------------------------------- pending logins


@dataclass(frozen=True)
class PendingLogin:
    """What the callback needs and only this process holds."""

    verifier: str = field(repr=False)
    nonce: str = field(repr=False)
    browser: bytes = field(repr=False)  # sha256 of the value in the browser's cookie
    source: str  # the source key it was started from
    started: float


@dataclass(frozen=True)
class Started:
    state: str  # goes to the provider and comes back
    browser: str  # goes into the browser's cookie
    login: PendingLogin


class PendingLogins:
    """Started sign-ins by the sha256 of their state: single use, expiring,
    capped overall and per source. Pure logic over a clock; one event loop."""

    def __init__(
        self,
        *,
        ttl_s: float = PENDING_TTL_S,
        max_pending: int = MAX_PENDING,
        per_source: int = MAX_PENDING_PER_SOURCE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_pending = max_pending
        self.per_source = per_source
        self._clock = clock
        self._by_state: OrderedDict[bytes, PendingLogin] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._by_state)

    def begin(self, address: str) -> Started:
        """A new pending sign-in from ``address``. A full table makes room
        from the source holding the most (its oldest goes): sources that fill
        it can push out only their own, never a newcomer's one sign-in."""
        now = self._clock()
        self._expire(now)
        source = source_key(address)
        mine = [k for k, p in self._by_state.items() if p.source == source]
        for key in mine[: max(0, len(mine) - self.per_source + 1)]:
            del self._by_state[key]  # this source's oldest make room for its newest
        if len(self._by_state) >= self.max_pending:
            counts = Counter(p.source for p in self._by_state.values())
            heaviest = max(counts.values())
            oldest = next(k for k, p in self._by_state.items() if counts[p.source] == heaviest)
            del self._by_state[oldest]
        state, browser = _random(), _random()
        login = PendingLogin(
            verifier=secrets.token_urlsafe(VERIFIER_BYTES),
            nonce=_random(),
            browser=_digest(browser),
            source=source,
            started=now,
        )
        self._by_state[_digest(state)] = login
        return Started(state, browser, login)

    def take(self, state: str | None, browser: str | None) -> PendingLogin:
        """The pending sign-in of this ``state``, removed (a state is good
        once, whatever follows), if ``browser`` is the cookie it was bound to."""
        if not state:
            raise SsoRefused(STATE, "no state in the callback")
        now = self._clock()
        self._expire(now)
        login = self._by_state.pop(_digest(state), None)
        if login is None:
            raise SsoRefused(STATE, "unknown, used or expired state")
        if not browser or not hmac.compare_digest(_digest(browser), login.browser):
            raise SsoRefused(STATE, "state bound to another browser")
        return login

    def _expire(self, now: float) -> None:
        while self._by_state:
            key, oldest = next(iter(self._by_state.items()))
            if now - oldest.started < self.ttl_s:
                return
            del self._by_state[key]


# -------------------------------------------------------------- the provider


@dataclass(frozen=True)
class Endpoints:
    authorization: str
    token: str


class OidcClient:
    """The console as an OAuth client of one provider."""

    def __init__(
        self,
        provider: IdentityProvider,
        *,
        client_id: str,
        client_secret: str,
        redirect_uri: str,
        scopes: tuple[str, ...],
        resource: str,
        endpoint: HttpFetcher | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.provider = provider
        self.client_id = client_id
        self._secret = client_secret
        self.redirect_uri = redirect_uri
        self.scope = " ".join(dict.fromkeys(("openid", *scopes)))
        self.resource = resource
        self._endpoint = endpoint or HttpFetcher(provider)
        self.keys = ProviderKeys(provider, self._endpoint)
        self._clock = clock
        self._lock = threading.Lock()
        self._endpoints: Endpoints | None = None

    @classmethod
    def from_settings(cls, sso: SsoSettings, redirect_uri: str) -> OidcClient:
        return cls(
            sso.provider, client_id=sso.client_id, client_secret=sso.client_secret,
            redirect_uri=redirect_uri, scopes=sso.scopes, resource=sso.resource,
        )  # fmt: skip

    def endpoints(self) -> Endpoints:
        """From the provider's discovery document (once it answered); it must
        name the provider's issuer exactly."""
        with self._lock:
            if self._endpoints is None:
                try:
                    document = self._endpoint(self.provider.issuer.rstrip("/") + DISCOVERY_PATH)
                    if document.get("issuer") != self.provider.issuer:
                        raise FetchError("the discovery document names another issuer")
                    self._endpoints = Endpoints(
                        self._url(document, "authorization_endpoint"),
                        self._url(document, "token_endpoint"),
                    )
                except FetchError as exc:
                    log.warning("SSO provider %s: discovery failed (%s)", self.provider.id, exc)
                    raise SsoRefused(UNAVAILABLE, "provider unavailable", failure=False) from None
            return self._endpoints

    def _url(self, document: Mapping[str, Any], name: str) -> str:
        value = document.get(name)
        if not isinstance(value, str):
            raise FetchError(f"the discovery document has no {name}")
        try:
            return check_provider_url(value, name, self.provider.allow_http_loopback)
        except ValueError as exc:
            raise FetchError(str(exc)) from None

    def authorization_url(self, started: Started) -> str:
        query = {
            "response_type": "code",
            "client_id": self.client_id,
            "redirect_uri": self.redirect_uri,
            "scope": self.scope,
            "state": started.state,
            "nonce": started.login.nonce,
            "code_challenge": s256(started.login.verifier),
            "code_challenge_method": "S256",
            "resource": self.resource,
        }
        return f"{self.endpoints().authorization}?{urlencode(query)}"

    def exchange(self, code: str, login: PendingLogin) -> TokenAnswer:
        return self._token_request(
            {
                "grant_type": "authorization_code",
                "code": code,
                "redirect_uri": self.redirect_uri,
                "code_verifier": login.verifier,
                "resource": self.resource,
            }
        )

    def refresh(self, refresh_token: str) -> TokenAnswer:
        return self._token_request(
            {"grant_type": "refresh_token", "refresh_token": refresh_token,
             "resource": self.resource}
        )  # fmt: skip

    def _token_request(self, form: dict[str, str]) -> TokenAnswer:
        url = self.endpoints().token
        try:
            return token_request(
                self._endpoint.client, url, form, auth=(self.client_id, self._secret)
            )
        except TokenError as exc:
            if exc.unreachable:
                log.warning("SSO provider %s: token endpoint failed (%s)", self.provider.id, exc)
                raise SsoRefused(UNAVAILABLE, "token endpoint unreachable", failure=False) from None
            raise SsoRefused(EXCHANGE, str(exc)) from None

    def verify_id_token(self, tokens: TokenAnswer, login: PendingLogin) -> dict[str, Any]:
        """The ID token's claims once its signature, issuer, audience, times
        and nonce hold, and the access token is for the same subject."""
        token = tokens.id_token
        if token is None or len(token) > MAX_TOKEN_CHARS:
            raise SsoRefused(TOKEN, "no usable ID token")
        provider = self.provider
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise SsoRefused(TOKEN, "ID token is not a well-formed JWT") from None
        alg, kid = header.get("alg"), header.get("kid")
        if not isinstance(alg, str) or alg not in provider.algorithms:
            raise SsoRefused(TOKEN, "ID token algorithm not allowed for this provider")
        if kid is not None and not isinstance(kid, str):
            raise SsoRefused(TOKEN, "ID token kid is not a string")
        try:
            key = self.keys.key_for(kid, alg)
        except FetchError:
            key = None
        if key is None:
            raise SsoRefused(TOKEN, "no known key for the ID token's kid")
        try:
            claims: dict[str, Any] = jwt.decode(
                token, key, algorithms=[alg], audience=self.client_id, issuer=provider.issuer,
                leeway=provider.clock_skew_s,
                options={"require": ["exp", "iat", "iss", "aud", "sub"], "verify_iat": True},
            )  # fmt: skip
        except jwt.ExpiredSignatureError:
            raise SsoRefused(TOKEN, "ID token expired") from None
        except jwt.InvalidAudienceError:
            raise SsoRefused(TOKEN, "ID token audience is not this console") from None
        except jwt.InvalidIssuerError:
            raise SsoRefused(TOKEN, "ID token issuer mismatch") from None
        except jwt.InvalidSignatureError:
            raise SsoRefused(TOKEN, "ID token bad signature") from None
        except jwt.PyJWTError as exc:
            raise SsoRefused(TOKEN, f"ID token rejected ({type(exc).__name__})") from None
        audiences = claims["aud"] if isinstance(claims["aud"], list) else [claims["aud"]]
        if len(audiences) > 1 and claims.get("azp") != self.client_id:
            raise SsoRefused(TOKEN, "ID token for several audiences, azp not this console")
        nonce = claims.get("nonce")
        if not isinstance(nonce, str) or not hmac.compare_digest(
            nonce.encode("utf-8", "surrogatepass"), login.nonce.encode()
        ):
            raise SsoRefused(TOKEN, "ID token nonce mismatch")
        if access_subject(tokens.access_token) != claims["sub"]:
            raise SsoRefused(TOKEN, "access token subject differs from the ID token's")
        return claims

    def close(self) -> None:
        self._endpoint.close()


def access_subject(access_token: str) -> str | None:
    """The ``sub`` an access token names, unverified (the registry verifies
    it; the console only checks that it is the ID token's person)."""
    try:
        claims = jwt.decode(access_token, options={"verify_signature": False})
    except jwt.PyJWTError:
        return None
    sub = claims.get("sub")
    return sub if isinstance(sub, str) else None


def identity(policy: Policy, provider: IdentityProvider, claims: Mapping[str, Any]) -> Client:
    """The policy client these claims make, as the registry maps an access
    token's (api.auth.access_tokens): a pinned subject, else its groups."""
    subject = provider.subject_of(claims)
    if subject is None:
        raise SsoRefused(TOKEN, f"ID token claim {provider.client_claim} missing")
    if subject in provider.denied_subjects:
        raise SsoRefused(TOKEN, "subject is denied by the policy")
    pinned = policy.client_by_idp(provider.id, subject)
    if pinned is not None:
        return pinned
    client = provider.client_for(subject, provider.groups_of(claims))
    if client is None:
        raise SsoRefused(TOKEN, "subject is not a usable client id")
    return client


# ------------------------------------------------------------ the bearer


class SsoBearer:
    """A signed-in person's registry bearer: their access token, refreshed
    with their refresh token once it is within ``REFRESH_MARGIN_S`` of expiry
    (asked per RPC; one refresh at a time). When no refresh is possible the
    stale token goes on (the registry refuses it) and ``on_lost`` is told once."""

    def __init__(
        self,
        oidc: OidcClient,
        tokens: TokenAnswer,
        on_lost: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._oidc = oidc
        self._on_lost = on_lost
        self._clock = clock
        self._lock = threading.Lock()
        self._access = tokens.access_token
        self._refresh = tokens.refresh_token
        self._expires_at = clock() + tokens.lifetime
        self._lost = False
        self.refreshes = 0

    def __call__(self) -> str:
        with self._lock:
            if not self._lost and self._clock() >= self._expires_at - REFRESH_MARGIN_S:
                self._renew()
            return self._access

    def _renew(self) -> None:
        if self._refresh is None:
            self._lose("no refresh token")
            return
        try:
            tokens = self._oidc.refresh(self._refresh)
        except SsoRefused as refused:
            if refused.kind == UNAVAILABLE:  # for now: the next call tries again
                log.warning("SSO access token not refreshed (%s)", refused.reason)
            else:
                self._lose(refused.reason)
            return
        self.refreshes += 1
        self._access = tokens.access_token
        self._refresh = tokens.refresh_token or self._refresh  # rotated, or kept
        self._expires_at = self._clock() + tokens.lifetime

    def _lose(self, reason: str) -> None:
        self._lost = True
        log.warning("SSO access token not refreshed (%s); the person must sign in again", reason)
        self._on_lost()

    def forget(self) -> None:
        """Drop the tokens (the person's last session ended)."""
        with self._lock:
            self._access, self._refresh, self._lost = "", None, True
