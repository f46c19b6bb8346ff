"""Webhook endpoints in the policy (docs/how-to/deploying.md, "Webhooks"): where
approvers are told about approval requests, and the base URL of the approval
console that the messages link to.

The policy file names each endpoint's secret by where it lives (a file or an
environment variable), never by value: the file is shared with the MCP
bridge and kept in configuration management. The server reads the secrets
at start (notify/endpoints.py) and refuses to start without them.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The approval events an endpoint may ask for (approvals/events.py, in lower case).
WEBHOOK_EVENTS = (
    "opened", "approval_added", "approved", "rejected", "consumed", "expired", "voided",
)  # fmt: skip
WEBHOOK_FORMATS = ("standard", "slack")
# Endpoint ids become metric labels and log fields: short, and only as many as the policy names.
WEBHOOK_ID_PATTERN = r"^[a-z0-9][a-z0-9_.-]{0,63}$"
SECRET_ENV_PATTERN = r"^[A-Z_][A-Z0-9_]{0,127}$"
MAX_WEBHOOKS = 16  # endpoints in one policy: each event is one delivery per endpoint
MAX_URL_CHARS = 2_048  # characters of an endpoint's URL or of console_url
MAX_PATH_CHARS = 4_096  # characters of a secret_file or ca_file path
DEFAULT_WEBHOOK_TIMEOUT_S = 5.0  # seconds one delivery attempt may take
MAX_WEBHOOK_TIMEOUT_S = 30.0  # seconds: a receiver slower than this is down
LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True)
class WebhookSpec:
    """One endpoint as the policy states it (the secret by where it lives)."""

    id: str
    url: str = field(default="", repr=False)  # may carry a credential in its path (Slack's do)
    events: frozenset[str] = frozenset()
    secret_file: str | None = None
    secret_env: str | None = None
    format: str = "standard"
    timeout_s: float = DEFAULT_WEBHOOK_TIMEOUT_S
    ca_file: str | None = None  # PEM CAs to verify an https receiver with, instead of the system's
    include_arguments: bool = False  # a short, escaped preview of the call's arguments
    where: str = ""  # "policy.yaml line 12: webhooks[0]", for messages at start

    def wants(self, event_type: str) -> bool:
        return event_type.lower() in self.events


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_url(value: str) -> str:
    """An https URL (http only to a loopback host, as tests and local relays
    use), without credentials or a fragment: deliveries carry approval news,
    and a signature does not hide a body from whoever reads the wire."""
    if len(value) > MAX_URL_CHARS:
        raise ValueError(f"at most {MAX_URL_CHARS} characters")
    if any(c.isspace() or ord(c) < 0x20 for c in value):
        raise ValueError("must not contain whitespace or control characters")
    try:
        parts = urlsplit(value)
        host, port = parts.hostname, parts.port  # port raises on a bad one
    except ValueError as exc:
        raise ValueError(f"is not a valid URL ({exc})") from None
    del port
    if parts.scheme not in ("https", "http") or not host:
        raise ValueError("must be an https:// URL with a host")
    if parts.scheme == "http" and not is_loopback(host):
        raise ValueError(
            "must use https (plain http is allowed only to a loopback host such as 127.0.0.1)"
        )
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not carry a user or password; the payload is signed instead")
    if parts.fragment:
        raise ValueError("must not have a #fragment")
    return value


def _check_path(value: str | None) -> str | None:
    if value is None:
        return None
    if not value or len(value) > MAX_PATH_CHARS or "\x00" in value:
        raise ValueError(f"must be a path of 1-{MAX_PATH_CHARS} characters")
    if not PurePosixPath(value).is_absolute():
        # The server's working directory is the supervisor's choice, not the policy's.
        raise ValueError("must be an absolute path")
    return value


class _WebhookIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    id: str
    url: str
    events: list[str] = Field(min_length=1, max_length=len(WEBHOOK_EVENTS))
    secret_file: str | None = None
    secret_env: str | None = None
    format: Literal["standard", "slack"] = "standard"
    timeout_s: float = Field(DEFAULT_WEBHOOK_TIMEOUT_S, gt=0, le=MAX_WEBHOOK_TIMEOUT_S)
    ca_file: str | None = None
    include_arguments: bool = False

    @field_validator("id")
    @classmethod
    def _id(cls, value: str) -> str:
        if not re.fullmatch(WEBHOOK_ID_PATTERN, value):
            raise ValueError(f"{value[:64]!r} is not a valid webhook id (must match"
                             f" {WEBHOOK_ID_PATTERN})")  # fmt: skip
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_url(value)

    @field_validator("events")
    @classmethod
    def _events(cls, value: list[str]) -> list[str]:
        for event in value:
            if event not in WEBHOOK_EVENTS:
                raise ValueError(f"unknown event {event[:32]!r}; use {', '.join(WEBHOOK_EVENTS)}")
        if len(set(value)) != len(value):
            raise ValueError("repeats an event")
        return value

    @field_validator("secret_env")
    @classmethod
    def _env(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(SECRET_ENV_PATTERN, value):
            raise ValueError(f"must be an environment variable name ({SECRET_ENV_PATTERN})")
        return value

    @field_validator("secret_file", "ca_file")
    @classmethod
    def _paths(cls, value: str | None) -> str | None:
        return _check_path(value)

    @model_validator(mode="after")
    def _one_secret(self) -> _WebhookIn:
        if (self.secret_file is None) == (self.secret_env is None):
            # Every delivery is signed: a receiver must be able to tell ours from a forgery.
            raise ValueError("needs exactly one of secret_file or secret_env (the signing secret)")
        if self.ca_file is not None and not self.url.startswith("https:"):
            raise ValueError("ca_file is for https URLs only")
        return self

    def spec(self, where: str) -> WebhookSpec:
        return WebhookSpec(
            id=self.id, url=self.url, events=frozenset(self.events),
            secret_file=self.secret_file, secret_env=self.secret_env, format=self.format,
            timeout_s=float(self.timeout_s), ca_file=self.ca_file,
            include_arguments=self.include_arguments, where=where,
        )  # fmt: skip
