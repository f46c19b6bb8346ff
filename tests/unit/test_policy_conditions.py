"""Conditions in the policy (issue 28): approval rules' ``when`` and ``name``,
deny rules, what they read of a call (policy/call_facts.py), their load errors
(file, YAML line, field, CEL's line and column) and a live reload that keeps
the policy in force when a condition does not compile."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from registry_server.domain.models import SafetyLevel
from registry_server.policy.call_facts import call_facts, caller_facts, request_rule, tool_facts
from registry_server.policy.conditions import CallFacts, ToolFacts
from registry_server.policy.live import LivePolicy
from registry_server.policy.loader import load_policy
from registry_server.policy.model import (
    Approver,
    Denial,
    Policy,
    PolicyError,
    RuleNotEvaluable,
)
from registry_server.policy.schema import (
    MAX_APPROVAL_RULES,
    MAX_DENY_REASON_CHARS,
    MAX_DENY_RULES,
)
from registry_server.signing.keys import generate_keypair
from tests.factories import sha, tool

SAFE, CAUTIOUS, DANGEROUS = SafetyLevel.SAFE, SafetyLevel.CAUTIOUS, SafetyLevel.DANGEROUS
KEYS = [generate_keypair()[1] for _ in range(4)]
DROP_TABLE = r'args.sql.matches("(?i)\\bdrop\\s+table\\b")'
AT = datetime(2026, 3, 4, 10, 30, tzinfo=UTC)

# The example: deploying to prod needs two of the SREs, staging one
# approval from anyone (the level rule); dropping a table is never allowed.
BASE: dict[str, Any] = {
    "audience": "toolreg-test",
    "approvers": [
        {"id": "alice", "public_key": KEYS[0], "groups": ["sre"]},
        {"id": "bob", "public_key": KEYS[1], "groups": ["sre", "dba"]},
        {"id": "carol", "public_key": KEYS[2]},
        {"id": "dave", "public_key": KEYS[3], "groups": ["frozen"]},
    ],
    "approval_rules": [
        {"name": "sre-prod", "match": {"tool": "deploy"}, "when": 'args.env == "prod"',
         "approvals_required": 2, "groups": ["sre"]},
        {"name": "dangerous", "match": {"level": "dangerous"}, "approvals_required": 1},
    ],
    "deny_rules": [
        {"name": "no-drop-table", "match": {"tool": "run_sql"}, "when": DROP_TABLE,
         "reason": "dropping tables is not allowed"},
        {"name": "no-truncate", "match": {"category": "db"},
         "when": 'args.sql.contains("TRUNCATE")', "reason": "no truncating"},
        {"name": "frozen", "when": '"frozen" in caller.groups', "reason": "the caller is frozen"},
    ],
    "clients": [
        {"id": "agent", "token_sha256": sha("agent"), "roles": ["execute", "register"],
         "max_safety_level": "dangerous"},
        {"id": "dave", "token_sha256": sha("dave"), "roles": ["execute"],
         "max_safety_level": "dangerous"},
        {"id": "ops-bot", "token_sha256": sha("ops"), "roles": ["execute", "approve"],
         "max_safety_level": "dangerous", "approver": "bob"},
    ],
}  # fmt: skip


def policy_data(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data.update(copy.deepcopy(changes))
    return data


def write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=1000))
    return path


def load(tmp_path: Path, data: dict[str, Any] | None = None) -> Policy:
    return load_policy(write(tmp_path, BASE if data is None else data))


def error(tmp_path: Path, data: dict[str, Any]) -> tuple[str, Path]:
    path = write(tmp_path, data)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    return str(info.value), path


def line_of(path: Path, text: str, after: int = 0) -> int:
    """The line (from 1) of the first line holding ``text`` past line ``after``."""
    lines = path.read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if n > after and text in line)


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    return load(tmp_path_factory.mktemp("conditions"))


def facts(
    policy: Policy,
    args: dict[str, Any] | None = None,
    *,
    tool_name: str = "deploy",
    caller: str = "agent",
    categories: tuple[str, ...] = (),
    level: SafetyLevel = DANGEROUS,
) -> CallFacts:
    return CallFacts(
        args or {}, ToolFacts(tool_name, level.value, categories), caller_facts(policy, caller), AT
    )


def rule(policy: Policy, args: dict[str, Any] | None, **kw: Any) -> Any:
    tool_name = kw.pop("tool_name", "deploy")
    categories = kw.pop("categories", ())
    refuse = kw.pop("refuse_on_error", False)
    call = None if args is None else facts(policy, args, tool_name=tool_name, categories=categories)
    return policy.rule_for(
        tool_name=tool_name, categories=categories, level=DANGEROUS, facts=call,
        refuse_on_error=refuse,
    )  # fmt: skip


def denial(
    policy: Policy, args: dict[str, Any], tool_name: str = "run_sql", **kw: Any
) -> Denial | None:
    call = facts(policy, args, tool_name=tool_name, **kw)
    return policy.denial_for(
        tool_name=tool_name, categories=kw.get("categories", ()),
        level=kw.get("level", DANGEROUS), facts=call,
    )  # fmt: skip


def approvers(policy: Policy, *ids: str) -> list[Approver]:
    found = [policy.approver(i) for i in ids]
    assert all(a is not None for a in found)
    return [a for a in found if a is not None]


# ------------------------------------------------------------------ approval rules


def test_prod_needs_two_from_sre_and_one_from_anyone(policy: Policy) -> None:
    prod = rule(policy, {"env": "prod"})
    assert [(r.name, r.approvals_required, r.groups) for r in prod.requirements] == [
        ("sre-prod", 2, ("sre",)),
        ("dangerous", 1, ()),
    ]
    assert prod.approvals_required == 2  # the strictest: two distinct approvers
    assert prod.missing(approvers(policy, "alice")) == 1
    assert prod.missing(approvers(policy, "alice", "carol")) == 1  # carol is no SRE
    assert prod.missing(approvers(policy, "alice", "bob")) == 0  # they count for both
    req = prod.requirements[0]
    assert req.condition == 'args.env == "prod"' and req.match == "tool deploy"
    assert req.source == 'sre-prod (tool deploy, when args.env == "prod")'


def test_staging_needs_one_from_anyone(policy: Policy) -> None:
    staging = rule(policy, {"env": "staging"})
    assert [r.name for r in staging.requirements] == ["dangerous"]
    assert staging.approvals_required == 1
    assert staging.missing(approvers(policy, "carol")) == 0


def test_without_the_calls_facts_every_conditional_rule_counts(policy: Policy) -> None:
    # A listing, or a stored request whose arguments are not shown: the strictest.
    assert [r.name for r in rule(policy, None).requirements] == ["sre-prod", "dangerous"]


def test_a_category_rule_can_only_add(tmp_path: Path) -> None:
    """A registrant chooses its tool's categories: a rule reached through one
    (even a lenient one, even one whose condition holds) never lowers what the
    tool's name and level demand."""
    lenient = [
        {"name": "lenient", "match": {"category": "lenient"}, "approvals_required": 1},
        {"name": "lenient-prod", "match": {"category": "lenient"}, "when": 'args.env == "prod"',
         "approvals_required": 1, "groups": ["dba"]},
    ]  # fmt: skip
    policy = load(tmp_path, policy_data(approval_rules=BASE["approval_rules"] + lenient))
    prod = rule(policy, {"env": "prod"}, categories=("lenient",))
    assert [r.name for r in prod.requirements] == [
        "sre-prod",
        "dangerous",
        "lenient",
        "lenient-prod",
    ]
    assert prod.approvals_required == 2
    assert prod.missing(approvers(policy, "alice", "carol")) == 1  # an SRE short, no dba
    assert prod.requirements[3].admits(("dba",)) and not prod.requirements[3].admits(("sre",))
    assert prod.missing(approvers(policy, "alice", "bob")) == 0  # bob is in sre and dba


