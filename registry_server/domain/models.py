"""Tool definitions: the one place their rules live.

A definition arrives as a plain mapping in manifest shape (from YAML, or from
a proto converted by ``convert.py``), is validated by the pydantic input model
``ToolManifest`` (every broken rule reported, each naming its field), and is
stored as the immutable ``ToolDefinition``. The parameters schema is kept as
JSON text in the caller's key order, so a definition can be handed out without
copying and without anyone mutating the registry's state through it.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import rfc8785
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from registry_server.domain import schema_safety, strict_json
from registry_server.domain.egress import (
    MAX_SECRETS,
    NetworkInput,
    SecretInput,
    SecretRef,
    check_len,
    cross_check,
    freeze_secrets,
)
from registry_server.domain.errors import InvalidDefinition, Violation
from registry_server.domain.prestart import prestart_problems

NAME_PATTERN = r"^[a-z][a-z0-9_]{0,63}$"
MAX_NAME_CHARS = 64  # characters of a tool name (what NAME_PATTERN allows)
MAX_CATEGORY_CHARS = 32  # characters of a category (what CATEGORY_PATTERN allows)
MAX_IMAGE_CHARS = 512  # characters of an image reference (name, tag and digest)
MAX_COMMAND_ARG_CHARS = 4_096  # characters of one argv entry
MAX_ENV_KEY_CHARS = 128  # characters of a variable name (what ENV_KEY_PATTERN allows)
MAX_ENV_VALUE_CHARS = 4_096  # characters of a variable's value
OPERATOR_OWNER = "[operator]"  # owner of --tools manifests; no client id can look like it
CATEGORY_PATTERN = r"^[a-z][a-z0-9_-]{0,31}$"
ENV_KEY_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
MAX_DESCRIPTION_CHARS = 8_192  # characters; longer descriptions waste the model's context
MAX_PARAMETERS_BYTES = 65_536  # bytes of JSON; a schema is a contract, not a data store
MAX_CACHED_SCHEMA_CHECKS = 256  # parameters schemas whose checks' answer is kept, by JSON text
MAX_CATEGORIES = 16  # per tool
MAX_COMMAND_ARGS = 64  # argv entries
MAX_ENV_VARS = 64  # per tool
MAX_WARM_POOL = 32  # pre-started containers per tool
MAX_GUARDS = 16  # per tool
# Characters of a guard's condition: policy/conditions.py's MAX_CONDITION_CHARS
# (the domain cannot import the policy; a unit test holds the two equal).
MAX_GUARD_CONDITION_CHARS = 2_048
MAX_GUARD_MESSAGE_CHARS = 300  # characters of what a refused caller is told
# What a guard's message may not hold: it reaches agents, logs and the pages
# approvers read, so no control characters (newlines included), no invisible
# format characters (bidi overrides, zero-width) and no line separators.
_UNSHOWABLE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
JSON_SCHEMA_2020_12 = "https://json-schema.org/draft/2020-12/schema"

# Upper bounds a definition may even ask for; the policy ceiling of its
# safety level is applied on top at execution time (the tightest wins).
MAX_MEMORY_MB = 65_536  # MiB
MAX_CPU_MILLIS = 64_000  # thousandths of a CPU
MAX_PIDS = 4_096  # processes
MAX_TIMEOUT_MS = 3_600_000  # milliseconds (one hour)
MAX_OUTPUT_BYTES = 64 * 1024 * 1024  # bytes per stream


class SafetyLevel(enum.Enum):
    SAFE = "safe"
    CAUTIOUS = "cautious"
    DANGEROUS = "dangerous"

    @property
    def rank(self) -> int:
        return _RANKS[self]

    def at_most(self, other: SafetyLevel) -> bool:
        return self.rank <= other.rank

    @classmethod
    def parse(cls, text: str) -> SafetyLevel:
        try:
            return cls(text.strip().lower())
        except ValueError:
            raise ValueError(
                f"unknown safety level {text!r}; use safe, cautious or dangerous"
            ) from None


_RANKS = {SafetyLevel.SAFE: 1, SafetyLevel.CAUTIOUS: 2, SafetyLevel.DANGEROUS: 3}


# ---------------------------------------------------------------- stored form


@dataclass(frozen=True, slots=True)
class ToolLimits:
    """Resource limits a tool asks for; 0 = its profile's default."""

    memory_mb: int = 0
    cpu_millis: int = 0
    pids: int = 0
    timeout_ms: int = 0
    output_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in LIMIT_FIELDS}


# The limits a tool may ask for, in manifest and message order: the one list
# that conversions, the CLI and the sandbox plan iterate.
LIMIT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ToolLimits))


