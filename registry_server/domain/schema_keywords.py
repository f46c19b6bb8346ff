"""JSON Schema keywords whose cost is bounded, for schemas nobody trusts.

jsonschema's own keywords match ``pattern``, ``patternProperties`` and (via
``additionalProperties`` / ``unevaluatedProperties``) pattern keys with
Python's backtracking ``re``: ``^(a+)+$`` against 28 ``a``s and ``!`` holds the
GIL for minutes. Its ``uniqueItems`` is quadratic for objects and its
``unevaluated*`` keywords are quadratic in the instance size. Here those
keywords use RE2 (linear time in the text) and sets.

Linear per keyword is not enough: a schema whose ``anyOf`` branches share
subschemas is evaluated exponentially often. So every keyword spends from a
per-validation step budget (``metered``); running out raises
``EvaluationBudgetExceeded`` instead of freezing a worker.
"""

from __future__ import annotations

import contextlib
import contextvars
import reprlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import re2
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

if not hasattr(re2, "Options"):  # pragma: no cover - a different package named re2
    # Other PyPI packages install a module "re2" too, and some quietly fall
    # back to Python's re for patterns RE2 rejects: exactly what must not happen.
    raise ImportError("toolreg needs google-re2 (pip install google-re2), not another re2")

MAX_CACHED_PATTERNS = 128  # compiled RE2 programs kept, each up to RE2_MAX_MEM_BYTES
RE2_MAX_MEM_BYTES = 8 * 1024 * 1024  # bytes one program and its DFA cache may use (RE2's default)
# Steps per validation; a step is one keyword applied (2-5 µs), so this is a
# few seconds of CPU: about what the largest legitimate arguments need.
MAX_EVALUATION_STEPS = 2_000_000  # steps
REGEX_WORK_PER_STEP = 4_096  # RE2 program instructions times characters searched, per step
MESSAGE_CHARS_PER_STEP = 256  # characters of error message built per step
REFERENCE_STEPS = 12  # steps one $ref / $dynamicRef costs (lookup and new resolver, ~40 µs)
SUBSCHEMA_STEPS = 2  # steps per subschema allOf / anyOf / oneOf descends into

# What jsonschema calls with (validator, keyword value, instance, schema).
Keyword = Callable[[Any, Any, Any, Any], Iterable[ValidationError] | None]


class EvaluationBudgetExceeded(Exception):
    """Validation needed more than its step budget."""


class Meter:
    """Steps left in one validation; not shared between threads."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def spend(self, steps: int) -> None:
        self.left -= steps
        if self.left < 0:
            raise EvaluationBudgetExceeded(f"needs more than {self.limit} evaluation steps")


# The meter of the validation running in this thread (or task). jsonschema
# passes nothing of ours down to keywords, so the budget travels here; it is
# set and reset around one validation by ``metered`` and never shared.
_current_meter: contextvars.ContextVar[Meter | None] = contextvars.ContextVar(
    "schema_evaluation_meter", default=None
)


@contextlib.contextmanager
def metered(limit: int | None = None) -> Iterator[Meter]:
    """Run the validation inside the block on a budget of ``limit`` steps
    (default MAX_EVALUATION_STEPS, read when called)."""
    meter = Meter(MAX_EVALUATION_STEPS if limit is None else limit)
    token = _current_meter.set(meter)
    try:
        yield meter
    finally:
        _current_meter.reset(token)


def _spend(steps: int) -> None:
    meter = _current_meter.get()
    if meter is not None and steps:
        meter.spend(steps)


# ---------------------------------------------------------------- patterns


def re2_error_text(exc: BaseException) -> str:
    """RE2's reason: its errors carry bytes, so str(exc) would print b'...'."""
    arg = exc.args[0] if exc.args else exc
    return arg.decode("utf-8", "replace") if isinstance(arg, bytes) else str(arg)


def _options() -> re2.Options:
    options = re2.Options()
    options.max_mem = RE2_MAX_MEM_BYTES
    # RE2 would log every rejected pattern to stderr; the caller reports it.
    options.log_errors = False
    return options


def ecma_to_re2(pattern: str) -> str:
    """JSON Schema patterns are ECMA-262; RE2 spells ``\\uXXXX`` (and
    ``\\u{X...}``) as ``\\x{X...}``. A surrogate pair becomes its code point.
    Everything else is passed through for RE2 to accept or reject."""
    out: list[str] = []
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char != "\\" or i + 1 == len(pattern):
            out.append(char)
            i += 1
            continue
        code, end = _unicode_escape(pattern, i)
        if code is None:
            out.append(pattern[i : i + 2])  # any other escape, \\ included
            i += 2
            continue
        low, after = _unicode_escape(pattern, end)
        if 0xD800 <= code <= 0xDBFF and low is not None and 0xDC00 <= low <= 0xDFFF:
            code, end = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00), after
        out.append(f"\\x{{{code:X}}}")
        i = end
    return "".join(out)


