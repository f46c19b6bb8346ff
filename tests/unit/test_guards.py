"""Tools' guards (issue 28): the manifest's ``guard:`` list, its caps, its
compile check at every way into the registry, its place in the digest and on
the wire, and its absence from the exported schemas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.catalog.guards import guard_violations
from registry_server.catalog.registry import Registry
from registry_server.domain.errors import InvalidDefinition
from registry_server.domain.manifests import load_manifest
from registry_server.domain.models import (
    MAX_GUARD_CONDITION_CHARS,
    MAX_GUARD_MESSAGE_CHARS,
    MAX_GUARDS,
    Guard,
    compute_digest,
    parse_definition,
)
from registry_server.domain.outcome import AppliedRule
from registry_server.domain.schemas import SchemaFormat, export_json, tool_belt
from registry_server.policy import conditions
from registry_server.store.base import StoredTool
from registry_server.store.memory import MemoryStore
from registry_server.wire import convert
from tests.factories import approval_request, manifest, tool

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tools"
UNDER_WORK = {"condition": 'args.message.startsWith("/work/")', "message": "must be under /work/"}
SHORT = {"condition": "args.message.size() <= 100", "message": "at most 100 characters"}
# Digests of definitions without guards, as they were before tools could have
# them: adding the feature must not change a single existing digest (approval
# tokens and stored requests name tools by digest).
FACTORY_DIGEST = "aa04395884977f986cf369c2398a8c5eb230ea486b76d29590abbad2fc2d437a"
EXAMPLE_DIGESTS = {
    "echo.yaml": "9b16c3983c3c4fb6c85512b48d6c8963243b0e3654336ef77164f712c1c512ce",
    "run_python.yaml": "0a3d8a095623e295ff25dae5034dd8b3d86f08e24f8b63a5bbf49c78feb79222",
    "word_count.yaml": "a4130bd5d4e4567af46afc2f3df2f1ce5ef936b20c68ca22ad97813d5f2b8015",
    "write_file.yaml": "8ef002fe95559edfa6b5d07e6579855ae13dcfb9889160d041620ae124370eeb",
}


def violations(raw: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(InvalidDefinition) as info:
        parse_definition(raw)
    return {v.field: v.description for v in info.value.violations}


# ------------------------------------------------------------------ manifest form


def test_guards_parse_in_the_authors_order() -> None:
    t = tool(guard=[UNDER_WORK, SHORT])
    assert t.guards == (
        Guard(UNDER_WORK["condition"], UNDER_WORK["message"]),
        Guard(SHORT["condition"], SHORT["message"]),
    )
    assert t.as_manifest()["guard"] == [UNDER_WORK, SHORT]


def test_the_manifest_caps_are_the_conditions_caps() -> None:
    # The domain cannot import the policy: the numbers are kept equal by hand.
    assert MAX_GUARD_CONDITION_CHARS == conditions.MAX_CONDITION_CHARS


@pytest.mark.parametrize(
    ("guard", "field", "rule"),
    [
        ([UNDER_WORK] * (MAX_GUARDS + 1), "guard", f"at most {MAX_GUARDS} guards"),
        ("true", "guard", "must be a list"),
        (["true"], "guard.0", "must be a mapping"),
        ([{"condition": "true"}], "guard.0.message", "is required"),
        ([{"message": "m"}], "guard.0.condition", "is required"),
        ([{"condition": "true", "message": "m", "why": "x"}], "guard.0.why", "unknown key"),
        ([{"condition": "  ", "message": "m"}], "guard.0.condition", "non-empty"),
        ([{"condition": "true || " * 300 + "true", "message": "m"}], "guard.0.condition",
         f"at most {MAX_GUARD_CONDITION_CHARS} characters"),
        ([{"condition": "true", "message": ""}], "guard.0.message", "must not be empty"),
        ([{"condition": "true", "message": "x" * (MAX_GUARD_MESSAGE_CHARS + 1)}],
         "guard.0.message", f"at most {MAX_GUARD_MESSAGE_CHARS} characters"),
        ([{"condition": "true", "message": "line one\nline two"}], "guard.0.message",
         "control"),
        ([{"condition": "true", "message": "\x1b[2Kapproved"}], "guard.0.message", "control"),
        ([{"condition": "true", "message": "abc\u202edef"}], "guard.0.message", "invisible"),
        ([{"condition": 1, "message": "m"}], "guard.0.condition", "valid string"),
    ],
)  # fmt: skip
def test_manifest_shape_errors_name_the_field(guard: Any, field: str, rule: str) -> None:
    found = violations(manifest(guard=guard))
    assert field in found, found
    assert rule in found[field]


def test_caps_are_inclusive() -> None:
    longest = "true" + " " * (MAX_GUARD_CONDITION_CHARS - 4)
    t = tool(guard=[{"condition": longest, "message": "m" * MAX_GUARD_MESSAGE_CHARS}] * MAX_GUARDS)
    assert len(t.guards) == MAX_GUARDS and guard_violations(t) == []


def test_a_guard_list_longer_than_the_cap_is_refused_before_its_items_are_read() -> None:
    found = violations(manifest(guard=[1] * (MAX_GUARDS + 1)))
    assert found == {"guard": f"at most {MAX_GUARDS} guards"}


# ------------------------------------------------------------------ compiling


@pytest.mark.parametrize(
    ("condition", "rule"),
    [
        ("args.message +", "line 1, column"),
        ('args.message.size() + "x"', "line 1, column"),  # a type error, found at registration
        ("args.message", "must be a bool"),
        ('tool.name == "echo"', "undeclared reference to 'tool"),  # guards read args only
        ('caller.id == "me"', "undeclared reference to 'caller"),
        ("now > timestamp('2020-01-01T00:00:00Z')", "undeclared reference to 'now"),
        ("args.message.matches(args.pattern)", "must be a string literal"),  # RE2, literal only
        ("args.items.all(a, args.items.all(b, a == b))", "over the limit"),  # a loop in a loop
    ],
)
def test_a_guard_that_does_not_compile_is_refused_naming_it(condition: str, rule: str) -> None:
    t = tool(guard=[SHORT, {"condition": condition, "message": "m"}])
    (problem,) = guard_violations(t)
    assert problem.field == "guard.1.condition"
    assert rule in problem.description
    with pytest.raises(InvalidDefinition) as info:
        Registry(MemoryStore()).register(t)
    assert info.value.violations[0].field == "guard.1.condition"
    assert "invalid definition of tool 'echo': guard.1.condition: " in info.value.message


def test_a_guard_reading_the_tool_says_guards_read_args_only() -> None:
    (problem,) = guard_violations(tool(guard=[{"condition": 'tool.name == "x"', "message": "m"}]))
    assert "a guard reads only `args`" in problem.description


def test_the_registry_refuses_before_anything_is_stored() -> None:
    store = MemoryStore()
    registry = Registry(store)
    with pytest.raises(InvalidDefinition):
        registry.register(tool(guard=[{"condition": "args.x +", "message": "m"}]))
    assert registry.names() == []
    with store.reading() as reads:
        assert reads.tools() == []


def test_a_manifest_file_with_a_bad_guard_is_refused_at_registration(tmp_path: Path) -> None:
    """--tools: the file parses (its shape is right); registering it, as the
    server does at start, is refused naming the tool and the guard."""
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: bad\ndescription: d\nparameters: {type: object}\n"
        "sandbox: {image: toolreg/base, command: [cat]}\n"
        "guard:\n  - condition: tool.name == 'bad'\n    message: never\n"
    )
    with pytest.raises(InvalidDefinition, match=r"tool 'bad': guard\.0\.condition: line 1"):
        Registry(MemoryStore()).register(load_manifest(path))


def test_a_manifest_file_with_guards_registers(tmp_path: Path) -> None:
    path = tmp_path / "reader.yaml"
    path.write_text(
        "name: reader\ndescription: d\n"
        "parameters: {type: object, properties: {path: {type: string}}, required: [path]}\n"
        "sandbox: {image: toolreg/base, command: [cat]}\n"
        "guard:\n"
        "  - condition: args.path.startsWith('/work/')\n"
        "    message: path must be under /work/\n"
        "  - condition: '!args.path.contains(\"..\")'\n"
        "    message: path must not climb out with ..\n"
    )
    registry = Registry(MemoryStore())
    registry.register(load_manifest(path))
    assert [g.message for g in registry.get("reader").guards] == [
        "path must be under /work/",
        "path must not climb out with ..",
    ]


def _store_with(*manifests: dict[str, Any]) -> MemoryStore:
    store = MemoryStore()
    with store.unit_of_work() as uow:
        for raw in manifests:
            digest = compute_digest(raw)
            uow.put_tool(StoredTool(raw["name"], json.dumps(raw), digest, "team"), 0.0)
    return store


def test_a_stored_tool_whose_guard_no_longer_compiles_is_not_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A guard the server cannot check is never skipped: the tool is left
    out (TOOL_NOT_FOUND), the others are served and the server starts."""
    broken = manifest(name="broken", guard=[{"condition": "tool.name == 'x'", "message": "m"}])
    fine = manifest(name="fine", guard=[UNDER_WORK])
    registry = Registry(_store_with(broken, fine))
    assert registry.names() == ["fine"]
    assert registry.get("fine").guards[0].message == UNDER_WORK["message"]
    assert "stored tool 'broken'" in caplog.text and "guard.0.condition" in caplog.text


