"""The policy as the server reads it: approvers, approval rules, clients and
their roles and register grants, sandbox ceilings. Frozen once loaded
(docs/how-to/deploying.md, docs/how-to/approvals.md)."""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from registry_server.domain.models import OPERATOR_OWNER, SafetyLevel
from registry_server.policy.clients import (
    ID_PATTERN,
    UNRESTRICTED,
    Client,
    Quota,
    RegisterGrant,
    Role,
)
from registry_server.policy.conditions import (
    CallFacts,
    Condition,
    ConditionFailed,
    fields_read,
)
from registry_server.policy.identity import IdentityProvider
from registry_server.policy.seen import SeenIdentities
from registry_server.policy.webhooks import WebhookSpec
from registry_server.signing.keys import public_key_from_text, raw_public_bytes
from registry_server.signing.passkeys import PasskeyCredential, WebAuthnSettings

GROUP_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
SHA256_HEX_PATTERN = r"^[0-9a-fA-F]{64}$"
# sha256 of the empty string: a client with this credential would accept "Bearer ".
EMPTY_TOKEN_SHA256 = hashlib.sha256(b"").hexdigest()

DEFAULT_MAX_TOKEN_TTL_S = 3_600  # seconds: a rule's max_token_ttl_s when it says nothing
MAX_TOKEN_TTL_S = 86_400  # seconds (a day): an approval is for a call about to happen
DEFAULT_APPROVAL_REQUEST_TTL_S = 3_600  # seconds a pending approval request waits
MAX_APPROVAL_REQUEST_TTL_S = 7 * 86_400  # seconds
MAX_AUDIENCE_CHARS = 256  # characters
MAX_SUBJECT_CHARS = 1_024  # characters of an mTLS certificate subject
MAX_TMPFS_MB = 65_536  # MiB of /tmp a profile may allow
MAX_POLICY_BYTES = 1024 * 1024  # bytes; a policy is configuration, not data
MAX_IMAGE_PATTERNS = 64  # image globs per client
MAX_IMAGE_PATTERN_CHARS = 256  # characters of one image glob


class PolicyError(Exception):
    """The policy is unusable. ``problems`` holds one line per broken rule, each
    naming the file and the line or field."""

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems = (problems,) if isinstance(problems, str) else tuple(problems)
        super().__init__("\n".join(self.problems))


# ---------------------------------------------------------------- runtime form


@dataclass(frozen=True)
class Approver:
    id: str
    public_key: Ed25519PublicKey | None = field(repr=False)  # None: passkeys only
    groups: tuple[str, ...] = ()
    passkeys: tuple[PasskeyCredential, ...] = ()  # WebAuthn credentials (signing/passkeys.py)


@dataclass(frozen=True)
class RuleMatch:
    """Exactly one of the three is set."""

    tool: str | None = None
    category: str | None = None
    level: SafetyLevel | None = None

    def matches(self, tool_name: str, categories: Sequence[str], level: SafetyLevel) -> bool:
        return (
            (self.tool is not None and self.tool == tool_name)
            or (self.category is not None and self.category in categories)
            or (self.level is not None and self.level is level)
        )

    def describe(self) -> str:
        if self.tool is not None:
            return f"tool {self.tool}"
        if self.category is not None:
            return f"category {self.category}"
        assert self.level is not None
        return f"level {self.level.value}"


@dataclass(frozen=True)
class ApprovalRule:
    match: RuleMatch
    approvals_required: int
    groups: tuple[str, ...] = ()  # empty: any approver
    max_token_ttl_s: int = DEFAULT_MAX_TOKEN_TTL_S
    name: str = ""  # the policy's name for it ("" = "rule N", N its position from 1)
    # Applies only to calls for which this holds (policy/conditions.py); None: every call.
    when: Condition | None = None


@dataclass(frozen=True)
class DenyRule:
    """A call that matches (and for which ``when`` holds) is refused before any
    approval request or sandbox exists, with ``reason``."""

    name: str
    reason: str
    match: RuleMatch | None = None  # None: every tool
    when: Condition | None = None  # None: every matching call

    def describe(self) -> str:
        return self.match.describe() if self.match is not None else "every tool"


