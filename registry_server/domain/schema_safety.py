"""Parameter schemas from untrusted clients, made safe to evaluate.

At registration (``schema_problems``): the schema must be valid draft 2020-12
with every ``pattern`` and ``patternProperties`` key compilable by RE2, every
``$ref`` / ``$dynamicRef`` a local reference that resolves inside the schema,
and no cycle of references that consumes no input (it would recurse for
ever). At execution (``validation_errors``): the RE2, linear, step-metered
keywords of ``schema_keywords``, a registry that never fetches anything, and
every failure of the schema itself raised as ``SchemaEvaluationError``.

Depth, lone surrogates and size are checked before any of this, by
``strict_json.structure_problem`` and the callers.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import re2
import referencing
import referencing.exceptions
import referencing.jsonschema
from jsonschema import Draft202012Validator, FormatChecker, validators
from jsonschema.exceptions import SchemaError, ValidationError
from jsonschema.protocols import Validator
from referencing.jsonschema import EMPTY_REGISTRY, Schema, SchemaRegistry

from registry_server.domain import schema_keywords
from registry_server.domain.schema_keywords import EvaluationBudgetExceeded, re2_error_text

if TYPE_CHECKING:  # referencing exports Resolver only from its private module
    from referencing._core import Resolver

MAX_REFERENCE_PROBLEMS = 5  # unresolvable references listed at once
MAX_REASON_CHARS = 300  # characters of a library's message quoted back (they repr whole schemas)

_SPEC = referencing.jsonschema.DRAFT202012

# Draft 2020-12 with RE2 patterns, linear uniqueItems/unevaluated*, and a step budget.
SafeValidator: type[Validator] = validators.extend(  # type: ignore[no-untyped-call]
    Draft202012Validator, schema_keywords.KEYWORDS
)

# Where subschemas sit in a draft 2020-12 schema. "In place" keywords apply
# their subschemas to the same instance; a cycle through only those (and
# references) never ends. The others move to a child value or a key, or are
# never applied (definitions, contentSchema).
_IN_PLACE_ONE: tuple[str, ...] = ("not", "if", "then", "else")
_IN_PLACE_MANY: tuple[str, ...] = ("allOf", "anyOf", "oneOf")
_IN_PLACE_MAP: tuple[str, ...] = ("dependentSchemas",)
_OTHER_ONE: tuple[str, ...] = (
    "additionalProperties",
    "contains",
    "contentSchema",
    "items",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_OTHER_MANY: tuple[str, ...] = ("prefixItems",)
_OTHER_MAP: tuple[str, ...] = ("$defs", "definitions", "patternProperties", "properties")
_REFERENCES = ("$ref", "$dynamicRef")


class SchemaEvaluationError(Exception):
    """The schema itself could not be evaluated against an instance."""


def _is_re2_pattern(instance: object) -> bool:
    if isinstance(instance, str):
        schema_keywords.compile_pattern(instance)  # raises re2.error
    return True


def _regex_format_checker() -> FormatChecker:
    """Checks the metaschema's "format": "regex" (pattern values and
    patternProperties keys) by compiling with RE2, not Python's re. Draft
    2020-12's metaschema uses no other format the default checker knows."""
    checker = FormatChecker(formats=())
    checker.checks("regex", raises=(re2.error, UnicodeError))(_is_re2_pattern)
    return checker


REGEX_FORMAT_CHECKER = _regex_format_checker()


def new_validator(schema: Mapping[str, Any]) -> Validator:
    """A validator for a schema ``schema_problems`` accepted. Its registry
    holds only the schema (crawled once, so anchors are not searched for on
    every lookup) and has no retriever: jsonschema's default would fetch
    remote references over HTTP."""
    return SafeValidator(schema, registry=_registry_of(schema))


def _registry_of(schema: Mapping[str, Any]) -> SchemaRegistry:
    resource: referencing.Resource[Schema] = _SPEC.create_resource(schema)
    registry: SchemaRegistry = EMPTY_REGISTRY.with_resource(resource.id() or "", resource)
    return registry.crawl()