def _unicode_escape(pattern: str, i: int) -> tuple[int | None, int]:
    """The code point of a ``\\uXXXX`` / ``\\u{X...}`` escape at ``i`` and
    the index after it, or (None, i)."""
    if not pattern.startswith("\\u", i):
        return None, i
    if pattern.startswith("{", i + 2):
        close = pattern.find("}", i + 3)
        digits = pattern[i + 3 : close] if close > 0 else ""
        end = close + 1
    else:
        digits = pattern[i + 2 : i + 6]
        end = i + 6
        if len(digits) != 4:
            return None, i
    if not digits or len(digits) > 6 or any(c not in "0123456789abcdefABCDEF" for c in digits):
        return None, i
    return int(digits, 16), end


class _PatternCache:
    """Compiled RE2 programs by pattern text, least recently used dropped first."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._programs: OrderedDict[str, re2._Regexp[str]] = OrderedDict()

    def get(self, pattern: str) -> re2._Regexp[str]:
        with self._lock:
            program = self._programs.get(pattern)
            if program is not None:
                self._programs.move_to_end(pattern)
                return program
        # Compile outside the lock: it can take milliseconds. Never falls back
        # to Python's re: what RE2 cannot compile raises re2.error.
        program = re2.compile(ecma_to_re2(pattern), _options())
        with self._lock:
            self._programs[pattern] = program
            while len(self._programs) > self._capacity:
                self._programs.popitem(last=False)
        return program


_patterns = _PatternCache(MAX_CACHED_PATTERNS)


def compile_pattern(pattern: str) -> re2._Regexp[str]:
    """The RE2 program for an ECMA-262 ``pattern``; raises re2.error."""
    return _patterns.get(pattern)


def pattern_search(pattern: str, text: str) -> bool:
    """Whether ``pattern`` matches anywhere in ``text`` (jsonschema's re.search)."""
    program = compile_pattern(pattern)
    # Charged before searching: where the DFA runs out of memory RE2 falls
    # back to its NFA, which costs program size times text length.
    _spend(1 + len(text) * program.programsize // REGEX_WORK_PER_STEP)
    return program.search(text) is not None


# ---------------------------------------------------------------- equality


def _canonical(value: Any) -> Hashable:
    """A hashable form equal exactly when jsonschema's ``equal`` says so:
    1 == 1.0, true != 1, object key order ignored. Numbers become decimal
    text, so the set it goes into hashes them with the randomized str hash
    (int hashes are predictable: colliding ints would make the set quadratic)."""
    _spend(1)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return ("n", _number_text(value))
    if isinstance(value, str):
        return ("s", value)
    if isinstance(value, list):
        return ("a", tuple(_canonical(item) for item in value))
    if isinstance(value, dict):
        return ("o", frozenset((key, _canonical(item)) for key, item in value.items()))
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def _number_text(number: int | float) -> str:
    # An integral float equals the int with the same exact value (2.0**60 ==
    # 2**60, but 2**53 + 1 != 2.0**53 + 1), so compare it as that int.
    if isinstance(number, float) and number.is_integer():
        return str(int(number))
    return repr(number)


def json_equal(one: Any, two: Any) -> bool:
    """jsonschema's ``equal`` (true != 1, 1 == 1.0), charging a step per value."""
    _spend(1)
    if isinstance(one, str) or isinstance(two, str):
        return bool(one == two)
    if isinstance(one, list) and isinstance(two, list):
        return len(one) == len(two) and all(json_equal(a, b) for a, b in zip(one, two, strict=True))
    if isinstance(one, dict) and isinstance(two, dict):
        return one.keys() == two.keys() and all(json_equal(v, two[k]) for k, v in one.items())
    if isinstance(one, bool) or isinstance(two, bool):
        return one is two
    if isinstance(one, list | dict) or isinstance(two, list | dict):
        return False
    return bool(one == two)


# ---------------------------------------------------------------- keywords
# Ports of jsonschema's keywords (same semantics and messages, except that
# instance reprs in enum/const/uniqueItems messages are shortened).


def unique_items(
    validator: Any, unique: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not unique or not validator.is_type(instance, "array"):
        return
    seen: set[Hashable] = set()
    for item in instance:
        key = _canonical(item)
        if key in seen:
            yield ValidationError(f"{reprlib.repr(instance)} has non-unique elements")
            return
        seen.add(key)


def enum(validator: Any, enums: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not any(json_equal(each, instance) for each in enums):
        yield ValidationError(f"{reprlib.repr(instance)} is not one of {reprlib.repr(enums)}")


def const(validator: Any, expected: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if not json_equal(instance, expected):
        yield ValidationError(f"{reprlib.repr(expected)} was expected")


def pattern(validator: Any, regex: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not pattern_search(regex, instance):
        yield ValidationError(f"{instance!r} does not match {regex!r}")


def pattern_properties(
    validator: Any, patterns: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for regex, subschema in patterns.items():
        for key, value in instance.items():
            if pattern_search(regex, key):
                yield from validator.descend(value, subschema, path=key, schema_path=regex)


def _first_errors(
    validator: Any, subschemas: Iterable[tuple[int, Any]], instance: Any
) -> tuple[list[ValidationError], Any]:
    """The first error of each subschema up to the first one ``instance``
    is valid under, and that subschema (None if there is none). Only the
    first error is computed (jsonschema computes them all), and its own
    context is dropped: kept, the contexts of nested anyOf/oneOf would hold
    every error of the whole evaluation."""
    failures: list[ValidationError] = []
    for index, subschema in subschemas:
        first = next(validator.descend(instance, subschema, schema_path=index), None)
        if first is None:
            return failures, subschema
        first.context = []
        failures.append(first)
    return failures, None


def _not_valid_under_any(instance: Any, failures: list[ValidationError]) -> ValidationError:
    error = ValidationError(f"{instance!r} is not valid under any of the given schemas")
    # What ValidationError(context=...) does, except that it would also keep
    # the list in error.args, out of reach of _first_errors.
    error.context = failures
    for failure in failures:
        failure.parent = error
    return error


def any_of(
    validator: Any, subschemas: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    failures, valid = _first_errors(validator, enumerate(subschemas), instance)
    if valid is None:
        yield _not_valid_under_any(instance, failures)


def one_of(
    validator: Any, subschemas: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    remaining = enumerate(subschemas)
    failures, valid = _first_errors(validator, remaining, instance)
    if valid is None:
        yield _not_valid_under_any(instance, failures)
        return
    also = [each for _, each in remaining if validator.evolve(schema=each).is_valid(instance)]
    if also:
        reprs = ", ".join(repr(each) for each in [*also, valid])
        yield ValidationError(f"{instance!r} is valid under each of {reprs}")


def _matches_any(patterns: Iterable[str], key: str) -> bool:
    # jsonschema searches "|".join(patterns): the same as searching each.
    return any(pattern_search(regex, key) for regex in patterns)


def _extras_msg(extras: list[Any]) -> tuple[str, str]:
    verb = "was" if len(extras) == 1 else "were"
    return ", ".join(repr(extra) for extra in extras), verb


def additional_properties(
    validator: Any, additional: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    properties = schema.get("properties", {})
    patterns = schema.get("patternProperties", {})
    extras = [k for k in instance if k not in properties and not _matches_any(patterns, k)]
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        if patterns:
            verb = "does" if len(extras) == 1 else "do"
            joined = ", ".join(repr(each) for each in sorted(extras))
            listed = ", ".join(repr(each) for each in sorted(patterns))
            yield ValidationError(f"{joined} {verb} not match any of the regexes: {listed}")
        else:
            error = "Additional properties are not allowed (%s %s unexpected)"
            yield ValidationError(error % _extras_msg(sorted(extras)))


def _is_valid(errors: Iterator[ValidationError]) -> bool:
    return next(errors, None) is None


def _referenced(validator: Any, schema: Any) -> Iterator[tuple[Any, Any]]:
    """(validator, schema) for each of ``$ref`` and ``$dynamicRef`` in ``schema``."""
    for keyword in ("$ref", "$dynamicRef"):
        ref = schema.get(keyword)
        if ref is not None:
            resolved = validator._resolver.lookup(ref)
            evolved = validator.evolve(schema=resolved.contents, _resolver=resolved.resolver)
            yield evolved, resolved.contents


def _evaluated_keys(validator: Any, instance: Any, schema: Any) -> set[str]:
    """jsonschema's find_evaluated_property_keys_by_schema, as a set, with RE2."""
    _spend(1)
    if validator.is_type(schema, "boolean"):
        return set()
    keys: set[str] = set()
    for evolved, target in _referenced(validator, schema):
        keys |= _evaluated_keys(evolved, instance, target)
    properties = schema.get("properties")
    if validator.is_type(properties, "object"):
        keys |= properties.keys() & instance.keys()
    for keyword in ("additionalProperties", "unevaluatedProperties"):
        if (subschema := schema.get(keyword)) is not None:
            keys.update(
                k for k, v in instance.items() if _is_valid(validator.descend(v, subschema))
            )
    if "patternProperties" in schema:
        keys.update(k for k in instance if _matches_any(schema["patternProperties"], k))
    for prop, subschema in schema.get("dependentSchemas", {}).items():
        if prop in instance:
            keys |= _evaluated_keys(validator, instance, subschema)
    for keyword in ("allOf", "oneOf", "anyOf"):
        for subschema in schema.get(keyword, []):
            if _is_valid(validator.descend(instance, subschema)):
                keys |= _evaluated_keys(validator, instance, subschema)
    for branch in _taken_branches(validator, instance, schema):
        keys |= _evaluated_keys(validator, instance, branch)
    return keys


def _taken_branches(validator: Any, instance: Any, schema: Any) -> list[Any]:
    """The subschemas of if/then/else that apply to ``instance``."""
    if "if" not in schema:
        return []
    if validator.evolve(schema=schema["if"]).is_valid(instance):
        return [schema["if"]] + ([schema["then"]] if "then" in schema else [])
    return [schema["else"]] if "else" in schema else []


def unevaluated_properties(
    validator: Any, unevaluated: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    evaluated = _evaluated_keys(validator, instance, schema)
    failed = [
        prop
        for prop in instance
        if prop not in evaluated
        and not _is_valid(
            validator.descend(instance[prop], unevaluated, path=prop, schema_path=prop)
        )
    ]
    if not failed:
        return
    if unevaluated is False:
        error = "Unevaluated properties are not allowed (%s %s unexpected)"
        yield ValidationError(error % _extras_msg(sorted(failed)))
    else:
        error = (
            "Unevaluated properties are not valid under the given schema"
            " (%s %s unevaluated and invalid)"
        )
        yield ValidationError(error % _extras_msg(failed))


def _evaluated_indexes(validator: Any, instance: Any, schema: Any) -> set[int]:
    """jsonschema's find_evaluated_item_indexes_by_schema, as a set."""
    _spend(1)
    if validator.is_type(schema, "boolean"):
        return set()
    if "items" in schema:
        return set(range(len(instance)))
    indexes: set[int] = set()
    for evolved, target in _referenced(validator, schema):
        indexes |= _evaluated_indexes(evolved, instance, target)
    indexes.update(range(len(schema.get("prefixItems", []))))
    for branch in _taken_branches(validator, instance, schema):
        indexes |= _evaluated_indexes(validator, instance, branch)
    for keyword in ("contains", "unevaluatedItems"):
        if keyword in schema:
            evolved = validator.evolve(schema=schema[keyword])
            indexes.update(k for k, v in enumerate(instance) if evolved.is_valid(v))
    for keyword in ("allOf", "oneOf", "anyOf"):
        for subschema in schema.get(keyword, []):
            if _is_valid(validator.descend(instance, subschema)):
                indexes |= _evaluated_indexes(validator, instance, subschema)
    return indexes


def unevaluated_items(
    validator: Any, unevaluated: Any, instance: Any, schema: Any
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "array"):
        return
    evaluated = _evaluated_indexes(validator, instance, schema)
    extras = [item for index, item in enumerate(instance) if index not in evaluated]
    if extras:
        error = "Unevaluated items are not allowed (%s %s unexpected)"
        yield ValidationError(error % _extras_msg(extras))


def _weight(name: str, value: Any) -> int:
    """Steps one use of keyword ``name`` with ``value`` costs, besides the
    keywords it leads to."""
    if name in ("$ref", "$dynamicRef"):
        return REFERENCE_STEPS
    if name in ("allOf", "anyOf", "oneOf") and isinstance(value, list):
        return 1 + SUBSCHEMA_STEPS * len(value)
    return 1


def _metered(name: str, keyword: Keyword) -> Keyword:
    """``keyword`` spending its weight in steps per use, and a step per
    MESSAGE_CHARS_PER_STEP of each error message it yields (messages repr
    the instance, which may be large)."""

    def apply(validator: Any, value: Any, instance: Any, schema: Any) -> Iterator[ValidationError]:
        meter = _current_meter.get()
        if meter is not None:
            meter.spend(_weight(name, value))
        for error in keyword(validator, value, instance, schema) or ():
            if meter is not None:
                meter.spend(len(error.message) // MESSAGE_CHARS_PER_STEP)
            yield error

    return apply


_REPLACED: dict[str, Keyword] = {
    "additionalProperties": additional_properties,
    "anyOf": any_of,
    "const": const,
    "enum": enum,
    "oneOf": one_of,
    "pattern": pattern,
    "patternProperties": pattern_properties,
    "unevaluatedItems": unevaluated_items,
    "unevaluatedProperties": unevaluated_properties,
    "uniqueItems": unique_items,
}


def _all_keywords() -> dict[str, Keyword]:
    """Every draft 2020-12 keyword, metered; the ones above replaced."""
    keywords: dict[str, Keyword] = {}
    for name, function in Draft202012Validator.VALIDATORS.items():
        original: Keyword = function
        keywords[name] = _metered(name, _REPLACED.get(name, original))
    return keywords


KEYWORDS = _all_keywords()