# ------------------------------------------------------------------ the digest


def test_guardless_digests_are_what_they_were() -> None:
    assert tool().digest == FACTORY_DIGEST
    assert "guard" not in tool().as_manifest()
    for name, digest in EXAMPLE_DIGESTS.items():
        loaded = load_manifest(EXAMPLES / name)
        if loaded.sandbox.prestart:
            # run_python has since become a warm interpreter (issue 30, with -B): a
            # change of its definition, so of its digest. As it was, it is what it was.
            assert loaded.digest != digest, name
            raw = loaded.as_manifest()
            sandbox = {k: v for k, v in raw["sandbox"].items() if k not in ("prestart", "preload")}
            sandbox["command"] = [arg for arg in sandbox["command"] if arg != "-B"]
            raw["sandbox"] = sandbox
            loaded = parse_definition(raw)
        assert loaded.digest == digest, name


def test_an_empty_guard_list_is_no_guard() -> None:
    assert tool(guard=[]).digest == FACTORY_DIGEST


def test_the_digest_covers_every_part_of_the_guards() -> None:
    base = tool(guard=[UNDER_WORK, SHORT]).digest
    variants = [
        [UNDER_WORK],
        [SHORT, UNDER_WORK],  # order: the first failing guard is the one reported
        [UNDER_WORK, {**SHORT, "message": "at most 100 chars"}],
        [UNDER_WORK, {**SHORT, "condition": "args.message.size() <= 101"}],
    ]
    digests = {base, FACTORY_DIGEST, *(tool(guard=v).digest for v in variants)}
    assert len(digests) == len(variants) + 2
    assert tool(guard=[UNDER_WORK, SHORT]).digest == base  # and it is stable


