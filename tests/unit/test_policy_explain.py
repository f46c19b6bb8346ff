"""`toolreg policy explain`'s logic (policy/explain.py): the decision the
server would give one call, from the policy's own functions, and why each
rule did or did not apply; the caller as the policy knows it."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from registry_server.domain.manifests import load_manifest
from registry_server.domain.models import OPERATOR_OWNER
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
from registry_server.policy.loader import load_policy
from registry_server.policy.model import Policy
from registry_server.signing.keys import generate_keypair
from tests.factories import sha

KEYS = [generate_keypair()[1] for _ in range(3)]
MORNING = datetime(2025, 6, 2, 9, 0, tzinfo=UTC)
EVENING = datetime(2025, 6, 2, 19, 0, tzinfo=UTC)

POLICY = f"""\
audience: toolreg-test
approvers:
  - {{id: alice, public_key: "{KEYS[0]}", groups: [security, sre]}}
  - {{id: bob, public_key: "{KEYS[1]}", groups: [sre]}}
  - {{id: carol, public_key: "{KEYS[2]}", groups: [ops]}}
approval_rules:
  - name: sre-prod
    match: {{tool: deploy}}
    when: args.env == "prod"
    approvals_required: 2
    groups: [sre]
    max_token_ttl_s: 900
  - name: after-hours
    match: {{level: dangerous}}
    when: now.getHours("UTC") >= 18
    approvals_required: 1
    groups: [ops]
  - match: {{category: files}}
    approvals_required: 1
    groups: [security]
deny_rules:
  - name: no-drop-table
    match: {{tool: run_sql}}
    when: args.sql.matches(r"(?i)\\bdrop\\s+table\\b")
    reason: no dropping tables
  - name: interns-read-only
    when: '"interns" in caller.groups && tool.level != "safe"'
    reason: interns run safe tools only
clients:
  - {{id: agent, token_sha256: "{sha("a")}", roles: [execute], max_safety_level: dangerous}}
  - id: alice
    token_sha256: "{sha("b")}"
    roles: [execute, approve]
    max_safety_level: dangerous
  - id: low
    token_sha256: "{sha("c")}"
    roles: [execute, register]
    max_safety_level: cautious
    quotas: {{max_concurrent: 2}}
    register: {{max_safety_level: cautious, images: ["toolreg/*"]}}
  - {{id: pinned, idp: {{provider: corp, subject: svc}}, roles: [execute], max_safety_level: safe}}
  - {{id: writer, token_sha256: "{sha("d")}", roles: [register]}}
quotas:
  default: {{rate_per_s: 5}}
