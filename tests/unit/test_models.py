"""Every validation rule of a tool definition, and the digest."""

from __future__ import annotations

import json
from typing import Any

import pytest

from registry_server.domain.errors import InvalidDefinition
from registry_server.domain.models import SafetyLevel, parse_definition
from tests.factories import manifest, tool


def violations(raw: Any) -> dict[str, str]:
    with pytest.raises(InvalidDefinition) as info:
        parse_definition(raw)
    return {v.field: v.description for v in info.value.violations}


def test_valid_definition_is_frozen_with_digest() -> None:
    t = tool()
    assert t.name == "echo" and t.safety_level is SafetyLevel.SAFE
    assert len(t.digest) == 64
    with pytest.raises(AttributeError):
        t.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("a", True),
        ("run_python", True),
        ("a1_b2", True),
        ("x" * 64, True),
        ("x" * 65, False),
        ("", False),
        ("Echo", False),
        ("1abc", False),
        ("_a", False),
        ("a-b", False),
        ("a b", False),
        ("é", False),
    ],
)
def test_name_must_be_snake_case(name: str, ok: bool) -> None:
    if ok:
        assert tool(name=name).name == name
    else:
        assert "name" in violations(manifest(name=name))


def test_empty_name_says_so() -> None:
    assert violations(manifest(name=""))["name"] == "must not be empty"


@pytest.mark.parametrize("desc", ["", "   ", "\n"])
def test_description_must_not_be_empty(desc: str) -> None:
    assert violations(manifest(description=desc))["description"] == "must not be empty"


@pytest.mark.parametrize(
    ("params", "rule"),
    [
        ({"type": "array"}, '"type": "object"'),
        ({"properties": {}}, '"type": "object"'),
        ({"type": "object", "properties": {"a": {"type": 5}}}, "not a valid JSON Schema"),
        ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, "['b']"),
        ({"type": "object", "required": ["a"]}, "['a']"),
        ({"type": "object", "$schema": "http://json-schema.org/draft-07/schema#"}, "2020-12"),
        ({"type": "object", "properties": {"a": {"minLength": -1}}}, "not a valid JSON Schema"),
    ],
)
def test_parameters_must_be_a_2020_12_object_schema(params: dict[str, Any], rule: str) -> None:
    assert rule in violations(manifest(parameters=params))["parameters"]


def test_parameters_must_be_a_mapping() -> None:
    assert "parameters" in violations(manifest(parameters=[1, 2]))


def test_parameters_declaring_2020_12_are_accepted() -> None:
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object"}
    assert tool(parameters=schema).parameters == schema


@pytest.mark.parametrize(
    ("level", "expected"),
    [
        ("safe", SafetyLevel.SAFE),
        ("cautious", SafetyLevel.CAUTIOUS),
        ("DANGEROUS", SafetyLevel.DANGEROUS),
        (None, SafetyLevel.SAFE),
        ("", SafetyLevel.SAFE),
    ],
)
def test_safety_level_unspecified_means_safe(level: str | None, expected: SafetyLevel) -> None:
    assert tool(safety_level=level).safety_level is expected


def test_unknown_safety_level_is_named() -> None:
    rule = violations(manifest(safety_level="risky"))["safety_level"]
    assert "risky" in rule and "safe, cautious or dangerous" in rule


@pytest.mark.parametrize("cats", [["Files"], ["two words"], ["a", "a"], ["-x"], [""], [1]])
def test_categories_are_unique_lowercase_words(cats: list[Any]) -> None:
    assert any(f.startswith("categories") for f in violations(manifest(categories=cats)))


def test_categories_are_sorted_so_order_does_not_change_the_definition() -> None:
    assert tool(categories=["b", "a"]).digest == tool(categories=["a", "b"]).digest


@pytest.mark.parametrize(
    ("sandbox", "field"),
    [
        ({"command": ["cat"]}, "sandbox.image"),
        ({"image": "", "command": ["cat"]}, "sandbox.image"),
        ({"image": "a b", "command": ["cat"]}, "sandbox.image"),
        ({"image": "x"}, "sandbox.command"),
        ({"image": "x", "command": []}, "sandbox.command"),
        ({"image": "x", "command": [""]}, "sandbox.command"),
        ({"image": "x", "command": ["cat"], "env": {"1BAD": "v"}}, "sandbox.env"),
        (
            {"image": "x", "command": ["cat"], "limits": {"memory_mb": -1}},
            "sandbox.limits.memory_mb",
        ),
        (
            {"image": "x", "command": ["cat"], "limits": {"timeout_ms": "5"}},
            "sandbox.limits.timeout_ms",
        ),
        ({"image": "x", "command": ["cat"], "limits": {"cpu": 1}}, "sandbox.limits.cpu"),
        ({"image": "x", "command": ["cat"], "mounts": []}, "sandbox.mounts"),
    ],
)
def test_sandbox_rules(sandbox: dict[str, Any], field: str) -> None:
    assert field in violations(manifest(sandbox=sandbox))


def test_unknown_keys_are_named() -> None:
    found = violations(manifest(colour="red"))
    assert found == {"colour": "unknown key"}


def test_every_violation_is_reported_at_once() -> None:
    found = violations(
        {
            "name": "Bad",
            "description": "",
            "parameters": {"type": "array"},
            "sandbox": {"image": ""},
        }
    )
    assert {"name", "description", "parameters", "sandbox.image", "sandbox.command"} <= set(found)


def test_not_a_mapping() -> None:
    assert violations([1]) == {"": "must be a mapping of tool fields"}


def test_warm_pool_bounds() -> None:
    assert tool(warm_pool=2).warm_pool == 2
    assert "warm_pool" in violations(manifest(warm_pool=-1))
    assert "warm_pool" in violations(manifest(warm_pool=10_000))


def test_digest_is_canonical_json_of_the_definition() -> None:
    import hashlib

    import rfc8785

    t = tool()
    assert t.digest == hashlib.sha256(rfc8785.dumps(t.as_manifest())).hexdigest()


def test_digest_ignores_key_order_but_parameters_keep_the_authors_order() -> None:
    a = tool(parameters={"type": "object", "properties": {"z": {}, "a": {}}})
    b = tool(parameters={"properties": {"a": {}, "z": {}}, "type": "object"})
    assert a.digest == b.digest
    assert list(json.loads(a.parameters_json)["properties"]) == ["z", "a"]


def test_digest_changes_with_any_field() -> None:
    base = tool().digest
    assert tool(description="other").digest != base
    assert tool(sandbox={"image": "toolreg/base", "command": ["cat", "-"]}).digest != base
    assert tool(safety_level="cautious").digest != base


def test_parameters_property_is_a_fresh_copy() -> None:
    t = tool()
    t.parameters["type"] = "array"
    assert t.parameters["type"] == "object"


def test_safety_level_order() -> None:
    assert SafetyLevel.SAFE.at_most(SafetyLevel.CAUTIOUS)
    assert not SafetyLevel.DANGEROUS.at_most(SafetyLevel.CAUTIOUS)
