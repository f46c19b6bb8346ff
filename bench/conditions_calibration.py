"""The cost model of conditions (policy/conditions.py ``estimate_cost``,
policy/regex_cost.py ``re2_cost``) against measured time, on 1 MiB of
arguments (issue 37, item 5). Part of the ``conditions`` section of
``python -m bench`` (bench/conditions_cost.py).

- calibration: each kind of work a condition can do (RE2 with ASCII
  classes, Unicode classes, case folding, bounded repeats; contains,
  startsWith, size, concatenation; exists, all, map, filter over large
  lists) on the texts that make it slowest (each case's slowest text is
  its row): the estimate in units, the unit's time (regex_cost.NS_PER_UNIT),
  and the measured median. The model is sound where estimate x NS_PER_UNIT
  >= measured for every case, including those the limit refuses (they are
  compiled here without it, to be measured);
- projection: a condition that reads one field, over 1 MiB of other
  arguments, with the call's arguments made into CEL values whole (before)
  and only as far as its conditions read (now);
- the worst guard set a registrant can register under GUARDS_COST_LIMIT
  (bench/worst_guards.py), its estimate and its measured time on 1 MiB.

Every measurement is a median of fresh evaluations (cel-expr-python
compiles a regex at each evaluation, so each is as cold as a call's), in
CPU time of the thread that evaluates (time.thread_time_ns): what the model
estimates is work, and on a shared machine the wall clock also counts the
time other processes held the cores (the worst sets show both).
"""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

from bench import worst_guards
from registry_server.domain.models import parse_definition
from registry_server.policy import conditions
from registry_server.policy.call_facts import call_facts
from registry_server.policy.conditions import (
    ARGUMENTS_BOUND,
    COST_LIMIT,
    GUARDS_COST_LIMIT,
    Scope,
    compile_condition,
    first_failing,
)
from registry_server.policy.regex_cost import (
    LARGE_PROGRAM,
    NS_PER_UNIT,
    re2_cost,
    re2_program_size,
)

SIZE = ARGUMENTS_BOUND - 64  # bytes of the one string argument (room for the JSON around it)
LIST_ITEMS = 9_999  # elements of a list a loop may visit (cel-cpp's budget: 10,000 iterations)


