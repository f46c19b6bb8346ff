"""A tool's guards compile before it is registered (docs/how-to/writing-tools.md,
"Guards").

The domain checks a guard's shape (``models.GuardInput``: sizes, a message
fit to show); whether its condition is CEL that type-checks against ``args``
alone and stays within the cost limit is known only to the policy's CEL
environment (policy/conditions.py), which the domain may not import. So every
path by which a definition becomes a served tool passes through here: a
registration (the RegisterTool RPC, and the operator's ``--tools`` manifests
at start, both through ``Registry.register``) and every stored tool the
registry loads (``Registry._parse``). The executor compiles the same text
again at each call (cached by text), so a guard that reached a served tool
always compiles there.
"""

from __future__ import annotations

from registry_server.domain.errors import InvalidDefinition, Violation
from registry_server.domain.models import ToolDefinition
from registry_server.policy.conditions import (
    GUARDS_COST_LIMIT,
    ConditionError,
    Scope,
    compile_condition,
)

MANIFEST_FIELD = "guard"  # the manifest's key (the Tool message's field is "guards")
ONLY_ARGS = "a guard reads only `args`, the call's arguments"


def guard_violations(tool: ToolDefinition, field: str = MANIFEST_FIELD) -> list[Violation]:
    """Each guard of ``tool`` whose condition does not compile, type-check
    (it may read ``args`` only) or fit the cost limit, named
    ``<field>.<index>.condition`` with CEL's reason (line and column); and
    ``<field>`` when the guards together cost more than GUARDS_COST_LIMIT
    (every call runs all of them: sixteen at the limit of one would be a
    registrant's way to make each call of its tool cost half a second)."""
    problems: list[Violation] = []
    total = 0
    for index, guard in enumerate(tool.guards):
        try:
            total += compile_condition(guard.condition, Scope.GUARD).cost
        except ConditionError as exc:
            reason = str(exc)
            if "undeclared reference" in reason:
                reason += f" ({ONLY_ARGS})"
            problems.append(Violation(f"{field}.{index}.condition", reason))
    if total > GUARDS_COST_LIMIT:
        problems.append(Violation(field, guards_over_limit(total)))
    return problems


def guards_over_limit(total: int) -> str:
    return (
        f"the guards together may cost up to {total:,} units at worst, over the limit of"
        f" {GUARDS_COST_LIMIT:,} for all of a tool's guards (fewer guards, cheaper tests:"
        " startsWith or == instead of contains() or a regex, no Unicode classes or (?i)"
        " over whole arguments)"
    )


def check_guards(
    tool: ToolDefinition, *, field: str = MANIFEST_FIELD, source: str = "tool definition"
) -> None:
    """Raise InvalidDefinition (INVALID_ARGUMENT) listing every guard of
    ``tool`` that does not compile."""
    problems = guard_violations(tool, field)
    if problems:
        raise InvalidDefinition(problems, source)
