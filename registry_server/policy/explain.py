"""What the policy decides for one call, and why, from the policy alone
(``toolreg policy explain``, and ``toolreg policy test`` for each case).

Offline: no server, no store, no engine. The caller is looked up in the
policy as the server would (a client of the file, or a client an identity
provider's groups make, as if the server had just seen its token); the
steps are the executor's, in its order (execution/executor.py): the caller
may execute the tool at its level; with the tool's manifest, its arguments
against its JSON Schema and its guards; the deny rules; with a manifest and
an owner, the owner's register grant; then, for a dangerous tool, the
approval rules. Each decision comes from the policy's own functions
(``Policy.denial_for``, ``Policy.rule_for``), never from a copy of their
logic; the per-rule listing beside it says why each rule did or did not
apply.

What it cannot know offline, and leaves out: whether the tool is registered
or disabled, whether an engine here can run it, the caller's call rate and
open requests, and the approval tokens themselves.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from registry_server.domain import strict_json
from registry_server.domain.arguments import parse_arguments
from registry_server.domain.errors import InvalidArgument
from registry_server.domain.models import OPERATOR_OWNER, SafetyLevel, ToolDefinition
from registry_server.policy.call_facts import caller_facts, tool_facts
from registry_server.policy.clients import Client, RegisterGrant, Role
from registry_server.policy.conditions import (
    CallerFacts,
    CallFacts,
    Condition,
    ConditionError,
    ConditionFailed,
    Scope,
    ToolFacts,
    compile_condition,
    first_failing,
)
from registry_server.policy.grants import grant_refusal
from registry_server.policy.identity import IdentityProvider
from registry_server.policy.model import EffectiveRule, Policy, RuleMatch, RuleNotEvaluable
from registry_server.policy.model import Requirement as PolicyRequirement
from registry_server.policy.seen import SeenIdentities, Sighting


class Decision(enum.StrEnum):
    """What the server does with the call, and the status the caller gets."""

    FORBIDDEN = "forbidden"  # the caller may not execute this tool
    INVALID = "invalid"  # the arguments fail the tool's JSON Schema or one of its guards
    DENIED = "denied"  # a deny rule, or an approval rule whose condition errs
    REFUSED = "refused"  # the tool's owner's register grant does not cover it
    APPROVAL = "approval"  # a dangerous tool: runs once enough approvers approve
    ALLOWED = "allowed"  # runs, no approval needed (safe and cautious tools)


class ExplainError(ValueError):
    """The call cannot be explained as given (``field`` names what is wrong:
    client, groups, claims, args, tool)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name
        self.message = message


@dataclass(frozen=True)
class Call:
    """One call to explain. ``definition`` (a manifest) adds the steps that
    need the whole tool: its JSON Schema, its guards, its owner's grant."""

    tool: ToolFacts
    args_json: str
    client: str
    at: datetime
    claims: Mapping[str, Any] = field(default_factory=dict)
    # The groups of the identity provider token a group-mapped client calls
    # with (None: those its claims carry, under the provider's groups_claim).
    idp_groups: frozenset[str] | None = None
    definition: ToolDefinition | None = None


def manifest_tool(definition: ToolDefinition, owner: str = "") -> tuple[ToolFacts, ToolDefinition]:
    """The facts and the definition of a manifest's tool, owned by ``owner``."""
    owned = replace(definition, owner=owner)
    return tool_facts(owned), owned


# ------------------------------------------------------------------ the result


@dataclass(frozen=True)
class CallerView:
    id: str
    client: Client | None
    how: str  # "a client of the policy file", "a client of identity provider corp", ...
    facts: CallerFacts
    refusal: str = ""  # why the server refuses the caller this tool ("" when it may call it)


@dataclass(frozen=True)
class RuleCheck:
    """One rule, as it went for the call."""

    kind: str  # "deny" or "approval"
    name: str
    match: str  # "tool deploy", "every tool"
    matched: bool
    why: str  # "the tool is deploy", "its categories are files"
    condition: str = ""  # the `when`, "" without one
    result: str = ""  # "true", "false", "error: ...", "" when not evaluated
    applies: bool = False
    effect: str = ""  # deny: its reason; approval: "2 approval(s) from sre, tokens 900 s"


