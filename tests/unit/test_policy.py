"""The policy file: loading, every rejection naming file and line, and lookups."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from registry_server.domain.models import SafetyLevel
from registry_server.execution.admission import ClientLimits
from registry_server.execution.quotas import Rate, Shares
from registry_server.policy.clients import Client, Quota, Role
from registry_server.policy.loader import load_policy
from registry_server.policy.model import (
    DEFAULT_MAX_TOKEN_TTL_S,
    EffectiveRule,
    Policy,
    PolicyError,
    Requirement,
    development_policy,
)
from registry_server.signing.keys import generate_keypair, public_key_from_text
from tests.factories import sha

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "policy.yaml"
KEY_A = generate_keypair()[1]
KEY_B = generate_keypair()[1]
KEY_C = generate_keypair()[1]
SAFE, CAUTIOUS, DANGEROUS = SafetyLevel.SAFE, SafetyLevel.CAUTIOUS, SafetyLevel.DANGEROUS


# A valid policy; tests break one line of it. Line numbers below refer to it.
BASE = f"""\
audience: toolreg-test
approvers:
  - id: alice
    public_key: "{KEY_A}"
    groups: [security, ops]
  - id: bob
    public_key: "{KEY_B}"
    groups: [security]
  - id: carol
    public_key: "{KEY_C}"
    groups: [ops]
approval_rules:
  - match: {{tool: write_file}}
    approvals_required: 2
    groups: [security]
    max_token_ttl_s: 900
  - match: {{category: files}}
    approvals_required: 1
    groups: [ops]
  - match: {{category: net}}
    approvals_required: 3
  - match: {{level: dangerous}}
    approvals_required: 2
    max_token_ttl_s: 600
clients:
  - id: agent
    token_sha256: "{sha("agent-secret")}"
    roles: [execute, register]
    max_safety_level: cautious
  - id: alice
    mtls_subject: "CN=alice,O=example"
    roles: [approve]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path


def replace_line(number: int, new: str) -> str:
    lines = BASE.splitlines()
    lines[number - 1] = new
    return "\n".join(lines) + "\n"


def insert_after(number: int, new: str) -> str:
    lines = BASE.splitlines()
    lines.insert(number, new)
    return "\n".join(lines) + "\n"


def error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    message = str(info.value)
    assert str(path) in message
    return message


@pytest.fixture
def policy(tmp_path: Path) -> Policy:
    return load_policy(write(tmp_path, BASE))


# ---------------------------------------------------------------- loading


def test_example_policy_loads() -> None:
    policy = load_policy(EXAMPLE)
    assert policy.audience == "toolreg-example"
    assert [a.id for a in policy.approvers] == ["alice", "bob", "carol"]
    assert policy.client_by_token("agent-token-123") is not None
    assert policy.client_by_token("approver-token-456") is not None
    rule = policy.rule_for(tool_name="write_file", categories=["files"], level=DANGEROUS)
    assert rule.approvals_required == 2
    assert rule.describe() == (
        "2 approval(s) from security and 1 approval(s) from ops and 1 approval(s) from any approver"
    )
    assert policy.ceiling(DANGEROUS) is not None


def test_example_policy_holds_no_private_key() -> None:
    assert "PRIVATE" not in EXAMPLE.read_text()


def test_base_policy_loads(policy: Policy) -> None:
    assert policy.approval_request_ttl_s == 3600
    assert set(policy.approver_keys()) == {"alice", "bob", "carol"}
    assert policy.ceiling(SAFE) is None


def test_unknown_top_level_key(tmp_path: Path) -> None:
    message = error(tmp_path, BASE + "approver_groups: [x]\n")
    assert "policy.yaml line 33: approver_groups: unknown key" in message


def test_unknown_nested_key(tmp_path: Path) -> None:
    message = error(tmp_path, insert_after(7, "    colour: blue"))
    assert "policy.yaml line 8: approvers[1].colour: unknown key" in message


def test_unknown_key_in_a_rule_match(tmp_path: Path) -> None:
    message = error(tmp_path, replace_line(13, "  - match: {tool: write_file, tools: x}"))
    assert "line 13: approval_rules[0].match.tools: unknown key" in message


def test_bad_public_key_named_with_line(tmp_path: Path) -> None:
    message = error(tmp_path, replace_line(7, '    public_key: "bm90IGEga2V5"'))
    assert "policy.yaml line 7: approvers[1].public_key: not an Ed25519 public key" in message


