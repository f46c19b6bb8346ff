"""IdP access tokens: who a bearer JWT says the caller is (docs/how-to/identity.md).

A token is checked against the provider its ``iss`` names, and only one the
policy trusts: the algorithm must be one the policy allows for that provider
(asymmetric only, pinned, never what the token asks for), the key one of the
provider's published keys for that algorithm, ``aud`` one of the accepted
audiences, ``exp``/``nbf``/``iat`` within the clock skew, the lifetime within
the policy's cap, and the client claim present. Then the policy decides who it
is: a client pinned to that subject, else the client its groups make
(policy/identity.py). A denied subject is nobody.

A refused token gets UNAUTHENTICATED with a short reason a client can act on
("expired" tells it to fetch a new one); the precise reason goes to the log,
by provider id, never with the token or any value from it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jwt

from registry_server.api.auth.jwks import Fetch, FetchError, HttpFetcher, ProviderKeys
from registry_server.policy.clients import Client
from registry_server.policy.identity import IdentityProvider
from registry_server.policy.model import Policy
from registry_server.policy.seen import Sighting

log = logging.getLogger(__name__)

MAX_ACCESS_TOKEN_CHARS = 8_192  # characters of a bearer JWT; checked before any parsing
MAX_VERIFIED_TOKENS = 4_096  # verified tokens remembered until they expire (least recent dropped)
REFUSAL_LOG_EVERY_S = 10.0  # seconds: each refusal reason is logged at most once per window


class TokenRefused(Exception):
    """``answer`` goes to the client; ``reason`` (no token content) to the log."""

    def __init__(self, answer: str, reason: str, provider: str = "-") -> None:
        super().__init__(reason)
        self.answer = answer
        self.reason = reason
        self.provider = provider


INVALID = "invalid access token"


def looks_like_jwt(token: str) -> bool:
    """A compact JWS: three base64url parts (static tokens are never this shape
    unless an operator made them so; those are compared first anyway)."""
    return token.count(".") == 2 and token.startswith("eyJ")


@dataclass(frozen=True)
class _Signed:
    """A token whose signature and claims were checked."""

    provider: IdentityProvider
    kid: str | None
    alg: str
    claims: dict[str, Any]
    key: jwt.PyJWK  # the very key that verified it: a replaced key under the same kid is not it


@dataclass(frozen=True)
class Verified:
    client: Client
    provider: str
    subject: str
    actor: str | None = None  # "<provider>:<act.sub>" for an exchanged token (RFC 8693)
    # The token's verified claims: what the policy's conditions read as caller.claims.
    claims: Mapping[str, Any] = field(default_factory=dict)


class AccessTokens:
    """Verifies IdP access tokens against the policy in force, with one key
    cache per provider (made again when the provider's settings change)."""

    def __init__(
        self,
        fetcher_for: Callable[[IdentityProvider], Fetch] = HttpFetcher,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._fetcher_for = fetcher_for
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[IdentityProvider, ProviderKeys] = {}
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}  # (provider, reason)
        self._verified: OrderedDict[bytes, _Signed] = OrderedDict()  # by the token's sha256

    def keys(self, provider: IdentityProvider) -> ProviderKeys:
        with self._lock:
            keys = self._keys.get(provider)
            if keys is None:
                # A changed provider (a reload) is another key; the old cache goes.
                for old in [p for p in self._keys if p.id == provider.id]:
                    del self._keys[old]
                keys = ProviderKeys(provider, self._fetcher_for(provider))
                self._keys[provider] = keys
            return keys

    def verify(self, policy: Policy, token: str) -> Verified:
        try:
            return self._verify(policy, token)
        except TokenRefused as refused:
            self._log_refusal(refused)
            raise
        except Exception as exc:  # a token must never be an unexpected error: refuse it
            internal = TokenRefused(INVALID, f"rejected (internal: {type(exc).__name__})")
            self._log_refusal(internal)
            raise internal from None

    def _verify(self, policy: Policy, token: str) -> Verified:
        if len(token) > MAX_ACCESS_TOKEN_CHARS:
            raise TokenRefused(INVALID, f"longer than {MAX_ACCESS_TOKEN_CHARS} characters")
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        found = self._recently_verified(policy, digest)
        if found is None:
            found = self._signed_claims(policy, token)
            with self._lock:
                self._verified[digest] = found
                while len(self._verified) > MAX_VERIFIED_TOKENS:
                    self._verified.popitem(last=False)
        return self._who(policy, found.provider, found.claims)

    def _recently_verified(self, policy: Policy, digest: bytes) -> _Signed | None:
        """A token whose signature and claims were checked before, while it
        has not expired, its provider's settings are the same and its key is
        still published: the signature need not be checked again (about
        0.2 ms each). Who it is, and whether denied, is decided anew."""
        with self._lock:
            found = self._verified.get(digest)
            if found is not None:
                self._verified.move_to_end(digest)
        if found is None:
            return None
        still = (
            self._clock() < found.claims["exp"]
            and policy.provider_for_issuer(found.provider.issuer) == found.provider
            and self.keys(found.provider).key_for(found.kid, found.alg) is found.key
        )
        if not still:
            with self._lock:
                self._verified.pop(digest, None)
            return None
        return found

    def _signed_claims(self, policy: Policy, token: str) -> _Signed:
        try:
            header = jwt.get_unverified_header(token)
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError:
            raise TokenRefused(INVALID, "not a well-formed JWT") from None
        issuer = unverified.get("iss")
        provider = policy.provider_for_issuer(issuer) if isinstance(issuer, str) else None
        if provider is None:
            raise TokenRefused(INVALID, "issued by no identity provider the policy names")
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in provider.algorithms:
            raise TokenRefused(INVALID, "algorithm not allowed for this provider", provider.id)
        typ = header.get("typ")
        if typ is not None and (not isinstance(typ, str) or typ.lower() not in _ACCESS_TYPES):
            # An ID token or a logout token is not an access token (RFC 9068, section 4).
            raise TokenRefused(INVALID, "not an access token (typ)", provider.id)
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise TokenRefused(INVALID, "kid is not a string", provider.id)
        try:
            key = self.keys(provider).key_for(kid, alg)
        except FetchError as exc:  # the provider's TLS settings do not load
            raise TokenRefused(INVALID, f"keys unavailable ({exc})", provider.id) from None
        if key is None:
            raise TokenRefused(INVALID, "no known key for this token's kid", provider.id)
        claims = self._checked_claims(token, key, alg, provider)
        return _Signed(provider, kid, alg, claims, key)

    def _who(self, policy: Policy, provider: IdentityProvider, claims: dict[str, Any]) -> Verified:
        """The client a verified token's claims make under the policy now."""
        subject = provider.subject_of(claims)
        if subject is None:
            raise TokenRefused(INVALID, f"claim {provider.client_claim} missing", provider.id)
        if subject in provider.denied_subjects:
            raise TokenRefused(INVALID, "subject is denied by the policy", provider.id)
        actor = _actor(claims, provider)
        pinned = policy.client_by_idp(provider.id, subject)
        if pinned is not None:
            return Verified(pinned, provider.id, subject, actor, claims)
        groups = provider.groups_of(claims)
        client = provider.client_for(subject, groups)
        if client is None:
            raise TokenRefused(INVALID, "subject is not a usable client id", provider.id)
        seen = Sighting(provider.id, subject, groups, claims["iat"], claims["exp"])
        # Stored only when the policy maps it to a role: nothing else reaches the store.
        policy.seen.saw(client.id, seen, remember=bool(client.roles))
        return Verified(client, provider.id, subject, actor, claims)

    def _checked_claims(
        self, token: str, key: jwt.PyJWK, alg: str, provider: IdentityProvider
    ) -> dict[str, Any]:
        try:
            claims: dict[str, Any] = jwt.decode(
                token, key, algorithms=[alg], audience=list(provider.audiences),
                issuer=provider.issuer, leeway=provider.clock_skew_s,
                options={"require": ["exp", "iat", "iss", "aud"], "verify_iat": True},
            )  # fmt: skip
        except jwt.ExpiredSignatureError:
            raise TokenRefused("access token expired", "expired", provider.id) from None
        except jwt.ImmatureSignatureError:
            raise TokenRefused(INVALID, "not yet valid (nbf or iat ahead)", provider.id) from None
        except jwt.InvalidAudienceError:
            raise TokenRefused(INVALID, "audience not accepted", provider.id) from None
        except jwt.InvalidIssuerError:
            raise TokenRefused(INVALID, "issuer mismatch", provider.id) from None
        except jwt.MissingRequiredClaimError as exc:
            raise TokenRefused(INVALID, f"claim {exc.claim} missing", provider.id) from None
        except jwt.InvalidSignatureError:
            raise TokenRefused(INVALID, "bad signature", provider.id) from None
        except jwt.PyJWTError as exc:
            raise TokenRefused(INVALID, f"rejected ({type(exc).__name__})", provider.id) from None
        for name in ("exp", "iat", "nbf"):
            value = claims.get(name)
            if name in claims and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise TokenRefused(INVALID, f"claim {name} is not a number", provider.id)
        if claims["exp"] - claims["iat"] > provider.max_token_lifetime_s:
            raise TokenRefused(INVALID, "lifetime above the policy's cap", provider.id)
        if any(name in claims for name in ID_TOKEN_CLAIMS):
            # An ID token for a client whose id is also an accepted audience.
            raise TokenRefused(INVALID, "an ID token, not an access token", provider.id)
        return claims

    def _log_refusal(self, refused: TokenRefused) -> None:
        """At most one line per provider and reason per window, with how many
        were refused since: a flood of bad tokens is not a flood of lines."""
        now = self._clock()
        key = (refused.provider, refused.reason)
        with self._lock:
            since, count = self._logged.get(key, (0.0, 0))
            if now - since < REFUSAL_LOG_EVERY_S:
                self._logged[key] = (since, count + 1)
                return
            self._logged[key] = (now, 0)
            if len(self._logged) > 1_000:
                self._logged = {k: v for k, v in self._logged.items() if now - v[0] < 60}
        more = f" (and {count} more in the last {REFUSAL_LOG_EVERY_S:.0f} s)" if count else ""
        log.info("access token refused: provider %s: %s%s", refused.provider, refused.reason, more)

    def close(self) -> None:
        with self._lock:
            for keys in self._keys.values():
                close = getattr(keys.fetch, "close", None)
                if close is not None:
                    close()
            self._keys.clear()


def _actor(claims: dict[str, Any], provider: IdentityProvider) -> str | None:
    """Who acts for the subject (RFC 8693's act claim: a token exchanged by a
    bridge). Only an actor the policy names for this provider may: a token
    exchanged by anyone else is nobody (fail closed)."""
    act = claims.get("act")
    if act is None:
        return None
    sub = act.get("sub") if isinstance(act, dict) else None
    if not isinstance(sub, str) or sub not in provider.actors:
        raise TokenRefused(INVALID, "acted for by a party the policy does not name", provider.id)
    return f"{provider.id}:{sub}"


# Claims only ID tokens carry (OpenID Connect Core 1.0, section 2): never an access token's.
ID_TOKEN_CLAIMS = ("nonce", "at_hash", "c_hash")
_ACCESS_TYPES = frozenset({"at+jwt", "application/at+jwt", "jwt"})

__all__ = ["AccessTokens", "FetchError", "TokenRefused", "Verified", "looks_like_jwt"]