@dataclass(frozen=True)
class Approvers:
    """One applying approval requirement, with who can meet it for this caller."""

    name: str
    approvals: int
    groups: tuple[str, ...]
    eligible: tuple[str, ...]  # approvers who count for it (never the caller's own)
    excluded: tuple[str, ...]  # approvers of its groups who are the caller (never count)


@dataclass(frozen=True)
class Explanation:
    policy_source: str
    policy_digest: str
    call: Call
    caller: CallerView
    decision: Decision
    status: str  # what the caller gets: APPROVAL_REQUIRED, POLICY_DENIED, ...
    detail: str  # the one line the decision comes down to
    rule: str = ""  # denied: the rule that refuses
    steps: tuple[tuple[str, str], ...] = ()  # (step, what it found), in the executor's order
    deny_rules: tuple[RuleCheck, ...] = ()
    approval_rules: tuple[RuleCheck, ...] = ()
    effective: EffectiveRule | None = None  # what the approval gate asks (dangerous tools)
    requirements: tuple[Approvers, ...] = ()
    approvable: bool = True  # whether this caller's call can get enough approvers at all
    quota: tuple[tuple[str, str], ...] = ()
    register: str = ""

    @property
    def approvals(self) -> int:
        return 0 if self.effective is None else self.effective.approvals_required

    @property
    def groups(self) -> tuple[str, ...]:
        """The approver groups the applying rules name (sorted)."""
        if self.effective is None:
            return ()
        return tuple(sorted({g for r in self.effective.requirements for g in r.groups}))

    @property
    def rules(self) -> tuple[str, ...]:
        """The names of the approval rules that apply ("default" when none does)."""
        if self.effective is None:
            return ()
        return tuple(r.name for r in self.effective.requirements)

    def summary(self) -> str:
        """One line: the decision and what it comes down to."""
        return f"{self.decision.value} ({self.status}): {self.detail}"

    def render(self) -> str:
        return "\n".join(_render(self)) + "\n"


# ------------------------------------------------------------------ explaining


def explain(policy: Policy, call: Call) -> Explanation:
    """What ``policy`` decides for ``call``, step by step. Raises
    ExplainError when the call cannot be one the server sees (its arguments
    are not a JSON object, groups given for a client of the file, ...)."""
    try:
        level = SafetyLevel(call.tool.level)
    except ValueError:
        raise ExplainError("tool", f"unknown safety level {call.tool.level!r}") from None
    policy, caller = _caller(policy, call, level)
    steps: list[tuple[str, str]] = [("caller", caller.refusal or _caller_line(caller, level))]
    deny_checks: tuple[RuleCheck, ...] = ()
    approval_checks: tuple[RuleCheck, ...] = ()

    def finish(decision: Decision, status: str, detail: str, **more: Any) -> Explanation:
        return Explanation(
            policy_source=policy.source, policy_digest=policy.digest, call=call, caller=caller,
            decision=decision, status=status, detail=detail, steps=tuple(steps),
            deny_rules=deny_checks, approval_rules=approval_checks,
            quota=_quota(policy, caller.client), register=_register(caller), **more,
        )  # fmt: skip

    if caller.refusal:
        status = "UNAUTHENTICATED" if caller.client is None else "PERMISSION_DENIED"
        return finish(Decision.FORBIDDEN, status, caller.refusal)

    args, invalid = _arguments(call, steps)
    facts = CallFacts(args, call.tool, caller.facts, call.at)
    if invalid is None:
        invalid = _guards(call, facts, steps)
    if invalid is not None:
        return finish(Decision.INVALID, "INVALID_ARGUMENTS", invalid)

    deny_checks = tuple(_deny_checks(policy, call.tool, facts))
    approval_checks = tuple(_approval_checks(policy, call.tool, level, facts))
    denial = policy.denial_for(
        tool_name=call.tool.name, categories=call.tool.categories, level=level, facts=facts
    )
    if denial is not None:
        steps.append(("deny rules", f"{denial.rule} refuses the call"))
        return finish(Decision.DENIED, "POLICY_DENIED", denial.message, rule=denial.rule)
    steps.append(("deny rules", "none refuses the call" if deny_checks else "the policy has none"))

    refused = _grant(policy, call, steps)
    if refused is not None:
        detail = f"Tool '{call.tool.name}' cannot run: {refused}"
        return finish(Decision.REFUSED, "SANDBOX_ERROR", detail)

    if level is not SafetyLevel.DANGEROUS:
        steps.append(
            ("approval gate", f"none: only dangerous tools need approvals ({level.value})")
        )
        return finish(Decision.ALLOWED, "OK", f"a {level.value} tool runs without approval")
    try:
        effective = policy.rule_for(
            tool_name=call.tool.name, categories=call.tool.categories, level=level, facts=facts,
            refuse_on_error=True,
        )  # fmt: skip
    except RuleNotEvaluable as exc:
        steps.append(("approval gate", f"{exc.rule}'s condition could not be evaluated"))
        return finish(Decision.DENIED, "POLICY_DENIED", str(exc), rule=exc.rule)
    requirements = tuple(_approvers(policy, r, caller.id) for r in effective.requirements)
    others = [
        a for a in (policy.approver(x.id) for x in policy.approvers)
        if a is not None and not policy.same_person(a.id, caller.id)
    ]  # fmt: skip
    steps.append(("approval gate", effective.describe()))
    return finish(
        Decision.APPROVAL, "APPROVAL_REQUIRED", effective.describe(), effective=effective,
        requirements=requirements, approvable=effective.missing(others) == 0,
    )  # fmt: skip