identity_providers:
  - id: corp
    issuer: https://idp.example.test
    audiences: [https://registry.example.test]
    groups:
      - {{group: agents, roles: [execute], max_safety_level: dangerous}}
      - {{group: interns, roles: [execute], max_safety_level: cautious}}
"""


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Policy:
    path = tmp_path_factory.mktemp("explain") / "policy.yaml"
    path.write_text(POLICY)
    return load_policy(path)


def call(
    tool: str = "deploy",
    args: dict[str, Any] | None = None,
    client: str = "agent",
    *,
    level: str = "dangerous",
    categories: tuple[str, ...] = (),
    at: datetime = MORNING,
    **more: Any,
) -> Call:
    facts = ToolFacts(tool, level, categories)
    return Call(facts, json.dumps(args or {}), client, at, **more)


def test_a_conditional_rule_applies_when_it_holds(policy: Policy) -> None:
    prod = explain(policy, call(args={"env": "prod"}))
    assert prod.decision is Decision.APPROVAL and prod.status == "APPROVAL_REQUIRED"
    assert (prod.approvals, prod.groups, prod.rules) == (2, ("sre",), ("sre-prod",))
    assert [(r.name, r.eligible) for r in prod.requirements] == [("sre-prod", ("alice", "bob"))]
    assert prod.effective is not None and prod.effective.max_token_ttl_s == 900
    checks = {c.name: c for c in prod.approval_rules}
    assert checks["sre-prod"].applies and checks["sre-prod"].result == "true"
    assert not checks["after-hours"].applies and checks["after-hours"].result == "false"
    assert not checks["rule 3"].matched and checks["rule 3"].why == "it has no categories"

    staging = explain(policy, call(args={"env": "staging"}))
    assert (staging.approvals, staging.groups, staging.rules) == (1, (), ("default",))
    assert "1 from any approver: alice, bob, carol" in staging.render()


def test_the_decision_is_the_policys_own(policy: Policy) -> None:
    """Whatever the listing says, the gate's answer is Policy.rule_for's."""
    for args, at in (
        ({"env": "prod"}, EVENING),
        ({"env": "dev"}, EVENING),
        ({"env": "x"}, MORNING),
    ):
        e = explain(policy, call(args=args, at=at, categories=("files",)))
        assert e.effective is not None
        applied = [c.name for c in e.approval_rules if c.applies]
        assert list(e.rules) == (applied or ["default"])
    evening = explain(policy, call(args={"env": "prod"}, at=EVENING))
    assert evening.rules == ("sre-prod", "after-hours")
    assert evening.groups == ("ops", "sre")


def test_a_condition_that_errs_refuses_the_call_naming_the_rule(policy: Policy) -> None:
    e = explain(policy, call(args={"version": "1"}))
    assert e.decision is Decision.DENIED and e.status == "POLICY_DENIED"
    assert e.rule == "sre-prod" and "could not be evaluated" in e.detail
    text = e.render()
    assert "REFUSES  sre-prod" in text and 'error: Key not found in map : "env"' in text


def test_a_deny_rule_refuses_before_the_approval_gate(policy: Policy) -> None:
    e = explain(policy, call("run_sql", {"sql": "select 1; DROP\n  table users"}))
    assert e.decision is Decision.DENIED and e.rule == "no-drop-table"
    assert e.detail == "denied by policy rule no-drop-table: no dropping tables"
    assert e.effective is None
    text = e.render()
    assert "DENIES   no-drop-table" in text and "not reached" in text
    reading = explain(policy, call("run_sql", {"sql": "SELECT drop_table_count FROM t"}))
    assert reading.decision is Decision.APPROVAL


def test_an_approver_never_counts_for_their_own_call(policy: Policy) -> None:
    e = explain(policy, call(args={"env": "prod"}, client="alice"))
    (sre,) = e.requirements
    assert sre.eligible == ("bob",) and sre.excluded == ("alice",)
    assert not e.approvable
    assert "NEVER APPROVABLE" in e.render()
    assert explain(policy, call(args={"env": "prod"})).approvable


@pytest.mark.parametrize(
    ("client", "level", "status", "needle"),
    [
        ("nobody", "safe", "UNAUTHENTICATED", "'nobody' is not in the policy"),
        ("writer", "safe", "PERMISSION_DENIED", "lacks the execute role"),
        ("low", "dangerous", "PERMISSION_DENIED", "may run tools up to cautious"),
        ("corp.dana", "safe", "PERMISSION_DENIED", "has no role in this policy"),
    ],
)
def test_callers_the_server_refuses(
    policy: Policy, client: str, level: str, status: str, needle: str
) -> None:
    e = explain(policy, call("echo", client=client, level=level))
    assert e.decision is Decision.FORBIDDEN and e.status == status
    assert needle in e.detail


def test_a_client_of_an_identity_provider_is_what_its_groups_make_it(policy: Policy) -> None:
    agent = explain(policy, call("lookup", client="corp.dana", level="cautious",
                                 idp_groups=frozenset({"agents"})))  # fmt: skip
    assert agent.decision is Decision.ALLOWED
    assert "identity provider corp" in agent.caller.how
    intern = explain(policy, call("lookup", client="corp.dana", level="cautious",
                                  idp_groups=frozenset({"interns"})))  # fmt: skip
    assert intern.decision is Decision.DENIED and intern.rule == "interns-read-only"
    assert intern.caller.facts.groups == ("interns",)
    # Without groups given, they are read from the claims, as the server reads the token.
    claimed = explain(policy, call("lookup", client="corp.dana", level="cautious",
                                   claims={"groups": ["interns"]}))  # fmt: skip
    assert claimed.rule == "interns-read-only"
    # The policy given is not changed: no sighting outlives the explanation.
    assert policy.client("corp.dana") is None


def test_what_a_call_of_the_file_cannot_carry_is_refused(policy: Policy) -> None:
    with pytest.raises(ExplainError) as info:
        explain(policy, call(args={"env": "prod"}, idp_groups=frozenset({"agents"})))
    assert info.value.field == "groups"
    with pytest.raises(ExplainError) as info:
        explain(policy, call(args={"env": "prod"}, claims={"sub": "x"}))
    assert info.value.field == "claims"
    pinned = explain(policy, call("echo", client="pinned", level="safe", claims={"team": "a"}))
    assert pinned.decision is Decision.ALLOWED and pinned.caller.facts.claims == {"team": "a"}
    with pytest.raises(ExplainError) as info:
        explain(policy, Call(ToolFacts("echo", "safe"), "[1]", "agent", MORNING))
    assert info.value.field == "args"


def test_rules_are_not_evaluated_for_tools_no_approval_gates(policy: Policy) -> None:
    e = explain(policy, call("copy", level="cautious", categories=("files",)))
    assert e.decision is Decision.ALLOWED and e.effective is None
    (files,) = [c for c in e.approval_rules if c.name == "rule 3"]
    assert files.matched and not files.applies
    assert files.result == "not evaluated (not a dangerous tool)"
    assert "only dangerous tools need approvals" in e.render()


def test_quotas_and_the_register_grant(policy: Policy) -> None:
    e = explain(policy, call("echo", client="low", level="safe"))
    quota = dict(e.quota)
    assert quota["max_concurrent"] == "2 (its own)"
    assert quota["rate_per_s"] == "5 (quotas.default)"
    assert quota["max_queued"].startswith("not set")
    assert e.register.startswith("tools up to cautious; images toolreg/*")
    assert explain(policy, call(args={"env": "x"})).register == "none (no register or admin role)"


def write_manifest(tmp_path: Path, **extra: Any) -> Path:
    manifest = {
        "name": "put_file", "description": "Writes a file.", "safety_level": "dangerous",
        "categories": ["files"],
        "parameters": {
            "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
            "additionalProperties": False,
        },
        "sandbox": {"image": "toolreg/python", "command": ["true"]},
        "guard": [{"condition": '!args.path.startsWith("/")', "message": "relative paths only"}],
        **extra,
    }  # fmt: skip
    path = tmp_path / "put_file.yaml"
    path.write_text(json.dumps(manifest))
    return path


def manifest_call(path: Path, args: dict[str, Any], owner: str = "") -> Call:
    facts, definition = manifest_tool(load_manifest(path), owner)
    return Call(facts, json.dumps(args), "agent", MORNING, definition=definition)


def test_with_a_manifest_the_schema_and_guards_come_first(policy: Policy, tmp_path: Path) -> None:
    path = write_manifest(tmp_path)
    ok = explain(policy, manifest_call(path, {"path": "a.txt"}))
    assert ok.decision is Decision.APPROVAL and ok.rules == ("rule 3",)
    assert ok.call.tool.digest and ok.call.tool.categories == ("files",)
    schema = explain(policy, manifest_call(path, {}))
    assert schema.decision is Decision.INVALID and "'path' is a required property" in schema.detail
    guard = explain(policy, manifest_call(path, {"path": "/etc/passwd"}))
    assert guard.decision is Decision.INVALID
    assert guard.detail == "guard failed: relative paths only"


def test_with_a_manifest_and_an_owner_the_owners_grant_is_checked(
    policy: Policy, tmp_path: Path
) -> None:
    path = write_manifest(tmp_path)
    refused = explain(policy, manifest_call(path, {"path": "a"}, owner="low"))
    assert refused.decision is Decision.REFUSED and refused.status == "SANDBOX_ERROR"
    assert "may register tools up to level cautious" in refused.detail
    gone = explain(policy, manifest_call(path, {"path": "a"}, owner="someone-gone"))
    assert gone.decision is Decision.REFUSED and "no longer holds a register grant" in gone.detail
    operator = explain(policy, manifest_call(path, {"path": "a"}, owner=OPERATOR_OWNER))
    assert operator.decision is Decision.APPROVAL
    assert "owner the operator" in operator.render()


def test_render_names_every_step_and_rule(policy: Policy) -> None:
    text = explain(policy, call(args={"env": "prod"})).render()
    for needle in (
        "decision: APPROVAL (APPROVAL_REQUIRED)",
        "sre-prod: 2 from sre: alice, bob",
        'when args.env == "prod": true',
        "match level dangerous: yes",
        "deny rules:     none refuses the call",
        "arguments:      not checked: no manifest",
        "at:       2025-06-02T09:00:00Z",
    ):
        assert needle in text, needle


def test_explanation_summary_is_one_line(policy: Policy) -> None:
    e: Explanation = explain(policy, call(args={"env": "prod"}))
    assert e.summary() == ("approval (APPROVAL_REQUIRED): 2 approval(s) from sre")


@pytest.mark.parametrize(
    ("text", "ok"),
    [("2025-06-02T09:00:00Z", True), ("2025-06-02T11:00:00+02:00", True),
     ("2025-06-02T09:00:00", False), ("tomorrow", False)],
)  # fmt: skip
def test_times_need_their_zone(text: str, ok: bool) -> None:
    if ok:
        assert parse_time(text) == MORNING
    else:
        with pytest.raises(ValueError, match="--at"):
            parse_time(text)
