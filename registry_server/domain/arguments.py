"""Checking a call's arguments before any container starts.

Both the arguments and (since anyone with the register role writes it) the
tool's schema are untrusted: the arguments' shape is bounded before the
schema sees them, the schema is evaluated by ``schema_safety`` (linear-time
regexes, a step budget, no fetching), and whatever goes wrong becomes an
INVALID_ARGUMENT naming ``arguments_json``, never an INTERNAL error.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Any, NoReturn

import rfc8785
from jsonschema.protocols import Validator

from registry_server.domain import schema_safety, strict_json
from registry_server.domain.errors import InvalidArgument, Violation
from registry_server.domain.models import ToolDefinition

MAX_ARGUMENTS_BYTES = 1024 * 1024  # bytes of arguments JSON per call
MAX_REPORTED_VIOLATIONS = 20  # schema errors listed back to the model
MAX_VIOLATION_CHARS = 240  # characters of one reported path or rule (they repr the instance)

FIELD = "arguments_json"


@dataclass(frozen=True, slots=True)
class ParsedArguments:
    """A call's arguments, checked against its tool's schema."""

    value: dict[str, Any]  # the arguments object
    canonical: bytes  # its RFC 8785 canonical JSON: what the sandbox reads, what tokens sign
    digest: str  # sha256 hex of ``canonical``


class _ValidatorCache:
    """Compiled validators by tool name, for the tool's current digest only
    (compiling costs more than validating); replaced definitions are dropped,
    so the cache never holds more than one validator per tool."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_name: dict[str, tuple[str, Validator]] = {}

    def get(self, tool: ToolDefinition) -> Validator:
        with self._lock:
            cached = self._by_name.get(tool.name)
            if cached is not None and cached[0] == tool.digest:
                return cached[1]
        validator = schema_safety.new_validator(tool.parameters)
        with self._lock:
            self._by_name[tool.name] = (tool.digest, validator)
        return validator


_validators = _ValidatorCache()


def arguments_digest(arguments: dict[str, Any]) -> str:
    """sha256 hex of the RFC 8785 canonical JSON (what approval tokens sign)."""
    return hashlib.sha256(rfc8785.dumps(arguments)).hexdigest()


def utf8_size_over(text: str, limit: int) -> bool:
    """Whether ``text`` is more than ``limit`` bytes of UTF-8, without encoding
    a large text to find out: an ASCII text's length is its size (isascii is
    a flag CPython keeps), and any text is at least as many bytes as
    characters and at most four times as many."""
    chars = len(text)
    if chars > limit or text.isascii():
        return chars > limit
    if 4 * chars <= limit:
        return False
    return len(text.encode("utf-8", "surrogatepass")) > limit


def check_size(text: str) -> None:
    """InvalidArgument when the arguments' text is over MAX_ARGUMENTS_BYTES."""
    if utf8_size_over(text, MAX_ARGUMENTS_BYTES):
        _reject(f"larger than {MAX_ARGUMENTS_BYTES} bytes")


def parse_arguments(tool: ToolDefinition, text: str) -> ParsedArguments:
    """The checked arguments, or InvalidArgument naming every problem by its
    JSON path. Shape first (size, nesting, lone surrogates), then the schema."""
    check_size(text)
    arguments = strict_json.loads_object(text, FIELD, empty_is={})
    problem = strict_json.structure_problem(arguments)
    if problem:
        _reject(problem)
    _check_against_schema(tool, arguments)
    try:
        canonical = rfc8785.dumps(arguments)
    except (rfc8785.IntegerDomainError, rfc8785.FloatDomainError) as exc:
        _reject(f"a number outside the range every JSON reader agrees on ({exc})")
    return ParsedArguments(arguments, canonical, hashlib.sha256(canonical).hexdigest())


def _check_against_schema(tool: ToolDefinition, arguments: dict[str, Any]) -> None:
    try:
        errors, total = schema_safety.validation_errors(
            _validators.get(tool), arguments, MAX_REPORTED_VIOLATIONS
        )
    except schema_safety.SchemaEvaluationError as exc:
        _reject(f"the parameters schema of tool '{tool.name}' cannot be checked: {exc}")
    if errors:
        violations = [Violation(_clip(e.json_path), _clip(e.message)) for e in errors]
        more = total - len(violations)
        summary = "; ".join(str(v) for v in violations) + (f"; and {more} more" if more else "")
        raise InvalidArgument(f"invalid arguments for tool '{tool.name}': {summary}", violations)


def _reject(rule: str) -> NoReturn:
    raise InvalidArgument(f"{FIELD}: {rule}", [Violation(FIELD, rule)]) from None


def _clip(text: str) -> str:
    # Messages repr the offending value, which may be a megabyte; a status
    # travels in gRPC trailers, which are limited to a few KiB.
    return text if len(text) <= MAX_VIOLATION_CHARS else text[:MAX_VIOLATION_CHARS] + "..."
