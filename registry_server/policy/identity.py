"""Who a caller is when its identity provider says so (docs/how-to/identity.md).

The policy names the identity providers (IdPs) it trusts: for each, its
issuer, the audiences it accepts, the algorithms it allows, and how a
verified token's claims become a policy client. An IdP is trusted for *who*
a caller is, never for what toolreg's policy grants: the grants are the
policy's own, keyed by the groups the token carries.

A token's subject becomes a client in one of two ways:

* **pinned**: a policy client names the provider and subject
  (``clients[].idp``); the token is then that client, exactly as its static
  token would be (its id, roles, grants, quotas);
* **by groups**: any other subject becomes the client ``<prefix><subject>``
  with what the provider's ``groups`` mappings give its groups (the union of
  roles, the highest execute level; the first mapping in file order that sets
  a register grant or a quota gives it). A subject none of whose groups is
  mapped has no role here.

Clients made from groups are known once a server has seen their token:
``SeenIdentities`` (policy/seen.py) keeps the subject and groups of the
latest verified token of each (bounded), and, on a server with a store,
remembers those the policy maps to a role there, so a restarted server and
every server on the same database know them too. Lookups by client id
(quotas, the grant of a tool's owner) see the same client as the call did;
roles are never remembered, only groups: each lookup derives them from the
mappings in force, a client whose groups map to no role is nobody, and a
denied subject is nobody from then on.
This is pure logic: verifying tokens and fetching keys is ``api.auth``'s.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from registry_server.domain.models import SafetyLevel
from registry_server.policy.clients import ID_PATTERN, Client, Quota, RegisterGrant, Role
from registry_server.policy.webhooks import is_loopback

# Asymmetric JWS algorithms only: with HS*, whoever holds the verification
# key (it is public, in the JWKS) could sign; "none" signs nothing.
ASYMMETRIC_ALGORITHMS = (
    "RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA",
)  # fmt: skip
DEFAULT_ALGORITHMS = ("RS256", "ES256")  # what Keycloak, Entra, Okta and Auth0 sign with
MAX_PROVIDERS = 8  # identity providers one policy may trust
MAX_AUDIENCES = 8  # audiences accepted per provider
MAX_GROUP_MAPPINGS = 256  # group mappings per provider
MAX_DENIED_SUBJECTS = 10_000  # subjects revoked per provider
MAX_SUBJECT_CLAIM_CHARS = 255  # characters of a subject (claim value) the policy may name
DEFAULT_CLOCK_SKEW_S = 30  # seconds of clock difference tolerated on exp, nbf and iat
MAX_CLOCK_SKEW_S = 300  # seconds
DEFAULT_MAX_TOKEN_LIFETIME_S = 86_400  # seconds from iat to exp an access token may span
MAX_TOKEN_LIFETIME_S = 7 * 86_400  # seconds
DEFAULT_JWKS_REFRESH_S = 300  # seconds between refreshes of a provider's keys while in use
DEFAULT_MIN_REFRESH_INTERVAL_S = 30  # seconds: at most one fetch per interval, however many kids
SUBJECT_DIGEST_HEX = 24  # hex digits (96 bits) of a subject's sha256 in a hashed client id
SUBJECT_IDS = ("verbatim", "sha256")
MAX_URL_CHARS = 2_048  # characters of an issuer or JWKS URL
CLAIM_PATH = r"^[A-Za-z_][A-Za-z0-9_:/.-]{0,127}$"  # a claim name, dots for nesting
PROVIDER_ID = r"^[a-z0-9][a-z0-9_-]{0,31}$"


def check_provider_url(value: str, what: str, allow_http_loopback: bool) -> str:
    """An https URL with a host, no credentials, query or fragment; plain
    http only to a loopback host, and only when the policy says so (tests,
    local development): keys fetched in the clear could be anyone's."""
    if len(value) > MAX_URL_CHARS or any(c.isspace() or ord(c) < 0x20 for c in value):
        raise ValueError(f"{what}: at most {MAX_URL_CHARS} characters, no whitespace")
    try:
        parts = urlsplit(value)
        host, _port = parts.hostname, parts.port  # port raises on a bad one
    except ValueError as exc:
        raise ValueError(f"{what}: not a valid URL ({exc})") from None
    if parts.scheme not in ("https", "http") or not host:
        raise ValueError(f"{what}: must be an https:// URL with a host")
    if parts.scheme == "http" and not (allow_http_loopback and is_loopback(host)):
        raise ValueError(
            f"{what}: must use https (plain http only to a loopback host,"
            " with allow_http_loopback: true)"
        )
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise ValueError(f"{what}: must not carry a user, password, query or fragment")
    return value


