"""JSON parsing that refuses what other languages' parsers disagree on:
duplicate keys (which one wins?) and NaN/Infinity (not JSON at all). Tool
definitions and call arguments are hashed and validated, so they must mean
exactly one thing."""

from __future__ import annotations

import json
from typing import Any, NoReturn

from registry_server.errors import InvalidArgument, Violation


class _Rejected(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Rejected(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> NoReturn:
    raise _Rejected(f"{name} is not valid JSON")


def loads(text: str, field: str) -> Any:
    """Parse ``text`` or raise InvalidArgument naming ``field`` and the rule."""
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _Rejected as exc:
        raise InvalidArgument(f"{field}: {exc}", [Violation(field, str(exc))]) from None
    except (json.JSONDecodeError, RecursionError) as exc:
        rule = (
            f"not valid JSON ({exc})"
            if isinstance(exc, json.JSONDecodeError)
            else "nested too deeply"
        )
        raise InvalidArgument(f"{field}: {rule}", [Violation(field, rule)]) from None


def loads_object(
    text: str, field: str, *, empty_is: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Parse a JSON object; ``empty_is`` (when given) stands for blank text."""
    if empty_is is not None and not text.strip():
        return dict(empty_is)
    value = loads(text, field)
    if not isinstance(value, dict):
        rule = f"must be a JSON object, got {type_name(value)}"
        raise InvalidArgument(f"{field}: {rule}", [Violation(field, rule)])
    return value


def dumps(value: Any) -> str:
    """Compact JSON that keeps key order and non-ASCII text as given."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def type_name(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    for py_type, name in names.items():
        if isinstance(value, py_type):
            return name
    return "number"