def test_private_key_pasted_as_public_is_refused_without_echo(tmp_path: Path) -> None:
    private_pem = generate_keypair()[0].decode()
    block = textwrap.indent(private_pem, "      ")
    message = error(tmp_path, replace_line(7, "    public_key: |\n" + block.rstrip()))
    assert "line 7: approvers[1].public_key" in message and "PRIVATE key" in message
    assert private_pem.splitlines()[1] not in message


def test_duplicate_approver_id(tmp_path: Path) -> None:
    message = error(tmp_path, replace_line(6, "  - id: alice"))
    assert "line 6: approvers[1].id: duplicate approver id 'alice' (also approvers[0])" in message


def test_one_key_for_two_approvers(tmp_path: Path) -> None:
    message = error(tmp_path, replace_line(7, f'    public_key: "{KEY_A}"'))
    assert "line 7: approvers[1].public_key: same key as approvers[0] ('alice')" in message


def test_rule_with_unknown_group(tmp_path: Path) -> None:
    message = error(tmp_path, replace_line(15, "    groups: [securty]"))
    assert "line 15: approval_rules[0].groups[0]: unknown group 'securty'" in message


def test_unsatisfiable_rule(tmp_path: Path) -> None:
    message = error(tmp_path, replace_line(14, "    approvals_required: 3"))
    assert "line 14: approval_rules[0].approvals_required: unsatisfiable rule" in message
    assert "only 2 approver(s) (alice, bob) are in groups security" in message


def test_rule_must_match_exactly_one_thing(tmp_path: Path) -> None:
    message = error(tmp_path, replace_line(13, "  - match: {tool: write_file, level: dangerous}"))
    assert "line 13: approval_rules[0].match: must name exactly one of" in message


def test_rule_for_a_non_dangerous_level_would_never_apply(tmp_path: Path) -> None:
    message = error(tmp_path, replace_line(22, "  - match: {level: cautious}"))
    assert "approval_rules[3].match.level: only dangerous tools need approvals" in message


def test_duplicate_yaml_key(tmp_path: Path) -> None:
    message = error(tmp_path, insert_after(4, f'    public_key: "{KEY_B}"'))
    assert "line 5: approvers[0].public_key: duplicate key 'public_key'" in message


def test_client_needs_a_credential(tmp_path: Path) -> None:
    text = BASE + "  - id: nobody\n    roles: [execute]\n"
    assert "line 33: clients[2]: needs a credential" in error(tmp_path, text)


def test_client_token_must_be_a_hash(tmp_path: Path) -> None:
    message = error(tmp_path, replace_line(27, '    token_sha256: "agent-secret"'))
    assert "line 27: clients[0].token_sha256: must be the sha256" in message
    assert "agent-secret" not in message


def test_duplicate_client_credential(tmp_path: Path) -> None:
    text = BASE + f'  - id: other\n    token_sha256: "{sha("agent-secret").upper()}"\n'
    assert "line 34: clients[2].token_sha256: duplicate credential" in error(tmp_path, text)


def test_id_with_a_trailing_newline_is_refused(tmp_path: Path) -> None:
    message = error(tmp_path, replace_line(6, '  - id: "bob\\n"'))
    assert "line 6: approvers[1].id: 'bob\\n' is not a valid approver id" in message


def test_unknown_role_and_level(tmp_path: Path) -> None:
    text = replace_line(28, "    roles: [execute, root]")
    assert "line 28: clients[0].roles: unknown role 'root'" in error(tmp_path, text)
    text = replace_line(29, "    max_safety_level: extreme")
    assert "line 29: clients[0].max_safety_level: unknown safety level" in error(tmp_path, text)


def test_missing_audience(tmp_path: Path) -> None:
    message = error(tmp_path, BASE.replace("audience: toolreg-test\n", ""))
    assert "line 1: audience: is required" in message


def test_empty_audience(tmp_path: Path) -> None:
    assert "audience: must not be empty" in error(tmp_path, replace_line(1, 'audience: ""'))


def test_wrong_types(tmp_path: Path) -> None:
    assert "line 14: approval_rules[0].approvals_required: must be a valid integer" in error(
        tmp_path, replace_line(14, '    approvals_required: "2"')
    )
    assert "line 2: approvers: must be a list" in error(
        tmp_path, "audience: x\napprovers: {alice: 1}\n"
    )


