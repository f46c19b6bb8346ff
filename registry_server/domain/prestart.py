"""The rules of a tool's warm interpreter (``prestart``/``preload``, docs/how-to/writing-tools.md).

``prestart: python`` starts the command's interpreter in the warm container before the
call, with the ``preload`` modules imported (no input, no network): what it may have
done before the call is part of the definition, so these rules are checked at
registration and both fields are in the digest. Never for a dangerous tool: nothing
its registrant chose may run before its approval is spent, so it keeps exec-at-release.
"""

from __future__ import annotations

from collections.abc import Sequence

from sandbox_runner.warm_interpreter import (
    MAX_PRELOAD,
    PRESTART_KINDS,
    parse_python_command,
    preload_problem,
)

__all__ = ["prestart_problems"]


def prestart_problems(
    prestart: str, preload: Sequence[str], command: Sequence[str], level: str
) -> list[tuple[str, str]]:
    """Why these prestart settings do not fit the tool, as (field, rule) pairs
    (empty = fine). ``level``: the tool's safety level, already validated."""
    if prestart not in PRESTART_KINDS:
        return [("sandbox.prestart", 'must be "" (none) or "python"')]
    problems: list[tuple[str, str]] = []
    if len(preload) > MAX_PRELOAD:
        problems.append(("sandbox.preload", f"at most {MAX_PRELOAD} modules"))
    for i, name in enumerate(preload[:MAX_PRELOAD]):
        problem = preload_problem(name)
        if problem is not None:
            problems.append((f"sandbox.preload.{i}", problem))
    if len(set(preload)) != len(preload):
        problems.append(("sandbox.preload", "must not repeat a module"))
    if not prestart:
        if preload:
            problems.append(("sandbox.preload", "needs prestart: python (nothing to import into)"))
        return problems
    if level == "dangerous":
        problems.append(
            (
                "sandbox.prestart",
                "not for dangerous tools: nothing chosen by its registrant may run before"
                " its approval is spent, so a dangerous tool starts at its call",
            )
        )
    try:
        parse_python_command(tuple(command))
    except ValueError as exc:
        problems.append(("sandbox.command", f"with prestart: python, {exc}"))
    return problems