@dataclass(frozen=True)
class Denial:
    """Why a deny rule refused a call (the rule's reason, or why its condition
    could not be evaluated: fail closed)."""

    rule: str
    reason: str

    @property
    def message(self) -> str:
        return f"denied by policy rule {self.rule}: {self.reason}"


class RuleNotEvaluable(Exception):
    """An approval rule's condition gave neither true nor false for a call:
    the call is refused (fail closed), naming the rule."""

    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(f"policy rule {rule}: its condition could not be evaluated: {detail}")
        self.rule = rule
        self.detail = detail


@dataclass(frozen=True)
class Requirement:
    """m approvals from approvers in ``groups`` (empty: any approver)."""

    approvals_required: int
    groups: tuple[str, ...]
    source: str  # where it comes from, for messages: "rule 1 (tool write_file)"
    # For people (the approval request shows them), not part of what it demands:
    name: str = field(default="", compare=False)  # "rule 1" when the policy gives none
    match: str = field(default="", compare=False)  # what it matches: "tool write_file"
    condition: str = field(default="", compare=False)  # its `when`, "" when it has none

    def admits(self, approver_groups: Sequence[str]) -> bool:
        return not self.groups or bool(set(self.groups) & set(approver_groups))


@dataclass(frozen=True)
class EffectiveRule:
    """What one tool needs: every matching rule at once (the strictest of all:
    a rule a registrant opted into through a category can add approvals, never
    remove those its name or level requires)."""

    requirements: tuple[Requirement, ...]
    max_token_ttl_s: int  # seconds: the shortest of the matching rules

    @property
    def approvals_required(self) -> int:
        """The fewest distinct approvers that can satisfy every requirement."""
        return max((r.approvals_required for r in self.requirements), default=0)

    @property
    def source(self) -> str:
        return "; ".join(r.source for r in self.requirements) or "no rule"

    def describe(self) -> str:
        """For messages: "2 approval(s) from security (rule 1 ...) and 1 from ops (...)"."""
        parts = [
            f"{r.approvals_required} approval(s) from {', '.join(r.groups) or 'any approver'}"
            for r in self.requirements
        ]
        return " and ".join(parts) or "no approval"

    def missing(self, approvers: Sequence[Approver]) -> int:
        """How many more distinct approvers are needed at least, given these
        (0 when they are enough: more approvers than required never hurt)."""
        shortfalls = (
            r.approvals_required - sum(1 for a in approvers if r.admits(a.groups))
            for r in self.requirements
        )
        return max([0, *shortfalls])


# Never safe: a tool that sends anything anywhere has an effect. Dangerous
# tools with egress run under gVisor (runtime runsc-net,
# sandbox_runner/profiles.py) with its own netstack, or with hostinet where
# that cannot start (unless TOOLREG_GVISOR_HOSTINET=refuse), every other
# dangerous call under runsc without a network; an engine without runsc-net
# refuses them.
DEFAULT_EGRESS_LEVELS = frozenset({SafetyLevel.CAUTIOUS, SafetyLevel.DANGEROUS})
DEFAULT_MAX_EGRESS_BYTES = 16 * 1024 * 1024  # bytes each call may move through the proxy
DEFAULT_MAX_EGRESS_CONNECTIONS = 32  # connections each call may open (refused ones count)
MAX_EGRESS_BYTES = 1024 * 1024 * 1024  # bytes: the highest per-call cap a policy may set
MAX_EGRESS_CONNECTIONS = 1_024  # connections: the highest per-call cap a policy may set
MAX_GRANT_ENTRIES = 64  # egress patterns, secret names or private networks in one list


@dataclass(frozen=True)
class EgressPolicy:
    # A tool that sends anything anywhere has an effect: by default it is at
    # least cautious (logged, tight limits), never safe.
    levels: frozenset[SafetyLevel] = DEFAULT_EGRESS_LEVELS
    # Networks (CIDR) the proxy may connect to although they are private,
    # loopback, link-local or the metadata address: named by the operator only.
    allow_private: tuple[str, ...] = ()
    max_bytes_per_call: int = DEFAULT_MAX_EGRESS_BYTES
    max_connections_per_call: int = DEFAULT_MAX_EGRESS_CONNECTIONS


@dataclass(frozen=True)
class QuotaPolicy:
    default: Quota = field(default_factory=Quota)  # for clients that name none (per field)
    # Servers sharing the load: each enforces 1/servers of every rate and burst
    # (the other limits hold per server: docs/how-to/deploying.md).
    servers: int = 1


