"""What the policy's conditions read about one call (policy/conditions.py),
gathered from the tool, the call's validated arguments, the caller as the
policy knows it, and the call's time."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from registry_server.domain.models import SafetyLevel, ToolDefinition
from registry_server.policy.conditions import (
    CallerFacts,
    CallFacts,
    Scope,
    ToolFacts,
    compile_condition,
    fields_read,
)
from registry_server.policy.model import EffectiveRule, Policy


def egress_hosts(entries: Iterable[str]) -> tuple[str, ...]:
    """The host names of "host:port" egress entries (conditions compare names)."""
    return tuple(dict.fromkeys(e.rpartition(":")[0] or e for e in entries))


def tool_facts(tool: ToolDefinition) -> ToolFacts:
    return ToolFacts(
        name=tool.name,
        level=tool.safety_level.value,
        categories=tuple(tool.categories),
        owner=tool.owner,
        digest=tool.digest,
        egress_hosts=egress_hosts(tool.egress),
    )


def caller_facts(
    policy: Policy, caller: str, claims: Mapping[str, Any] | None = None
) -> CallerFacts:
    """The caller's roles as the policy gives them now; its groups: those of
    the approver it is (the file's, and an identity provider's approver
    groups) and the groups its identity provider's latest token gave it;
    the claims of the token it called with (none for other credentials)."""
    client = policy.client(caller)
    roles = () if client is None else tuple(sorted(r.value for r in client.roles))
    groups: list[str] = []
    if client is not None:
        approver_id = policy.approver_identity(client)
        approver = None if approver_id is None else policy.approver(approver_id)
        if approver is not None:
            groups.extend(approver.groups)
    sighting = policy.seen.get(caller) if policy.identity_providers else None
    if sighting is not None:
        groups.extend(sorted(sighting.groups))
    return CallerFacts(caller, roles, tuple(dict.fromkeys(groups)), dict(claims or {}))


def request_rule(
    policy: Policy, tool: ToolFacts, arguments_json: str, requested_by: str, at: float
) -> EffectiveRule:
    """The rule for a stored approval request's call, as the policy states it
    now: its conditions read the request's arguments, its requester and the
    time it was made. Arguments left out (a listing) or unreadable, and a
    condition that errs, make every conditional rule count (the strictest)."""
    facts = None
    if arguments_json:
        try:
            args = json.loads(arguments_json)
        except ValueError:
            args = None
        if isinstance(args, dict):
            when = datetime.fromtimestamp(at, UTC)
            facts = CallFacts(
                args, tool, caller_facts(policy, requested_by), when, policy.reads,
                policy.arg_fields,
            )  # fmt: skip
    return policy.rule_for(
        tool_name=tool.name, categories=tool.categories, level=SafetyLevel(tool.level),
        facts=facts,
    )  # fmt: skip


def call_facts(
    policy: Policy,
    tool: ToolDefinition,
    args: Mapping[str, Any],
    caller: str,
    at: float,
    claims: Mapping[str, Any] | None = None,
) -> CallFacts:
    """The facts of one call made at ``at`` (time.time()): its arguments made
    into CEL values only as far as the tool's guards and the policy's
    conditions read them."""
    return CallFacts(
        args=args,
        tool=tool_facts(tool),
        caller=caller_facts(policy, caller, claims),
        now=datetime.fromtimestamp(at, UTC),
        reads=policy.reads,
        arg_fields=_union(policy.arg_fields, guard_fields(tuple(g.condition for g in tool.guards))),
    )


@functools.lru_cache(maxsize=1024)
def guard_fields(conditions: tuple[str, ...]) -> frozenset[str] | None:
    """The top-level arguments a tool's guards read (None: all); once per
    set of guards (each guard compiled from the cache). A guard that no
    longer compiles reads all of them: the executor refuses the call anyway."""
    try:
        return fields_read(compile_condition(text, Scope.GUARD) for text in conditions)
    except ValueError:
        return None


def _union(a: frozenset[str] | None, b: frozenset[str] | None) -> frozenset[str] | None:
    return None if a is None or b is None else a | b