@dataclass(frozen=True, slots=True)
class ToolSandbox:
    image: str
    command: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()  # sorted by key
    limits: ToolLimits = field(default_factory=ToolLimits)
    # "python": a warm interpreter, started before the call with ``preload``
    # imported (domain/prestart.py); "": the command starts at release.
    prestart: str = ""
    preload: tuple[str, ...] = ()  # in the author's order: imported so

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


@dataclass(frozen=True, slots=True)
class Guard:
    """A precondition on a call's arguments (CEL over ``args``, compiled by
    the catalog at registration: policy/conditions.py), with what the caller
    is told when it does not hold."""

    condition: str
    message: str

    def as_manifest(self) -> dict[str, str]:
        return {"condition": self.condition, "message": self.message}


@dataclass(frozen=True, slots=True)
class ToolDefinition:
    """A validated, immutable tool definition. Build it with ``parse_definition``."""

    name: str
    description: str
    parameters_json: str  # the JSON Schema as compact text, the author's key order kept
    safety_level: SafetyLevel
    categories: tuple[str, ...]  # sorted, unique
    sandbox: ToolSandbox
    warm_pool: int
    digest: str  # sha256 hex of the RFC 8785 canonical JSON of ``as_manifest()``
    egress: tuple[str, ...] = ()  # "host:port" entries, sorted (domain/egress.py)
    secrets: tuple[SecretRef, ...] = ()  # sorted by name; references, never values
    guards: tuple[Guard, ...] = ()  # in the author's order: the first that fails is reported
    # Who registered it (a client id, or OPERATOR_OWNER): not part of the
    # definition, so not in ``as_manifest()`` or the digest.
    owner: str = ""
    # The registry's state of the tool, not part of the definition either.
    # The kill switch (SetToolEnabled): its calls are refused while set.
    disabled: bool = False
    disabled_reason: str = ""
    # Approval tokens issued (iat) before this time (time.time()) do not count
    # for it: when it was last disabled, or when its name was last deleted
    # before it was registered (docs/how-to/approvals.md, "Deleted and disabled tools").
    tokens_not_before: float = 0.0

    @property
    def parameters(self) -> dict[str, Any]:
        """A fresh copy of the parameters schema."""
        value: dict[str, Any] = json.loads(self.parameters_json)
        return value

    def as_manifest(self) -> dict[str, Any]:
        """The definition in manifest shape (what YAML files and the store hold)."""
        return {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "safety_level": self.safety_level.value,
            "categories": list(self.categories),
            "sandbox": {
                "image": self.sandbox.image,
                "command": list(self.sandbox.command),
                "env": self.sandbox.env_dict(),
                "limits": self.sandbox.limits.as_dict(),
                # Only when set: definitions without them keep their digests.
                **({"prestart": self.sandbox.prestart} if self.sandbox.prestart else {}),
                **({"preload": list(self.sandbox.preload)} if self.sandbox.preload else {}),
            },
            "warm_pool": self.warm_pool,
            # Only when set, so definitions without them keep the digests
            # they had before tools could have them.
            **({"network": {"egress": list(self.egress)}} if self.egress else {}),
            **({"secrets": [s.as_manifest() for s in self.secrets]} if self.secrets else {}),
            **({"guard": [g.as_manifest() for g in self.guards]} if self.guards else {}),
        }

    @property
    def reaches_network(self) -> bool:
        return bool(self.egress)


def valid_tool_name(name: str) -> bool:
    """Whether ``name`` could name a tool (cheap: checked before any look-up)."""
    return len(name) <= MAX_NAME_CHARS and re.fullmatch(NAME_PATTERN, name) is not None


def compute_digest(manifest: Mapping[str, Any]) -> str:
    return hashlib.sha256(rfc8785.dumps(dict(manifest))).hexdigest()


# ---------------------------------------------------------------- input form


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class LimitsInput(_Strict):
    memory_mb: int = Field(0, ge=0, le=MAX_MEMORY_MB)
    cpu_millis: int = Field(0, ge=0, le=MAX_CPU_MILLIS)
    pids: int = Field(0, ge=0, le=MAX_PIDS)
    timeout_ms: int = Field(0, ge=0, le=MAX_TIMEOUT_MS)
    output_bytes: int = Field(0, ge=0, le=MAX_OUTPUT_BYTES)