@dataclass(frozen=True)
class Policy:
    audience: str
    approval_request_ttl_s: int = DEFAULT_APPROVAL_REQUEST_TTL_S
    approvers: tuple[Approver, ...] = ()
    rules: tuple[ApprovalRule, ...] = ()
    # per level, only the fields the policy sets (the rest keep the built-in profile)
    profiles: Mapping[SafetyLevel, Mapping[str, int]] = field(default_factory=dict)
    clients: tuple[Client, ...] = ()
    egress: EgressPolicy = field(default_factory=EgressPolicy)
    quotas: QuotaPolicy = QuotaPolicy()
    source: str = "policy"  # the file it came from, for messages
    digest: str = ""  # sha256 hex of the file's bytes ("" without a file)
    webhooks: tuple[WebhookSpec, ...] = ()  # where approval events are posted (notify/)
    console_url: str = ""  # the approval console's base URL, without a trailing slash
    identity_providers: tuple[IdentityProvider, ...] = ()  # policy/identity.py
    # The group-mapped clients this server has seen (shared across reloads).
    seen: SeenIdentities = field(default_factory=SeenIdentities, compare=False, repr=False)
    webauthn: WebAuthnSettings | None = None  # the relying party of passkey approvals
    deny_rules: tuple[DenyRule, ...] = ()
    _by_id: Mapping[str, Approver] = field(init=False, repr=False, compare=False)
    _by_credential: Mapping[str, PasskeyCredential] = field(init=False, repr=False, compare=False)
    _requirements: tuple[Requirement, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Built once: the approval path looks approvers up for every token.
        by_id = MappingProxyType({a.id: a for a in self.approvers})
        object.__setattr__(self, "_by_id", by_id)
        credentials = {c.credential_id: c for a in self.approvers for c in a.passkeys}
        object.__setattr__(self, "_by_credential", MappingProxyType(credentials))
        # Each rule's requirement, made once (rule_for runs for every call).
        requirements = tuple(_requirement(n, r) for n, r in enumerate(self.rules, start=1))
        object.__setattr__(self, "_requirements", requirements)

    @functools.cached_property
    def reads(self) -> frozenset[str]:
        """What the policy's conditions read of a call (policy/conditions.py
        VARIABLES): a call's facts are made into CEL values that far only."""
        whens = [r.when for r in self.rules] + [r.when for r in self.deny_rules]
        return frozenset({"args"}).union(*(c.reads for c in whens if c is not None))

    @functools.cached_property
    def arg_fields(self) -> frozenset[str] | None:
        """The top-level arguments the policy's conditions read (None: all)."""
        return fields_read([r.when for r in self.rules] + [r.when for r in self.deny_rules])

    def approver(self, approver_id: str) -> Approver | None:
        """The approver, in its groups of the file and, when it is a
        group-mapped client this server has seen, the approval-rule groups its
        identity provider's groups give it now (never those of a denied subject)."""
        approver = self._by_id.get(approver_id)
        if approver is None or not self.identity_providers:
            return approver
        sighting = self.seen.get(approver_id)
        provider = None if sighting is None else self.identity_provider(sighting.provider)
        if sighting is None or provider is None or sighting.subject in provider.denied_subjects:
            return approver
        if provider.client_id(sighting.subject) != approver_id:
            return approver
        if time.time() >= sighting.expires_at:
            # Approvals are signed offline: the IdP's groups count only while
            # the token that showed them is valid (fail closed to the file's).
            return approver
        extra = provider.approver_groups_of(sighting.groups)
        groups = tuple(dict.fromkeys((*approver.groups, *extra)))
        return approver if groups == approver.groups else replace(approver, groups=groups)

    def client(self, client_id: str) -> Client | None:
        """A client of the file, else a group-mapped client of an identity
        provider that this server has seen, or that the store remembers (as
        its provider's mappings make it now; nobody once its subject is
        denied, its provider gone, or its groups map to no role)."""
        static = next((c for c in self.clients if c.id == client_id), None)
        if static is not None or not self.identity_providers:
            return static
        sighting = self.seen.get(client_id)
        provider = None if sighting is None else self.identity_provider(sighting.provider)
        if sighting is None or provider is None or sighting.subject in provider.denied_subjects:
            return None
        client = provider.client_for(sighting.subject, sighting.groups)
        if client is None or client.id != client_id or not client.roles:
            # Groups that map to nothing now: nobody here (its tools are not served).
            return None
        return client

    def identity_provider(self, provider_id: str) -> IdentityProvider | None:
        return next((p for p in self.identity_providers if p.id == provider_id), None)

    def provider_for_issuer(self, issuer: str) -> IdentityProvider | None:
        return next((p for p in self.identity_providers if p.issuer == issuer), None)

    def client_by_idp(self, provider_id: str, subject: str) -> Client | None:
        """The policy client pinned to this provider's subject, if any."""
        wanted = (provider_id, subject)
        return next((c for c in self.clients if c.idp_subject == wanted), None)

    def same_person(self, approver_id: str, client_id: str) -> bool:
        """An approver never approves a call of their own: same id, or the
        client the policy links to them (``clients[].approver``), or the
        identity provider subject a client is pinned to."""
        if approver_id == client_id:
            return True
        client = self.client(client_id)
        if client is None:
            return False
        if client.approver == approver_id:
            return True
        # A client pinned to an IdP subject is that subject's person, whose
        # group-mapped id (and so approver id) is the provider's prefix + subject.
        if client.idp_subject is not None:
            provider = self.identity_provider(client.idp_subject[0])
            return provider is not None and provider.client_id(client.idp_subject[1]) == approver_id
        return False

    def quota_for(self, client_id: str) -> Quota:
        """The client's own quota over the policy's default."""
        client = self.client(client_id)
        own = client.quota if client is not None else Quota()
        return own.over(self.quotas.default)

    @functools.cached_property
    def shared(self) -> bool:
        """Whether several clients may execute: then each gets a share by
        default, so one of them can never take the whole server."""
        return sum(1 for c in self.clients if Role.EXECUTE in c.roles) > 1

    def approver_identity(self, client: Client) -> str | None:
        """The approver a client is: the one it names (``approver:``), else
        the approver of the same id, else none."""
        if client.approver is not None:
            return client.approver
        return client.id if client.id in self._by_id else None

    def approver_keys(self) -> Mapping[str, Ed25519PublicKey]:
        return MappingProxyType(
            {a.id: a.public_key for a in self.approvers if a.public_key is not None}
        )

    def passkey_credentials(self) -> Mapping[str, PasskeyCredential]:
        """Every approver's passkeys, by credential id (canonical base64url)."""
        return self._by_credential

    def rule_for(
        self, *, tool_name: str, categories: Sequence[str], level: SafetyLevel,
        facts: CallFacts | None = None, refuse_on_error: bool = False,
    ) -> EffectiveRule:  # fmt: skip
        """Every rule that matches the tool (by name, by any of its categories,
        by level) and whose ``when`` holds for the call applies at once; with
        none, a dangerous tool needs one approval from any approver. Only
        dangerous tools are gated by approvals (the executor decides).

        A condition that cannot be evaluated, or that has no call to read
        (``facts`` None), counts as holding: the strictest reading. With
        ``refuse_on_error`` (a call about to be decided) such a condition
        raises RuleNotEvaluable instead, and the call is refused."""
        if level is not SafetyLevel.DANGEROUS:
            return EffectiveRule((), DEFAULT_MAX_TOKEN_TTL_S)
        matched: list[tuple[Requirement, ApprovalRule]] = []
        for requirement, rule in zip(self._requirements, self.rules, strict=True):
            if not rule.match.matches(tool_name, categories, level):
                continue
            if rule.when is not None and facts is not None:
                try:
                    if not rule.when.holds(facts):
                        continue
                except ConditionFailed as failed:
                    if refuse_on_error:
                        raise RuleNotEvaluable(requirement.name, failed.detail) from None
            matched.append((requirement, rule))
        if not matched:
            return _DEFAULT_RULE
        return EffectiveRule(
            tuple(requirement for requirement, _ in matched),
            min(r.max_token_ttl_s for _, r in matched),
        )

    def denial_for(
        self, *, tool_name: str, categories: Sequence[str], level: SafetyLevel, facts: CallFacts
    ) -> Denial | None:
        """The first deny rule (in file order) that matches the call, or None.
        A condition that cannot be evaluated denies (fail closed)."""
        for n, rule in enumerate(self.deny_rules, start=1):
            name = rule.name or f"deny rule {n}"
            if rule.match is not None and not rule.match.matches(tool_name, categories, level):
                continue
            if rule.when is None:
                return Denial(name, rule.reason)
            try:
                if rule.when.holds(facts):
                    return Denial(name, rule.reason)
            except ConditionFailed as failed:
                return Denial(
                    name, f"{rule.reason} (its condition could not be evaluated: {failed.detail})"
                )
        return None

    def eligible(self, approver_id: str, rule: EffectiveRule) -> bool:
        """Whether this approver counts towards at least one requirement."""
        approver = self.approver(approver_id)
        return approver is not None and any(r.admits(approver.groups) for r in rule.requirements)

    def client_by_token(self, token: str) -> Client | None:
        """The client whose token_sha256 is sha256(token). Every client is
        compared, in constant time, so timing reveals neither which nor whether."""
        if not token:
            return None
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest().encode()
        found: Client | None = None
        for client in self.clients:
            if client.token_sha256 is not None and hmac.compare_digest(
                digest, client.token_sha256.encode()
            ):
                found = client
        return found

    def client_by_subject(self, subject: str) -> Client | None:
        if not subject:
            return None
        for client in self.clients:
            if client.mtls_subject is not None and client.mtls_subject == subject:
                return client
        return None

    def grant_of(self, owner: str) -> RegisterGrant | None:
        """What the owner of a stored tool may grant now: the operator
        everything, a client what its register grant says (admins
        everything), anyone the policy no longer names nothing."""
        if owner == OPERATOR_OWNER:
            return UNRESTRICTED
        client = self.client(owner)
        if client is None or not client.roles & {Role.REGISTER, Role.ADMIN}:
            return None
        return client.register

    def ceiling(self, level: SafetyLevel) -> dict[str, int] | None:
        """The limits the policy sets for ``level`` (only those fields), or None."""
        fields = self.profiles.get(level)
        return None if fields is None else dict(fields)


_DEFAULT_RULE = EffectiveRule(
    (Requirement(1, (), "default for dangerous tools", "default", "default for dangerous tools"),),
    DEFAULT_MAX_TOKEN_TTL_S,
)  # no rule of the policy matches a dangerous tool: one approval from anyone


def _requirement(n: int, rule: ApprovalRule) -> Requirement:
    name = rule.name or f"rule {n}"
    condition = "" if rule.when is None else rule.when.text
    return Requirement(
        rule.approvals_required, rule.groups, _source(name, rule), name, rule.match.describe(),
        condition,
    )  # fmt: skip


def _source(name: str, rule: ApprovalRule) -> str:
    """For messages: 'rule sre-prod (tool deploy, when args.env == "prod")'."""
    when = "" if rule.when is None else f", when {rule.when.text}"
    return f"{name} ({rule.match.describe()}{when})"


def development_policy(*, audience: str, approvers: Mapping[str, str | Ed25519PublicKey]) -> Policy:
    """Development mode (no policy file): the approvers are the keys that
    `toolreg keys generate --install` put in the data directory, with no groups;
    the default rules apply; there are no clients (the server lets every local
    caller in). Raises PolicyError naming a bad id or key."""
    problems: list[str] = []
    built: list[Approver] = []
    seen_keys: dict[bytes, str] = {}
    for approver_id, key in approvers.items():
        if not re.fullmatch(ID_PATTERN, approver_id):
            problems.append(f"approver {approver_id!r}: id must match {ID_PATTERN}")
            continue
        try:
            public_key = key if isinstance(key, Ed25519PublicKey) else public_key_from_text(key)
        except ValueError as exc:
            problems.append(f"approver {approver_id!r}: {exc}")
            continue
        raw = raw_public_bytes(public_key)
        if raw in seen_keys:
            problems.append(
                f"approver {approver_id!r}: same key as approver {seen_keys[raw]!r};"
                " one key must not count as two approvers"
            )
            continue
        seen_keys[raw] = approver_id
        built.append(Approver(approver_id, public_key, ()))
    if problems:
        raise PolicyError(problems)
    return Policy(audience=audience, approvers=tuple(built), source="development mode")
