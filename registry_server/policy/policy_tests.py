"""Policy unit tests (``toolreg policy test POLICY TESTS``): a YAML file of
calls and the decision the policy must give each, for an operator's CI.

    cases:
      - name: a deploy to prod needs two from sre
        call:
          tool: {name: deploy, level: dangerous, categories: [ops]}
          args: {env: prod}
          client: agent-1
          at: 2025-06-02T09:00:00Z       # optional: the call's time (default: now)
        expect:
          decision: approval             # forbidden|invalid|denied|refused|approval|allowed
          approvals: 2                   # approval: the fewest distinct approvers
          groups: [sre]                  # approval: the groups the applying rules name
          rules: [sre-prod, dangerous]   # approval: the rules that apply ("default": none)

Each case is explained as ``toolreg policy explain`` does (policy/explain.py)
and every key of ``expect`` that is given must agree. The file is strict,
like the policy: an unknown key, a missing one or a bad value is refused
with the file, the line and the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from registry_server.domain.errors import ToolregError
from registry_server.domain.manifests import load_manifest
from registry_server.domain.models import CATEGORY_PATTERN, NAME_PATTERN, SafetyLevel
from registry_server.policy.clients import ID_PATTERN
from registry_server.policy.conditions import ToolFacts
from registry_server.policy.explain import (
    Call,
    Decision,
    ExplainError,
    Explanation,
    explain,
    manifest_tool,
    parse_time,
)
from registry_server.policy.loader import (
    Loc,
    _describe,
    _duplicate_keys,
    _format,
    _line_of,
    _path,
)
from registry_server.policy.model import Policy

MAX_TESTS_BYTES = 1024 * 1024  # bytes of one tests file
MAX_CASES = 10_000  # cases in one tests file
MAX_NAME_CHARS = 200  # characters of a case's name

_DECISIONS = ", ".join(d.value for d in Decision)


class TestsFileError(Exception):
    """The tests file is unusable: one line per problem, each naming the file,
    the line and the field."""

    __test__ = False  # not a pytest class

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems = (problems,) if isinstance(problems, str) else tuple(problems)
        super().__init__("\n".join(self.problems))


# ------------------------------------------------------------------ the file's form


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _pattern(value: str, pattern: str, what: str) -> str:
    if not re.fullmatch(pattern, value):
        raise ValueError(f"not a valid {what} (must match {pattern})")
    return value


def _json(value: Any) -> Any:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        raise ValueError(
            "must be JSON values only (quote a date or time: YAML reads it as a timestamp)"
        ) from None
    return value


class _ToolIn(_Strict):
    """The tool: inline (name and level, categories, ...), or a manifest."""

    name: str | None = None
    level: str | None = None
    categories: list[str] = Field(default_factory=list)
    egress_hosts: list[str] = Field(default_factory=list)
    owner: str = ""
    manifest: str | None = None  # a tool manifest, relative to the tests file

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return None if value is None else _pattern(value, NAME_PATTERN, "tool name")

    @field_validator("level")
    @classmethod
    def _level(cls, value: str | None) -> str | None:
        return None if value is None else SafetyLevel.parse(value).value

    @field_validator("categories")
    @classmethod
    def _categories(cls, value: list[str]) -> list[str]:
        return [_pattern(c, CATEGORY_PATTERN, "category") for c in value]

    @model_validator(mode="after")
    def _one_source(self) -> _ToolIn:
        if self.manifest is not None:
            given = [n for n in ("name", "level", "categories", "egress_hosts") if self.has(n)]
            if given:
                raise ValueError(
                    f"{', '.join(given)}: comes from the manifest; give manifest or the"
                    " tool's fields, not both"
                )
        elif self.name is None or self.level is None:
            missing = " and ".join(n for n in ("name", "level") if getattr(self, n) is None)
            raise ValueError(f"{missing}: required (or manifest: a tool manifest file)")
        return self

    def has(self, name: str) -> bool:
        return name in self.model_fields_set


class _CallIn(_Strict):
    tool: _ToolIn
    args: dict[str, Any] = Field(default_factory=dict)
    client: str
    at: Any = None  # a YAML timestamp with its zone; None: the time of the run
    claims: dict[str, Any] | None = None  # an identity provider token's claims
    groups: list[str] | None = None  # its groups, for a client an identity provider makes

    @field_validator("client")
    @classmethod
    def _client(cls, value: str) -> str:
        return _pattern(value, ID_PATTERN, "client id")

    @field_validator("args", "claims")
    @classmethod
    def _plain(cls, value: Any) -> Any:
        return _json(value)

    @field_validator("groups")
    @classmethod
    def _groups(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not g for g in value):
            raise ValueError("a group must not be empty")
        return value

    @field_validator("at")
    @classmethod
    def _at(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            return parse_time(value, "at")
        if isinstance(value, datetime):
            if value.tzinfo is None:
                raise ValueError("give the time zone too, e.g. 2025-06-02T09:00:00Z")
            return value
        if isinstance(value, date):
            raise ValueError("a date alone; give the time and zone, e.g. 2025-06-02T09:00:00Z")
        raise ValueError("must be an ISO 8601 time, e.g. 2025-06-02T09:00:00Z")


class _ExpectIn(_Strict):
    decision: str
    rule: str | None = None  # denied: the rule that refuses the call
    approvals: int | None = Field(None, ge=1)  # approval: the fewest distinct approvers
    groups: list[str] | None = None  # approval: the groups the applying rules name
    rules: list[str] | None = None  # approval: the names of the rules that apply

    @field_validator("decision")
    @classmethod
    def _decision(cls, value: str) -> str:
        if value not in {d.value for d in Decision}:
            raise ValueError(f"unknown decision {value!r}; use one of {_DECISIONS}")
        return value

    @model_validator(mode="after")
    def _fits(self) -> _ExpectIn:
        wrong = []
        if self.rule is not None and self.decision != Decision.DENIED:
            wrong.append("rule: only with decision denied (the rule that refuses the call)")
        for name in ("approvals", "groups", "rules"):
            if getattr(self, name) is not None and self.decision != Decision.APPROVAL:
                wrong.append(f"{name}: only with decision approval")
        if wrong:
            raise ValueError("; ".join(wrong))
        return self


class _CaseIn(_Strict):
    name: str
    call: _CallIn
    expect: _ExpectIn

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not value.strip() or len(value) > MAX_NAME_CHARS:
            raise ValueError(f"must be 1 to {MAX_NAME_CHARS} characters")
        if any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise ValueError("must not contain control characters")
        return value


class _TestsIn(_Strict):
    cases: list[_CaseIn]

    @field_validator("cases")
    @classmethod
    def _cases(cls, value: list[_CaseIn]) -> list[_CaseIn]:
        if not 1 <= len(value) <= MAX_CASES:
            raise ValueError(f"must list 1 to {MAX_CASES} cases")
        return value


# ------------------------------------------------------------------ cases


@dataclass(frozen=True)
class Expectation:
    decision: Decision
    rule: str | None = None
    approvals: int | None = None
    groups: tuple[str, ...] | None = None
    rules: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Case:
    name: str
    where: str  # "policy.tests.yaml line 12"
    call: Call
    expect: Expectation
    # Where each field of the call is written ("FILE line N: cases[0].call.client"),
    # for a problem only the policy reveals (groups for a client of the file).
    fields: tuple[tuple[str, str], ...] = ()


def load_tests(path: Path, now: datetime) -> list[Case]:
    """Read and check the tests file; a call without ``at`` is made at ``now``.
    Raises TestsFileError listing every problem."""
    source = str(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TestsFileError(
            f"{source}: cannot read the tests file: {exc.strerror or exc}"
        ) from None
    if len(data) > MAX_TESTS_BYTES:
        raise TestsFileError(f"{source}: larger than {MAX_TESTS_BYTES} bytes")
    root, raw = _parse(data, source)
    try:
        parsed = _TestsIn.model_validate(raw)
    except ValidationError as exc:
        found = [(tuple(e["loc"]), _describe(e)) for e in exc.errors()]
        raise TestsFileError(_problems(source, root, found)) from None
    problems: list[tuple[Loc, str]] = []
    first: dict[str, int] = {}
    for i, case in enumerate(parsed.cases):
        if case.name in first:
            problems.append(
                (
                    ("cases", i, "name"),
                    f"duplicate name {case.name!r} (also cases[{first[case.name]}])",
                )
            )
        first.setdefault(case.name, i)
    cases: list[Case] = []
    for i, case in enumerate(parsed.cases):
        try:
            cases.append(_case(case, i, path, root, now))
        except _Problem as problem:
            problems.append((problem.loc, problem.message))
    if problems:
        raise TestsFileError(_problems(source, root, problems))
    return cases


class _Problem(Exception):
    def __init__(self, loc: Loc, message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


def _case(case: _CaseIn, i: int, path: Path, root: yaml.Node, now: datetime) -> Case:
    call, tool = case.call, case.call.tool
    loc: Loc = ("cases", i, "call")
    definition = None
    if tool.manifest is not None:
        try:
            loaded = load_manifest(path.parent / tool.manifest)
        except ToolregError as exc:
            raise _Problem((*loc, "tool", "manifest"), exc.message) from None
        facts, definition = manifest_tool(loaded, tool.owner)
    else:
        assert tool.name is not None and tool.level is not None
        facts = ToolFacts(
            name=tool.name, level=tool.level, categories=tuple(sorted(set(tool.categories))),
            owner=tool.owner, egress_hosts=tuple(tool.egress_hosts),
        )  # fmt: skip
    made = Call(
        facts, json.dumps(call.args), call.client, call.at or now, claims=call.claims or {},
        idp_groups=None if call.groups is None else frozenset(call.groups),
        definition=definition,
    )  # fmt: skip
    source = str(path)
    fields = tuple(
        (name, f"{source} line {_line_of(root, (*loc, name))}: {_path((*loc, name))}")
        for name in ("client", "groups", "claims", "args", "tool")
    )
    expect = case.expect
    return Case(
        name=case.name,
        where=f"{source} line {_line_of(root, ('cases', i))}",
        call=made,
        expect=Expectation(
            Decision(expect.decision),
            expect.rule,
            expect.approvals,
            None if expect.groups is None else tuple(expect.groups),
            None if expect.rules is None else tuple(expect.rules),
        ),
        fields=fields,
    )


# libyaml's parser gives the same nodes and marks (line numbers) as the pure-Python
# one at a tenth of the time: a policy reload or `toolreg policy test` parses a few
# hundred lines. PyYAML built without libyaml falls back to the Python parser.
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _parse(data: bytes, source: str) -> tuple[yaml.Node, Any]:
    loader = _YAML_LOADER(data)
    try:
        root = loader.get_single_node()
        if root is None:
            raise TestsFileError(f"{source}: is empty; expected a mapping with 'cases'")
        duplicates = sorted(_duplicate_keys(root, ()))
        if duplicates:
            raise TestsFileError([_format(source, line, loc, msg) for line, loc, msg in duplicates])
        raw = loader.construct_document(root)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise TestsFileError(f"{source}{where}: not valid YAML: {problem}") from None
    finally:
        loader.dispose()
    if not isinstance(raw, dict):
        raise TestsFileError(f"{source} line {root.start_mark.line + 1}: must be a mapping")
    return root, raw


def _problems(source: str, root: yaml.Node, found: Sequence[tuple[Loc, str]]) -> list[str]:
    lines = sorted(
        ((_line_of(root, loc) or 0, n), _format(source, _line_of(root, loc), loc, message))
        for n, (loc, message) in enumerate(found)
    )
    return [text for _, text in lines]


# ------------------------------------------------------------------ running


@dataclass(frozen=True)
class Result:
    case: Case
    explanation: Explanation | None
    differences: tuple[str, ...] = ()
    error: str = ""  # the call cannot be made under this policy (a malformed case)

    @property
    def passed(self) -> bool:
        return not self.differences and not self.error

    def line(self) -> str:
        if self.error:
            return f"ERROR {self.case.name}: {self.error}"
        if self.passed:
            return f"PASS  {self.case.name}"
        assert self.explanation is not None
        return (
            f"FAIL  {self.case.name} ({self.case.where}): {'; '.join(self.differences)}"
            f"\n      got {self.explanation.summary()}"
        )


def run(policy: Policy, cases: Sequence[Case]) -> list[Result]:
    return list(_run(policy, cases))


def _run(policy: Policy, cases: Sequence[Case]) -> Iterator[Result]:
    for case in cases:
        try:
            explanation = explain(policy, case.call)
        except ExplainError as exc:
            where = dict(case.fields).get(exc.field, case.where)
            yield Result(case, None, error=f"{where}: {exc.message}")
            continue
        yield Result(case, explanation, tuple(differences(case.expect, explanation)))


def differences(expect: Expectation, got: Explanation) -> Iterator[str]:
    """What ``got`` says differently from what is expected, one line per key."""
    if got.decision is not expect.decision:
        yield f"decision: expected {expect.decision.value}, got {got.decision.value}"
        return
    if expect.rule is not None and expect.rule != got.rule:
        yield f"rule: expected {expect.rule}, got {got.rule or 'none'}"
    if expect.approvals is not None and expect.approvals != got.approvals:
        yield f"approvals: expected {expect.approvals}, got {got.approvals}"
    if expect.groups is not None and set(expect.groups) != set(got.groups):
        wanted = ", ".join(sorted(expect.groups))
        yield f"groups: expected [{wanted}], got [{', '.join(got.groups)}]"
    if expect.rules is not None and sorted(expect.rules) != sorted(got.rules):
        yield f"rules: expected [{', '.join(expect.rules)}], got [{', '.join(got.rules)}]"