def validation_errors(
    validator: Validator, instance: Any, limit: int
) -> tuple[list[ValidationError], int]:
    """The first ``limit`` errors by JSON path and how many there are in all.
    Raises SchemaEvaluationError when the schema cannot be evaluated: more
    than MAX_EVALUATION_STEPS, a reference that does not resolve, nesting
    beyond the interpreter's stack, or anything else jsonschema raises."""
    counter = _Counter()
    try:
        with schema_keywords.metered():
            errors = counter.count(validator.iter_errors(instance))
            first = heapq.nsmallest(limit, errors, key=lambda e: e.json_path)
    except EvaluationBudgetExceeded as exc:
        raise SchemaEvaluationError(f"evaluating it for these arguments {exc}") from None
    except referencing.exceptions.Unresolvable as exc:
        reason = _clip(str(exc))
        raise SchemaEvaluationError(f"a reference does not resolve ({reason})") from None
    except RecursionError:
        raise SchemaEvaluationError("it nests too deeply to evaluate") from None
    except re2.error as exc:
        reason = re2_error_text(exc)
        raise SchemaEvaluationError(f"a pattern RE2 cannot compile ({reason})") from None
    except Exception as exc:  # never an INTERNAL error for what a client sent
        reason = _clip(f"{type(exc).__name__}: {exc}")
        raise SchemaEvaluationError(f"evaluating it failed ({reason})") from None
    return first, counter.total


class _Counter:
    def __init__(self) -> None:
        self.total = 0

    def count(self, errors: Iterator[ValidationError]) -> Iterator[ValidationError]:
        for error in errors:
            self.total += 1
            yield error


# ---------------------------------------------------------------- registration


def schema_problems(schema: Mapping[str, Any]) -> list[str]:
    """Why ``schema`` is not a safe draft 2020-12 schema (empty = fine).
    ``schema`` must already have passed ``strict_json.structure_problem``."""
    try:
        Draft202012Validator.check_schema(schema, format_checker=REGEX_FORMAT_CHECKER)
    except SchemaError as exc:
        return [_describe(exc)]
    return reference_problems(schema)


def _describe(exc: SchemaError) -> str:
    where = pointer(exc.absolute_path)
    message = exc.message
    if exc.validator == "format" and exc.validator_value == "regex":
        # A patternProperties key is checked by "propertyNames": the path
        # is the object, so say it is about the key.
        what = "key" if "propertyNames" in exc.absolute_schema_path else "pattern"
        reason = re2_error_text(exc.cause) if exc.cause else "not a regex"
        message = f"{what} {exc.instance!r} is not a regex RE2 accepts ({reason})"
    return f"not a valid JSON Schema (draft 2020-12) at '{where}': {_clip(message)}"


def _clip(text: str) -> str:
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + "..."


def pointer(parts: Iterable[str | int]) -> str:
    """A JSON Pointer (RFC 6901) for a path, clipped for a message; the
    whole document is shown as '/'."""
    escaped = (str(p).replace("~", "~0").replace("/", "~1") for p in parts)
    return _clip("".join("/" + p for p in escaped) or "/")


@dataclass
class _Node:
    """One subschema (an object; boolean schemas reference nothing)."""

    contents: dict[str, Any]
    path: tuple[str | int, ...]
    resolver: Resolver[Schema]
    in_place: list[int] = field(default_factory=list)  # indexes of nodes applied in place
    references: dict[int, str] = field(default_factory=dict)  # target index -> $ref/$dynamicRef


@dataclass
class _Graph:
    nodes: list[_Node] = field(default_factory=list)
    index: dict[int, int] = field(default_factory=dict)  # id(contents) -> node index
    problems: list[str] = field(default_factory=list)

    def node_of(self, contents: Any) -> int | None:
        found = self.index.get(id(contents))
        return found if found is not None and self.nodes[found].contents is contents else None


def reference_problems(schema: Mapping[str, Any]) -> list[str]:
    """Unresolvable, remote or non-schema references, then any cycle of
    in-place applicators and references (which would never end)."""
    graph = _collect(schema)
    _link_references(graph)
    if graph.problems:
        return graph.problems[:MAX_REFERENCE_PROBLEMS]
    cycle = _in_place_cycle(graph)
    return [_describe_cycle(graph, cycle)] if cycle else []


def _describe_cycle(graph: _Graph, cycle: list[int]) -> str:
    route = " -> ".join(f"'{pointer(graph.nodes[i].path)}'" for i in cycle)
    used = [
        pointer((*graph.nodes[a].path, graph.nodes[a].references[b]))
        for a, b in itertools.pairwise(cycle)
        if b in graph.nodes[a].references
    ]
    through = ", ".join(f"'{where}'" for where in used)
    return (
        f"a cycle of references that consumes no input: {route} (through {through});"
        " validating would recurse for ever"
    )


