"""Approvers see which approval rules apply to a request and why (issue 28):
`toolreg approvals show` prints one `needs` line per rule (its name and its
condition, or the default for dangerous tools), and the console's detail JSON
carries the same rules for the page. The rules here are the policy's own
(rule_for over a conditional rule), as the approval service puts them on a
request; every text is escaped like the rest of what an approver reads."""

from __future__ import annotations

import json
from typing import Any

import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.cli.approvals import request_lines, rule_lines
from registry_server.console import views
from registry_server.domain.arguments import arguments_digest
from registry_server.domain.models import SafetyLevel
from registry_server.policy.conditions import CallFacts
from registry_server.policy.model import Requirement
from registry_server.signing.keys import generate_keypair
from registry_server.wire import convert
from tests.factories import policy_of, tool

POLICY = yaml.safe_dump({
    "audience": "rules-shown",
    "approvers": [
        {"id": who, "public_key": generate_keypair()[1], "groups": groups}
        for who, groups in (("alice", ["sre", "security"]), ("bob", ["sre"]), ("carol", ["ops"]))
    ],
    "approval_rules": [
        {"name": "sre-prod", "match": {"tool": "release"}, "when": 'args.env == "prod"',
         "approvals_required": 2, "groups": ["sre"]},
        {"match": {"tool": "release"}, "approvals_required": 1, "groups": ["ops", "security"]},
    ],
})  # fmt: skip


def applied(requirements: tuple[Requirement, ...]) -> list[pb.AppliedRule]:
    """The rules as a request carries them (approval service: name, match,
    condition, approvals and groups of each requirement)."""
    return [
        pb.AppliedRule(
            name=r.name,
            match=r.match,
            condition=r.condition,
            approvals_required=r.approvals_required,
            groups=list(r.groups),
        )
        for r in requirements
    ]


def rules_for(tool_name: str, args: dict[str, Any]) -> list[pb.AppliedRule]:
    rule = policy_of(POLICY).rule_for(
        tool_name=tool_name, categories=(), level=SafetyLevel.DANGEROUS, facts=CallFacts(args)
    )
    return applied(rule.requirements)


def request(args: dict[str, Any], rules: list[pb.AppliedRule]) -> pb.ApprovalRequest:
    definition = tool(name="release", safety_level="dangerous")
    msg = pb.ApprovalRequest(
        id="b" * 32, tool_name="release", tool_digest=definition.digest,
        arguments_json=json.dumps(args), arguments_digest=arguments_digest(args),
        requested_by="agent", approvals_required=3, state="PENDING", audience="rules-shown",
        max_token_ttl_s=600, approvals_missing=3, tool=convert.tool_to_pb(definition),
    )  # fmt: skip
    msg.applied_rules.extend(rules)
    return msg


def test_show_prints_each_rule_that_applies_with_its_condition() -> None:
    args = {"env": "prod"}
    lines = request_lines(request(args, rules_for("release", args)))
    needs = [line for line in lines if line.startswith("needs ")]
    assert needs == [
        'needs     2 approval(s) from sre — rule sre-prod (when args.env == "prod")',
        "needs     1 approval(s) from ops, security — rule 2 (tool release)",
    ]
    # After the fields the console shows too, before the arguments.
    assert lines.index(needs[0]) == lines.index("definition matches the digest signed") + 1
    assert lines[-2].startswith("arguments (digest ")


def test_a_rule_whose_condition_does_not_hold_is_not_shown() -> None:
    args = {"env": "staging"}
    assert rule_lines(request(args, rules_for("release", args))) == [
        "1 approval(s) from ops, security — rule 2 (tool release)"
    ]


def test_the_default_for_dangerous_tools_says_so() -> None:
    rules = rules_for("scratch", {})
    assert [(r.name, r.match) for r in rules] == [("default", "default for dangerous tools")]
    assert rule_lines(request({}, rules)) == [
        "1 approval(s) from any approver — default for dangerous tools"
    ]


def test_a_request_without_rules_prints_no_needs_line() -> None:
    """An older server (or a request whose tool is gone) says nothing: nothing is guessed."""
    lines = request_lines(request({"env": "prod"}, []))
    assert not [line for line in lines if line.startswith("needs")]


def test_rule_text_is_escaped_on_the_terminal_and_in_the_console() -> None:
    hostile = pb.AppliedRule(
        name="sre\u202eprod", match="tool release", condition='args.env == "\x1b[2Jprod"',
        approvals_required=2, groups=["sre\u200b"],
    )  # fmt: skip
    req = request({"env": "prod"}, [hostile])
    (line,) = rule_lines(req)
    assert "\x1b" not in line and "\u202e" not in line and "\u200b" not in line
    assert "rule sre\\u202eprod" in line and "\\u001b[2Jprod" in line
    (shown,) = views.detail(req, "alice")["applied_rules"]
    assert shown["name"] == "sre\\u202eprod" and shown["groups"] == ["sre\\u200b"]
    assert shown["condition"] == 'args.env == "\\u001b[2Jprod"'


def test_the_console_detail_carries_the_rules() -> None:
    args = {"env": "prod"}
    detail = views.detail(request(args, rules_for("release", args)), "alice")
    assert detail["applied_rules"] == [
        {
            "name": "sre-prod", "match": "tool release", "condition": 'args.env == "prod"',
            "approvals_required": 2, "groups": ["sre"], "default": False,
        },
        {
            "name": "rule 2", "match": "tool release", "condition": "",
            "approvals_required": 1, "groups": ["ops", "security"], "default": False,
        },
    ]  # fmt: skip
    (default,) = views.detail(request({}, rules_for("scratch", {})), "alice")["applied_rules"]
    assert default["default"] is True and default["groups"] == []


def test_an_approver_reads_the_tools_guards_which_its_signature_covers() -> None:
    """Guards are part of the digest an approval signs: the approver sees them
    (and 'none' when the tool has none), on the terminal and in the console."""
    guarded = tool(
        name="release", safety_level="dangerous",
        guard=[{"condition": 'args.env != "prod"', "message": "not <b>prod</b> here"}],
    )  # fmt: skip
    req = request({"env": "staging"}, [])
    req.tool.CopyFrom(convert.tool_to_pb(guarded))
    req.tool_digest = guarded.digest
    lines = request_lines(req)
    (shown,) = [line for line in lines if line.startswith("guards ")]
    assert shown == 'guards    args.env != "prod" (not <b>prod</b> here)'
    assert "definition matches the digest signed" in lines
    assert ["guards", shown.removeprefix("guards    ")] in views.detail(req, "alice")["fields"]
    unguarded = request_lines(request({"env": "staging"}, []))
    assert "guards    none" in unguarded
