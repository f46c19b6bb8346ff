"""The policy file's input form: strict pydantic models (unknown keys
forbidden) that check each field on its own; ``loader`` cross-checks the whole."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from registry_server.domain.egress import SECRET_NAME_PATTERN
from registry_server.domain.models import (
    CATEGORY_PATTERN,
    MAX_CPU_MILLIS,
    MAX_MEMORY_MB,
    MAX_OUTPUT_BYTES,
    MAX_PIDS,
    MAX_TIMEOUT_MS,
    NAME_PATTERN,
    SafetyLevel,
)
from registry_server.policy.clients import (
    DEFAULT_REGISTER_IMAGES,
    DEFAULT_REGISTER_LEVEL,
    ID_PATTERN,
    MAX_QUOTA_BURST,
    MAX_QUOTA_COUNT,
    MAX_QUOTA_RATE,
    MAX_QUOTA_SERVERS,
    Role,
)
from registry_server.policy.conditions import (
    POLICY_COST_LIMIT,
    ConditionError,
    Scope,
    compile_condition,
    total_cost,
)
from registry_server.policy.identity import (
    ASYMMETRIC_ALGORITHMS,
    CLAIM_PATH,
    DEFAULT_ALGORITHMS,
    DEFAULT_CLOCK_SKEW_S,
    DEFAULT_JWKS_REFRESH_S,
    DEFAULT_MAX_TOKEN_LIFETIME_S,
    DEFAULT_MIN_REFRESH_INTERVAL_S,
    MAX_AUDIENCES,
    MAX_CLOCK_SKEW_S,
    MAX_DENIED_SUBJECTS,
    MAX_GROUP_MAPPINGS,
    MAX_PROVIDERS,
    MAX_SUBJECT_CLAIM_CHARS,
    MAX_TOKEN_LIFETIME_S,
    PROVIDER_ID,
    SUBJECT_IDS,
    check_provider_url,
)
from registry_server.policy.model import (
    DEFAULT_APPROVAL_REQUEST_TTL_S,
    DEFAULT_EGRESS_LEVELS,
    DEFAULT_MAX_EGRESS_BYTES,
    DEFAULT_MAX_EGRESS_CONNECTIONS,
    DEFAULT_MAX_TOKEN_TTL_S,
    EMPTY_TOKEN_SHA256,
    GROUP_PATTERN,
    MAX_APPROVAL_REQUEST_TTL_S,
    MAX_AUDIENCE_CHARS,
    MAX_EGRESS_BYTES,
    MAX_EGRESS_CONNECTIONS,
    MAX_GRANT_ENTRIES,
    MAX_IMAGE_PATTERN_CHARS,
    MAX_IMAGE_PATTERNS,
    MAX_SUBJECT_CHARS,
    MAX_TMPFS_MB,
    MAX_TOKEN_TTL_S,
    SHA256_HEX_PATTERN,
)
from registry_server.policy.webhooks import MAX_WEBHOOKS, _WebhookIn, check_url
from registry_server.signing import passkeys
from registry_server.signing.keys import public_key_from_text
from sandbox_runner.egress import rules


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _check_pattern(value: str, pattern: str, what: str) -> str:
    # fullmatch: with re.match, "$" would also accept a trailing newline.
    if not re.fullmatch(pattern, value):
        raise ValueError(f"{value!r} is not a valid {what} (must match {pattern})")
    return value


def _check_unique(values: Sequence[str], what: str) -> None:
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"repeats {what} {', '.join(repr(v) for v in repeated)}")


def _check_roles(values: list[str]) -> list[str]:
    known = {r.value for r in Role}
    for role in values:
        if role not in known:
            raise ValueError(f"unknown role {role!r}; use {', '.join(r.value for r in Role)}")
    _check_unique(values, "role")
    return values


def _check_groups(values: list[str]) -> list[str]:
    for group in values:
        _check_pattern(group, GROUP_PATTERN, "group name")
    _check_unique(values, "group")
    return values


MAX_PASSKEYS_PER_APPROVER = 16


class _PasskeyIn(_Strict):
    """One WebAuthn credential of an approver: what the console's enrolment prints."""

    id: str  # the credential id, base64url
    public_key: str  # the COSE_Key, base64url

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        return passkeys.canonical_credential_id(value)  # raises ValueError with the reason

    @field_validator("public_key")
    @classmethod
    def _key(cls, value: str) -> str:
        passkeys.public_key_from_text(value)
        return value