def test_a_conditional_rule_never_lowers_below_the_default(tmp_path: Path) -> None:
    only = [
        {"name": "sre-prod", "match": {"tool": "deploy"}, "when": 'args.env == "prod"',
         "approvals_required": 2, "groups": ["sre"]},
        {"name": "never", "match": {"tool": "deploy"}, "when": "false", "approvals_required": 1},
    ]  # fmt: skip
    policy = load(tmp_path, policy_data(approval_rules=only))
    staging = rule(policy, {"env": "staging"})
    assert [(r.name, r.approvals_required, r.groups) for r in staging.requirements] == [
        ("default", 1, ())
    ]
    assert rule(policy, {"env": "prod"}).approvals_required == 2


def test_tools_below_dangerous_need_no_approval_and_their_conditions_are_not_read(
    policy: Policy,
) -> None:
    for level in (SAFE, CAUTIOUS):
        got = policy.rule_for(
            tool_name="deploy", categories=(), level=level, facts=facts(policy, {}),
            refuse_on_error=True,
        )  # fmt: skip
        assert got.requirements == ()


def test_a_condition_that_errs_refuses_the_call_naming_the_rule(policy: Policy) -> None:
    with pytest.raises(RuleNotEvaluable) as info:
        rule(policy, {"replicas": 3}, refuse_on_error=True)  # no env
    assert info.value.rule == "sre-prod"
    assert str(info.value) == (
        'policy rule sre-prod: its condition could not be evaluated: Key not found in map : "env"'
    )