def test_bad_profile_field(tmp_path: Path) -> None:
    text = BASE + "profiles:\n  safe: {memory_mb: 0}\n  risky: {pids: 1}\n"
    message = error(tmp_path, text)
    assert "line 34: profiles.safe.memory_mb: must be greater than or equal to 1" in message
    assert "line 35: profiles.risky: unknown key" in message


def test_every_problem_is_reported_in_file_order(tmp_path: Path) -> None:
    text = replace_line(4, '    public_key: "junk"').replace("max_token_ttl_s: 900", "ttl: 900")
    lines = error(tmp_path, text).splitlines()
    assert len(lines) == 2
    assert "line 4:" in lines[0] and "line 16:" in lines[1]


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(PolicyError, match=r"absent\.yaml: cannot read the policy file"):
        load_policy(path)


def test_bad_yaml_syntax_with_line(tmp_path: Path) -> None:
    message = error(tmp_path, replace_line(5, "    groups: [security, ops"))
    assert "policy.yaml line 6" in message and "not valid YAML" in message


@pytest.mark.parametrize(
    ("text", "reason"), [("", "is empty"), ("- a\n- b\n", "must be a mapping")]
)
def test_not_a_mapping(tmp_path: Path, text: str, reason: str) -> None:
    assert reason in error(tmp_path, text)


# ---------------------------------------------------------------- lookups


def test_every_matching_rule_applies_at_once(policy: Policy) -> None:
    """The strictest of all: a category a registrant chose can add approvals,
    never remove what the tool's name or level requires."""

    def rule(name: str, categories: list[str], level: SafetyLevel = DANGEROUS) -> EffectiveRule:
        return policy.rule_for(tool_name=name, categories=categories, level=level)

    by_tool = rule("write_file", ["files"])
    assert [r.source for r in by_tool.requirements] == [
        "rule 1 (tool write_file)", "rule 2 (category files)", "rule 4 (level dangerous)",
    ]  # fmt: skip
    assert by_tool.max_token_ttl_s == 600  # the shortest of them
    alice, bob, carol = (policy.approver(a) for a in ("alice", "bob", "carol"))
    assert alice and bob and carol
    assert by_tool.missing([alice]) == 1  # 2 from security
    assert by_tool.missing([alice, bob]) == 0  # alice is in ops too
    assert by_tool.missing([bob, carol]) == 1  # 2 from security still
    # a category with a looser rule than the level's: the level's still holds
    by_category = rule("delete_file", ["files"])
    assert by_category.approvals_required == 2
    assert by_category.missing([carol]) == 1
    assert by_category.missing([carol, bob]) == 0
    # a stricter category rule adds to the level's
    assert rule("fetch", ["net"]).approvals_required == 3
    by_level = rule("launch", ["misc"])
    assert (by_level.approvals_required, by_level.max_token_ttl_s) == (2, 600)
    assert by_level.source == "rule 4 (level dangerous)"


def test_rule_for_defaults(tmp_path: Path) -> None:
    policy = load_policy(write(tmp_path, "audience: x\n"))
    dangerous = policy.rule_for(tool_name="t", categories=[], level=DANGEROUS)
    assert dangerous == EffectiveRule(
        (Requirement(1, (), "default for dangerous tools"),), DEFAULT_MAX_TOKEN_TTL_S
    )
    for level in (SAFE, CAUTIOUS):
        assert policy.rule_for(tool_name="t", categories=[], level=level).approvals_required == 0


def test_eligible(policy: Policy) -> None:
    security = policy.rule_for(tool_name="write_file", categories=[], level=DANGEROUS)
    assert policy.eligible("alice", security) and policy.eligible("bob", security)
    # carol is not in security, but counts towards the level rule's "any two"
    assert policy.eligible("carol", security)
    assert not policy.eligible("mallory", security)
    carol = policy.approver("carol")
    assert carol is not None and security.missing([carol]) == 2
    anyone = policy.rule_for(tool_name="x", categories=[], level=DANGEROUS)
    assert all(policy.eligible(a, anyone) for a in ("alice", "bob", "carol"))
    assert not policy.eligible("mallory", anyone)