class _WebAuthnIn(_Strict):
    """The relying party passkey approvals are made for, and where."""

    rp_id: str
    origins: list[str] = Field(min_length=1, max_length=passkeys.MAX_ORIGINS)

    @field_validator("rp_id")
    @classmethod
    def _rp_id(cls, value: str) -> str:
        return passkeys.check_rp_id(value)

    @model_validator(mode="after")
    def _origins(self) -> _WebAuthnIn:
        for origin in self.origins:
            passkeys.check_origin(origin, self.rp_id)
        _check_unique(self.origins, "origin")
        return self


class _ApproverIn(_Strict):
    id: str
    public_key: str | None = None  # Ed25519; an approver has it, passkeys, or both
    groups: list[str] = Field(default_factory=list)
    passkeys: list[_PasskeyIn] = Field(default_factory=list, max_length=MAX_PASSKEYS_PER_APPROVER)

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        return _check_pattern(value, ID_PATTERN, "approver id")

    @field_validator("public_key")
    @classmethod
    def _key(cls, value: str | None) -> str | None:
        if value is not None:
            public_key_from_text(value)  # raises ValueError with the reason
        return value

    @model_validator(mode="after")
    def _some_key(self) -> _ApproverIn:
        if self.public_key is None and not self.passkeys:
            raise ValueError("an approver needs a public_key, passkeys, or both")
        return self

    @field_validator("groups")
    @classmethod
    def _groups(cls, value: list[str]) -> list[str]:
        return _check_groups(value)


class _DenyMatchIn(_Strict):
    """What a deny rule matches: one of tool, category or level (any level)."""

    tool: str | None = None
    category: str | None = None
    level: str | None = None
    _HINT: ClassVar[str] = " (leave match out for every tool)"

    @field_validator("tool")
    @classmethod
    def _tool(cls, value: str | None) -> str | None:
        return None if value is None else _check_pattern(value, NAME_PATTERN, "tool name")

    @field_validator("category")
    @classmethod
    def _category(cls, value: str | None) -> str | None:
        return None if value is None else _check_pattern(value, CATEGORY_PATTERN, "category")

    @field_validator("level")
    @classmethod
    def _level(cls, value: str | None) -> str | None:
        return None if value is None else SafetyLevel.parse(value).value

    @model_validator(mode="after")
    def _exactly_one(self) -> Self:
        given = [n for n in ("tool", "category", "level") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "must name exactly one of tool, category or level"
                + self._HINT
                + (f" (found {', '.join(given)})" if given else "")
            )
        return self


class _MatchIn(_DenyMatchIn):
    """What an approval rule matches: the same, and only the dangerous level."""

    _HINT: ClassVar[str] = ""

    @field_validator("level")
    @classmethod
    def _level(cls, value: str | None) -> str | None:
        if value is None:
            return None
        level = SafetyLevel.parse(value)
        if level is not SafetyLevel.DANGEROUS:
            # Only dangerous tools are gated by approvals; a rule that can
            # never apply would give a false sense of protection.
            raise ValueError(
                f"only dangerous tools need approvals; a rule for level {level.value!r}"
                " would never apply"
            )
        return SafetyLevel.DANGEROUS.value


RULE_NAME_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
MAX_DENY_RULES = 256  # deny rules in one policy
MAX_APPROVAL_RULES = 256  # approval rules in one policy
MAX_DENY_REASON_CHARS = 300  # characters of a deny rule's reason (the caller is told it)