def _caller(policy: Policy, call: Call, level: SafetyLevel) -> tuple[Policy, CallerView]:
    """The policy to decide with (with the caller's token seen, for a
    group-mapped client) and the caller as it knows it."""
    static = next((c for c in policy.clients if c.id == call.client), None)
    if static is not None:
        if call.idp_groups is not None:
            raise ExplainError(
                "groups",
                f"client '{call.client}' is a client of the policy file: its groups are its"
                " approver's there, not an identity provider token's",
            )
        if call.claims and static.idp_subject is None:
            raise ExplainError(
                "claims",
                f"client '{call.client}' is not pinned to an identity provider subject: its"
                " calls carry no token claims",
            )
        how = "a client of the policy file"
        if static.idp_subject is not None:
            how += f" (pinned to subject {static.idp_subject[1]!r} of {static.idp_subject[0]})"
        return policy, _view(policy, call, static, how, level)
    provider = _provider_of(policy, call.client)
    if provider is None:
        facts = CallerFacts(call.client, (), tuple(sorted(call.idp_groups or ())), call.claims)
        refusal = (
            f"client '{call.client}' is not in the policy: its calls are refused"
            " (no token, certificate or identity provider makes it)"
        )
        return policy, CallerView(call.client, None, "not a client of the policy", facts, refusal)
    subject = call.client.removeprefix(provider.client_id_prefix)
    groups = call.idp_groups
    if groups is None:
        groups = provider.groups_of(call.claims)
    if subject in provider.denied_subjects:
        facts = CallerFacts(call.client, (), tuple(sorted(groups)), call.claims)
        refusal = f"subject {subject!r} of {provider.id} is denied by the policy"
        return policy, CallerView(call.client, None, f"a subject of {provider.id}", facts, refusal)
    # As the server has it once it has verified the caller's token.
    seeing = replace(policy, seen=SeenIdentities())
    seeing.seen.saw(call.client, Sighting(provider.id, subject, frozenset(groups)))
    # As the token makes it (roles or none), not as a lookup by id sees it: a
    # lookup makes a client whose groups map to no role nobody (model.py).
    client = provider.client_for(subject, frozenset(groups))
    client = client if client is not None and client.id == call.client else None
    shown = ", ".join(sorted(groups)) or "none"
    how = f"a client of identity provider {provider.id} (its token's groups: {shown})"
    return seeing, _view(seeing, call, client, how, level)


def _provider_of(policy: Policy, client_id: str) -> IdentityProvider | None:
    """The identity provider whose group-mapped client ``client_id`` would be."""
    for provider in policy.identity_providers:
        prefix = provider.client_id_prefix
        if not client_id.startswith(prefix) or len(client_id) == len(prefix):
            continue
        if provider.subject_ids == "sha256":
            raise ExplainError(
                "client",
                f"client '{client_id}' has {provider.id}'s prefix, but {provider.id} makes"
                " client ids from subjects' sha256: the subject cannot be read back",
            )
        if provider.client_id(client_id.removeprefix(prefix)) == client_id:
            return provider
    return None


