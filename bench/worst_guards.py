"""The costliest set of guards a registrant can register under the caps
(policy/conditions.py COST_LIMIT per guard, GUARDS_COST_LIMIT for a tool's
guards together), and arguments that make every one of them do its worst
and still hold, so a call evaluates all of them.

Used by bench/conditions_cost.py (what the set costs a call, estimated and
measured on 1 MiB of arguments) and by load tests that register "sixteen
heavy guards": ``worst_guard_set()`` gives the conditions, ``worst_tool()``
a definition carrying them (it passes ``check_guards``), and
``worst_arguments()`` the arguments.

Each of MAX_GUARDS slots takes, from its family in turn (a substring
search, a Unicode class, a case-folded class, an ASCII class; the next
family when its own has no variant that fits), the variant whose estimate
is the largest within the slot's budget: by default an even share of what
is left of the cap (sixteen heavy guards), or with ``spread=False`` all of
it but what the later slots need for the cheapest guard (the costliest
first: two at the limit of one and fourteen trivial ones).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from registry_server.domain.models import MAX_GUARDS, ToolDefinition, parse_definition
from registry_server.policy.conditions import (
    ARGUMENTS_BOUND,
    COST_LIMIT,
    GUARDS_COST_LIMIT,
    ConditionError,
    Scope,
    compile_condition,
)

FIELD = "q"  # the one argument every guard reads (all of 1 MiB can be in one field)
# Characters no guard looks for and the arguments never hold: each guard
# scans the whole text and holds (a call evaluates every guard).
_ABSENT = "".join(
    chr(c)
    for c in (
        *range(0x0436, 0x0438),
        *range(0x0449, 0x0450),
        0x045B,
        0x045F,
        *range(0x0416, 0x0418),
        *range(0x0429, 0x042C),
    )
)
# Latin, Greek and Cyrillic letters: inside every family's class, so the
# regexes' automata stay busy; "a" often, so a needle starting with it is
# compared at a third of the places.
_UNIT = "a\u03b1\u0430b\u03b2\u0431c\u03b3\u0432"  # a, alpha, Cyrillic a, b, beta, ...


def _families() -> list[Callable[[int, str], str]]:
    """Each: (a size parameter, an absent character) -> a guard's condition."""
    return [
        lambda k, x: f'!args.{FIELD}.contains("a{"b" * k}{x}")',  # substring search
        lambda k, x: f'!args.{FIELD}.matches("\\\\p{{Cyrillic}}{{0,{k}}}{x}")',  # Unicode class
        lambda k, x: f'!args.{FIELD}.matches("(?i)[a-z\u03b1-\u03c9]{{0,{k}}}{x}")',  # case folding
        lambda k, x: f'!args.{FIELD}.matches("[a-z]{{0,{k}}}{x}")',  # ASCII class, bounded repeat
    ]


_FLOOR_TEXT = f'args.{FIELD} != "{{x}}"'  # the cheapest guard that reads the field


def _cost(text: str) -> int | None:
    try:
        return compile_condition(text, Scope.GUARD).cost
    except ConditionError:
        return None


def _largest(family: Callable[[int, str], str], absent: str, budget: int) -> tuple[str, int] | None:
    """The variant of ``family`` with the largest estimate within ``budget``."""
    best: tuple[str, int] | None = None
    for k in range(0, 64):
        text = family(k, absent)
        cost = _cost(text)
        if cost is None or cost > budget:
            if best is not None:
                break
            continue
        if best is None or cost > best[1]:
            best = (text, cost)
    return best


@functools.cache
def worst_guard_set(count: int = MAX_GUARDS, spread: bool = True) -> tuple[tuple[str, int], ...]:
    """``count`` guards, (condition, estimated cost), whose costs add up to
    as much of GUARDS_COST_LIMIT as the families allow, never more."""
    floor = max(_cost(_FLOOR_TEXT.format(x=x)) or 0 for x in _ABSENT)
    families = _families()
    chosen: list[tuple[str, int]] = []
    remaining = GUARDS_COST_LIMIT
    for slot in range(count):
        absent = _ABSENT[slot % len(_ABSENT)]
        left = count - slot
        budget = remaining // left if spread else remaining - (left - 1) * floor
        budget = min(COST_LIMIT, budget)
        picked = None
        for offset in range(len(families)):
            picked = _largest(families[(slot + offset) % len(families)], absent, budget)
            if picked is not None:
                break
        if picked is None:
            text = _FLOOR_TEXT.format(x=absent)
            picked = (text, _cost(text) or floor)
        chosen.append(picked)
        remaining -= picked[1]
    assert sum(c for _, c in chosen) <= GUARDS_COST_LIMIT
    return tuple(chosen)


def worst_tool(
    name: str = "heavy_guards", count: int = MAX_GUARDS, spread: bool = True
) -> ToolDefinition:
    """A tool carrying ``worst_guard_set(count, spread)``, reading ``q`` (a string)."""
    return parse_definition(
        {
            "name": name,
            "description": "a tool whose guards cost as much as the caps allow",
            "parameters": {"type": "object", "properties": {FIELD: {"type": "string"}}},
            "sandbox": {"image": "toolreg/base", "command": ["cat"]},
            "guard": [
                {"condition": text, "message": f"guard {n} refused the call"}
                for n, (text, _) in enumerate(worst_guard_set(count, spread))
            ],
        }
    )


def worst_arguments(size: int = ARGUMENTS_BOUND - 64) -> dict[str, Any]:
    """Arguments of at most ``size`` bytes as UTF-8 JSON on which every guard
    of the set scans its whole text and holds. Send them as
    ``json.dumps(args, ensure_ascii=False)``: escaped (``\\u03b1``), the
    Greek and Cyrillic letters take 6 bytes instead of 2 and the call is over
    the 1 MiB the arguments may have."""
    room = size - len(json.dumps({FIELD: ""}))
    unit_bytes = len(json.dumps(_UNIT, ensure_ascii=False).encode()) - 2
    text = _UNIT * (room // unit_bytes)
    return {FIELD: text}