class SandboxInput(_Strict):
    image: str
    command: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    limits: LimitsInput = Field(default_factory=lambda: LimitsInput())
    prestart: str = ""  # checked with the rest of the tool: domain/prestart.py
    preload: list[str] = Field(default_factory=list)

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        if len(value) > MAX_IMAGE_CHARS:
            raise ValueError(f"at most {MAX_IMAGE_CHARS} characters")
        if value != value.strip() or any(c.isspace() for c in value):
            raise ValueError("must not contain whitespace")
        return value

    @field_validator("command")
    @classmethod
    def _command(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("must name the program to run (at least one entry)")
        if len(value) > MAX_COMMAND_ARGS:
            raise ValueError(f"at most {MAX_COMMAND_ARGS} entries")
        if not value[0].strip():
            raise ValueError("the program (first entry) must not be empty")
        if any("\x00" in arg for arg in value):
            raise ValueError("entries must not contain NUL characters")
        if any(len(arg) > MAX_COMMAND_ARG_CHARS for arg in value):
            raise ValueError(f"each entry at most {MAX_COMMAND_ARG_CHARS} characters")
        return value

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        if len(value) > MAX_ENV_VARS:
            raise ValueError(f"at most {MAX_ENV_VARS} variables")
        for key, val in value.items():
            if not re.match(ENV_KEY_PATTERN, key):
                raise ValueError(f"variable name {key!r} must match {ENV_KEY_PATTERN}")
            if "\x00" in val:
                raise ValueError(f"value of {key!r} must not contain NUL characters")
            if len(val) > MAX_ENV_VALUE_CHARS:
                raise ValueError(f"value of {key!r} at most {MAX_ENV_VALUE_CHARS} characters")
        return value


class GuardInput(_Strict):
    """One ``guard:`` entry. Only its shape is checked here: whether the
    condition compiles (CEL, reading ``args`` only, within the cost limit) is
    the catalog's check at registration (catalog/guards.py), since the domain
    does not know the policy's CEL environment."""

    condition: str
    message: str

    @field_validator("condition")
    @classmethod
    def _condition(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a non-empty CEL expression")
        if len(value) > MAX_GUARD_CONDITION_CHARS:
            raise ValueError(f"at most {MAX_GUARD_CONDITION_CHARS} characters")
        if "\x00" in value:
            raise ValueError("must not contain NUL characters")
        return value

    @field_validator("message")
    @classmethod
    def _message(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty (say what the caller must change)")
        if len(value) > MAX_GUARD_MESSAGE_CHARS:
            raise ValueError(f"at most {MAX_GUARD_MESSAGE_CHARS} characters")
        if any(unicodedata.category(ch) in _UNSHOWABLE_CATEGORIES for ch in value):
            raise ValueError(
                "must not contain control or invisible formatting characters (newlines included)"
            )
        return value


class ToolManifest(_Strict):
    """The manifest shape of a tool definition, validated rule by rule."""

    name: str
    description: str
    parameters: dict[str, Any]
    safety_level: str = "safe"
    categories: list[str] = Field(default_factory=list)
    sandbox: SandboxInput
    warm_pool: int = Field(0, ge=0, le=MAX_WARM_POOL)
    network: NetworkInput = Field(default_factory=lambda: NetworkInput())
    secrets: list[SecretInput] = Field(default_factory=list)
    guard: list[GuardInput] = Field(default_factory=list)

    @field_validator("secrets", mode="before")
    @classmethod
    def _secrets_cap(cls, value: Any) -> Any:
        return check_len(value, MAX_SECRETS, "secrets")

    @field_validator("guard", mode="before")
    @classmethod
    def _guard_cap(cls, value: Any) -> Any:
        return check_len(value, MAX_GUARDS, "guards")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not value:
            raise ValueError("must not be empty")
        if not re.match(NAME_PATTERN, value):
            raise ValueError(
                f"{value!r} is not snake_case: use 1-64 of a-z, 0-9 and _, starting with a letter"
            )
        return value

    @field_validator("description")
    @classmethod
    def _description(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        if len(value) > MAX_DESCRIPTION_CHARS:
            raise ValueError(f"at most {MAX_DESCRIPTION_CHARS} characters")
        return value

    @field_validator("safety_level")
    @classmethod
    def _level(cls, value: str) -> str:
        return SafetyLevel.parse(value).value

    @field_validator("categories")
    @classmethod
    def _categories(cls, value: list[str]) -> list[str]:
        if len(value) > MAX_CATEGORIES:
            raise ValueError(f"at most {MAX_CATEGORIES} categories")
        for cat in value:
            if not re.match(CATEGORY_PATTERN, cat):
                raise ValueError(
                    f"{cat!r} is not a lowercase word:"
                    " use a-z, 0-9, _ and -, starting with a letter"
                )
        if len(set(value)) != len(value):
            raise ValueError("must not repeat a category")
        return sorted(value)

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, value: dict[str, Any]) -> dict[str, Any]:
        for rule in parameter_schema_problems(value):
            raise ValueError(rule)
        return value

    @model_validator(mode="before")
    @classmethod
    def _level_default(cls, data: Any) -> Any:
        # An explicit null/empty level means "unspecified", which is SAFE.
        if isinstance(data, dict) and data.get("safety_level") in (None, ""):
            data = {k: v for k, v in data.items() if k != "safety_level"}
        return data


def parameter_schema_problems(schema: Mapping[str, Any]) -> list[str]:
    """Why ``schema`` is not an acceptable parameters schema (empty = fine).
    The cheap, bounded checks (shape, size) come first, so the schema is
    known to be small plain JSON before anything evaluates it."""
    problem = strict_json.structure_problem(schema)
    if problem:
        return [problem]
    text = strict_json.dumps(schema)
    if len(text.encode()) > MAX_PARAMETERS_BYTES:
        return [f"at most {MAX_PARAMETERS_BYTES} bytes of JSON"]
    return list(_schema_text_problems(text))


@functools.lru_cache(maxsize=MAX_CACHED_SCHEMA_CHECKS)
def _schema_text_problems(text: str) -> tuple[str, ...]:
    """The rest of ``parameter_schema_problems``, for a schema that passed its
    shape and size checks, given as its JSON text. The answer depends on that
    text alone, and checking it against the metaschema costs about a
    millisecond, so it is kept: the same schema is checked again each time its
    tool is loaded or re-registered and for every approval request shown (its
    snapshot is parsed)."""
    return tuple(_evaluated_schema_problems(json.loads(text)))


def _evaluated_schema_problems(schema: Mapping[str, Any]) -> list[str]:
    if schema.get("type") != "object":
        return ['must be an object schema ("type": "object")']
    declared = schema.get("$schema")
    if declared is not None and (
        not isinstance(declared, str) or declared.rstrip("#") != JSON_SCHEMA_2020_12
    ):
        return [f'"$schema" must be {JSON_SCHEMA_2020_12} (JSON Schema draft 2020-12)']
    problems = schema_safety.schema_problems(schema)
    if problems:
        return problems
    properties = schema.get("properties", {})
    missing = [n for n in schema.get("required", []) if n not in properties]
    if missing:
        return [f'"required" names {missing} that are not in "properties"']
    return []


def parse_definition(raw: Mapping[str, Any], *, source: str = "tool definition") -> ToolDefinition:
    """Validate a manifest-shaped mapping; raise InvalidDefinition listing every problem."""
    if not isinstance(raw, Mapping):
        raise InvalidDefinition([Violation("", "must be a mapping of tool fields")], source)
    try:
        manifest = ToolManifest.model_validate(dict(raw))
    except ValidationError as exc:
        raise InvalidDefinition(_violations(exc), source) from None
    mismatched = cross_check(manifest.network, manifest.secrets, manifest.warm_pool)
    sandbox = manifest.sandbox
    mismatched += prestart_problems(
        sandbox.prestart, sandbox.preload, sandbox.command, manifest.safety_level
    )
    if mismatched:
        raise InvalidDefinition([Violation(f, rule) for f, rule in mismatched], source)
    return _freeze(manifest)


def _freeze(m: ToolManifest) -> ToolDefinition:
    sandbox = ToolSandbox(
        image=m.sandbox.image,
        command=tuple(m.sandbox.command),
        env=tuple(sorted(m.sandbox.env.items())),
        limits=ToolLimits(**m.sandbox.limits.model_dump()),
        prestart=m.sandbox.prestart,
        preload=tuple(m.sandbox.preload),
    )
    unsigned = ToolDefinition(
        name=m.name,
        description=m.description,
        parameters_json=strict_json.dumps(m.parameters),
        safety_level=SafetyLevel(m.safety_level),
        categories=tuple(m.categories),
        sandbox=sandbox,
        warm_pool=m.warm_pool,
        digest="",
        egress=tuple(m.network.egress),
        secrets=freeze_secrets(m.secrets),
        guards=tuple(Guard(g.condition, g.message) for g in m.guard),
    )
    return _with_digest(unsigned)


def _with_digest(tool: ToolDefinition) -> ToolDefinition:
    from dataclasses import replace

    return replace(tool, digest=compute_digest(tool.as_manifest()))


def _violations(exc: ValidationError) -> list[Violation]:
    out: list[Violation] = []
    for err in exc.errors(include_url=False):
        loc = [str(p) for p in err["loc"]]
        path = ".".join(loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            out.append(Violation(path, "unknown key"))
        elif kind == "missing":
            out.append(Violation(path, "is required"))
        elif kind in ("dict_type", "model_type"):
            out.append(Violation(path, "must be a mapping (JSON object)"))
        elif kind == "list_type":
            out.append(Violation(path, "must be a list"))
        elif kind == "value_error":
            out.append(Violation(path, str(err["ctx"]["error"]) if "ctx" in err else err["msg"]))
        else:
            out.append(Violation(path, _plain(err["msg"])))
    return out


def _plain(msg: str) -> str:
    # pydantic says "Input should be a valid string"; say what the field must be.
    return msg.replace("Input should be", "must be")