# ------------------------------------------------------------------ the wire


def test_guards_round_trip_through_the_tool_message() -> None:
    t = tool(guard=[UNDER_WORK, SHORT])
    msg = convert.tool_to_pb(t)
    assert [(g.condition, g.message) for g in msg.guards] == [
        (UNDER_WORK["condition"], UNDER_WORK["message"]),
        (SHORT["condition"], SHORT["message"]),
    ]
    assert convert.tool_from_pb(msg) == t
    assert convert.stored_tool_from_pb(msg) == t
    assert convert.tool_from_pb(convert.tool_to_pb(tool())).guards == ()


def _pb_violations(msg: pb.Tool) -> dict[str, str]:
    with pytest.raises(InvalidDefinition) as info:
        convert.tool_from_pb(msg)
    return {v.field: v.description for v in info.value.violations}


def test_message_errors_use_the_proto_field_name() -> None:
    msg = convert.tool_to_pb(tool())
    msg.guards.add(condition="true", message="")
    assert "guards.0.message" in _pb_violations(msg)
    del msg.guards[:]
    msg.guards.add(condition="true", message="fine")
    msg.guards.add(condition="caller.id == 'x'", message="m")
    found = _pb_violations(msg)
    assert list(found) == ["guards.1.condition"]
    assert "undeclared reference to 'caller" in found["guards.1.condition"]


def test_oversized_guards_are_refused_before_parsing() -> None:
    msg = convert.tool_to_pb(tool())
    for _ in range(MAX_GUARDS + 1):
        msg.guards.add(condition="true", message="m")
    assert _pb_violations(msg) == {"guards": f"at most {MAX_GUARDS} entries"}
    del msg.guards[:]
    msg.guards.add(condition="x" * 100_000, message="m")
    assert "condition at most" in _pb_violations(msg)["guards"]


def test_a_client_shows_a_stored_tool_without_compiling_its_guards() -> None:
    # What the server sent was checked there; a client reads it whatever its CEL.
    msg = convert.tool_to_pb(tool())
    msg.guards.add(condition="tool.name == 'x'", message="m")
    assert convert.stored_tool_from_pb(msg).guards == (Guard("tool.name == 'x'", "m"),)


def test_applied_rules_round_trip_through_the_approval_request_message() -> None:
    rules = (
        AppliedRule("sre-prod", "tool deploy", 'args.env == "prod"', 2, ("sre", "ops")),
        AppliedRule("default", "default for dangerous tools", "", 1, ()),
    )
    view = approval_request(applied_rules=rules)
    msg = convert.approval_request_to_pb(view)
    assert [r.name for r in msg.applied_rules] == ["sre-prod", "default"]
    assert list(msg.applied_rules[0].groups) == ["sre", "ops"]
    assert msg.applied_rules[0].approvals_required == 2
    assert msg.applied_rules[0].condition == 'args.env == "prod"'
    assert convert.approval_request_from_pb(msg) == view
    assert convert.approval_request_from_pb(convert.approval_request_to_pb(approval_request())) == (
        approval_request()
    )


# ------------------------------------------------------------------ exported schemas


@pytest.mark.parametrize("fmt", list(SchemaFormat))
def test_exported_schemas_are_the_same_with_or_without_guards(fmt: SchemaFormat) -> None:
    guarded = tool(guard=[UNDER_WORK, SHORT])
    assert guarded.digest != tool().digest
    assert export_json([guarded], fmt) == export_json([tool()], fmt)
    assert "guard" not in export_json([guarded], fmt)


def test_the_tool_belt_is_the_same_with_or_without_guards() -> None:
    assert tool_belt([tool(guard=[UNDER_WORK])]) == tool_belt([tool()])