def _check_condition(value: str | None) -> str | None:
    """Compiled and type-checked now, so the error names the file, the line and
    the rule (loader.py compiles it again, from the cache, into the policy)."""
    if value is None:
        return None
    try:
        compile_condition(value, Scope.POLICY)
    except ConditionError as exc:
        raise ValueError(f"CEL: {exc}") from None
    return value


class _RuleIn(_Strict):
    name: str | None = None
    match: _MatchIn
    when: str | None = None  # CEL: the rule applies only when it holds (all `when`s: a cost cap)
    approvals_required: int = Field(ge=1)
    groups: list[str] = Field(default_factory=list)
    max_token_ttl_s: int = Field(DEFAULT_MAX_TOKEN_TTL_S, ge=1, le=MAX_TOKEN_TTL_S)

    @field_validator("groups")
    @classmethod
    def _groups(cls, value: list[str]) -> list[str]:
        return _check_groups(value)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return None if value is None else _check_pattern(value, RULE_NAME_PATTERN, "rule name")

    @field_validator("when")
    @classmethod
    def _when(cls, value: str | None) -> str | None:
        return _check_condition(value)


class _DenyRuleIn(_Strict):
    name: str
    match: _DenyMatchIn | None = None  # None: every tool
    when: str | None = None  # None: every call the match covers (all `when`s: a cost cap)
    reason: str

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _check_pattern(value, RULE_NAME_PATTERN, "rule name")

    @field_validator("when")
    @classmethod
    def _when(cls, value: str | None) -> str | None:
        return _check_condition(value)

    @field_validator("reason")
    @classmethod
    def _reason(cls, value: str) -> str:
        if not value.strip() or len(value) > MAX_DENY_REASON_CHARS:
            raise ValueError(f"must be 1 to {MAX_DENY_REASON_CHARS} characters")
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError("must not contain control characters")
        return value

    @model_validator(mode="after")
    def _not_everything(self) -> _DenyRuleIn:
        if self.match is None and self.when is None:
            raise ValueError("a deny rule with neither match nor when would refuse every call")
        return self


class _CeilingIn(_Strict):
    """Fields left out keep the built-in profile of the level."""

    memory_mb: int | None = Field(None, ge=1, le=MAX_MEMORY_MB)
    cpu_millis: int | None = Field(None, ge=1, le=MAX_CPU_MILLIS)
    pids: int | None = Field(None, ge=1, le=MAX_PIDS)
    timeout_ms: int | None = Field(None, ge=1, le=MAX_TIMEOUT_MS)
    output_bytes: int | None = Field(None, ge=1, le=MAX_OUTPUT_BYTES)
    tmpfs_mb: int | None = Field(None, ge=1, le=MAX_TMPFS_MB)


class _ProfilesIn(_Strict):
    safe: _CeilingIn | None = None
    cautious: _CeilingIn | None = None
    dangerous: _CeilingIn | None = None