def _view(
    policy: Policy, call: Call, client: Client | None, how: str, level: SafetyLevel
) -> CallerView:
    facts = caller_facts(policy, call.client, call.claims)
    if client is None:
        refusal = f"client '{call.client}' is not a usable client id of the policy"
    elif not client.roles:
        refusal = (
            f"client '{call.client}' has no role in this policy (none of its groups is mapped)"
        )
    elif Role.EXECUTE not in client.roles:
        refusal = f"client '{call.client}' lacks the execute role"
    elif not client.may(Role.EXECUTE, level):
        refusal = (
            f"client '{call.client}' may run tools up to {client.max_safety_level.value};"
            f" '{call.tool.name}' is {level.value}"
        )
    else:
        refusal = ""
    return CallerView(call.client, client, how, facts, refusal)


def _caller_line(caller: CallerView, level: SafetyLevel) -> str:
    assert caller.client is not None
    return (
        f"{caller.id} may execute it (execute role, tools up to"
        f" {caller.client.max_safety_level.value}; this one is {level.value})"
    )


def _arguments(call: Call, steps: list[tuple[str, str]]) -> tuple[dict[str, Any], str | None]:
    """The arguments as conditions read them, and why they are invalid (None: they are not)."""
    if call.definition is not None:
        try:
            parsed = parse_arguments(call.definition, call.args_json)
        except InvalidArgument as exc:
            steps.append(("arguments", exc.message))
            return {}, exc.message
        steps.append(("arguments", "valid against the manifest's JSON Schema"))
        return parsed.value, None
    try:
        args = strict_json.loads_object(call.args_json, "args", empty_is={})
    except InvalidArgument as exc:
        raise ExplainError("args", exc.message) from None
    problem = strict_json.structure_problem(args)
    if problem:
        raise ExplainError("args", f"args: {problem}")
    steps.append(("arguments", "not checked: no manifest, so no JSON Schema"))
    return args, None


def _guards(call: Call, facts: CallFacts, steps: list[tuple[str, str]]) -> str | None:
    if call.definition is None:
        steps.append(("guards", "not checked: no manifest"))
        return None
    if not call.definition.guards:
        steps.append(("guards", "the tool has none"))
        return None
    guards: list[tuple[Condition, str]] = []
    for n, guard in enumerate(call.definition.guards, start=1):
        try:
            guards.append((compile_condition(guard.condition, Scope.GUARD), guard.message))
        except ConditionError as exc:
            raise ExplainError("tool", f"guard {n} of the manifest: {exc}") from None
    failed = first_failing(guards, facts)
    if failed is None:
        steps.append(("guards", f"all {len(guards)} hold"))
        return None
    steps.append(("guards", f"guard failed: {failed}"))
    return f"guard failed: {failed}"


def _grant(policy: Policy, call: Call, steps: list[tuple[str, str]]) -> str | None:
    """Why the tool's owner's grant does not cover it (None: it does, or it is not checked)."""
    owner = call.tool.owner
    if call.definition is None or not owner:
        steps.append(("owner's grant", "not checked: it needs the manifest and the owner"))
        return None
    refusal = grant_refusal(call.definition, owner, policy.grant_of(owner), policy.egress)
    steps.append(("owner's grant", refusal or f"{owner}'s register grant covers the tool"))
    return refusal


def _match_why(match: RuleMatch, tool: ToolFacts) -> tuple[bool, str]:
    level = SafetyLevel(tool.level)
    matched = match.matches(tool.name, tool.categories, level)
    if match.tool is not None:
        return matched, f"the tool is {tool.name}"
    if match.category is not None:
        if matched:
            return True, f"the tool is in category {match.category}"
        cats = ", ".join(tool.categories)
        return False, f"its categories are {cats}" if cats else "it has no categories"
    return matched, f"the tool is {level.value}"


def _evaluate(condition: Condition | None, facts: CallFacts) -> tuple[str, bool]:
    """(result, holds) of a rule's `when`: "" without one; an error counts as
    holding here, and the callers say what the server does with it."""
    if condition is None:
        return "", True
    try:
        holds = condition.holds(facts)
    except ConditionFailed as failed:
        return f"error: {failed.detail}", True
    return ("true" if holds else "false"), holds


def _deny_checks(policy: Policy, tool: ToolFacts, facts: CallFacts) -> list[RuleCheck]:
    checks: list[RuleCheck] = []
    for rule in policy.deny_rules:
        if rule.match is None:
            matched, why = True, "it matches every tool"
        else:
            matched, why = _match_why(rule.match, tool)
        result, holds = _evaluate(rule.when, facts) if matched else (_NO_MATCH, False)
        checks.append(RuleCheck(
            "deny", rule.name, rule.describe(), matched, why,
            "" if rule.when is None else rule.when.text, result, applies=matched and holds,
            effect=rule.reason,
        ))  # fmt: skip
    return checks


