"""Warm interpreters (``prestart``/``preload``): the manifest's rules, the digest,
the wire, the plan (never for a dangerous tool) and the forms the stub runs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.domain.errors import InvalidDefinition
from registry_server.domain.models import SafetyLevel, parse_definition
from registry_server.execution.sandbox_plan import SandboxPlanner, SandboxPolicy
from registry_server.wire import convert
from sandbox_runner.warm_interpreter import (
    MAX_PRELOAD,
    STUB_SOURCE,
    parse_python_command,
    stub_command,
)
from tests import factories
from tests.unit.fakes import FakeBackend

PY = ["python3", "/opt/tool.py"]


def warm(level: str = "cautious", **sandbox: Any) -> dict[str, Any]:
    box = {"image": "toolreg/python", "command": PY, "prestart": "python", **sandbox}
    return factories.manifest(safety_level=level, sandbox=box)


def problems(raw: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(InvalidDefinition) as caught:
        parse_definition(raw)
    return {v.field: v.description for v in caught.value.violations}


def test_a_safe_or_cautious_tool_may_prestart_and_preload() -> None:
    for level in ("safe", "cautious"):
        tool = parse_definition(warm(level, preload=["json", "xml.etree.ElementTree"]))
        assert (tool.sandbox.prestart, tool.sandbox.preload) == (
            "python",
            ("json", "xml.etree.ElementTree"),
        )


def test_prestart_names_a_known_kind() -> None:
    assert problems(warm(prestart="node")) == {"sandbox.prestart": 'must be "" (none) or "python"'}


def test_preload_needs_prestart() -> None:
    raw = factories.manifest(
        sandbox={"image": "toolreg/python", "command": PY, "preload": ["json"]}
    )
    assert "needs prestart: python" in problems(raw)["sandbox.preload"]


@pytest.mark.parametrize(
    "name", ["", "1json", "json;rm", "os..path", "a-b", " json", "x" * 200, "json."]
)
def test_each_preload_is_a_dotted_module_name(name: str) -> None:
    assert "sandbox.preload.1" in problems(warm(preload=["json", name]))


def test_preload_is_capped_and_unrepeated() -> None:
    many = [f"m{i}" for i in range(MAX_PRELOAD + 1)]
    assert problems(warm(preload=many))["sandbox.preload"] == f"at most {MAX_PRELOAD} modules"
    assert problems(warm(preload=["json", "json"]))["sandbox.preload"] == (
        "must not repeat a module"
    )


def test_a_dangerous_tool_is_never_prestarted() -> None:
    rule = problems(warm("dangerous"))["sandbox.prestart"]
    assert rule.startswith("not for dangerous tools") and "approval" in rule


@pytest.mark.parametrize(
    "command",
    [
        ["sh", "-c", "python3 x.py"],
        ["node", "/x.js"],
        ["python3"],
        ["python3", "-u"],
        ["python3", "-c"],
        ["python3", "-m", "not a module"],
        ["python3", "-W", "ignore", "/x.py"],
        ["python3", "-Bu", "/x.py"],
        ["python3", "relative.py"],
        ["python3", "-"],
    ],
)
def test_the_command_must_be_a_form_the_stub_runs(command: list[str]) -> None:
    rule = problems(warm(command=command))["sandbox.command"]
    assert rule.startswith("with prestart: python, the command must be [python3, SCRIPT")


@pytest.mark.parametrize(
    ("command", "mode", "target", "flags", "args"),
    [
        (["python3", "/t.py", "a"], "script", "/t.py", (), ("a",)),
        (["/usr/bin/python3.11", "-B", "-u", "/t.py"], "script", "/t.py", ("-B", "-u"), ()),
        (["python", "-I", "-c", "print(1)", "x", "-y"], "code", "print(1)", ("-I",), ("x", "-y")),
        (
            ["python3", "-m", "json.tool", "--sort-keys"],
            "module",
            "json.tool",
            (),
            ("--sort-keys",),
        ),
    ],
)
def test_supported_forms(
    command: list[str], mode: str, target: str, flags: tuple[str, ...], args: tuple[str, ...]
) -> None:
    parsed = parse_python_command(command)
    assert (parsed.interpreter, parsed.mode, parsed.target, parsed.flags, parsed.args) == (
        command[0], mode, target, flags, args,
    )  # fmt: skip
    argv = stub_command(tuple(command), ("json", "re"))
    # The interpreter and its flags run the stub; the tool's command follows it.
    assert argv[: 1 + len(flags)] == [command[0], *flags]
    assert argv[1 + len(flags) : 5 + len(flags)] == ["-c", STUB_SOURCE, "json,re", mode]
    assert argv[5 + len(flags)] == target and tuple(argv[6 + len(flags) :]) == args


def test_the_stub_compiles() -> None:
    compile(STUB_SOURCE, "<stub>", "exec")


def test_prestart_and_preload_are_in_the_digest_only_when_set() -> None:
    cold = parse_definition(factories.manifest(sandbox={"image": "toolreg/python", "command": PY}))
    assert "prestart" not in cold.as_manifest()["sandbox"]  # old digests are kept
    started = parse_definition(warm())
    preloaded = parse_definition(warm(preload=["json"]))
    other = parse_definition(warm(preload=["re"]))
    reordered = parse_definition(warm(preload=["re", "json"]))
    both = parse_definition(warm(preload=["json", "re"]))
    digests = {t.digest for t in (cold, started, preloaded, other, reordered, both)}
    assert len(digests) == 6  # import order is behaviour too
    assert started.as_manifest()["sandbox"]["prestart"] == "python"
    assert parse_definition(preloaded.as_manifest()).digest == preloaded.digest


def test_the_wire_carries_both_fields() -> None:
    tool = parse_definition(warm(preload=["json", "re"]))
    msg = convert.tool_to_pb(tool)
    assert (msg.sandbox.prestart, list(msg.sandbox.preload)) == ("python", ["json", "re"])
    back = convert.tool_from_pb(msg)
    assert back.digest == tool.digest


def test_the_wire_refuses_what_the_manifest_refuses() -> None:
    msg = convert.tool_to_pb(parse_definition(warm()))
    msg.safety_level = pb.SAFETY_LEVEL_DANGEROUS
    with pytest.raises(InvalidDefinition) as caught:
        convert.tool_from_pb(msg)
    assert "sandbox.prestart" in {v.field for v in caught.value.violations}


def test_the_plan_gives_prestart_to_safe_and_cautious_tools_only() -> None:
    planner = SandboxPlanner(FakeBackend(), SandboxPolicy())
    tool = parse_definition(warm(preload=["json"]))
    spec = planner.spec(tool, b"{}", "runc")
    assert (spec.prestart, spec.preload) == ("python", ("json",))
    # A stored dangerous tool with it (not registrable now) still starts at release.
    risky = dataclasses.replace(tool, safety_level=SafetyLevel.DANGEROUS)
    spec = planner.spec(risky, b"{}", "runc")
    assert (spec.prestart, spec.preload) == ("", ())


def test_the_init_says_ready_or_why_not_after_its_hello() -> None:
    from sandbox_runner.framing import INIT_FAILED, INIT_HELLO, INIT_READY, InitDecoder

    why = b"prestart: preload 'nope' failed: No module named 'nope'"
    stream = b"H\0\0\0\1\3" + b"R\0\0\0\0" + b"F" + len(why).to_bytes(4, "big") + why
    events: list[tuple[str, object]] = []
    decoder = InitDecoder()
    for i in range(len(stream)):  # byte by byte: frames cut anywhere
        events += decoder.feed(stream[i : i + 1])
    assert events == [(INIT_HELLO, 3), (INIT_READY, b""), (INIT_FAILED, why)]


def test_a_prestart_failure_message_is_capped_and_shows_control_characters() -> None:
    """The 'F' frame carries a preloaded module's own words: they reach the
    call's error, the audit record and the pool's log line, so a newline or a
    terminal escape is shown, never obeyed, and the text is capped."""
    from sandbox_runner.docker_backend import MAX_FAILED_CHARS, _tool_text

    text = _tool_text(b"prestart: preload 'x' failed: bad\nFAKE LOG LINE \x1b[2J\xe2\x80\xae")
    assert text == "prestart: preload 'x' failed: bad\\nFAKE LOG LINE \\x1b[2J\\u202e"
    assert len(_tool_text(b"y" * 100_000)) == MAX_FAILED_CHARS
