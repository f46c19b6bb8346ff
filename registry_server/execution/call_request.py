"""One call as the executor receives it from the API edge."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from registry_server.domain.models import SafetyLevel


@dataclass(frozen=True)
class CallRequest:
    name: str
    arguments_json: str
    caller: str = "anonymous"
    actor: str | None = None  # who acts for the caller (a bridge, by token exchange)
    approval_tokens: tuple[str, ...] = ()
    approval_request_id: str = ""
    # time.monotonic() by which the client stops waiting (its gRPC deadline)
    deadline: float | None = None
    # the most dangerous level this caller may run (None = any)
    max_level: SafetyLevel | None = None
    # the caller's IdP access token claims, for the policy's conditions (caller.claims)
    claims: Mapping[str, Any] = field(default_factory=dict)
