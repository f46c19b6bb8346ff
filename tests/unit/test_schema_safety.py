"""Hostile parameter schemas and arguments: linear-time regexes, linear
uniqueItems, local acyclic references, bounded depth, no lone surrogates, a
step budget, and every problem an InvalidArgument naming its field."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from registry_server.domain import schema_keywords, schema_safety, strict_json
from registry_server.domain.arguments import ParsedArguments, parse_arguments
from registry_server.domain.errors import InvalidArgument, InvalidDefinition
from registry_server.domain.models import ToolDefinition, parse_definition
from tests.factories import manifest, tool

# Generous: the backtracking version of each case takes minutes to hours.
FAST_S = 5.0


def obj(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


def problem(schema: dict[str, Any]) -> str:
    """The one problem registration reports for ``schema`` (through the
    whole definition, so the field is checked too)."""
    with pytest.raises(InvalidDefinition) as info:
        parse_definition(manifest(parameters=schema))
    found = {v.field: v.description for v in info.value.violations}
    assert list(found) == ["parameters"], found
    return found["parameters"]


def accepted(schema: dict[str, Any]) -> ToolDefinition:
    return tool(parameters=schema)


def unchecked(schema: dict[str, Any]) -> ToolDefinition:
    """A definition whose schema skipped registration's checks (as one
    stored by an older server might have)."""
    return dataclasses.replace(tool(), parameters_json=json.dumps(schema), digest=str(id(schema)))


def call(t: ToolDefinition, arguments: Any) -> ParsedArguments:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return parse_arguments(t, text)


def call_problem(t: ToolDefinition, arguments: Any) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as info:
        call(t, arguments)
    return info.value


def nested(levels: int, leaf: Any = 1) -> Any:
    """``levels`` objects nested in each other, ``leaf`` innermost."""
    value = leaf
    for _ in range(levels):
        value = {"k": value}
    return value


# ---------------------------------------------------------------- patterns


def test_catastrophic_pattern_runs_in_linear_time() -> None:
    t = accepted(obj(x={"type": "string", "pattern": "^(a+)+$"}))
    started = time.monotonic()
    error = call_problem(t, {"x": "a" * 28 + "!"})
    assert time.monotonic() - started < 1.0
    assert error.violations[0].field == "$.x"
    assert "does not match" in error.violations[0].description
    assert call(t, {"x": "a" * 10_000}).value == {"x": "a" * 10_000}


def test_pattern_is_a_search_not_a_full_match() -> None:
    t = accepted(obj(x={"pattern": "b+"}))
    call(t, {"x": "abbbc"})
    call_problem(t, {"x": "ac"})


def test_pattern_properties_and_additional_properties_use_re2() -> None:
    t = accepted(
        {
            "type": "object",
            "patternProperties": {"^(x+)+_$": {"type": "integer"}},
            "additionalProperties": False,
        }
    )
    call(t, {"xx_": 1})
    assert call_problem(t, {"xx_": "s"}).violations[0].field == "$.xx_"
    started = time.monotonic()
    error = call_problem(t, {"x" * 28 + "!": 1})
    assert time.monotonic() - started < 1.0
    assert "do not match any of the regexes" in error.message or "does not match" in error.message


def test_unevaluated_properties_use_re2() -> None:
    t = accepted(
        {
            "type": "object",
            "patternProperties": {"^(a+)+$": True},
            "unevaluatedProperties": False,
        }
    )
    call(t, {"aaa": 1})
    started = time.monotonic()
    error = call_problem(t, {"a" * 28 + "!": 1})
    assert time.monotonic() - started < 1.0
    assert "Unevaluated properties are not allowed" in error.message


def test_patterns_speak_ecma_262_unicode() -> None:
    t = accepted(
        obj(
            ascii={"pattern": "^[\\u0000-\\u007f]*$"},
            e={"pattern": "^\\u00e9+$"},
            emoji={"pattern": "^\\ud83d\\ude00$"},
            one={"pattern": "^.$"},
            digit={"pattern": "^\\d$"},
            literal={"pattern": "^\\\\u0041$"},
        )
    )
    call(t, {"ascii": "plain", "e": "éé", "emoji": "😀", "one": "😀", "digit": "7"})
    call(t, {"literal": "\\u0041"})
    assert call_problem(t, {"ascii": "café"}).violations[0].field == "$.ascii"
    # As in ECMA-262 (not Python's re), \d is ASCII only.
    assert call_problem(t, {"digit": "٣"}).violations[0].field == "$.digit"


def test_ecma_escapes_become_re2_escapes() -> None:
    assert schema_keywords.ecma_to_re2("\\u00E9") == "\\x{E9}"
    assert schema_keywords.ecma_to_re2("\\u{1F600}") == "\\x{1F600}"
    assert schema_keywords.ecma_to_re2("\\ud83d\\ude00") == "\\x{1F600}"
    assert schema_keywords.ecma_to_re2("\\\\u0041") == "\\\\u0041"
    assert schema_keywords.ecma_to_re2("[\\d\\w]\\u12") == "[\\d\\w]\\u12"


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        ("(a)\\1", "invalid escape sequence"),
        ("(?=a)", "invalid perl operator"),
        ("(?<=a)b", "invalid perl operator"),
        ("a{1001}", "invalid repetition size"),
        ("[", "missing ]"),
    ],
)
def test_patterns_re2_cannot_compile_are_rejected_at_registration(
    pattern: str, reason: str
) -> None:
    rule = problem(obj(x={"type": "string", "pattern": pattern}))
    assert "at '/properties/x/pattern'" in rule
    assert "RE2" in rule and reason in rule


def test_pattern_property_keys_re2_cannot_compile_are_rejected() -> None:
    rule = problem({"type": "object", "patternProperties": {"(?=a)": {}}})
    assert "at '/patternProperties'" in rule
    assert "key '(?=a)'" in rule and "invalid perl operator" in rule


def test_a_nested_pattern_is_named_by_its_path() -> None:
    rule = problem(obj(x={"anyOf": [{"type": "string"}, {"pattern": "(a)\\1"}]}))
    assert "at '/properties/x/anyOf/1/pattern'" in rule


def test_a_pattern_that_slipped_through_is_invalid_argument_not_internal() -> None:
    error = call_problem(unchecked(obj(x={"pattern": "(?=a)"})), {"x": "a"})
    assert error.violations[0].field == "arguments_json"
    assert "parameters schema of tool 'echo'" in error.message
    assert "RE2" in error.message


# ---------------------------------------------------------------- references


def test_local_references_are_accepted_and_followed() -> None:
    t = accepted(
        {
            "type": "object",
            "$defs": {
                "name": {"type": "string", "minLength": 1},
                "tagged": {"$anchor": "count", "type": "integer"},
            },
            "properties": {"a": {"$ref": "#/$defs/name"}, "b": {"$ref": "#count"}},
        }
    )
    call(t, {"a": "x", "b": 2})
    assert call_problem(t, {"a": ""}).violations[0].field == "$.a"
    assert call_problem(t, {"b": "2"}).violations[0].field == "$.b"


@pytest.mark.parametrize(
    "ref",
    [
        "https://example.com/schema.json",
        "http://127.0.0.1:9/x",
        "other.json#/a",
        "https://json-schema.org/draft/2020-12/schema",
    ],
)
def test_remote_references_are_rejected(ref: str) -> None:
    rule = problem(obj(x={"$ref": ref}))
    assert "at '/properties/x/$ref'" in rule
    assert "never fetches" in rule


@pytest.mark.parametrize(
    ("ref", "words"),
    [
        ("#/$defs/missing", "points to nothing"),
        ("#nowhere", "points to nothing"),
        ("#/properties", "not a schema"),
    ],
)
def test_references_that_do_not_resolve_to_a_schema_are_rejected(ref: str, words: str) -> None:
    rule = problem(obj(x={"$ref": ref}))
    assert "at '/properties/x/$ref'" in rule and words in rule


def test_dynamic_references_must_be_local_too() -> None:
    rule = problem(obj(x={"$dynamicRef": "https://example.com/s#meta"}))
    assert "$dynamicRef at '/properties/x/$dynamicRef'" in rule


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        {"type": "object", "allOf": [{"$ref": "#"}]},
        {
            "type": "object",
            "$defs": {
                "a": {"anyOf": [{"$ref": "#/$defs/b"}]},
                "b": {"not": {"if": {"$ref": "#/$defs/a"}}},
            },
        },
        {
            "type": "object",
            "$defs": {
                "a": {"oneOf": [{"$ref": "#/$defs/b"}]},
                "b": {"then": {"else": {"$ref": "#/$defs/a"}}},
            },
        },
        {"type": "object", "dependentSchemas": {"x": {"$ref": "#"}}},
        {"type": "object", "$dynamicAnchor": "n", "allOf": [{"$dynamicRef": "#n"}]},
    ],
)
def test_reference_cycles_that_consume_no_input_are_rejected(schema: dict[str, Any]) -> None:
    rule = problem(schema)
    assert "a cycle of references that consumes no input" in rule
    # It names the $ref or $dynamicRef the cycle goes through.
    assert "/$ref'" in rule or "/$dynamicRef'" in rule


def test_recursion_through_child_values_is_accepted() -> None:
    t = accepted(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#"}},
            },
        }
    )
    tree = {"name": "root", "children": [{"name": "a", "children": [{"name": "b"}]}]}
    call(t, tree)
    bad = {"children": [{"children": [{"name": 5}]}]}
    assert call_problem(t, bad).violations[0].field == "$.children[0].children[0].name"


def test_dynamic_recursion_through_child_values_is_accepted() -> None:
    accepted(
        {
            "type": "object",
            "$dynamicAnchor": "node",
            "properties": {"kids": {"type": "array", "items": {"$dynamicRef": "#node"}}},
        }
    )


def test_unresolvable_reference_at_execution_is_invalid_argument() -> None:
    error = call_problem(unchecked(obj(x={"$ref": "#/$defs/gone"})), {"x": 1})
    assert error.violations[0].field == "arguments_json"
    assert "does not resolve" in error.message


def test_remote_reference_at_execution_is_never_fetched() -> None:
    # Port 9 (discard) on loopback: a fetch would hang or be refused; the
    # registry has no retriever, so it fails at once.
    started = time.monotonic()
    error = call_problem(unchecked(obj(x={"$ref": "http://127.0.0.1:9/s.json"})), {"x": 1})
    assert time.monotonic() - started < 1.0
    assert "does not resolve" in error.message


# ---------------------------------------------------------------- uniqueItems


@pytest.mark.parametrize(
    ("items", "unique"),
    [
        ([1, 1.0], False),
        ([True, 1], True),
        ([False, 0], True),
        ([None, False], True),
        ([{"a": 1, "b": 2}, {"b": 2, "a": 1}], False),
        ([[1, {"x": 1.0}], [1.0, {"x": 1}]], False),
        ([[1, 2], [2, 1]], True),
        (["1", 1], True),
        ([2**53 + 1, 2.0**53], True),
        ([2**60, 2.0**60], False),
        ([0.1, 0.1], False),
        ([{"a": [True]}, {"a": [1]}], True),
    ],
)
def test_unique_items_follows_json_schema_equality(items: list[Any], unique: bool) -> None:
    schema = {"type": "array", "uniqueItems": True}
    expected = Draft202012Validator(schema).is_valid(items)
    assert expected is unique  # the reference implementation agrees
    valid = not list(schema_safety.new_validator(schema).iter_errors(items))
    assert valid is unique


def test_unique_items_is_linear_for_many_distinct_objects() -> None:
    # Through the validator itself. 20,000 objects take about 0.1 s; comparing
    # them pairwise takes far longer than FAST_S: over 20 s with Python's own
    # ==, and jsonschema's quadratic uniqueItems about 9 s for 2,000 already.
    validator = schema_safety.new_validator({"type": "array", "uniqueItems": True})
    items = [{"k": i} for i in range(20_000)]
    started = time.monotonic()
    assert schema_safety.validation_errors(validator, items, 20) == ([], 0)
    assert time.monotonic() - started < FAST_S
    errors, total = schema_safety.validation_errors(validator, [*items, {"k": 5.0}], 20)
    assert total == 1 and "non-unique" in errors[0].message


def test_unevaluated_items_is_linear() -> None:
    t = accepted(
        obj(x={"type": "array", "prefixItems": [True], "items": True, "unevaluatedItems": False})
    )
    # 60,000 items take about 0.15 s; jsonschema's quadratic unevaluatedItems
    # takes 20-40 s for them.
    started = time.monotonic()
    call(t, {"x": [0] * 60_000})
    assert time.monotonic() - started < FAST_S


# ---------------------------------------------------------------- depth, surrogates


def test_schema_depth_is_bounded() -> None:
    # The schema object is level 1; "properties" holds the rest.
    deepest = {"type": "object", "properties": nested(strict_json.MAX_JSON_DEPTH - 1)}
    assert strict_json.structure_problem(deepest) is None
    accepted(deepest)
    too_deep = {"type": "object", "properties": nested(strict_json.MAX_JSON_DEPTH)}
    rule = problem(too_deep)
    assert f"nested deeper than {strict_json.MAX_JSON_DEPTH} levels" in rule
    assert "at '/properties/k/k/" in rule


def test_very_deep_schema_is_refused_without_recursion() -> None:
    # Deeper than Python's recursion limit: must still be a plain problem.
    assert "nested deeper" in problem({"type": "object", "properties": nested(5_000)})


def test_argument_depth_is_bounded() -> None:
    t = accepted({"type": "object"})
    call(t, {"a": nested(strict_json.MAX_JSON_DEPTH - 1)})
    error = call_problem(t, {"a": nested(strict_json.MAX_JSON_DEPTH)})
    assert error.violations[0].field == "arguments_json"
    assert f"nested deeper than {strict_json.MAX_JSON_DEPTH} levels" in error.message


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('{"type":"object","description":"\\ud800"}', "at '/description'"),
        ('{"type":"object","properties":{"\\udfff":{}}}', "in the key at '/properties/\\udfff'"),
        ('{"type":"object","enum":[{"a":["x\\udbff"]}]}', "at '/enum/0/a/0'"),
    ],
)
def test_lone_surrogates_in_the_schema_are_rejected(text: str, where: str) -> None:
    rule = problem(json.loads(text))
    assert "lone surrogate" in rule and where in rule
    rule.encode()  # the message itself must be sendable


def test_surrogate_pairs_are_fine() -> None:
    accepted(json.loads('{"type":"object","description":"\\ud83d\\ude00"}'))


@pytest.mark.parametrize(
    "text",
    ['{"message":"\\ud800"}', '{"message":"ok","\\udc00":1}', '{"m":[["\\ud800x"]]}'],
)
def test_lone_surrogates_in_arguments_are_rejected(text: str) -> None:
    error = call_problem(accepted({"type": "object"}), text)
    assert error.violations[0].field == "arguments_json"
    assert "lone surrogate" in error.message
    error.message.encode()


@pytest.mark.parametrize(
    ("parameters_json", "words"),
    [
        ('{"type":"object","description":"\\ud800"}', "lone surrogate"),
        ('{"type":"object","properties":{"x":{"pattern":"(?=a)"}}}', "RE2"),
        ('{"type":"object","properties":{"x":{"$ref":"https://example.com/s"}}}', "never fetches"),
    ],
)
def test_proto_schema_problems_name_parameters_json(parameters_json: str, words: str) -> None:
    from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
    from registry_server.wire import convert

    msg = pb.Tool(
        name="echo",
        description="Echo.",
        parameters_json=parameters_json,
        sandbox=pb.SandboxSpec(image="toolreg/base", command=["cat"]),
    )
    with pytest.raises(InvalidDefinition) as info:
        convert.tool_from_pb(msg)
    found = {v.field: v.description for v in info.value.violations}
    assert words in found["parameters_json"], found


# ---------------------------------------------------------------- budget and the rest


def _exploding_schema(levels: int) -> dict[str, Any]:
    """Each level refers twice to the next: 2**levels paths, no cycle."""
    defs: dict[str, Any] = {
        f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]}
        for i in range(levels)
    }
    defs[f"d{levels}"] = {"type": "string"}
    return {"type": "object", "$defs": defs, "properties": {"x": {"$ref": "#/$defs/d0"}}}


def test_exponential_schemas_stop_at_the_step_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schema_keywords, "MAX_EVALUATION_STEPS", 50_000)
    t = accepted(_exploding_schema(40))
    started = time.monotonic()
    error = call_problem(t, {"x": 1})
    assert time.monotonic() - started < FAST_S
    assert error.violations[0].field == "arguments_json"
    assert "more than 50000 evaluation steps" in error.message
    call(t, {"x": "fine"})  # valid input takes the first branch at each level


def test_many_errors_report_the_first_twenty_by_path_and_a_count() -> None:
    t = accepted(obj(x={"type": "array", "items": {"type": "string"}}))
    error = call_problem(t, {"x": list(range(1_000))})
    assert len(error.violations) == 20
    assert error.violations[0].field == "$.x[0]"
    assert "and 980 more" in error.message


def test_reported_rules_are_clipped() -> None:
    t = accepted(obj(x={"type": "string"}))
    error = call_problem(t, {"x": ["y" * 100] * 5_000})
    assert len(error.violations[0].description) < 300
    assert len(error.message) < 1_000


def test_huge_numbers_are_invalid_argument_not_internal() -> None:
    t = accepted(obj(x={"multipleOf": 0.5}))
    assert call_problem(t, '{"x": ' + "9" * 5_000 + "}").violations[0].field == "arguments_json"
    assert "cannot be checked" in call_problem(t, {"x": 10**400}).message


def test_schema_declaring_a_non_string_dialect_is_a_problem() -> None:
    assert "$schema" in problem({"type": "object", "$schema": 5})


def test_size_is_checked_before_the_schema_is_evaluated() -> None:
    huge = obj(**{f"p{i}": {"pattern": "(?=x)"} for i in range(5_000)})
    assert "bytes of JSON" in problem(huge)


def test_yaml_values_that_are_not_json_are_a_problem() -> None:
    import datetime

    assert "is not a JSON value" in problem(obj(x={"default": datetime.date(2024, 1, 1)}))


@pytest.mark.parametrize(
    ("schema", "instance"),
    [
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, 1),
        ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, 1.5),
        ({"oneOf": [{"type": "integer"}, {"minimum": 0}]}, 1),
        ({"oneOf": [{"type": "integer"}, {"minimum": 0}]}, -1),
        ({"oneOf": [{"type": "integer"}, {"minimum": 0}]}, 0.5),
        ({"oneOf": [{"type": "integer"}, {"minimum": 0}]}, "s"),
        ({"enum": [1, [True], {"a": None}]}, 1.0),
        ({"enum": [1, [True], {"a": None}]}, [1]),
        ({"enum": [1, [True], {"a": None}]}, {"a": None}),
        ({"const": {"a": [1, 2]}}, {"a": [1.0, 2]}),
        ({"const": False}, 0),
        (
            {
                "properties": {"a": True},
                "patternProperties": {"^b": True},
                "additionalProperties": False,
            },
            {"a": 1, "bc": 2, "d": 3},
        ),
        (
            {"allOf": [{"properties": {"a": True}}], "unevaluatedProperties": False},
            {"a": 1, "b": 2},
        ),
        (
            {
                "if": {"required": ["a"]},
                "then": {"properties": {"b": True}},
                "unevaluatedProperties": False,
            },
            {"a": 1, "b": 2},
        ),
        (
            {"prefixItems": [True], "contains": {"type": "string"}, "unevaluatedItems": False},
            [1, "s"],
        ),
        (
            {"prefixItems": [True], "contains": {"type": "string"}, "unevaluatedItems": False},
            [1, 2],
        ),
    ],
)
def test_replaced_keywords_agree_with_jsonschema(schema: dict[str, Any], instance: Any) -> None:
    ours = schema_safety.new_validator(schema)
    reference = Draft202012Validator(schema)
    assert ours.is_valid(instance) == reference.is_valid(instance)
    assert [e.message for e in ours.iter_errors(instance)] == [
        e.message for e in reference.iter_errors(instance)
    ]
