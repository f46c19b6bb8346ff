"""What a tool may reach and which server-held secrets it uses: the
``network`` and ``secrets`` parts of a definition. Both are part of the
digest, so an approval signs them and a changed allow-list voids old tokens.

Secrets are named here, never valued: a definition says *that* a tool uses
TICKETS_TOKEN and how it is delivered; the value lives only on the server
(registry_server/execution/secrets.py) and never in a definition, a listing
or an approval request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sandbox_runner.egress import rules

MAX_EGRESS_ENTRIES = 32  # host:port entries per tool
MAX_SECRETS = 16  # secrets per tool
MAX_FORMAT_CHARS = 256  # characters of an injected header's value template
SECRET_NAME_PATTERN = r"^[A-Z][A-Z0-9_]{0,63}$"
HEADER_NAME_PATTERN = r"^[A-Za-z0-9-]{1,64}$"
VALUE_PLACEHOLDER = "{value}"
DEFAULT_TLS_PORT = 443  # the port an injection targets when it names none
# Headers that frame or route the request: a secret may not replace them.
_RESERVED_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te",
     "trailer", "keep-alive", "accept-encoding", "proxy-authorization", "proxy-connection"}
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Injection:
    """Where the egress proxy adds a header-delivered secret."""

    host: str
    port: int
    header: str
    format: str  # contains "{value}" once

    def render(self, value: str) -> str:
        return self.format.replace(VALUE_PLACEHOLDER, value)


@dataclass(frozen=True, slots=True)
class SecretRef:
    name: str
    deliver: Literal["header", "file"]
    inject: Injection | None  # set exactly when deliver == "header"

    def as_manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "deliver": self.deliver}
        if self.inject is not None:
            out["inject"] = {
                "host": self.inject.host,
                "port": self.inject.port,
                "header": self.inject.header,
                "format": self.inject.format,
            }
        return out


# ---------------------------------------------------------------- input form


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def check_len(value: Any, limit: int, what: str) -> Any:
    """For before-validators: a list longer than ``limit`` is refused before
    any of its items is looked at."""
    if isinstance(value, list) and len(value) > limit:
        raise ValueError(f"at most {limit} {what}")
    return value


class NetworkInput(_Strict):
    egress: list[str] = Field(default_factory=list)

    @field_validator("egress", mode="before")
    @classmethod
    def _cap(cls, value: Any) -> Any:
        return check_len(value, MAX_EGRESS_ENTRIES, "entries")

    @field_validator("egress")
    @classmethod
    def _egress(cls, value: list[str]) -> list[str]:
        entries = [str(rules.parse_entry(text)) for text in value]
        if len(set(entries)) != len(entries):
            raise ValueError("must not repeat an entry")
        return sorted(entries)


class InjectionInput(_Strict):
    host: str
    port: int = Field(DEFAULT_TLS_PORT, ge=1, le=65535)
    header: str = "Authorization"
    format: str = "Bearer {value}"

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        if rules.normalize_host(value) != value or "." not in value:
            raise ValueError(f"{value[:64]!r} must be one lowercase, fully qualified host name")
        return value

    @field_validator("header")
    @classmethod
    def _header(cls, value: str) -> str:
        if not re.match(HEADER_NAME_PATTERN, value):
            raise ValueError("must be an HTTP header name (letters, digits and '-')")
        if value.lower() in _RESERVED_HEADERS or value.lower().startswith("proxy-"):
            raise ValueError(f"{value!r} frames or routes the request; use another header")
        return value

    @field_validator("format")
    @classmethod
    def _format(cls, value: str) -> str:
        if len(value) > MAX_FORMAT_CHARS:
            raise ValueError(f"at most {MAX_FORMAT_CHARS} characters")
        if value.count(VALUE_PLACEHOLDER) != 1:
            raise ValueError(f"must contain {VALUE_PLACEHOLDER} exactly once")
        if not all(32 <= ord(c) < 127 for c in value):
            raise ValueError("must be printable ASCII (no line breaks)")
        return value


class SecretInput(_Strict):
    name: str
    deliver: Literal["header", "file"] = "header"
    inject: InjectionInput | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not re.match(SECRET_NAME_PATTERN, value):
            raise ValueError(f"{value[:64]!r} must match {SECRET_NAME_PATTERN}")
        return value

    @model_validator(mode="after")
    def _delivery(self) -> SecretInput:
        if self.deliver == "header" and self.inject is None:
            raise ValueError("a header-delivered secret needs inject: {host, header, format}")
        if self.deliver == "file" and self.inject is not None:
            raise ValueError("inject applies to deliver: header only")
        return self


def cross_check(
    network: NetworkInput, secrets: list[SecretInput], warm_pool: int
) -> list[tuple[str, str]]:
    """Rules between the parts, as (field, rule) pairs: why they do not fit
    together (empty = fine)."""
    problems: list[tuple[str, str]] = []
    names = [s.name for s in secrets]
    if len(set(names)) != len(names):
        problems.append(("secrets", "must not repeat a name"))
    entries = rules.parse_entries(network.egress)
    for i, secret in enumerate(secrets):
        inj = secret.inject
        if inj is not None and rules.first_match(entries, inj.host, inj.port) is None:
            problems.append(
                (
                    f"secrets.{i}.inject.host",
                    f"{inj.host}:{inj.port} is not in network.egress;"
                    " a secret goes only to a host the tool may reach",
                )
            )
    # A file secret is bind-mounted into the container: it must not exist
    # before the call, so such a tool is never made ahead of one. Egress and
    # header secrets are bound to a warm container only when its call is
    # released (registry_server/execution/warm_pool.py).
    if warm_pool and any(s.deliver == "file" for s in secrets):
        problems.append(
            (
                "warm_pool",
                "not available for tools with deliver: file secrets"
                " (the secret file is made for each call)",
            )
        )
    return problems


def freeze_secrets(secrets: list[SecretInput]) -> tuple[SecretRef, ...]:
    return tuple(
        SecretRef(
            name=s.name,
            deliver=s.deliver,
            inject=None
            if s.inject is None
            else Injection(s.inject.host, s.inject.port, s.inject.header, s.inject.format),
        )
        for s in sorted(secrets, key=lambda s: s.name)
    )


def describe_reach(egress: tuple[str, ...], secrets: tuple[SecretRef, ...]) -> tuple[str, str]:
    """(egress, secrets) in words for people: what an approver signs, what a
    tool belt tells the model. Names and hosts only, never values."""
    reach = ", ".join(egress) or "none (no network)"
    used = []
    for ref in secrets:
        if ref.inject is not None:
            used.append(
                f"{ref.name} (header {ref.inject.header} to {ref.inject.host}:{ref.inject.port})"
            )
        else:
            used.append(f"{ref.name} (file /run/secrets/{ref.name})")
    return reach, ", ".join(used) or "none"