def test_approver_keys(policy: Policy) -> None:
    keys = policy.approver_keys()
    assert keys["alice"] == public_key_from_text(KEY_A)


def test_client_by_token(policy: Policy) -> None:
    client = policy.client_by_token("agent-secret")
    assert client is not None and client.id == "agent"
    assert policy.client_by_token("agent-secret ") is None
    assert policy.client_by_token("wrong") is None
    assert policy.client_by_token("") is None
    assert sha("agent-secret") not in repr(client)


def test_client_by_subject(policy: Policy) -> None:
    client = policy.client_by_subject("CN=alice,O=example")
    assert client is not None and client.id == "alice"
    assert policy.client_by_subject("CN=alice") is None
    assert policy.client_by_subject("") is None


def test_may_with_level_boundaries(policy: Policy) -> None:
    agent = policy.client_by_token("agent-secret")
    assert agent is not None
    assert agent.may(Role.EXECUTE) and agent.may(Role.REGISTER)
    assert agent.may(Role.EXECUTE, SAFE) and agent.may(Role.EXECUTE, CAUTIOUS)
    assert not agent.may(Role.EXECUTE, DANGEROUS)
    assert not agent.may(Role.APPROVE)
    approver = policy.client_by_subject("CN=alice,O=example")
    assert approver is not None
    assert approver.may(Role.APPROVE) and not approver.may(Role.EXECUTE, SAFE)


def test_default_max_level_is_safe() -> None:
    client = Client("c", frozenset({Role.EXECUTE}))
    assert client.may(Role.EXECUTE, SAFE) and not client.may(Role.EXECUTE, CAUTIOUS)


def test_ceiling_keeps_only_the_fields_set(tmp_path: Path) -> None:
    text = BASE + "profiles:\n  dangerous: {memory_mb: 64, timeout_ms: 2000}\n  safe: {}\n"
    policy = load_policy(write(tmp_path, text))
    assert policy.ceiling(DANGEROUS) == {"memory_mb": 64, "timeout_ms": 2000}
    assert policy.ceiling(SAFE) == {}
    assert policy.ceiling(CAUTIOUS) is None


def test_development_policy() -> None:
    policy = development_policy(audience="toolreg-dev", approvers={"dev": KEY_A})
    assert policy.audience == "toolreg-dev" and policy.clients == ()
    rule = policy.rule_for(tool_name="write_file", categories=["files"], level=DANGEROUS)
    assert rule.approvals_required == 1 and policy.eligible("dev", rule)
    assert development_policy(audience="a", approvers={}).approvers == ()
    with pytest.raises(PolicyError, match="approver 'Bad Id'"):
        development_policy(audience="a", approvers={"Bad Id": KEY_A})
    with pytest.raises(PolicyError, match="approver 'dev': not an Ed25519 public key"):
        development_policy(audience="a", approvers={"dev": "junk"})
    with pytest.raises(PolicyError, match="same key"):
        development_policy(audience="a", approvers={"a": KEY_A, "b": KEY_A})


def test_register_grants_and_links(tmp_path: Path) -> None:
    text = BASE + (
        "  - id: team\n"
        f'    token_sha256: "{sha("team-secret")}"\n'
        "    roles: [register]\n"
        '    register: {max_safety_level: dangerous, images: ["registry.local/*"]}\n'
        "    approver: carol\n"
        "  - id: ops\n"
        f'    token_sha256: "{sha("ops-secret")}"\n'
        "    roles: [admin]\n"
    )
    policy = load_policy(write(tmp_path, text))
    agent, team, ops = (policy.client(c) for c in ("agent", "team", "ops"))
    assert agent and team and ops
    assert agent.register.max_level is SAFE and agent.register.allows_image("toolreg/base")
    assert not agent.register.allows_image("alpine")
    assert team.register.max_level is DANGEROUS and team.register.allows_image("registry.local/x")
    assert ops.register.max_level is DANGEROUS and ops.register.allows_image("anything")
    assert policy.same_person("carol", "team") and policy.same_person("alice", "alice")
    assert not policy.same_person("bob", "team")


def test_links_and_grants_are_checked(tmp_path: Path) -> None:
    unknown = BASE + "    approver: mallory\n"
    assert "clients[1].approver: unknown approver 'mallory'" in error(tmp_path, unknown)
    no_role = BASE + "    register: {max_safety_level: safe}\n"
    assert "clients[1].register: given without the register role" in error(tmp_path, no_role)


