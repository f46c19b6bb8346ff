"""JSON parsing that refuses what other languages' parsers disagree on:
duplicate keys (which one wins?) and NaN/Infinity (not JSON at all). Tool
definitions and call arguments are hashed and validated, so they must mean
exactly one thing.

``structure_problem`` is the one walk over parsed JSON that both a tool's
parameters schema and a call's arguments get before anything evaluates them:
it bounds nesting (so nothing later recurses without limit) and refuses lone
surrogates (a ``"\\ud800"`` escape parses to a str that cannot be encoded as
UTF-8, so storing it or sending it back in a protobuf message would fail)."""

from __future__ import annotations

import json
import math
import re
from typing import Any, NoReturn

from registry_server.domain.errors import InvalidArgument, Violation

MAX_JSON_DEPTH = 32  # nesting levels of objects and arrays; the outermost one is level 1
MAX_POINTER_CHARS = 200  # characters of a JSON Pointer quoted back in a message

# Fixed, linear character class: safe to run with Python's re.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# A parent link and the key or index under it: a path costs O(1) per value.
_Path = tuple["_Path", str | int] | None


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
    except RecursionError:
        rule = "nested too deeply"
        raise InvalidArgument(f"{field}: {rule}", [Violation(field, rule)]) from None
    except ValueError as exc:
        # JSONDecodeError, and also the plain ValueError Python raises for an
        # integer of more than sys.get_int_max_str_digits() digits.
        rule = f"not valid JSON ({exc})"
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


def structure_problem(value: Any) -> str | None:
    """Why ``value`` (parsed JSON, or YAML) is not plain JSON this server can
    evaluate, store and send back, or None. Iterative: it never recurses, so
    it is safe on any nesting. Checks: nesting at most MAX_JSON_DEPTH levels,
    no lone surrogate in a key or string, string keys, finite numbers, and
    only JSON types (YAML can produce dates)."""
    stack: list[tuple[Any, int, _Path]] = [(value, 0, None)]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return f"a lone surrogate (an unpaired \\ud800-\\udfff escape) at {_pointer(path)}"
        elif isinstance(item, dict | list):
            if depth + 1 > MAX_JSON_DEPTH:
                return f"nested deeper than {MAX_JSON_DEPTH} levels at {_pointer(path)}"
            problem = _push_children(item, depth + 1, path, stack)
            if problem:
                return problem
        elif isinstance(item, float) and not math.isfinite(item):
            return f"NaN and Infinity are not JSON, at {_pointer(path)}"
        elif item is not None and not isinstance(item, bool | int | float):
            return f"a {type(item).__name__} is not a JSON value, at {_pointer(path)}"
    return None


def _push_children(
    item: dict[Any, Any] | list[Any], depth: int, path: _Path, stack: list[tuple[Any, int, _Path]]
) -> str | None:
    if isinstance(item, list):
        stack.extend((child, depth, (path, index)) for index, child in enumerate(item))
        return None
    for key, child in item.items():
        if not isinstance(key, str):
            return f"object keys must be strings, got {type(key).__name__} at {_pointer(path)}"
        if _LONE_SURROGATE.search(key):
            where = _pointer((path, key))
            return f"a lone surrogate (an unpaired \\ud800-\\udfff escape) in the key at {where}"
        stack.append((child, depth, (path, key)))
    return None


def _pointer(path: _Path) -> str:
    """The JSON Pointer (RFC 6901) of ``path``, quoted, printable and clipped."""
    parts: list[str] = []
    while path is not None:
        path, key = path
        parts.append(str(key).replace("~", "~0").replace("/", "~1"))
    text = "".join("/" + part for part in reversed(parts)) or "/"
    # A lone surrogate cannot go into a protobuf string: escape it.
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > MAX_POINTER_CHARS:
        text = text[:MAX_POINTER_CHARS] + "..."
    return f"'{text}'"
