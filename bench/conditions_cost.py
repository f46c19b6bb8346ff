"""What the policy's conditions cost a call (issue 28), in process, on the
decision path and nothing else (no server, no container): for a dangerous tool,
``call_facts(...)``, then ``policy.denial_for(...)``, then
``policy.rule_for(..., facts=..., refuse_on_error=True)``, as the executor runs
them for every call (``_check_policy``, then the approval gate).

Policies, all with the same approvers, clients and one unconditional rule for
the tool, loaded from YAML by ``load_policy`` as the server does:

- ``none``: no condition at all (the baseline of the same run);
- ``deny``: plus the deny rule of docs/explanation/threat-model.md (a regex over
  ``args.sql``);
- ``typical``: plus 50 conditional approval rules of which 3 match the tool;
- ``worst``: plus 50 conditional approval rules that all match the tool and
  all hold, so every condition is evaluated in full and every rule becomes a
  requirement: a mix of argument comparisons, ``in caller.groups``, RE2
  ``matches``, ``now``, a loop over a list argument and an IdP claim;
- the same 50 with the ten ``matches()`` replaced by plain string functions
  (cel-expr-python compiles a ``matches()`` pattern at every evaluation).

Calls are timed one by one, the cases interleaved in blocks so the machine's
noise hits them alike; the delta of a case's median against ``none``'s is what
its conditions cost a call. For the worst case, the same work is split into
its phases (the facts, the messages and the CEL activation, the evaluations,
the rest of ``rule_for``).

Also: compiling one expression (type check and cost estimate), a policy load
with 50 conditions against one without, and, for the record, the costliest
expressions the static cost limit accepts, run on arguments of 1 MiB (the most
a call can carry): the limit bounds their evaluation to milliseconds. Apart
from it, the first read of ``args`` in a call converts all of them into CEL
values, bounded by their size (tens of ms for 1 MiB of small values, a
fraction of what ``parse_arguments`` pays for the same JSON).

Runs alone: ``python -m bench.conditions_cost [--rounds N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from bench import conditions_calibration
from bench.common import pct
from registry_server.domain.arguments import parse_arguments
from registry_server.domain.models import ToolDefinition, parse_definition
from registry_server.policy import conditions
from registry_server.policy.call_facts import call_facts
from registry_server.policy.conditions import (
    ARGUMENTS_BOUND,
    COST_LIMIT,
    CallFacts,
    Condition,
    ConditionError,
    ConditionFailed,
    Scope,
    compile_condition,
)
from registry_server.policy.loader import load_policy
from registry_server.policy.model import Policy
from registry_server.signing.keys import generate_keypair

TARGET_US = 200.0  # µs a call: what 50 conditional rules may add (issue 28)
BLOCK = 25  # calls of one case in a row, before the next case's
N_RULES = 50
TOOL = "run_sql"
CALLER = "carol"
ARGS: dict[str, Any] = {
    "env": "prod",
    "replicas": 3,
    "sql": "SELECT id, name FROM users WHERE id = 42",
    "tables": ["users", "orders"],
}
# What an IdP's access token would carry (caller.claims).
CLAIMS: dict[str, Any] = {
    "iss": "https://idp.example.com",
    "sub": "carol",
    "email": "carol@example.com",
    "department": "eng",
    "groups": ["sre", "dba"],
}
NONE, DENY, TYPICAL, WORST, WORST_PLAIN = (
    "no conditions (baseline)",
    "1 deny rule (the docs' no-drop-table)",
    "50 conditional rules, 3 match the tool",
    "50 conditional rules, all match and hold (10 with matches())",
    "the same 50 without matches()",
)
DENY_RULE = {
    "name": "no-drop-table",
    "match": {"tool": TOOL},
    "when": r'args.sql.matches("(?i)\\bdrop\\s+table\\b")',
    "reason": "DROP TABLE is never run by an agent",
}


# ------------------------------------------------------------------ the policies


def _families(i: int, regex: bool = True) -> list[tuple[dict[str, str], str]]:
    """Five kinds of condition, each true for the bench's call; ``i`` keeps
    every rule's (match, when) distinct, as the loader requires. Without
    ``regex``, the matches() kind becomes plain string functions."""
    sql = (
        rf'args.sql.matches("(?i)\\bfrom\\s+users\\b|never{i}")'
        if regex
        else f'args.sql.startsWith("SELECT") && args.sql.contains("users")'
        f" && size(args.sql) < {1000 + i}"
    )
    return [
        ({"tool": TOOL}, f'args.env == "prod" && args.replicas < {100 + i}'),
        ({"category": "db"}, f'"sre" in caller.groups && caller.id != "nobody{i}"'),
        ({"tool": TOOL}, sql),
        ({"level": "dangerous"}, f"now.getHours() < 24 && now.getDayOfWeek() < {7 + i}"),
        (
            {"tool": TOOL},
            f'args.tables.exists(t, t == "users") && caller.claims.department == "eng"'
            f" && size(args.tables) < {100 + i}",
        ),
    ]


def conditional_rules(matching: int, regex: bool = True) -> list[dict[str, Any]]:
    """``N_RULES`` conditional approval rules, of which the first ``matching``
    match the bench's tool; the others name other tools."""
    rules: list[dict[str, Any]] = []
    for n in range(N_RULES):
        match, when = _families(n // 5, regex)[n % 5]
        if n >= matching:
            match = {"tool": f"deploy_{n}"}
        rules.append(
            {
                "name": f"cond-{n}",
                "match": match,
                "when": when,
                "approvals_required": 1 + n % 2,
                "groups": ["sre"],
            }
        )
    return rules


def policy_text(rules: Sequence[Mapping[str, Any]], deny: Sequence[Mapping[str, Any]]) -> str:
    keys = {who: generate_keypair()[1] for who in ("alice", "bob", CALLER)}
    return yaml.safe_dump(
        {
            "audience": "toolreg-bench",
            "approvers": [
                {
                    "id": who,
                    "public_key": key,
                    "groups": ["sre", "dba"] if who == CALLER else ["sre"],
                }
                for who, key in keys.items()
            ],
            "approval_rules": [
                {
                    "name": "sql",
                    "match": {"tool": TOOL},
                    "approvals_required": 1,
                    "groups": ["sre"],
                },
                *rules,
            ],
            "deny_rules": list(deny),
            "clients": [
                {"id": "agent", "token_sha256": "a" * 64, "roles": ["execute"]},
                {"id": CALLER, "token_sha256": "b" * 64, "roles": ["execute", "approve"]},
            ],
        },
        sort_keys=False,
    )


def policy_files(work: Path) -> dict[str, Path]:
    texts = {
        NONE: policy_text([], []),
        DENY: policy_text([], [DENY_RULE]),
        TYPICAL: policy_text(conditional_rules(3), []),
        WORST: policy_text(conditional_rules(N_RULES), []),
        WORST_PLAIN: policy_text(conditional_rules(N_RULES, regex=False), []),
    }
    files = {}
    for n, (case, text) in enumerate(texts.items()):
        files[case] = work / f"policy-{n}.yaml"
        files[case].write_text(text)
    return files


def tool() -> ToolDefinition:
    return parse_definition(
        {
            "name": TOOL,
            "description": "runs one SQL statement",
            "parameters": {"type": "object"},
            "safety_level": "dangerous",
            "categories": ["db"],
            "sandbox": {"image": "toolreg/base", "command": ["cat"]},
        }
    )


# ------------------------------------------------------------------ per call


def decide(policy: Policy, t: ToolDefinition) -> Callable[[], int]:
    """One call's decision path, as the executor runs it."""

    def call() -> int:
        facts = call_facts(policy, t, ARGS, CALLER, time.time(), CLAIMS)
        denial = policy.denial_for(
            tool_name=t.name, categories=t.categories, level=t.safety_level, facts=facts
        )
        if denial is not None:
            raise RuntimeError(f"the bench's call was denied: {denial.message}")
        rule = policy.rule_for(
            tool_name=t.name, categories=t.categories, level=t.safety_level, facts=facts,
            refuse_on_error=True,
        )  # fmt: skip
        return len(rule.requirements)

    return call


def per_call(policies: Mapping[str, Policy], t: ToolDefinition, rounds: int) -> dict[str, Any]:
    fns = {case: decide(p, t) for case, p in policies.items()}
    requirements = {case: fn() for case, fn in fns.items()}  # and a warm-up
    for fn in fns.values():
        for _ in range(BLOCK):
            fn()
    samples: dict[str, list[float]] = {case: [] for case in fns}
    order = list(fns)
    gc.collect()
    for r in range(rounds):
        shift = r % len(order)
        for case in order[shift:] + order[:shift]:
            fn, out = fns[case], samples[case]
            for _ in range(BLOCK):
                t0 = time.perf_counter_ns()
                fn()
                out.append((time.perf_counter_ns() - t0) / 1000)
    base = statistics.median(samples[NONE])
    rows = []
    for case, values in samples.items():
        p50 = statistics.median(values)
        rows.append(
            {
                "what": case,
                "calls": len(values),
                "requirements": requirements[case],
                "p50_us": round(p50, 1),
                "p90_us": round(pct(values, 0.9), 1),
                "delta_us": round(p50 - base, 1),
                "ratio": round(p50 / base, 2),
            }
        )
    return {"rows": rows}


def phases(policy: Policy, t: ToolDefinition, runs: int) -> dict[str, float]:
    """The worst case's call, split into phases that add up to about the
    whole: medians in µs of each."""
    whens = [r.when for r in policy.rules if r.when is not None]
    regex = [w for w in whens if "matches(" in w.text]
    other = [w for w in whens if "matches(" not in w.text]
    env = conditions._env(Scope.POLICY)
    got: dict[str, list[float]] = {
        "call_facts(): the caller's roles and groups, the tool's facts": [],
        "messages: Tool, Caller, claims as a Struct (as far as the policy reads)": [],
        "CEL activation from them": [],
        f"{len(other)} evaluations without matches() (cel-cpp)": [],
        f"{len(regex)} evaluations with matches() (cel-cpp)": [],
        f"Condition.holds() around the {len(whens)} evaluations": [],
        f"rule_for() itself: matching, {len(policy.rules)} requirements (facts=None)": [],
        "denial_for() (no deny rules)": [],
    }
    names = list(got)
    for _ in range(runs):
        t0 = time.perf_counter_ns()
        facts = call_facts(policy, t, ARGS, CALLER, time.time(), CLAIMS)
        t1 = time.perf_counter_ns()
        data = facts._data(policy.reads)
        t2 = time.perf_counter_ns()
        activation = env.Activation(data)
        t3 = time.perf_counter_ns()
        for when in other:
            when._program.eval(activation)
        t4 = time.perf_counter_ns()
        for when in regex:
            when._program.eval(activation)
        t5 = time.perf_counter_ns()
        facts._activation, facts._made_for = activation, policy.reads
        for when in whens:
            when.holds(facts)
        t6 = time.perf_counter_ns()
        policy.rule_for(tool_name=t.name, categories=t.categories, level=t.safety_level)
        t7 = time.perf_counter_ns()
        policy.denial_for(
            tool_name=t.name, categories=t.categories, level=t.safety_level, facts=facts
        )
        t8 = time.perf_counter_ns()
        spans = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, (t6 - t5) - (t5 - t3), t7 - t6,
                 t8 - t7)  # fmt: skip
        for name, ns in zip(names, spans, strict=True):
            got[name].append(ns / 1000)
    return {name: round(statistics.median(v), 1) for name, v in got.items()}


