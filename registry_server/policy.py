"""The policy file (docs/deploying.md): who may approve what, which clients may do what,
and the sandbox ceilings of each safety level.

The YAML is validated in two passes: pydantic input models (strict, frozen,
unknown keys forbidden) check each field, then cross-checks catch what no
single field shows (duplicate ids and credentials, one key serving two
approvers, rules naming groups nobody is in, rules no set of approvers can
satisfy). Every problem names the file, the YAML line of the offending node
when there is one, and the field path. The validated file becomes a frozen
``Policy`` that the server only reads.
"""

from __future__ import annotations

import enum
import fnmatch
import hashlib
import hmac
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from registry_server.models import (
    CATEGORY_PATTERN,
    MAX_CPU_MILLIS,
    MAX_MEMORY_MB,
    MAX_OUTPUT_BYTES,
    MAX_PIDS,
    MAX_TIMEOUT_MS,
    NAME_PATTERN,
    SafetyLevel,
)
from registry_server.tokens import public_key_from_text

ID_PATTERN = r"^[a-z0-9][a-z0-9_.@-]{0,63}$"  # approver and client ids
GROUP_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
SHA256_HEX_PATTERN = r"^[0-9a-fA-F]{64}$"
# sha256 of the empty string: a client with this credential would accept "Bearer ".
EMPTY_TOKEN_SHA256 = hashlib.sha256(b"").hexdigest()

DEFAULT_TOKEN_TTL_S = 3_600  # seconds an approval token may live when a rule says nothing
MAX_TOKEN_TTL_S = 86_400  # seconds (a day): an approval is for a call about to happen
DEFAULT_APPROVAL_REQUEST_TTL_S = 3_600  # seconds a pending approval request waits
MAX_APPROVAL_REQUEST_TTL_S = 7 * 86_400  # seconds
MAX_AUDIENCE_CHARS = 256  # characters
MAX_SUBJECT_CHARS = 1_024  # characters of an mTLS certificate subject
MAX_TMPFS_MB = 65_536  # MiB of /tmp a profile may allow
MAX_POLICY_BYTES = 1024 * 1024  # bytes; a policy is configuration, not data
MAX_IMAGE_PATTERNS = 64  # image globs per client
MAX_IMAGE_PATTERN_CHARS = 256  # characters of one image glob
# What a client may register when the policy does not say: the images this
# project builds, at the safe level (a higher level is granted, never assumed).
DEFAULT_REGISTER_IMAGES = ("toolreg/base", "toolreg/base:*", "toolreg/python", "toolreg/python:*")
DEFAULT_REGISTER_LEVEL = "safe"


class Role(enum.StrEnum):
    REGISTER = "register"
    EXECUTE = "execute"
    APPROVE = "approve"
    ADMIN = "admin"  # an operator: may replace any tool, and register without the limits


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
    public_key: Ed25519PublicKey = field(repr=False)
    groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class RuleMatch:
    """Exactly one of the three is set."""

    tool: str | None = None
    category: str | None = None
    level: SafetyLevel | None = None

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
    max_token_ttl_s: int = DEFAULT_TOKEN_TTL_S


@dataclass(frozen=True)
class Requirement:
    """m approvals from approvers in ``groups`` (empty: any approver)."""

    approvals_required: int
    groups: tuple[str, ...]
    source: str  # where it comes from, for messages: "rule 1 (tool write_file)"

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
        """How many more distinct approvers are needed at least, given these."""
        return max(
            (
                r.approvals_required - sum(1 for a in approvers if r.admits(a.groups))
                for r in self.requirements
            ),
            default=0,
        )


@dataclass(frozen=True)
class RegisterGrant:
    """What a client may register: tools up to ``max_level``, from images
    matching one of ``images`` (shell-style globs on the image reference)."""

    max_level: SafetyLevel = SafetyLevel.SAFE  # DEFAULT_REGISTER_LEVEL
    images: tuple[str, ...] = DEFAULT_REGISTER_IMAGES

    def allows_image(self, image: str) -> bool:
        return any(fnmatch.fnmatchcase(image, pattern) for pattern in self.images)


