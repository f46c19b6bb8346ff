"""Small builders for test data (plain data, no fakes)."""

from __future__ import annotations

import copy
import hashlib
from typing import Any

from registry_server.domain.models import ToolDefinition, parse_definition


def sha(token: str) -> str:
    """The ``token_sha256`` a policy holds for the bearer token ``token``."""
    return hashlib.sha256(token.encode()).hexdigest()


def manifest(**overrides: Any) -> dict[str, Any]:
    """A valid manifest-shaped mapping; overrides replace top-level keys."""
    base: dict[str, Any] = {
        "name": "echo",
        "description": "Returns its arguments.",
        "parameters": {
            "type": "object",
            "properties": {"message": {"type": "string"}},
            "required": ["message"],
        },
        "safety_level": "safe",
        "categories": ["debug"],
        "sandbox": {"image": "toolreg/base", "command": ["cat"]},
    }
    out = copy.deepcopy(base)
    out.update(overrides)
    return out


def tool(**overrides: Any) -> ToolDefinition:
    return parse_definition(manifest(**overrides))


def example_tools_policy(
    audience: str,
    approver_keys: dict[str, str],
    clients: list[dict[str, Any]],
    **settings: Any,
) -> dict[str, Any]:
    """A policy for a server of examples/tools: the approvers (id -> public key)
    in group security, one of whom must approve write_file; ``clients`` as given
    (see ``token_client``); ``settings`` are further top-level keys."""
    return {
        "audience": audience,
        **settings,
        "approvers": [
            {"id": who, "public_key": key, "groups": ["security"]}
            for who, key in approver_keys.items()
        ],
        "approval_rules": [
            {
                "match": {"tool": "write_file"},
                "approvals_required": 1,
                "groups": ["security"],
                "max_token_ttl_s": 600,
            },
        ],
        "clients": clients,
    }


def token_client(
    client_id: str, token: str, roles: list[str], max_level: str | None = None
) -> dict[str, Any]:
    """A policy client entry identified by a bearer token."""
    entry: dict[str, Any] = {"id": client_id, "token_sha256": sha(token), "roles": roles}
    if max_level is not None:
        entry["max_safety_level"] = max_level
    return entry