_NO_MATCH = "not evaluated (no match)"


def _approval_checks(
    policy: Policy, tool: ToolFacts, level: SafetyLevel, facts: CallFacts
) -> list[RuleCheck]:
    gated = level is SafetyLevel.DANGEROUS
    checks: list[RuleCheck] = []
    for n, rule in enumerate(policy.rules, start=1):
        matched, why = _match_why(rule.match, tool)
        if not matched:
            result, holds = _NO_MATCH, False
        elif not gated:
            result, holds = "not evaluated (not a dangerous tool)", False
        else:
            result, holds = _evaluate(rule.when, facts)
        who = ", ".join(rule.groups) or "any approver"
        effect = (
            f"{rule.approvals_required} approval(s) from {who},"
            f" tokens living at most {rule.max_token_ttl_s} s"
        )
        checks.append(RuleCheck(
            "approval", rule.name or f"rule {n}", rule.match.describe(), matched, why,
            "" if rule.when is None else rule.when.text, result, applies=matched and holds,
            effect=effect,
        ))  # fmt: skip
    return checks


def _approvers(policy: Policy, requirement: PolicyRequirement, caller: str) -> Approvers:
    eligible: list[str] = []
    excluded: list[str] = []
    for listed in policy.approvers:
        approver = policy.approver(listed.id)
        if approver is None or not requirement.admits(approver.groups):
            continue
        (excluded if policy.same_person(approver.id, caller) else eligible).append(approver.id)
    return Approvers(
        requirement.name,
        requirement.approvals_required,
        requirement.groups,
        tuple(eligible),
        tuple(excluded),
    )


# ------------------------------------------------------------------ quotas and grants


def _quota(policy: Policy, client: Client | None) -> tuple[tuple[str, str], ...]:
    """Each limit of the client's share: its value and where it comes from."""
    if client is None:
        return ()
    own, default = client.quota, policy.quotas.default
    shared = policy.shared
    builtin = {
        "max_concurrent": (
            "all of the server's sandbox slots but one (several clients may execute)"
            if shared else "no cap beyond the server's"
        ),
        "max_queued": (
            "half of the server's queue (several clients may execute)"
            if shared else "no cap beyond the server's"
        ),
        "rate_per_s": "no rate limit",
        "burst": (
            "the rate, rounded up" if own.rate_per_s or default.rate_per_s else "no rate limit"
        ),
        "max_pending_approvals": "the server's built-in cap per caller",
    }  # fmt: skip
    rows: list[tuple[str, str]] = []
    for name, otherwise in builtin.items():
        mine, base = getattr(own, name), getattr(default, name)
        if mine is not None:
            rows.append((name, f"{mine:g} (its own)"))
        elif base is not None:
            rows.append((name, f"{base:g} (quotas.default)"))
        else:
            rows.append((name, f"not set: {otherwise}"))
    servers = policy.quotas.servers
    if servers > 1:
        rows.append(
            ("servers", f"{servers}: each server enforces 1/{servers} of the rate and burst")
        )
    return tuple(rows)


def _register(caller: CallerView) -> str:
    client = caller.client
    if client is None:
        return ""
    if not client.roles & {Role.REGISTER, Role.ADMIN}:
        return "none (no register or admin role)"
    return _grant_text(client.register)


def _grant_text(grant: RegisterGrant) -> str:
    if grant.any_egress:
        return "anything (an admin without a register grant: like the policy file)"
    parts = [
        f"tools up to {grant.max_level.value}", f"images {', '.join(grant.images) or 'none'}",
        f"egress {', '.join(grant.egress) or 'none'}",
        f"secrets {', '.join(sorted(grant.secrets)) or 'none'}",
    ]  # fmt: skip
    return "; ".join(parts)


# ------------------------------------------------------------------ rendering