# ------------------------------------------------------------------ quotas


QUOTAS = """\
quotas:
  servers: 2
  default: {max_concurrent: 3, rate_per_s: 10, burst: 20}
"""


def test_quotas_merge_field_by_field_over_the_default(tmp_path: Path) -> None:
    text = insert_after(29, "    quotas: {max_queued: 2, rate_per_s: 1}") + QUOTAS
    policy = load_policy(write(tmp_path, text))
    assert policy.quota_for("agent") == Quota(
        max_concurrent=3, max_queued=2, rate_per_s=1.0, burst=20
    )
    assert policy.quota_for("alice") == Quota(max_concurrent=3, rate_per_s=10.0, burst=20)
    assert policy.quota_for("nobody") == policy.quota_for("alice")
    assert policy.quotas.servers == 2
    shares = Shares(lambda: policy, max_running=8, max_waiting=32)
    # one client that executes: no built-in share beyond what the policy says
    assert shares.limits("agent") == ClientLimits(max_running=3, max_queued=2)
    assert shares.rate("agent") == Rate(per_s=0.5, burst=10)  # split across 2 servers
    assert shares.rate("alice") == Rate(per_s=5.0, burst=10)


def test_several_executing_clients_each_get_a_share_by_default(tmp_path: Path) -> None:
    text = BASE.replace("roles: [approve]", "roles: [approve, execute]")
    policy = load_policy(write(tmp_path, text))
    assert policy.shared
    shares = Shares(lambda: policy, max_running=4, max_waiting=32)
    assert shares.limits("agent") == ClientLimits(max_running=3, max_queued=16)
    assert shares.rate("agent") is None
    alone = load_policy(write(tmp_path, BASE))
    assert not alone.shared
    assert Shares(lambda: alone, 4, 32).limits("agent") == ClientLimits()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("quotas: {default: {max_concurrent: 0}}", "quotas.default.max_concurrent"),
        ("quotas: {default: {rate_per_s: -1}}", "quotas.default.rate_per_s"),
        ("quotas: {servers: 0}", "quotas.servers"),
        ("quotas: {default: {max_parallel: 3}}", "quotas.default.max_parallel: unknown key"),
    ],
)
def test_bad_quotas_are_refused_with_the_field(tmp_path: Path, line: str, message: str) -> None:
    assert message in error(tmp_path, BASE + line + "\n")


def test_the_examples_commented_quotas_load_when_uncommented(tmp_path: Path) -> None:
    text = EXAMPLE.read_text()
    start = text.index("# quotas:\n")
    block = text[start : text.index("\n\n", start)]
    opened = "\n".join(line[2:] for line in block.splitlines())  # drop "# "
    text = text.replace(block, opened).replace(
        "    # quotas: {max_concurrent: 2", "    quotas: {max_concurrent: 2"
    )
    policy = load_policy(write(tmp_path, text))
    assert policy.quotas.servers == 3
    assert policy.quota_for("agent-1") == Quota(2, 8, 1.0, 20, 32)
    assert policy.quota_for("alice") == Quota(4, 8, 10.0, 20, 32)


def test_the_example_policys_comment_on_write_file_is_what_the_server_does() -> None:
    """examples/policy.yaml says: every matching rule applies at once, so
    write_file (category files) needs 2 from security, 1 from ops and 1 from
    anyone, with tokens usable 600 s; alice (security, ops) and bob do it."""
    policy = load_policy(EXAMPLE)
    rule = policy.rule_for(tool_name="write_file", categories=["files"], level=DANGEROUS)
    assert rule.describe() == (
        "2 approval(s) from security and 1 approval(s) from ops and 1 approval(s) from any approver"
    )
    assert rule.max_token_ttl_s == 600
    alice, bob, carol = (policy.approver(a) for a in ("alice", "bob", "carol"))
    assert rule.missing([alice, bob]) == 0  # type: ignore[list-item]
    assert rule.missing([alice]) == 1  # type: ignore[list-item]
    assert rule.missing([bob, carol]) == 1  # type: ignore[list-item]  (one from security)
    # A category a registrant chooses cannot lower what the level demands.
    lighter = policy.rule_for(tool_name="t", categories=["files"], level=DANGEROUS)
    assert lighter.approvals_required == 1 and len(lighter.requirements) == 2