class _RegisterIn(_Strict):
    """What a client with the register role may register."""

    max_safety_level: str = DEFAULT_REGISTER_LEVEL
    images: list[str] = Field(
        default_factory=lambda: list(DEFAULT_REGISTER_IMAGES), max_length=MAX_IMAGE_PATTERNS
    )
    # host:port patterns its tools may reach, and the secrets they may use
    egress: list[str] = Field(default_factory=list, max_length=MAX_GRANT_ENTRIES)
    secrets: list[str] = Field(default_factory=list, max_length=MAX_GRANT_ENTRIES)

    @field_validator("egress")
    @classmethod
    def _egress(cls, value: list[str]) -> list[str]:
        return [str(rules.parse_entry(text)) for text in value]

    @field_validator("secrets")
    @classmethod
    def _secrets(cls, value: list[str]) -> list[str]:
        for name in value:
            _check_pattern(name, SECRET_NAME_PATTERN, "secret name")
        return value

    @field_validator("max_safety_level")
    @classmethod
    def _level(cls, value: str) -> str:
        return SafetyLevel.parse(value).value

    @field_validator("images")
    @classmethod
    def _images(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not pattern or len(pattern) > MAX_IMAGE_PATTERN_CHARS:
                raise ValueError(f"image patterns must be 1-{MAX_IMAGE_PATTERN_CHARS} characters")
            if any(c.isspace() for c in pattern):
                raise ValueError(f"image pattern {pattern!r} must not contain whitespace")
        return value


class _QuotaIn(_Strict):
    """A client's share of each server; each field on its own."""

    max_concurrent: int | None = Field(None, ge=1, le=MAX_QUOTA_COUNT)
    max_queued: int | None = Field(None, ge=0, le=MAX_QUOTA_COUNT)
    rate_per_s: float | None = Field(None, gt=0, le=MAX_QUOTA_RATE)
    burst: int | None = Field(None, ge=1, le=MAX_QUOTA_BURST)
    max_pending_approvals: int | None = Field(None, ge=1, le=MAX_QUOTA_COUNT)


class _QuotasIn(_Strict):
    default: _QuotaIn = Field(default_factory=lambda: _QuotaIn())
    servers: int = Field(1, ge=1, le=MAX_QUOTA_SERVERS)


class _IdpSubjectIn(_Strict):
    """A subject of an identity provider (its client claim's value)."""

    provider: str
    subject: str = Field(min_length=1, max_length=MAX_SUBJECT_CLAIM_CHARS)


class _ClientIn(_Strict):
    id: str
    token_sha256: str | None = None
    mtls_subject: str | None = None
    roles: list[str] = Field(default_factory=list)
    max_safety_level: str = SafetyLevel.SAFE.value
    # "register" in the file (the attribute name would shadow BaseModel's own)
    grant: _RegisterIn | None = Field(None, alias="register")
    approver: str | None = None  # the approver id of the same person
    quotas: _QuotaIn | None = None  # its share of each server, over quotas.default
    idp: _IdpSubjectIn | None = None  # an identity provider's subject that is this client

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        return _check_pattern(value, ID_PATTERN, "client id")

    @field_validator("token_sha256")
    @classmethod
    def _token(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not re.fullmatch(SHA256_HEX_PATTERN, value):
            raise ValueError(
                "must be the sha256 of the bearer token as 64 hex digits"
                " (e.g. `printf %s TOKEN | sha256sum`), never the token itself"
            )
        if value.lower() == EMPTY_TOKEN_SHA256:
            raise ValueError("is the sha256 of an empty token")
        return value.lower()

    @field_validator("mtls_subject")
    @classmethod
    def _subject(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip() or value != value.strip():
            raise ValueError("must be a non-empty subject without surrounding spaces")
        if len(value) > MAX_SUBJECT_CHARS:
            raise ValueError(f"at most {MAX_SUBJECT_CHARS} characters")
        return value

    @field_validator("roles")
    @classmethod
    def _roles(cls, value: list[str]) -> list[str]:
        return _check_roles(value)

    @field_validator("max_safety_level")
    @classmethod
    def _level(cls, value: str) -> str:
        return SafetyLevel.parse(value).value

    @model_validator(mode="after")
    def _credential(self) -> _ClientIn:
        if self.token_sha256 is None and self.mtls_subject is None and self.idp is None:
            raise ValueError("needs a credential: token_sha256, mtls_subject and/or idp")
        return self


class _EgressIn(_Strict):
    """Egress for the whole server (each tool's hosts are its owner's grant)."""

    levels: list[str] = Field(
        default_factory=lambda: sorted(lvl.value for lvl in DEFAULT_EGRESS_LEVELS), max_length=3
    )
    allow_private: list[str] = Field(default_factory=list, max_length=MAX_GRANT_ENTRIES)
    max_bytes_per_call: int = Field(DEFAULT_MAX_EGRESS_BYTES, ge=1, le=MAX_EGRESS_BYTES)
    max_connections_per_call: int = Field(
        DEFAULT_MAX_EGRESS_CONNECTIONS, ge=1, le=MAX_EGRESS_CONNECTIONS
    )

    @field_validator("levels")
    @classmethod
    def _levels(cls, value: list[str]) -> list[str]:
        return [SafetyLevel.parse(v).value for v in value]

    @field_validator("allow_private")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for text in value:
            try:
                rules.parse_networks([text])
            except ValueError:
                raise ValueError(f"{text[:64]!r} is not a network in CIDR form") from None
        return value


class _GroupGrantIn(_Strict):
    """What members of one of the provider's groups are here."""

    group: str = Field(min_length=1, max_length=MAX_SUBJECT_CLAIM_CHARS)
    roles: list[str] = Field(default_factory=list)
    max_safety_level: str | None = None
    grant: _RegisterIn | None = Field(None, alias="register")
    quotas: _QuotaIn | None = None
    approver_groups: list[str] = Field(default_factory=list, max_length=MAX_GRANT_ENTRIES)

    @field_validator("roles")
    @classmethod
    def _roles(cls, value: list[str]) -> list[str]:
        return _check_roles(value)

    @field_validator("approver_groups")
    @classmethod
    def _approver_groups(cls, value: list[str]) -> list[str]:
        return _check_groups(value)

    @field_validator("max_safety_level")
    @classmethod
    def _level(cls, value: str | None) -> str | None:
        return None if value is None else SafetyLevel.parse(value).value

    @model_validator(mode="after")
    def _grant_needs_role(self) -> _GroupGrantIn:
        if self.grant is not None and "register" not in self.roles:
            raise ValueError("register is given without the register role")
        return self


class _IdentityProviderIn(_Strict):
    """An OpenID provider whose access tokens name clients (policy/identity.py)."""

    id: str
    issuer: str
    audiences: list[str] = Field(min_length=1, max_length=MAX_AUDIENCES)
    algorithms: list[str] = Field(
        default_factory=lambda: list(DEFAULT_ALGORITHMS), min_length=1, max_length=10
    )
    clock_skew_s: int = Field(DEFAULT_CLOCK_SKEW_S, ge=0, le=MAX_CLOCK_SKEW_S)
    max_token_lifetime_s: int = Field(DEFAULT_MAX_TOKEN_LIFETIME_S, ge=1, le=MAX_TOKEN_LIFETIME_S)
    client_claim: str = "sub"
    groups_claim: str | None = "groups"
    client_id_prefix: str | None = None
    subject_ids: str = "verbatim"
    groups: list[_GroupGrantIn] = Field(default_factory=list, max_length=MAX_GROUP_MAPPINGS)
    denied_subjects: list[str] = Field(default_factory=list, max_length=MAX_DENIED_SUBJECTS)
    actors: list[str] = Field(default_factory=list, max_length=MAX_AUDIENCES)
    jwks_uri: str | None = None
    ca_file: str | None = Field(None, min_length=1, max_length=4096)
    allow_http_loopback: bool = False
    jwks_refresh_s: int = Field(DEFAULT_JWKS_REFRESH_S, ge=10, le=86_400)
    min_refresh_interval_s: int = Field(DEFAULT_MIN_REFRESH_INTERVAL_S, ge=1, le=3_600)

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        return _check_pattern(value, PROVIDER_ID, "identity provider id")

    @field_validator("audiences")
    @classmethod
    def _audiences(cls, value: list[str]) -> list[str]:
        for audience in value:
            if not audience or len(audience) > MAX_AUDIENCE_CHARS or audience != audience.strip():
                raise ValueError(f"each audience is 1 to {MAX_AUDIENCE_CHARS} characters, unpadded")
        _check_unique(value, "audience")
        return value

    @field_validator("algorithms")
    @classmethod
    def _algorithms(cls, value: list[str]) -> list[str]:
        for alg in value:
            if alg not in ASYMMETRIC_ALGORITHMS:
                raise ValueError(
                    f"{alg[:16]!r} is not allowed: only asymmetric algorithms"
                    f" ({', '.join(ASYMMETRIC_ALGORITHMS)}); never none or HS*"
                )
        _check_unique(value, "algorithm")
        return value

    @field_validator("client_claim", "groups_claim")
    @classmethod
    def _claim(cls, value: str | None) -> str | None:
        return None if value is None else _check_pattern(value, CLAIM_PATH, "claim name")

    @field_validator("client_id_prefix")
    @classmethod
    def _prefix(cls, value: str | None) -> str | None:
        # Never empty: group-mapped ids must not be able to take a file client's id.
        if value is not None and (not value or not re.fullmatch(ID_PATTERN, value + "x")):
            raise ValueError(f"{value!r} does not start a valid client id ({ID_PATTERN})")
        return value

    @field_validator("subject_ids")
    @classmethod
    def _subject_ids(cls, value: str) -> str:
        if value not in SUBJECT_IDS:
            raise ValueError(f"must be one of {', '.join(SUBJECT_IDS)}")
        return value

    @field_validator("denied_subjects", "actors")
    @classmethod
    def _denied(cls, value: list[str]) -> list[str]:
        for subject in value:
            if not subject or len(subject) > MAX_SUBJECT_CLAIM_CHARS:
                raise ValueError(f"each subject is 1 to {MAX_SUBJECT_CLAIM_CHARS} characters")
        return value

    @model_validator(mode="after")
    def _urls(self) -> _IdentityProviderIn:
        check_provider_url(self.issuer, "issuer", self.allow_http_loopback)
        if self.jwks_uri is not None:
            check_provider_url(self.jwks_uri, "jwks_uri", self.allow_http_loopback)
        return self


class _PolicyIn(_Strict):
    audience: str
    approval_request_ttl_s: int = Field(
        DEFAULT_APPROVAL_REQUEST_TTL_S, ge=1, le=MAX_APPROVAL_REQUEST_TTL_S
    )
    approvers: list[_ApproverIn] = Field(default_factory=list)
    webauthn: _WebAuthnIn | None = None  # needed when an approver has passkeys
    approval_rules: list[_RuleIn] = Field(default_factory=list, max_length=MAX_APPROVAL_RULES)
    deny_rules: list[_DenyRuleIn] = Field(default_factory=list, max_length=MAX_DENY_RULES)
    profiles: _ProfilesIn = Field(default_factory=lambda: _ProfilesIn())
    clients: list[_ClientIn] = Field(default_factory=list)
    egress: _EgressIn = Field(default_factory=lambda: _EgressIn())
    quotas: _QuotasIn = Field(default_factory=lambda: _QuotasIn())
    webhooks: list[_WebhookIn] = Field(default_factory=list, max_length=MAX_WEBHOOKS)
    console_url: str | None = None  # the approval console's base URL, for links in webhooks
    identity_providers: list[_IdentityProviderIn] = Field(
        default_factory=list, max_length=MAX_PROVIDERS
    )

    @model_validator(mode="after")
    def _conditions_cost(self) -> _PolicyIn:
        # One call may evaluate every deny rule's and approval rule's `when`:
        # their sum is what the policy's conditions can cost a call.
        whens = [r.when for r in self.approval_rules] + [r.when for r in self.deny_rules]
        total = total_cost(compile_condition(w, Scope.POLICY) for w in whens if w is not None)
        if total > POLICY_COST_LIMIT:
            raise ValueError(
                f"the conditions (`when`) of approval_rules and deny_rules may cost up to"
                f" {total:,} units together at worst for one call, over the limit of"
                f" {POLICY_COST_LIMIT:,} (fewer conditions, or cheaper ones: see"
                " docs/how-to/approvals.md, Conditions)"
            )
        return self

    @field_validator("console_url")
    @classmethod
    def _console_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        check_url(value)
        if "?" in value:
            raise ValueError("must not have a ?query (links append #/requests/<id>)")
        return value.rstrip("/")

    @field_validator("audience")
    @classmethod
    def _audience(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        if value != value.strip() or any(c.isspace() for c in value):
            raise ValueError("must not contain whitespace")
        if len(value) > MAX_AUDIENCE_CHARS:
            raise ValueError(f"at most {MAX_AUDIENCE_CHARS} characters")
        return value