# ------------------------------------------------------------------ compiling


def compile_costs(files: Mapping[str, Path], runs: int) -> dict[str, Any]:
    """One expression compiled (uncached: parse, type check, cost estimate),
    and loading the policy file with 50 conditions (compile cache emptied
    first, and again with the cache full: a reload of the same file) against
    the baseline's file, interleaved."""
    texts = [r["when"] for r in conditional_rules(N_RULES)]
    uncached = compile_condition.__wrapped__
    per_expr: list[float] = []
    for _ in range(max(1, runs // 5)):
        for text in texts:
            t0 = time.perf_counter_ns()
            uncached(text, Scope.POLICY)
            per_expr.append((time.perf_counter_ns() - t0) / 1000)
    loads: dict[str, list[float]] = {"none": [], "cold": [], "cached": []}
    for i in range(runs):
        steps = [("none", files[NONE]), ("cold", files[WORST])]
        for which, path in steps if i % 2 == 0 else steps[::-1]:
            if which == "cold":
                compile_condition.cache_clear()
            t0 = time.perf_counter_ns()
            load_policy(path)
            loads[which].append((time.perf_counter_ns() - t0) / 1e6)
        t0 = time.perf_counter_ns()
        load_policy(files[WORST])  # every expression from the cache now
        loads["cached"].append((time.perf_counter_ns() - t0) / 1e6)
    p50 = {k: statistics.median(v) for k, v in loads.items()}
    return {
        "expressions": len(texts),
        "compile_p50_us": round(statistics.median(per_expr), 1),
        "compile_p90_us": round(pct(per_expr, 0.9), 1),
        "compile_mean_us": round(statistics.fmean(per_expr), 1),
        "load_none_p50_ms": round(p50["none"], 2),
        "load_worst_p50_ms": round(p50["cold"], 2),
        "reload_cached_p50_ms": round(p50["cached"], 2),
    }


# ------------------------------------------------------------------ the costliest


def _sql(size: int) -> str:
    line = "select name, total from orders where total > 100 and region = 'north'; "
    return (line * (size // len(line) + 1))[:size]


def _most_matches() -> str:
    """As many matches() of one short pattern over ``args.sql``, joined by
    ||, as the cost limit accepts."""
    accepted = ""
    for n in range(1, 33):
        text = " || ".join(rf'args.sql.matches("(?i)drop\\s+table{i}")' for i in range(n))
        try:
            compile_condition(text, Scope.POLICY)
        except ConditionError:
            break
        accepted = text
    return accepted


def _big_cases() -> list[tuple[str, str, dict[str, Any]]]:
    """(what, expression, arguments): arguments of about 1 MiB as JSON."""
    room = ARGUMENTS_BOUND - 64
    short = ["a"] * (room // 4)  # '"a",' : 4 bytes each
    in_budget = ["x" * 96] * 9_999  # the most a loop may run (cel-cpp's budget), ~1 MiB
    keys = {f"k{i:05d}": 0 for i in range(room // 11)}  # '"k00000":0,' : 11 bytes each
    ors = _most_matches()
    return [
        ("one RE2 matches() over a 1 MiB string", r'args.sql.matches("(?i)drop\\s+table")',
         {"sql": _sql(room)}),
        (f"{ors.count('matches(')} matches() over the same 1 MiB string (the most the limit"
         " admits)", ors, {"sql": _sql(room)}),
        ("a 2 MiB string built (concatenation)", "size(args.sql + args.sql) > 0",
         {"sql": _sql(room)}),
        (f"exists() over {len(short):,} one-character strings",
         'args.tables.exists(t, t == "users")', {"tables": short}),
        (f"`in` over the same {len(short):,} strings (no loop: no iteration budget)",
         '"users" in args.tables', {"tables": short}),
        (f"exists() with contains() over {len(in_budget):,} strings of 96 bytes",
         'args.tables.exists(t, t.contains("users"))', {"tables": in_budget}),
        (f"one field of {len(keys):,} (the cheapest expression, the dearest arguments)",
         'args.k00000 == 1', keys),
    ]  # fmt: skip


def costliest(runs: int) -> list[dict[str, Any]]:
    """Each expression on a fresh call's facts: the activation, the first
    read of ``args`` (which converts all of them into CEL values, once per
    call: later conditions of the call find them converted), then the
    expression itself."""
    env = conditions._env(Scope.POLICY)
    first_read = compile_condition('"" in args', Scope.POLICY)
    t = tool()
    rows: list[dict[str, Any]] = []
    for what, text, raw in _big_cases():
        try:
            cond: Condition = compile_condition(text, Scope.POLICY)
        except ConditionError as refused:  # the limit changed since this list was made
            rows.append({"what": what, "expression": text[:90], "refused": str(refused)})
            continue
        got: dict[str, list[float]] = {
            "parse_ms": [], "activation_ms": [], "convert_ms": [], "eval_ms": [],
        }  # fmt: skip
        wire = json.dumps(raw, separators=(",", ":"))
        for _ in range(3):  # what the call pays anyway, for scale
            t0 = time.perf_counter_ns()
            args = parse_arguments(t, wire).value
            got["parse_ms"].append((time.perf_counter_ns() - t0) / 1e6)
        outcome = ""
        for _ in range(runs):
            facts = CallFacts(args)
            t0 = time.perf_counter_ns()
            facts._activation = env.Activation(facts._data(facts.reads))
            facts._made_for = facts.reads
            t1 = time.perf_counter_ns()
            first_read.holds(facts)
            t2 = time.perf_counter_ns()
            try:
                outcome = str(cond.holds(facts)).lower()
            except ConditionFailed as failed:
                outcome = f"errs: {failed.detail}"
            t3 = time.perf_counter_ns()
            for key, ns in (("activation_ms", t1 - t0), ("convert_ms", t2 - t1),
                            ("eval_ms", t3 - t2)):  # fmt: skip
                got[key].append(ns / 1e6)
        rows.append(
            {
                "what": what,
                "expression": text if len(text) < 90 else text[:70] + " || ...",
                "arguments_bytes": len(wire),
                "cost": cond.cost,
                "of_limit": round(cond.cost / COST_LIMIT, 2),
                **{key: round(statistics.median(v), 2) for key, v in got.items()},
                "outcome": outcome,
            }
        )
    return rows


# ------------------------------------------------------------------ the section


def run(rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="toolreg-bench-cond-") as work:
        files = policy_files(Path(work))
        policies = {case: load_policy(path) for case, path in files.items()}
        compiled = compile_costs(files, max(5, rounds // 10))
    t = tool()
    out: dict[str, Any] = {"rounds": rounds, "block": BLOCK, "target_us": TARGET_US}
    out |= per_call(policies, t, rounds)
    out["phases_us"] = phases(policies[WORST], t, max(200, rounds * 5))
    out["compile"] = compiled
    out["costliest"] = costliest(max(3, rounds // 20))
    out["cost_limit"] = COST_LIMIT
    out["examples"] = [when for _, when in _families(0)]
    out["model"] = conditions_calibration.run(policies[NONE], max(3, rounds // 40))
    return out


def row(sec: Mapping[str, Any], case: str) -> Mapping[str, Any] | None:
    return next((r for r in sec.get("rows", ()) if r["what"] == case), None)


def report_md(sec: Mapping[str, Any]) -> list[str]:
    calls = sec["rows"][0]["calls"] if sec.get("rows") else 0
    lines = [
        "",
        f"## What conditions cost a call (in process, {calls:,} calls per case, interleaved"
        f" in blocks of {sec['block']})",
        "",
        "The decision path of one call to a dangerous tool with small arguments:"
        " `call_facts()`, `denial_for()`, `rule_for(facts=...)`. Delta: p50 against the"
        " policy without conditions, measured in the same run.",
        "",
        "| policy | rules applied | p50 µs | p90 µs | delta p50 µs | p50 / baseline |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in sec["rows"]:
        lines.append(
            f"| {r['what']} | {r['requirements']} | {r['p50_us']:.1f} | {r['p90_us']:.1f}"
            f" | {r['delta_us']:+.1f} | {r['ratio']:.2f}x |"
        )
    lines += [
        "",
        "Where the worst case's time goes (medians of each phase, µs, timed apart: they add up"
        " to about the whole):",
        "",
        "| phase | µs |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {us:.1f} |" for name, us in sec["phases_us"].items()]
    c = sec["compile"]
    lines += [
        "",
        f"Compiling one expression (parse, type check, cost estimate; uncached):"
        f" p50 {c['compile_p50_us']:.0f} µs, p90 {c['compile_p90_us']:.0f} µs, mean"
        f" {c['compile_mean_us']:.0f} µs. Loading the policy file: {c['load_none_p50_ms']:.1f}"
        f" ms without conditions; with {c['expressions']}, {c['load_worst_p50_ms']:.1f} ms"
        f" compiling them and {c['reload_cached_p50_ms']:.1f} ms from the compile cache (a"
        " reload of the same expressions): the rest of a load is mostly the YAML parser,"
        " which keeps every node's line for messages.",
        "",
        f"The costliest expressions the static limit accepts ({sec['cost_limit']:,} units),"
        " on arguments of about 1 MiB (the most a call carries), on a fresh call each time."
        " First read: the first condition of a call that reads `args` whole converts all of"
        " them into CEL values (once a call: its other conditions find them converted; a"
        " call's conditions that name their fields convert those only, see the projection"
        " below); eval: the"
        " expression itself. cel-cpp stops an evaluation's loops at 10,000 iterations in all."
        " For scale, what the call pays for the same arguments before any condition:"
        " `parse_arguments` (strict JSON, shape, JSON Schema, RFC 8785 form).",
        "",
        "| what | expression | share of the limit | parse_arguments ms | activation ms"
        " | first read ms | eval ms | outcome |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in sec["costliest"]:
        expr = r["expression"].replace("|", "\\|")
        if "refused" in r:
            lines.append(f"| {r['what']} | `{expr}` | refused at load: {r['refused']} ||||||")
            continue
        lines.append(
            f"| {r['what']} | `{expr}` | {r['of_limit']:.2f} | {r['parse_ms']:.1f}"
            f" | {r['activation_ms']:.2f}"
            f" | {r['convert_ms']:.2f} | {r['eval_ms']:.2f} | {r['outcome']} |"
        )
    if "model" in sec:
        lines += conditions_calibration.report_md(sec["model"])
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.conditions_cost", description=__doc__)
    parser.add_argument("--rounds", type=int, default=200, help=f"rounds of {BLOCK} calls per case")
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument(
        "--model-only", action="store_true",
        help="only the cost model against measured time (bench/conditions_calibration.py)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.model_only:
        with tempfile.TemporaryDirectory(prefix="toolreg-bench-cond-") as work:
            policy = load_policy(policy_files(Path(work))[NONE])
        model = conditions_calibration.run(policy, max(3, args.rounds // 40))
        print("\n".join(conditions_calibration.report_md(model)))
        return
    result = run(args.rounds)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(report_md(result)))


if __name__ == "__main__":
    main()