UNRESTRICTED = RegisterGrant(SafetyLevel.DANGEROUS, ("*",))  # operators and admins


@dataclass(frozen=True)
class Client:
    id: str
    roles: frozenset[Role]
    max_safety_level: SafetyLevel = SafetyLevel.SAFE  # the most dangerous level it may execute
    token_sha256: str | None = field(default=None, repr=False)  # lowercase hex
    mtls_subject: str | None = None
    register: RegisterGrant = field(default_factory=RegisterGrant)
    # The approver this client is (the same person): never approves its calls.
    approver: str | None = None

    def may(self, role: Role, level: SafetyLevel | None = None) -> bool:
        """Whether this client holds ``role``; for EXECUTE, also at ``level``."""
        if role not in self.roles:
            return False
        if role is Role.EXECUTE and level is not None:
            return level.at_most(self.max_safety_level)
        return True


@dataclass(frozen=True)
class Policy:
    audience: str
    approval_request_ttl_s: int = DEFAULT_APPROVAL_REQUEST_TTL_S
    approvers: tuple[Approver, ...] = ()
    rules: tuple[ApprovalRule, ...] = ()
    # per level, only the fields the policy sets (the rest keep the built-in profile)
    profiles: Mapping[SafetyLevel, Mapping[str, int]] = field(default_factory=dict)
    clients: tuple[Client, ...] = ()
    source: str = "policy"  # the file it came from, for messages
    _by_id: Mapping[str, Approver] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Built once: the approval path looks approvers up for every token.
        by_id = MappingProxyType({a.id: a for a in self.approvers})
        object.__setattr__(self, "_by_id", by_id)

    def approver(self, approver_id: str) -> Approver | None:
        return self._by_id.get(approver_id)

    def client(self, client_id: str) -> Client | None:
        return next((c for c in self.clients if c.id == client_id), None)

    def same_person(self, approver_id: str, client_id: str) -> bool:
        """An approver never approves a call of their own: same id, or the
        client the policy links to them (``clients[].approver``)."""
        if approver_id == client_id:
            return True
        client = self.client(client_id)
        return client is not None and client.approver == approver_id

    def approver_keys(self) -> Mapping[str, Ed25519PublicKey]:
        return MappingProxyType({a.id: a.public_key for a in self.approvers})

    def rule_for(
        self, *, tool_name: str, categories: Sequence[str], level: SafetyLevel
    ) -> EffectiveRule:
        """Every rule that matches the tool (by name, by any of its categories,
        by level) applies at once; with none, a dangerous tool needs one
        approval from any approver. Only dangerous tools are gated by
        approvals (the executor decides)."""
        if level is not SafetyLevel.DANGEROUS:
            return EffectiveRule((), DEFAULT_TOKEN_TTL_S)
        matches: Callable[[RuleMatch], bool] = lambda m: (  # noqa: E731
            (m.tool is not None and m.tool == tool_name)
            or (m.category is not None and m.category in categories)
            or (m.level is not None and m.level is level)
        )
        matched = [(n, r) for n, r in enumerate(self.rules, start=1) if matches(r.match)]
        if not matched:
            default = Requirement(1, (), "default for dangerous tools")
            return EffectiveRule((default,), DEFAULT_TOKEN_TTL_S)
        return EffectiveRule(
            tuple(
                Requirement(r.approvals_required, r.groups, f"rule {n} ({r.match.describe()})")
                for n, r in matched
            ),
            min(r.max_token_ttl_s for _, r in matched),
        )

    def eligible(self, approver_id: str, rule: EffectiveRule) -> bool:
        """Whether this approver counts towards at least one requirement."""
        approver = self._by_id.get(approver_id)
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

    def ceiling(self, level: SafetyLevel) -> dict[str, int] | None:
        """The limits the policy sets for ``level`` (only those fields), or None."""
        fields = self.profiles.get(level)
        return None if fields is None else dict(fields)


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
        raw = _raw(public_key)
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


def _raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


# ------------------------------------------------------------------ input form


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