def _collect(schema: Mapping[str, Any]) -> _Graph:
    """Every object subschema, with the resolver in scope there (nested
    $id change the base URI) and its in-place children. Iterative."""
    graph = _Graph()
    root = _registry_of(schema).resolver(base_uri=_SPEC.create_resource(schema).id() or "")
    pending: list[tuple[Any, tuple[str | int, ...], Resolver[Schema], int | None]]
    pending = [(schema, (), root, None)]
    while pending:
        contents, path, resolver, parent = pending.pop()
        if not isinstance(contents, dict):
            continue
        resolver = resolver.in_subresource(_SPEC.create_resource(contents))
        number = len(graph.nodes)
        graph.nodes.append(_Node(contents, path, resolver))
        graph.index[id(contents)] = number
        if parent is not None:
            graph.nodes[parent].in_place.append(number)
        for sub_path, child, in_place in _subschemas(contents):
            pending.append((child, path + sub_path, resolver, number if in_place else None))
    return graph


def _subschemas(
    contents: dict[str, Any],
) -> Iterator[tuple[tuple[str | int, ...], Any, bool]]:
    """(relative path, subschema, applied in place) for each subschema."""
    for keywords, in_place in ((_IN_PLACE_ONE, True), (_OTHER_ONE, False)):
        for keyword in keywords:
            if keyword in contents:
                yield (keyword,), contents[keyword], in_place
    for keywords, in_place in ((_IN_PLACE_MANY, True), (_OTHER_MANY, False)):
        for keyword in keywords:
            for i, child in enumerate(contents.get(keyword, [])):
                yield (keyword, i), child, in_place
    for keywords, in_place in ((_IN_PLACE_MAP, True), (_OTHER_MAP, False)):
        for keyword in keywords:
            for name, child in contents.get(keyword, {}).items():
                yield (keyword, name), child, in_place


def _link_references(graph: _Graph) -> None:
    """Add each reference's target(s) as in-place edges, or a problem."""
    dynamic_anchors: dict[str, list[int]] = {}
    for number, node in enumerate(graph.nodes):
        name = node.contents.get("$dynamicAnchor")
        if isinstance(name, str):
            dynamic_anchors.setdefault(name, []).append(number)
    for node in list(graph.nodes):
        for keyword in _REFERENCES:
            ref = node.contents.get(keyword)
            if isinstance(ref, str):
                targets = _targets(graph, node, keyword, ref)
                if keyword == "$dynamicRef" and targets is not None:
                    # Resolved at run time against the dynamic scope: any
                    # subschema with this $dynamicAnchor may be the target.
                    targets += dynamic_anchors.get(ref.removeprefix("#"), [])
                node.in_place.extend(targets or [])
                node.references.update(dict.fromkeys(targets or [], keyword))


def _targets(graph: _Graph, node: _Node, keyword: str, ref: str) -> list[int] | None:
    where = f"'{pointer((*node.path, keyword))}'"
    if not ref.startswith("#"):
        graph.problems.append(
            f"{keyword} at {where} is {_clip(repr(ref))}: only references within the schema"
            " (starting with '#') are allowed; this server never fetches schemas"
        )
        return None
    try:
        target = node.resolver.lookup(ref).contents
    except referencing.exceptions.Unresolvable:
        graph.problems.append(
            f"{keyword} at {where}: {_clip(repr(ref))} points to nothing in this schema"
        )
        return None
    if isinstance(target, bool):
        return []  # true/false reference nothing further
    number = graph.node_of(target)
    if number is None:
        graph.problems.append(
            f"{keyword} at {where}: {_clip(repr(ref))} points to a value that is not a schema"
        )
        return None
    return [number]


def _in_place_cycle(graph: _Graph) -> list[int] | None:
    """A cycle of in-place edges as node indexes (first repeated last), or
    None. Iterative depth-first search."""
    new, open_, done = 0, 1, 2
    state = [new] * len(graph.nodes)
    for start in range(len(graph.nodes)):
        if state[start] != new:
            continue
        state[start] = open_
        route = [start]
        stack = [iter(graph.nodes[start].in_place)]
        while stack:
            step = next(stack[-1], None)
            if step is None:
                state[route.pop()] = done
                stack.pop()
            elif state[step] == open_:
                return [*route[route.index(step) :], step]
            elif state[step] == new:
                state[step] = open_
                route.append(step)
                stack.append(iter(graph.nodes[step].in_place))
    return None