def test_without_refuse_on_error_a_condition_that_errs_counts_as_applying(policy: Policy) -> None:
    assert [r.name for r in rule(policy, {"replicas": 3}).requirements] == ["sre-prod", "dangerous"]


def test_a_rule_without_a_name_is_named_by_its_position(tmp_path: Path) -> None:
    rules = copy.deepcopy(BASE["approval_rules"])
    del rules[0]["name"]
    policy = load(tmp_path, policy_data(approval_rules=[rules[1], rules[0]]))
    with pytest.raises(RuleNotEvaluable) as info:
        rule(policy, {}, refuse_on_error=True)
    assert info.value.rule == "rule 2"
    assert rule(policy, {"env": "prod"}).requirements[1].name == "rule 2"


def test_the_first_erring_rule_in_file_order_is_named(tmp_path: Path) -> None:
    second = {"name": "replicas", "match": {"level": "dangerous"}, "when": "args.replicas > 10",
              "approvals_required": 2}  # fmt: skip
    policy = load(tmp_path, policy_data(approval_rules=[*BASE["approval_rules"], second]))
    with pytest.raises(RuleNotEvaluable) as info:
        rule(policy, {"env": "prod"}, refuse_on_error=True)
    assert info.value.rule == "replicas"


# ------------------------------------------------------------------ deny rules


@pytest.mark.parametrize(
    "sql", ["DROP TABLE users", "drop table users", "x; Drop\tTable t", "DROP  TABLE t"]
)
def test_drop_table_is_denied_in_any_case(policy: Policy, sql: str) -> None:
    found = denial(policy, {"sql": sql})
    assert found == Denial("no-drop-table", "dropping tables is not allowed")
    assert found.message == "denied by policy rule no-drop-table: dropping tables is not allowed"


@pytest.mark.parametrize("sql", ["select * from users", "backdrop tables", "DROP INDEX i"])
def test_other_statements_are_allowed(policy: Policy, sql: str) -> None:
    assert denial(policy, {"sql": sql}) is None


def test_a_deny_rule_matches_only_its_tool(policy: Policy) -> None:
    assert denial(policy, {"sql": "DROP TABLE t"}, tool_name="run_query") is None


def test_the_first_matching_deny_rule_wins(policy: Policy) -> None:
    both = {"sql": "DROP TABLE a; TRUNCATE b"}
    assert denial(policy, both, categories=("db",)).rule == "no-drop-table"
    assert denial(policy, {"sql": "TRUNCATE b"}, categories=("db",)).rule == "no-truncate"


def test_a_deny_rule_without_match_covers_every_tool_at_every_level(policy: Policy) -> None:
    for level in SafetyLevel:
        found = denial(policy, {}, tool_name="echo", caller="dave", level=level)
        assert found == Denial("frozen", "the caller is frozen")
    assert denial(policy, {}, tool_name="echo", caller="agent") is None


def test_a_deny_rule_whose_condition_errs_denies_naming_the_rule(policy: Policy) -> None:
    found = denial(policy, {"query": "DROP TABLE t"})  # no sql
    assert found is not None and found.rule == "no-drop-table"
    assert found.reason == (
        "dropping tables is not allowed (its condition could not be evaluated:"
        ' Key not found in map : "sql")'
    )


