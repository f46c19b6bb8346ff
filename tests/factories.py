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