def _render(e: Explanation) -> list[str]:
    call, tool = e.call, e.call.tool
    digest = f" (sha256 {e.policy_digest[:12]})" if e.policy_digest else ""
    cats = ", ".join(tool.categories) or "none"
    owner = "" if not tool.owner else f"; owner {tool.owner}"
    if tool.owner == OPERATOR_OWNER:
        owner = "; owner the operator"
    lines = [
        f"policy:   {e.policy_source}{digest}",
        f"tool:     {tool.name} ({tool.level}; categories {cats}{owner})",
        f"args:     {_compact(call.args_json)}",
        f"caller:   {e.caller.id}, {e.caller.how}",
        f"at:       {call.at.astimezone(UTC).isoformat().replace('+00:00', 'Z')}",
        "",
        f"decision: {e.decision.value.upper()} ({e.status})",
        f"          {e.detail}",
    ]
    if e.decision is Decision.APPROVAL:
        lines += _render_approvals(e)
    lines += ["", "steps, in the server's order:"]
    lines += [f"  {step + ':':<15} {found}" for step, found in e.steps]
    if e.decision not in (Decision.FORBIDDEN, Decision.INVALID):
        lines += ["", "deny rules (in file order; the first that holds refuses the call):"]
        lines += [f"  {line}" for c in e.deny_rules for line in _render_check(c)] or ["  none"]
        lines += ["", "approval rules (each that matches and holds applies; the strictest of all):"]
        if not any(step == "approval gate" for step, _ in e.steps):
            lines.append("  (not reached: the call is refused before the approval gate)")
        lines += [f"  {line}" for c in e.approval_rules for line in _render_check(c)] or ["  none"]
        if SafetyLevel(tool.level) is not SafetyLevel.DANGEROUS and e.approval_rules:
            lines.append(
                f"  (none applies: only dangerous tools need approvals; this is {tool.level})"
            )
    lines += ["", f"client {e.caller.id}:"]
    facts = e.caller.facts
    lines.append(f"  roles:     {', '.join(facts.roles) or 'none'}")
    lines.append(f"  groups:    {', '.join(facts.groups) or 'none'} (caller.groups)")
    if facts.claims:
        lines.append(f"  claims:    {_compact(json.dumps(dict(facts.claims), default=str))}")
    if e.caller.client is not None:
        lines.append(f"  executes:  tools up to {e.caller.client.max_safety_level.value}")
        lines.append(f"  registers: {e.register}")
        lines.append("  quotas:")
        lines += [f"    {name:<22} {value}" for name, value in e.quota]
    return lines


def _render_approvals(e: Explanation) -> list[str]:
    assert e.effective is not None
    lines = [
        f"          at least {e.approvals} distinct approver(s); tokens may live at most"
        f" {e.effective.max_token_ttl_s} s",
    ]
    for r in e.requirements:
        who = ", ".join(r.groups) or "any approver"
        eligible = ", ".join(r.eligible) or "nobody"
        line = f"          {r.name}: {r.approvals} from {who}: {eligible}"
        if r.excluded:
            line += f" (not {', '.join(r.excluded)}: never for their own call)"
        lines.append(line)
    if not e.approvable:
        lines.append(
            f"          NEVER APPROVABLE: too few approvers other than {e.caller.id} meet these"
        )
    return lines


def _render_check(c: RuleCheck) -> list[str]:
    verdict = ("DENIES" if c.kind == "deny" else "APPLIES") if c.applies else "-"
    if c.applies and c.kind == "approval" and c.result.startswith("error"):
        verdict = "REFUSES"
    lines = [f"{verdict:<8} {c.name}"]
    lines.append(f"           match {c.match}: {'yes' if c.matched else 'no'} ({c.why})")
    if c.condition:
        lines.append(f"           when {c.condition}: {c.result}")
        if c.result.startswith("error"):
            lines.append("           a condition that errs refuses the call (fail closed)")
    label = "reason" if c.kind == "deny" else "needs"
    lines.append(f"           {label}: {c.effect}")
    return lines


def _compact(text: str, limit: int = 400) -> str:
    try:
        shown = json.dumps(json.loads(text), ensure_ascii=False, separators=(", ", ": "))
    except ValueError:
        shown = text
    return shown if len(shown) <= limit else shown[:limit] + "..."


def parse_time(text: str, what: str = "--at") -> datetime:
    """An ISO 8601 time with its zone ("2025-06-01T09:30:00Z")."""
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"{what}: not an ISO 8601 time: {text!r}") from None
    if at.tzinfo is None:
        raise ValueError(f"{what}: give the time zone too, e.g. {text}Z or {text}+02:00")
    return at
