"""Checking a call's arguments before any container starts."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import rfc8785
from jsonschema import Draft202012Validator

from registry_server import strict_json
from registry_server.errors import InvalidArgument, Violation
from registry_server.models import ToolDefinition

MAX_ARGUMENTS_BYTES = 1024 * 1024  # bytes of arguments JSON per call
MAX_REPORTED_VIOLATIONS = 20  # schema errors listed back to the model


class _ValidatorCache:
    """Compiled validators by tool digest: compiling costs more than validating."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_digest: dict[str, Draft202012Validator] = {}

    def get(self, tool: ToolDefinition) -> Draft202012Validator:
        with self._lock:
            validator = self._by_digest.get(tool.digest)
            if validator is None:
                validator = Draft202012Validator(tool.parameters)
                self._by_digest[tool.digest] = validator
            return validator


_validators = _ValidatorCache()


def arguments_digest(arguments: dict[str, Any]) -> str:
    """sha256 hex of the RFC 8785 canonical JSON (what approval tokens sign)."""
    return hashlib.sha256(rfc8785.dumps(arguments)).hexdigest()


def parse_arguments(tool: ToolDefinition, text: str) -> tuple[dict[str, Any], str]:
    """The arguments object and its digest, or InvalidArgument naming every
    problem by its JSON path."""
    if len(text.encode()) > MAX_ARGUMENTS_BYTES:
        rule = f"larger than {MAX_ARGUMENTS_BYTES} bytes"
        raise InvalidArgument(f"arguments_json: {rule}", [Violation("arguments_json", rule)])
    arguments = strict_json.loads_object(text, "arguments_json", empty_is={})
    errors = sorted(_validators.get(tool).iter_errors(arguments), key=lambda e: e.json_path)
    if errors:
        violations = [Violation(e.json_path, e.message) for e in errors[:MAX_REPORTED_VIOLATIONS]]
        more = len(errors) - len(violations)
        summary = "; ".join(str(v) for v in violations) + (f"; and {more} more" if more else "")
        raise InvalidArgument(f"invalid arguments for tool '{tool.name}': {summary}", violations)
    try:
        digest = arguments_digest(arguments)
    except (rfc8785.IntegerDomainError, rfc8785.FloatDomainError) as exc:
        rule = f"a number outside the range every JSON reader agrees on ({exc})"
        raise InvalidArgument(
            f"arguments_json: {rule}", [Violation("arguments_json", rule)]
        ) from None
    return arguments, digest