def test_a_deny_rule_for_every_tool_that_reads_an_argument_must_test_it_first(
    tmp_path: Path,
) -> None:
    """Without a match, a condition reading ``args.env`` errs for every tool
    without that argument: they are all denied (fail closed). ``has()``
    first keeps them."""
    reckless = {"name": "prod-freeze", "when": 'args.env == "prod"', "reason": "frozen"}
    careful = {**reckless, "when": 'has(args.env) && args.env == "prod"'}
    for rule_, echo_denied in ((reckless, True), (careful, False)):
        policy = load(tmp_path, policy_data(deny_rules=[rule_]))
        assert (denial(policy, {"message": "hi"}, tool_name="echo") is not None) is echo_denied
        assert denial(policy, {"env": "prod"}, tool_name="deploy") is not None
        assert denial(policy, {"env": "dev"}, tool_name="deploy") is None


def test_a_deny_rule_with_match_only_denies_every_call_of_it(tmp_path: Path) -> None:
    rules = [{"name": "no-rm", "match": {"tool": "rm_rf"}, "reason": "never"}]
    policy = load(tmp_path, policy_data(deny_rules=rules))
    assert denial(policy, {}, tool_name="rm_rf") == Denial("no-rm", "never")
    assert denial(policy, {}, tool_name="ls") is None


def test_a_deny_rule_may_match_a_level_below_dangerous(tmp_path: Path) -> None:
    rules = [{"name": "no-safe", "match": {"level": "safe"}, "when": 'caller.id == "agent"',
              "reason": "no"}]  # fmt: skip
    policy = load(tmp_path, policy_data(deny_rules=rules))
    assert denial(policy, {}, tool_name="echo", level=SAFE) is not None
    assert denial(policy, {}, tool_name="echo", level=CAUTIOUS) is None


# ------------------------------------------------------------------ load errors


@pytest.mark.parametrize(
    ("when", "message"),
    [
        ('tool.nmae == "deploy"', "CEL: line 1, column 5: undefined field 'nmae'"),
        ("tool.level == 3", "CEL: line 1, column 12: found no matching overload"),
        ("args.env", "CEL: must be a bool, not dyn"),
        ('args.env == "prod" &&', "CEL: line 1, column 22: Syntax error"),
        ("args.a.exists(x, args.b.exists(y, x == y))", "CEL: may cost up to"),
        ('args.sql.matches("(a)\\\\1")', "CEL: matches(): the pattern is not valid RE2"),
        ("args.sql.matches(args.pattern)", "CEL: matches(): the pattern must be a string literal"),
    ],
)
def test_a_bad_when_names_the_file_line_and_field(tmp_path: Path, when: str, message: str) -> None:
    rules = copy.deepcopy(BASE["approval_rules"])
    rules[1]["when"] = when
    denies = copy.deepcopy(BASE["deny_rules"])
    denies[2]["when"] = when
    text, path = error(tmp_path, policy_data(approval_rules=rules, deny_rules=denies))
    problems = text.splitlines()
    approval_line = line_of(path, "when:", after=line_of(path, "name: dangerous"))
    deny_line = line_of(path, "when:", after=line_of(path, "name: frozen"))
    # the rule's name too: operators look rules up by name
    approval = f"{path} line {approval_line}: approval_rules[1].when: (rule dangerous) {message}"
    assert problems[0].startswith(approval)
    deny = f"{path} line {deny_line}: deny_rules[2].when: (rule frozen) {message}"
    assert problems[1].startswith(deny)
    assert len(problems) == 2


def test_a_multi_line_when_names_the_line_within_it(tmp_path: Path) -> None:
    rules = copy.deepcopy(BASE["approval_rules"])
    rules[0]["when"] = 'args.env == "prod" &&\n  tool.nmae == "x"\n'
    text, path = error(tmp_path, policy_data(approval_rules=rules))
    assert (
        f"{path} line {line_of(path, 'when:')}: approval_rules[0].when: (rule sre-prod) CEL: line 2,"
        " column 7" in (text)
    )


def test_duplicate_rule_names_are_refused(tmp_path: Path) -> None:
    denies = copy.deepcopy(BASE["deny_rules"])
    denies[0]["name"] = "sre-prod"
    denies[2]["name"] = "no-truncate"
    text, _ = error(tmp_path, policy_data(deny_rules=denies))
    problems = text.splitlines()
    assert len(problems) == 2
    assert problems[0].endswith(
        "deny_rules[0].name: duplicate rule name 'sre-prod' (also approval_rules[0])"
    )
    assert problems[1].endswith(
        "deny_rules[2].name: duplicate rule name 'no-truncate' (also deny_rules[1])"
    )