def _fill(unit: str, size: int = SIZE) -> str:
    text = unit * (size // len(unit.encode()) + 1)
    return text.encode()[:size].decode("utf-8", "ignore")


def texts() -> dict[str, str]:
    """Texts of about SIZE bytes of UTF-8 holding no "ж" (which every
    pattern ends with, so it scans to the end)."""
    return {
        "sql": _fill("select name, total from orders where total > 100 and region = 'north'; "),
        "a": _fill("a"),
        "latin-greek-cyrillic": _fill(worst_guards.worst_arguments(4096)[worst_guards.FIELD]),
        "cjk": _fill("\u4e2d\u6587\u5b57\u7b26\u6d4b\u8bd5"),
        "emoji": _fill("\U0001f600\U0001f601\U0001f602"),
    }


def _string_case(what: str, expr: str) -> tuple[str, str, Callable[[str], dict[str, Any]]]:
    return what, expr, lambda text: {"q": text}


def _cases() -> list[tuple[str, str, Callable[[str], dict[str, Any]] | dict[str, Any]]]:
    """(what, expression, arguments: from a text, or fixed)."""
    short = ["a"] * (SIZE // 4)  # '"a",': the most elements 1 MiB of JSON holds, near enough
    long = ["a" * 96] * LIST_ITEMS  # as many as the budget visits, 1 MiB in all
    ints = [1] * (SIZE // 4)  # two lists of "1,": 1 MiB together
    keys = {f"k{i:05d}": 0 for i in range(SIZE // 22)}  # two maps of '"k00000":0,'
    return [
        _string_case("matches: literal", r'!args.q.matches("drop\\s+table")'),
        _string_case("matches: ASCII class, bounded repeat", r'!args.q.matches("[a-z]{0,7}ж")'),
        _string_case("matches: ASCII class, long repeat", r'!args.q.matches("[a-z]{3,40}ж")'),
        _string_case("matches: `.` repeat (NFA)", r'!args.q.matches("a.{0,30}ж")'),
        _string_case("matches: \\p{L} (issue 37's)", r'!args.q.matches("[\\p{L}]{0,7}ж")'),
        _string_case("matches: \\pL+", r'!args.q.matches("\\pL+ж")'),
        _string_case("matches: \\p{L}, longer repeat", r'!args.q.matches("\\p{L}{0,15}ж")'),
        _string_case("matches: \\p{Greek}", r'!args.q.matches("\\p{Greek}{2,5}ж")'),
        _string_case("matches: \\p{Cyrillic}", r'!args.q.matches("\\p{Cyrillic}{0,3}ж")'),
        _string_case("matches: (?i) literal", r'!args.q.matches("(?i)drop\\s+table")'),
        _string_case("matches: (?i) ASCII class", r'!args.q.matches("(?i)[a-z]{0,30}ж")'),
        _string_case("matches: (?i) Greek range",
                     '!args.q.matches("(?i)[a-z\u03b1-\u03c9]{0,7}ж")'),
        _string_case("matches: (?i) \\p{Greek}", r'!args.q.matches("(?i)\\p{Greek}{0,3}ж")'),
        _string_case("matches: (?i) \\p{Ll}", r'!args.q.matches("(?i)\\p{Ll}{0,10}ж")'),
        _string_case("contains: one byte", '!args.q.contains("z")'),
        _string_case("contains: one character, two bytes", '!args.q.contains("ж")'),
        _string_case("contains: two bytes", '!args.q.contains("ab")'),
        _string_case("contains: 64 bytes", '!args.q.contains("' + "a" * 63 + 'b")'),
        _string_case("startsWith", '!args.q.startsWith("ж")'),
        _string_case("==", 'args.q != "ж"'),
        _string_case("size", "size(args.q) > 0"),
        _string_case("concatenation", "size(args.q + args.q) > 0"),
        (f"exists over {len(short):,} strings (stops at the budget)",
         'args.t.exists(x, x == "ж")', {"t": short}),
        (f"all over {len(long):,} strings of 96 bytes", 'args.t.all(x, x.startsWith("a"))',
         {"t": long}),
        (f"exists with contains over {len(long):,} strings of 96 bytes",
         'args.t.exists(x, x.contains("ab"))', {"t": long}),
        (f"map over {len(long):,} strings of 96 bytes", 'size(args.t.map(x, x + "a")) > 0',
         {"t": long}),
        (f"filter over {len(long):,} strings of 96 bytes",
         'size(args.t.filter(x, x.startsWith("a"))) > 0', {"t": long}),
        (f"`in` over {len(short):,} strings", '"ж" in args.t', {"t": short}),
        (f"== of two lists of {len(ints):,} numbers", "args.a == args.b", {"a": ints, "b": ints}),
        (f"== of two maps of {len(keys):,} keys", "args.a == args.b", {"a": keys, "b": keys}),
        ("has() of one field: what any evaluation costs", "has(args.q)", {"q": ""}),
    ]  # fmt: skip


def _estimate(text: str) -> tuple[int, bool]:
    """(the estimate, whether the limit accepts it): computed without the
    limit, so what it refuses is measured too."""
    program = conditions._env(Scope.GUARD).compile(text)
    cost = conditions.estimate_cost(conditions._syntax(program))
    return cost, cost <= COST_LIMIT


def _time_eval(program: Any, data: dict[str, Any], runs: int) -> float:
    """Median ns of ``runs`` evaluations (CEL values made beforehand)."""
    activation = conditions._env(Scope.GUARD).Activation({"args": data})
    samples = []
    for _ in range(runs):
        t0 = time.thread_time_ns()
        with contextlib.suppress(RuntimeError):  # cel-cpp's iteration budget: its time counts
            program.eval(activation)
        samples.append(time.thread_time_ns() - t0)
    return statistics.median(samples)


_COMPILED = (r"\pL", r"[\p{L}]{0,7}ж", r"\p{L}{0,15}ж", r"(?i)\p{Ll}{0,10}ж")


def compiling(runs: int) -> list[dict[str, Any]]:
    """What RE2 costs to compile a pattern, which cel-expr-python does at
    every evaluation: on an empty text, against ``re2_cost(pattern, 0)``."""
    rows = []
    for pattern in _COMPILED:
        program = conditions._env(Scope.GUARD).compile(f"args.q.matches({json.dumps(pattern)})")
        ns = _time_eval(program, {"q": ""}, runs)
        estimate = re2_cost(pattern, 0)
        rows.append(
            {
                "pattern": pattern,
                "program": re2_program_size(pattern),
                "estimate_ms": round(estimate * NS_PER_UNIT / 1e6, 3),
                "measured_ms": round(ns / 1e6, 3),
                "estimate_over_measured": round(estimate * NS_PER_UNIT / max(ns, 1), 2),
            }
        )
    return rows


_GIVES_UP = (r"\p{L}{0,20}ж", r"\p{L}{0,30}ж", r"\p{Lu}{0,30}ж")
GIVES_UP_SIZE = 64 * 1024  # bytes of text: RE2 takes microseconds a byte here


def giving_up(runs: int) -> list[dict[str, Any]]:
    """Patterns whose program outgrows RE2's DFA (over LARGE_PROGRAM
    instructions), on a 64 KiB text (1 MiB would take seconds an
    evaluation), against ``re2_cost(pattern, 64 KiB)``: they are refused
    over the arguments, and priced per instruction and byte."""
    rows = []
    for pattern in _GIVES_UP:
        program = conditions._env(Scope.GUARD).compile(f"!args.q.matches({json.dumps(pattern)})")
        worst_ns, worst_text = 0.0, ""
        for name, text in texts().items():
            data = {"q": _fill(text, GIVES_UP_SIZE)}
            ns = _time_eval(program, data, max(1, runs // 2))
            if ns >= worst_ns:
                worst_ns, worst_text = ns, name
        estimate = re2_cost(pattern, GIVES_UP_SIZE)
        rows.append(
            {
                "pattern": pattern,
                "program": re2_program_size(pattern),
                "estimate_ms": round(estimate * NS_PER_UNIT / 1e6, 3),
                "measured_ms": round(worst_ns / 1e6, 3),
                "slowest_text": worst_text,
                "measured_ns_per_byte": round(worst_ns / GIVES_UP_SIZE, 1),
                "estimate_over_measured": round(estimate * NS_PER_UNIT / max(worst_ns, 1), 2),
            }
        )
    return rows


def calibration(runs: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    variants = texts()
    for what, text, make in _cases():
        estimate, accepted = _estimate(text)
        program = conditions._env(Scope.GUARD).compile(text)
        cases = {n: make(t) for n, t in variants.items()} if callable(make) else {"": make}
        worst_ns, worst_text = 0.0, ""
        for name, data in cases.items():
            gc.collect()
            ns = _time_eval(program, data, runs)
            if ns >= worst_ns:
                worst_ns, worst_text = ns, name
        size = len(json.dumps(next(iter(cases.values())), ensure_ascii=False).encode())
        pattern = text.split('matches("', 1)[1].rsplit('")', 1)[0] if "matches(" in text else ""
        rows.append(
            {
                "what": what,
                "expression": text,
                "arguments_bytes": size,
                "program": re2_program_size(pattern.replace("\\\\", "\\")) if pattern else None,
                "estimate_units": estimate,
                "estimate_ms": round(estimate * NS_PER_UNIT / 1e6, 3),
                "accepted": accepted,
                "measured_ms": round(worst_ns / 1e6, 3),
                "slowest_text": worst_text,
                "measured_ns_per_byte": round(worst_ns / size, 3),
                "estimate_over_measured": round(estimate * NS_PER_UNIT / max(worst_ns, 1), 2),
            }
        )
    return rows


# ------------------------------------------------------------------ projection


def _keys_tool(guard: str) -> Any:
    return parse_definition(
        {
            "name": "one_field",
            "description": "reads one field of many",
            "parameters": {"type": "object"},
            "sandbox": {"image": "toolreg/base", "command": ["cat"]},
            "guard": [{"condition": guard, "message": "k00000 must be 0"}],
        }
    )


def projection(policy: Any, runs: int) -> dict[str, Any]:
    """A guard reading one field of 1 MiB of arguments (95,000 small ones):
    the call's facts as the executor makes them (call_facts(): only the
    fields the guards and the policy read) against the same facts with the
    whole arguments (as before), interleaved."""
    keys = {f"k{i:05d}": 0 for i in range((ARGUMENTS_BOUND - 64) // 11)}  # '"k00000":0,'
    guard = "args.k00000 == 0"
    tool = _keys_tool(guard)
    condition = compile_condition(guard, Scope.GUARD)
    checks = [(condition, "k00000 must be 0")]
    samples: dict[str, list[float]] = {"projected": [], "whole": []}
    for i in range(runs):
        for which in ("projected", "whole") if i % 2 == 0 else ("whole", "projected"):
            t0 = time.thread_time_ns()
            facts = call_facts(policy, tool, keys, "agent", time.time())
            if which == "whole":
                facts.arg_fields = None
            if first_failing(checks, facts) is not None:
                raise RuntimeError("the bench's guard did not hold")
            samples[which].append((time.thread_time_ns() - t0) / 1e6)
    p50 = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "arguments": len(keys),
        "arguments_bytes": len(json.dumps(keys, separators=(",", ":"))),
        "guard": guard,
        "projected_p50_ms": round(p50["projected"], 3),
        "whole_p50_ms": round(p50["whole"], 3),
        "ratio": round(p50["projected"] / p50["whole"], 4),
    }


# ------------------------------------------------------------------ the worst guard set


def worst_set(policy: Any, runs: int) -> list[dict[str, Any]]:
    """Each worst guard set (bench/worst_guards.py) on its 1 MiB of
    arguments, as the executor runs it: call_facts(), then every guard."""
    args = worst_guards.worst_arguments()
    rows = []
    for spread, label in ((True, "16 guards, the cap shared evenly"),
                          (False, "the costliest first, then the cheapest")):  # fmt: skip
        chosen = worst_guards.worst_guard_set(spread=spread)
        tool = worst_guards.worst_tool(spread=spread)
        checks = [(compile_condition(text, Scope.GUARD), "refused") for text, _ in chosen]
        samples, wall = [], []
        for _ in range(runs):
            gc.collect()
            t0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            facts = call_facts(policy, tool, args, "agent", time.time())
            failed = first_failing(checks, facts)
            samples.append((time.thread_time_ns() - t0) / 1e6)
            wall.append((time.perf_counter_ns() - w0) / 1e6)
            if failed is not None:
                raise RuntimeError(f"a guard of the worst set did not hold: {failed}")
        estimate = sum(cost for _, cost in chosen)
        measured = statistics.median(samples)
        rows.append(
            {
                "what": label,
                "guards": len(chosen),
                "kinds": _kinds([t for t, _ in chosen]),
                "estimate_units": estimate,
                "of_cap": round(estimate / GUARDS_COST_LIMIT, 3),
                "estimate_ms": round(estimate * NS_PER_UNIT / 1e6, 2),
                "measured_p50_ms": round(measured, 2),
                "measured_max_ms": round(max(samples), 2),
                "wall_p50_ms": round(statistics.median(wall), 2),
                "arguments_bytes": len(json.dumps(args, ensure_ascii=False).encode()),
            }
        )
    return rows


def _kinds(guards: list[str]) -> str:
    kinds = {
        "Unicode class": sum("\\p{" in g for g in guards),
        "case-folded": sum("(?i)" in g for g in guards),
        "ASCII class": sum("[a-z]{" in g and "(?i)" not in g for g in guards),
        "contains": sum("contains(" in g for g in guards),
        "==": sum("!=" in g for g in guards),
    }
    return ", ".join(f"{n} {k}" for k, n in kinds.items() if n)


def run(policy: Any, runs: int) -> dict[str, Any]:
    return {
        "ns_per_unit": NS_PER_UNIT,
        "cost_limit": COST_LIMIT,
        "guards_cost_limit": GUARDS_COST_LIMIT,
        "calibration": calibration(runs),
        "compiling": compiling(runs),
        "giving_up": giving_up(runs),
        "projection": projection(policy, max(5, runs * 2)),
        "worst_guards": worst_set(policy, runs),
    }


def sound(sec: Mapping[str, Any]) -> tuple[int, int]:
    """(cases whose estimate covers the measured time, cases)."""
    rows = [*sec.get("calibration", ()), *sec.get("compiling", ()), *sec.get("giving_up", ())]
    return sum(r["estimate_over_measured"] >= 1 for r in rows), len(rows)


def report_md(sec: Mapping[str, Any]) -> list[str]:
    ok, total = sound(sec)
    lines = [
        "",
        f"## The cost model against measured time (1 MiB of arguments; a unit ="
        f" {sec['ns_per_unit']} ns)",
        "",
        f"Each case on the texts that make it slowest (its slowest shown), median CPU time of"
        f" the evaluating thread; estimate ms ="
        f" units x {sec['ns_per_unit']} ns. The limit of one expression is"
        f" {sec['cost_limit']:,} units; cases over it are refused at load and measured here"
        f" anyway. Estimate >= measured in {ok} of {total} cases (with the two tables below).",
        "",
        "| case | expression | RE2 instructions | estimate units | estimate ms | accepted"
        " | measured ms (text) | ns/byte | estimate / measured |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in sec["calibration"]:
        expr = r["expression"].replace("|", "\\|")
        lines.append(
            f"| {r['what']} | `{expr}` | {r['program'] or ''} | {r['estimate_units']:,}"
            f" | {r['estimate_ms']:.2f} | {'yes' if r['accepted'] else 'refused'}"
            f" | {r['measured_ms']:.2f} ({r['slowest_text']}) | {r['measured_ns_per_byte']:.2f}"
            f" | {r['estimate_over_measured']:.2f} |"
        )
    lines += [
        "",
        "Compiling alone (cel-expr-python compiles a pattern at every evaluation), on an"
        " empty text:",
        "",
        "| pattern | RE2 instructions | estimate ms | measured ms | estimate / measured |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in sec.get("compiling", ()):
        lines.append(
            f"| `{r['pattern']}` | {r['program']} | {r['estimate_ms']:.2f} | {r['measured_ms']:.2f}"
            f" | {r['estimate_over_measured']:.2f} |"
        )
    lines += [
        "",
        "Where RE2's DFA gives up (programs over"
        f" {LARGE_PROGRAM:,} instructions), on {GIVES_UP_SIZE // 1024} KiB of text:",
        "",
        "| pattern | RE2 instructions | estimate ms | measured ms (text) | ns/byte"
        " | estimate / measured |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in sec.get("giving_up", ()):
        lines.append(
            f"| `{r['pattern']}` | {r['program']} | {r['estimate_ms']:.1f}"
            f" | {r['measured_ms']:.1f} ({r['slowest_text']}) | {r['measured_ns_per_byte']:.0f}"
            f" | {r['estimate_over_measured']:.2f} |"
        )
    p = sec["projection"]
    lines += [
        "",
        f"A guard reading one field (`{p['guard']}`) of {p['arguments']:,} arguments"
        f" ({p['arguments_bytes']:,} bytes), call_facts() and the guard:"
        f" {p['projected_p50_ms']:.2f} ms p50 with only the fields the conditions read made"
        " into CEL values, against"
        f" {p['whole_p50_ms']:.2f} ms with all of them (before): {p['ratio']:.3f}x.",
        "",
        f"The worst guard sets a registrant can register under the cap of"
        f" {sec['guards_cost_limit']:,} units for a tool's guards (bench/worst_guards.py), on"
        " 1 MiB of arguments that every guard scans to the end and passes:",
        "",
        "| set | guards | kinds | share of the cap | estimate ms | CPU p50 ms | CPU max ms"
        " | wall p50 ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in sec["worst_guards"]:
        lines.append(
            f"| {r['what']} | {r['guards']} | {r['kinds']} | {r['of_cap']:.2f}"
            f" | {r['estimate_ms']:.1f} | {r['measured_p50_ms']:.1f} | {r['measured_max_ms']:.1f}"
            f" | {r['wall_p50_ms']:.1f} |"
        )
    return lines