def _check_groups(values: list[str]) -> list[str]:
    for group in values:
        _check_pattern(group, GROUP_PATTERN, "group name")
    _check_unique(values, "group")
    return values


class _ApproverIn(_Strict):
    id: str
    public_key: str
    groups: list[str] = Field(default_factory=list)

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        return _check_pattern(value, ID_PATTERN, "approver id")

    @field_validator("public_key")
    @classmethod
    def _key(cls, value: str) -> str:
        public_key_from_text(value)  # raises ValueError with the reason
        return value

    @field_validator("groups")
    @classmethod
    def _groups(cls, value: list[str]) -> list[str]:
        return _check_groups(value)


class _MatchIn(_Strict):
    tool: str | None = None
    category: str | None = None
    level: str | None = None

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

    @model_validator(mode="after")
    def _exactly_one(self) -> _MatchIn:
        given = [n for n in ("tool", "category", "level") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(
                "must name exactly one of tool, category or level"
                + (f" (found {', '.join(given)})" if given else "")
            )
        return self


class _RuleIn(_Strict):
    match: _MatchIn
    approvals_required: int = Field(ge=1)
    groups: list[str] = Field(default_factory=list)
    max_token_ttl_s: int = Field(DEFAULT_TOKEN_TTL_S, ge=1, le=MAX_TOKEN_TTL_S)

    @field_validator("groups")
    @classmethod
    def _groups(cls, value: list[str]) -> list[str]:
        return _check_groups(value)


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


class _ClientIn(_Strict):
    id: str
    token_sha256: str | None = None
    mtls_subject: str | None = None
    roles: list[str] = Field(default_factory=list)
    max_safety_level: str = SafetyLevel.SAFE.value
    # "register" in the file (the attribute name would shadow BaseModel's own)
    grant: _RegisterIn | None = Field(None, alias="register")
    approver: str | None = None  # the approver id of the same person

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
        known = {r.value for r in Role}
        for role in value:
            if role not in known:
                raise ValueError(f"unknown role {role!r}; use {', '.join(r.value for r in Role)}")
        _check_unique(value, "role")
        return value

    @field_validator("max_safety_level")
    @classmethod
    def _level(cls, value: str) -> str:
        return SafetyLevel.parse(value).value

    @model_validator(mode="after")
    def _credential(self) -> _ClientIn:
        if self.token_sha256 is None and self.mtls_subject is None:
            raise ValueError("needs a credential: token_sha256 and/or mtls_subject")
        return self


class _PolicyIn(_Strict):
    audience: str
    approval_request_ttl_s: int = Field(
        DEFAULT_APPROVAL_REQUEST_TTL_S, ge=1, le=MAX_APPROVAL_REQUEST_TTL_S
    )
    approvers: list[_ApproverIn] = Field(default_factory=list)
    approval_rules: list[_RuleIn] = Field(default_factory=list)
    profiles: _ProfilesIn = Field(default_factory=lambda: _ProfilesIn())
    clients: list[_ClientIn] = Field(default_factory=list)

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


# ---------------------------------------------------------------------- loading

Loc = tuple[int | str, ...]


def load_policy(path: Path) -> Policy:
    """Read and validate the policy file; PolicyError lists every problem."""
    source = str(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise PolicyError(f"{source}: cannot read the policy file: {exc.strerror or exc}") from None
    if len(data) > MAX_POLICY_BYTES:
        raise PolicyError(f"{source}: larger than {MAX_POLICY_BYTES} bytes")
    root, raw = _parse_yaml(data, source)
    try:
        parsed = _PolicyIn.model_validate(raw)
    except ValidationError as exc:
        raise PolicyError(
            _problems(source, root, [(tuple(e["loc"]), _describe(e)) for e in exc.errors()])
        ) from None
    problems = _problems(source, root, list(_cross_check(parsed)))
    if problems:
        raise PolicyError(problems)
    return _freeze(parsed, source)


def _parse_yaml(data: bytes, source: str) -> tuple[yaml.Node, dict[str, Any]]:
    """The node tree (for line numbers) and the plain data built from it."""
    loader = yaml.SafeLoader(data)
    try:
        root = loader.get_single_node()
        if root is None:
            raise PolicyError(f"{source}: is empty; expected a mapping with at least 'audience'")
        duplicates = list(_duplicate_keys(root, ()))
        if duplicates:
            raise PolicyError(
                [_format(source, line, loc, message) for line, loc, message in sorted(duplicates)]
            )
        raw = loader.construct_document(root)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise PolicyError(f"{source}{where}: not valid YAML: {problem}") from None
    finally:
        loader.dispose()
    if not isinstance(raw, dict):
        raise PolicyError(f"{source} line {root.start_mark.line + 1}: must be a mapping")
    return root, raw


def _duplicate_keys(node: yaml.Node, loc: Loc) -> Iterator[tuple[int, Loc, str]]:
    """PyYAML silently keeps the last of two equal keys; in a policy that would
    hide, say, a second public_key. Each node is visited once (aliases share nodes)."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, Loc]] = [(node, loc)]
    while stack:
        current, where = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, yaml.MappingNode):
            keys: set[str] = set()
            for key, value in current.value:
                if isinstance(key, yaml.ScalarNode):
                    if key.value in keys:
                        line = key.start_mark.line + 1  # the repeat, not the first
                        yield line, (*where, key.value), f"duplicate key {key.value!r}"
                    keys.add(key.value)
                    stack.append((value, (*where, key.value)))
        elif isinstance(current, yaml.SequenceNode):
            stack.extend((item, (*where, i)) for i, item in enumerate(current.value))


def _cross_check(policy: _PolicyIn) -> Iterator[tuple[Loc, str]]:
    """The rules no single field can check."""
    first_id: dict[str, int] = {}
    first_key: dict[bytes, int] = {}
    for i, approver in enumerate(policy.approvers):
        if approver.id in first_id:
            first = first_id[approver.id]
            yield (
                ("approvers", i, "id"),
                f"duplicate approver id {approver.id!r} (also approvers[{first}])",
            )
        first_id.setdefault(approver.id, i)
        raw = _raw(public_key_from_text(approver.public_key))
        if raw in first_key:
            other = first_key[raw]
            yield (
                ("approvers", i, "public_key"),
                (
                    f"same key as approvers[{other}] ({policy.approvers[other].id!r});"
                    " one key must not count as two approvers"
                ),
            )
        first_key.setdefault(raw, i)

    known_groups = {g for a in policy.approvers for g in a.groups}
    first_match: dict[tuple[str | None, ...], int] = {}
    for i, rule in enumerate(policy.approval_rules):
        match = (rule.match.tool, rule.match.category, rule.match.level)
        if match in first_match:
            first = first_match[match]
            yield (
                ("approval_rules", i, "match"),
                f"same match as approval_rules[{first}]; this rule would never apply",
            )
        first_match.setdefault(match, i)
        for j, group in enumerate(rule.groups):
            if group not in known_groups:
                yield (
                    ("approval_rules", i, "groups", j),
                    f"unknown group {group!r} (no approver is in it)",
                )
        eligible = sorted(
            {a.id for a in policy.approvers if not rule.groups or set(a.groups) & set(rule.groups)}
        )
        if rule.approvals_required > len(eligible):
            who = f" ({', '.join(eligible)})" if eligible else ""
            scope = f"in groups {', '.join(rule.groups)}" if rule.groups else "in the policy"
            yield (
                ("approval_rules", i, "approvals_required"),
                (
                    f"unsatisfiable rule: needs {rule.approvals_required} approvals but only"
                    f" {len(eligible)} approver(s){who} are {scope}"
                ),
            )

    seen: dict[tuple[str, str], int] = {}
    for i, client in enumerate(policy.clients):
        for name in ("id", "token_sha256", "mtls_subject"):
            value = getattr(client, name)
            if value is None:
                continue
            if (name, value) in seen:
                what = "client id" if name == "id" else f"credential ({name})"
                yield (
                    ("clients", i, name),
                    (f"duplicate {what}: same as clients[{seen[(name, value)]}]"),
                )
            seen.setdefault((name, value), i)
        if client.approver is not None and client.approver not in first_id:
            yield (("clients", i, "approver"), f"unknown approver {client.approver!r}")
        if client.grant is not None and "register" not in client.roles:
            yield (("clients", i, "register"), "given without the register role")


def _freeze(policy: _PolicyIn, source: str) -> Policy:
    profiles: dict[SafetyLevel, Mapping[str, int]] = {}
    for level in SafetyLevel:
        ceiling: _CeilingIn | None = getattr(policy.profiles, level.value)
        if ceiling is not None:
            profiles[level] = MappingProxyType(ceiling.model_dump(exclude_none=True))
    return Policy(
        audience=policy.audience,
        approval_request_ttl_s=policy.approval_request_ttl_s,
        approvers=tuple(
            Approver(a.id, public_key_from_text(a.public_key), tuple(a.groups))
            for a in policy.approvers
        ),
        rules=tuple(
            ApprovalRule(
                match=RuleMatch(
                    tool=r.match.tool,
                    category=r.match.category,
                    level=None if r.match.level is None else SafetyLevel(r.match.level),
                ),
                approvals_required=r.approvals_required,
                groups=tuple(r.groups),
                max_token_ttl_s=r.max_token_ttl_s,
            )
            for r in policy.approval_rules
        ),
        profiles=MappingProxyType(profiles),
        clients=tuple(
            Client(
                id=c.id,
                roles=frozenset(Role(r) for r in c.roles),
                max_safety_level=SafetyLevel(c.max_safety_level),
                token_sha256=c.token_sha256,
                mtls_subject=c.mtls_subject,
                register=_grant(c),
                approver=c.approver,
            )
            for c in policy.clients
        ),
        source=source,
    )


def _grant(client: _ClientIn) -> RegisterGrant:
    if "admin" in client.roles and client.grant is None:
        return UNRESTRICTED  # an operator's own client: trusted like the policy file
    given = client.grant or _RegisterIn()
    return RegisterGrant(SafetyLevel(given.max_safety_level), tuple(given.images))


# ------------------------------------------------------------------- messages


def _problems(source: str, root: yaml.Node, found: Sequence[tuple[Loc, str]]) -> list[str]:
    """One line per problem, in file order (the order an operator fixes them)."""
    lines = sorted(
        ((_line_of(root, loc) or 0, index), _problem(source, root, loc, message))
        for index, (loc, message) in enumerate(found)
    )
    return [text for _, text in lines]


def _problem(source: str, root: yaml.Node, loc: Loc, message: str) -> str:
    return _format(source, _line_of(root, loc), loc, message)


def _format(source: str, line: int | None, loc: Loc, message: str) -> str:
    path = _path(loc)
    where = f"{source} line {line}" if line is not None else source
    return f"{where}: {path}: {message}" if path else f"{where}: {message}"


def _path(loc: Loc) -> str:
    """("approvers", 1, "public_key") -> "approvers[1].public_key"."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _line_of(root: yaml.Node, loc: Loc) -> int | None:
    """The 1-based line of the deepest node on ``loc``: the key itself for a
    mapping entry (an unknown or bad key), else the closest enclosing node
    (a missing key is reported at the mapping that lacks it)."""
    node: yaml.Node = root
    mark = root.start_mark
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            entry = next(
                (
                    (k, v)
                    for k, v in node.value
                    if isinstance(k, yaml.ScalarNode) and k.value == str(part)
                ),
                None,
            )
            if entry is None:
                break
            mark = entry[0].start_mark
            node = entry[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if not 0 <= part < len(node.value):
                break
            node = node.value[part]
            mark = node.start_mark
        else:
            break
    return mark.line + 1 if mark is not None else None


def _describe(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "is required"
    if kind in ("dict_type", "model_type"):
        return "must be a mapping"
    if kind == "list_type":
        return "must be a list"
    if kind == "value_error" and "ctx" in error:
        return str(error["ctx"]["error"])
    # pydantic says "Input should be a valid string"; say what the field must be.
    return str(error["msg"]).replace("Input should be", "must be").replace("Value error, ", "")