@dataclass(frozen=True)
class GroupGrant:
    """What members of one group of the provider are, in this policy."""

    group: str
    roles: frozenset[Role] = frozenset()
    max_safety_level: SafetyLevel | None = None  # for execute; None: the client default (safe)
    register: RegisterGrant | None = None
    quota: Quota | None = None
    # approval-rule groups a member is in, when it is also one of the policy's approvers
    approver_groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class IdentityProvider:
    id: str
    issuer: str  # exactly as the tokens' iss and the discovery document say it
    audiences: tuple[str, ...]  # a token's aud must name one of them
    algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS
    clock_skew_s: int = DEFAULT_CLOCK_SKEW_S
    max_token_lifetime_s: int = DEFAULT_MAX_TOKEN_LIFETIME_S
    client_claim: str = "sub"  # the claim whose value names the client
    groups_claim: str | None = "groups"  # dotted path (realm_access.roles); None: no groups
    client_id_prefix: str = ""  # prefix of group-mapped client ids ("<id>." unless set)
    # "verbatim": the id is prefix + subject, refused when that is not a valid id;
    # "sha256": prefix + 24 hex digits of the subject's sha256 (mixed-case subjects, as Okta's)
    subject_ids: str = "verbatim"
    groups: tuple[GroupGrant, ...] = ()
    denied_subjects: frozenset[str] = frozenset()
    # act.sub values (RFC 8693) that may act for subjects: the bridges that exchange tokens
    actors: frozenset[str] = frozenset()
    jwks_uri: str | None = None  # None: from OIDC discovery at the issuer
    ca_file: str | None = None  # PEM CAs for the provider's TLS, instead of the system's
    allow_http_loopback: bool = False  # plain http to 127.0.0.1: tests and local development
    jwks_refresh_s: int = DEFAULT_JWKS_REFRESH_S
    min_refresh_interval_s: int = DEFAULT_MIN_REFRESH_INTERVAL_S
    where: str = ""  # "policy.yaml line 40: identity_providers[0]", for messages

    def subject_of(self, claims: Mapping[str, Any]) -> str | None:
        value = claims.get(self.client_claim)
        if not isinstance(value, str) or not value or len(value) > MAX_SUBJECT_CLAIM_CHARS:
            return None
        return value

    def groups_of(self, claims: Mapping[str, Any]) -> frozenset[str]:
        """The token's groups: a list of strings, or one space-separated
        string (as a scope is); anything else, none. Entries that are not
        strings are ignored, never an error: the groups only ever grant."""
        if self.groups_claim is None:
            return frozenset()
        value: Any = claims
        for part in self.groups_claim.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if isinstance(value, str):
            return frozenset(value.split())
        if isinstance(value, list):
            return frozenset(v for v in value[: MAX_GROUP_MAPPINGS * 4] if isinstance(v, str))
        return frozenset()

    def client_id(self, subject: str) -> str | None:
        """The id of the group-mapped client of ``subject``; None when it
        would not be a valid client id (then the token is nobody)."""
        if self.subject_ids == "sha256":
            digest = hashlib.sha256(subject.encode("utf-8", "surrogatepass")).hexdigest()
            return self.client_id_prefix + digest[:SUBJECT_DIGEST_HEX]
        candidate = self.client_id_prefix + subject
        return candidate if re.fullmatch(ID_PATTERN, candidate) else None

    def client_for(self, subject: str, groups: frozenset[str]) -> Client | None:
        """The client a subject with these groups is; None when its id is
        not a valid client id."""
        client_id = self.client_id(subject)
        if client_id is None:
            return None
        mapped = [g for g in self.groups if g.group in groups]
        levels = [g.max_safety_level for g in mapped if g.max_safety_level is not None]
        register = next((g.register for g in mapped if g.register is not None), None)
        quota = next((g.quota for g in mapped if g.quota is not None), None)
        return Client(
            id=client_id,
            roles=frozenset(r for g in mapped for r in g.roles),
            max_safety_level=max(levels, key=_rank) if levels else SafetyLevel.SAFE,
            register=register if register is not None else RegisterGrant(),
            quota=quota if quota is not None else Quota(),
        )

    def approver_groups_of(self, groups: frozenset[str]) -> tuple[str, ...]:
        """The approval-rule groups these IdP groups give (in file order)."""
        given = (a for g in self.groups if g.group in groups for a in g.approver_groups)
        return tuple(dict.fromkeys(given))


def _rank(level: SafetyLevel) -> int:
    return list(SafetyLevel).index(level)