def test_the_same_match_under_the_same_condition_is_refused(tmp_path: Path) -> None:
    again = {"name": "sre-prod-2", "match": {"tool": "deploy"}, "when": 'args.env == "prod"',
             "approvals_required": 1}  # fmt: skip
    text, _ = error(tmp_path, policy_data(approval_rules=[*BASE["approval_rules"], again]))
    assert (
        "approval_rules[2].match: (rule sre-prod-2) same match and condition as approval_rules[0]"
        in text
    )


@pytest.mark.parametrize("when", ['args.env == "staging"', None])
def test_the_same_match_under_another_condition_or_none_is_accepted(
    tmp_path: Path, when: str | None
) -> None:
    other = {"name": "deploy-other", "match": {"tool": "deploy"}, "approvals_required": 1}
    if when is not None:
        other["when"] = when
    policy = load(tmp_path, policy_data(approval_rules=[*BASE["approval_rules"], other]))
    assert [r.name for r in policy.rules] == ["sre-prod", "dangerous", "deploy-other"]


@pytest.mark.parametrize(
    ("change", "field", "message"),
    [
        ({"match": None}, "deny_rules[0]", "neither match nor when would refuse every call"),
        ({"reason": ""}, "deny_rules[0].reason", f"must be 1 to {MAX_DENY_REASON_CHARS}"),
        ({"reason": "   "}, "deny_rules[0].reason", "must be 1 to"),
        ({"reason": "x" * (MAX_DENY_REASON_CHARS + 1)}, "deny_rules[0].reason", "must be 1 to"),
        ({"reason": "a\nb"}, "deny_rules[0].reason", "must not contain control characters"),
        ({"name": None}, "deny_rules[0].name", "is required"),
        ({"name": "No Spaces"}, "deny_rules[0].name", "is not a valid rule name"),
        ({"match": {"tool": "a", "level": "safe"}}, "deny_rules[0].match", "exactly one of"),
        ({"match": {}}, "deny_rules[0].match", "exactly one of"),
        ({"unknown": 1}, "deny_rules[0].unknown", "unknown key"),
    ],
)
def test_a_deny_rule_is_checked(
    tmp_path: Path, change: dict[str, Any], field: str, message: str
) -> None:
    deny = {"name": "d", "match": {"tool": "rm"}, "reason": "no"}
    deny.update(change)
    deny = {k: v for k, v in deny.items() if v is not None}
    text, path = error(tmp_path, policy_data(deny_rules=[deny]))
    assert f"{path} line" in text
    assert f"{field}: " in text and message in text, text


def test_a_reason_of_the_largest_size_is_accepted(tmp_path: Path) -> None:
    deny = {"name": "d", "match": {"tool": "rm"}, "reason": "x" * MAX_DENY_REASON_CHARS}
    assert load(tmp_path, policy_data(deny_rules=[deny])).deny_rules[0].reason == deny["reason"]


def test_rule_lists_are_capped(tmp_path: Path) -> None:
    denies = [{"name": f"d{i}", "match": {"tool": f"t{i}"}, "reason": "no"}
              for i in range(MAX_DENY_RULES + 1)]  # fmt: skip
    text, _ = error(tmp_path, policy_data(deny_rules=denies))
    assert f"deny_rules: List should have at most {MAX_DENY_RULES} items" in text
    rules = [{"match": {"tool": f"t{i}"}, "approvals_required": 1}
             for i in range(MAX_APPROVAL_RULES + 1)]  # fmt: skip
    text, _ = error(tmp_path, policy_data(approval_rules=rules))
    assert f"approval_rules: List should have at most {MAX_APPROVAL_RULES} items" in text


# ------------------------------------------------------------------ what conditions read


def test_conditions_read_the_callers_roles_groups_and_claims(tmp_path: Path) -> None:
    rules = [{"name": "bob-or-eng", "match": {"level": "dangerous"},
              "when": '"dba" in caller.groups && "approve" in caller.roles'
                      ' && caller.claims.department == "eng"',
              "approvals_required": 1}]  # fmt: skip
    policy = load(tmp_path, policy_data(approval_rules=rules))
    ops = caller_facts(policy, "ops-bot", {"department": "eng"})
    # its roles from the policy, its groups those of the approver it is
    assert ops.roles == ("approve", "execute") and ops.groups == ("sre", "dba")
    assert dict(ops.claims) == {"department": "eng"}
    assert caller_facts(policy, "stranger") == caller_facts(policy, "stranger")
    assert caller_facts(policy, "stranger").roles == () == caller_facts(policy, "stranger").groups

    def applies(caller: str, claims: dict[str, Any]) -> bool:
        call = call_facts(
            policy, tool(safety_level="dangerous"), {}, caller, AT.timestamp(), claims
        )
        found = policy.rule_for(tool_name="echo", categories=(), level=DANGEROUS, facts=call)
        return [r.name for r in found.requirements] == ["bob-or-eng"]

    assert applies("ops-bot", {"department": "eng"})
    assert not applies("ops-bot", {"department": "sales"})
    assert not applies("agent", {"department": "eng"})  # no dba, no approve


def test_conditions_read_the_tool_as_registered(tmp_path: Path) -> None:
    defined = replace(
        tool(name="deploy", safety_level="dangerous", categories=["ops", "prod"]),
        owner="team-a",
        egress=("api.example.com:443", "db.example.com:5432", "api.example.com:8443"),
    )
    facts_ = tool_facts(defined)
    assert facts_ == ToolFacts(
        "deploy", "dangerous", ("ops", "prod"), "team-a", defined.digest,
        ("api.example.com", "db.example.com"),
    )  # fmt: skip
    when = (
        'tool.name == "deploy" && tool.level == "dangerous" && "prod" in tool.categories'
        ' && tool.owner == "team-a" && "db.example.com" in tool.egress_hosts'
        f' && tool.digest == "{defined.digest}"'
    )
    rules = [{"name": "t", "match": {"tool": "deploy"}, "when": when, "approvals_required": 1}]
    policy = load(tmp_path, policy_data(approval_rules=rules))
    call = call_facts(policy, defined, {}, "agent", AT.timestamp())
    found = policy.rule_for(tool_name="deploy", categories=defined.categories, level=DANGEROUS,
                            facts=call, refuse_on_error=True)  # fmt: skip
    assert [r.name for r in found.requirements] == ["t"]


def test_now_is_the_time_of_the_call(tmp_path: Path) -> None:
    rules = [{"name": "office-hours", "match": {"tool": "deploy"},
              "when": "now.getHours() < 9 || now.getHours() >= 18", "approvals_required": 2,
              "groups": ["sre"]}]  # fmt: skip
    policy = load(tmp_path, policy_data(approval_rules=rules))
    defined = tool(name="deploy", safety_level="dangerous")

    def needs(hour: int) -> int:
        at = AT.replace(hour=hour).timestamp()
        call = call_facts(policy, defined, {}, "agent", at)
        return policy.rule_for(tool_name="deploy", categories=(), level=DANGEROUS, facts=call,
                               refuse_on_error=True).approvals_required  # fmt: skip

    assert needs(10) == 1 and needs(20) == 2 and needs(6) == 2


def test_a_stored_requests_rule_reads_its_arguments_requester_and_time(policy: Policy) -> None:
    deploy = ToolFacts("deploy", "dangerous")
    at = AT.timestamp()
    assert request_rule(policy, deploy, '{"env": "prod"}', "agent", at).approvals_required == 2
    assert request_rule(policy, deploy, '{"env": "dev"}', "agent", at).approvals_required == 1
    # arguments left out, unreadable or not an object: the strictest
    for hidden in ("", "{not json", "[1, 2]", json.dumps({"replicas": 1})):
        found = request_rule(policy, deploy, hidden, "agent", at)
        assert [r.name for r in found.requirements] == ["sre-prod", "dangerous"], hidden


# ------------------------------------------------------------------ live reload


def test_a_reload_whose_condition_does_not_compile_keeps_the_policy_in_force(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, BASE)
    live = LivePolicy(lambda: load_policy(path))
    before = live.current
    broken = copy.deepcopy(BASE)
    broken["approval_rules"][0]["when"] = 'args.env == "prod" &&'
    write(tmp_path, broken)
    with pytest.raises(PolicyError) as info:
        live.reload()
    assert "approval_rules[0].when: (rule sre-prod) CEL: line 1, column 22" in str(info.value)
    assert live.current is before
    assert rule(live.current, {"env": "prod"}).approvals_required == 2
    # fixed: the next reload puts the new condition in force
    fixed = copy.deepcopy(BASE)
    fixed["approval_rules"][0]["when"] = 'args.env in ["prod", "staging"]'
    write(tmp_path, fixed)
    live.reload()
    assert live.current is not before
    assert rule(live.current, {"env": "staging"}).approvals_required == 2
