"""CEL conditions (policy/conditions.py, issue 28): what compiles, what the
static cost limit refuses, and how evaluating fails closed. In memory; no
timing asserts (the runtime of the costliest accepted expressions on 1 MiB of
arguments is bench/conditions_cost.py's to measure): the runtime side is
asserted through its outcomes (cel-cpp's iteration budget stops a loop that
the estimate let through, and the call is refused)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from registry_server.policy import regex_cost
from registry_server.policy.conditions import (
    ARGUMENTS_BOUND,
    COST_LIMIT,
    MAX_CLAIMS_BYTES,
    MAX_CONDITION_CHARS,
    TOOL_BOUND,
    CallerFacts,
    CallFacts,
    ConditionError,
    ConditionFailed,
    Scope,
    ToolFacts,
    compile_condition,
    first_failing,
)

POLICY, GUARD = Scope.POLICY, Scope.GUARD
TEN = "[" + ", ".join(str(i) for i in range(10)) + "]"  # a literal list of ten
DROP_TABLE = r'args.sql.matches("(?i)\\bdrop\\s+table\\b")'


def refused(text: str, scope: Scope = POLICY) -> str:
    with pytest.raises(ConditionError) as info:
        compile_condition(text, scope)
    return str(info.value)


def holds(text: str, args: dict[str, Any] | None = None, **facts: Any) -> bool:
    return compile_condition(text, facts.pop("scope", POLICY)).holds(CallFacts(args or {}, **facts))


def fails(text: str, args: dict[str, Any] | None = None, **facts: Any) -> str:
    """The reason evaluating ``text`` gave neither true nor false."""
    condition = compile_condition(text, facts.pop("scope", POLICY))
    with pytest.raises(ConditionFailed) as info:
        condition.holds(CallFacts(args or {}, **facts))
    return info.value.detail


# ------------------------------------------------------------------ compiling


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # a misspelt field of a typed variable: at load, not at the first call
        ('tool.nmae == "deploy"', "line 1, column 5: undefined field 'nmae'"),
        ('caller.gropus.exists(g, g == "sre")', "line 1, column 7: undefined field 'gropus'"),
        ("tool.level == 3", "line 1, column 12: found no matching overload for '_==_'"),
        ('now == "2026-01-01"', "line 1, column 5: found no matching overload for '_==_'"),
        ('tenant == "acme"', "line 1, column 1: undeclared reference to 'tenant'"),
        # the column of a later line of a multi-line expression (YAML `|`)
        ('args.env == "prod" &&\n  tool.nmae == "x"', "line 2, column 7: undefined field 'nmae'"),
        ('args.env == "prod" &&', "line 1, column 22: Syntax error"),
    ],
)
def test_a_type_or_syntax_error_is_named_with_its_line_and_column(text: str, message: str) -> None:
    assert message in refused(text)


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("args.env", "dyn"),
        ("size(caller.groups)", "int"),
        ('"prod"', "string"),
        ("now", "timestamp"),
    ],
)
def test_an_expression_must_give_a_bool(text: str, kind: str) -> None:
    assert refused(text) == f"must be a bool, not {kind}"


@pytest.mark.parametrize(
    ("text", "name"),
    [('tool.name == "x"', "tool.name"), ('"sre" in caller.groups', "caller.groups"),
     ("now.getHours() < 18", "now")],
)  # fmt: skip
def test_a_guard_reads_only_the_arguments(text: str, name: str) -> None:
    assert f"undeclared reference to '{name}'" in refused(text, GUARD)
    compile_condition(text, POLICY)  # what the policy may read
    assert holds('args.path.startsWith("/work/")', {"path": "/work/a"}, scope=GUARD)


def test_a_guard_reads_only_the_arguments_so_only_they_are_made_into_cel_values() -> None:
    guard = compile_condition('args.a == 1 && args.b.startsWith("x")', GUARD)
    assert guard.reads == {"args"}
    facts = CallFacts({"a": 1}, ToolFacts("deploy", "dangerous"), CallerFacts("agent"))
    assert set(facts._data(guard.reads)) == {"args"}


@pytest.mark.parametrize(
    ("text", "reads"),
    [
        ('args.env == "prod"', {"args"}),
        ('tool.name == "deploy" && now.getHours() < 18', {"tool", "now"}),
        ('"sre" in caller.groups', {"caller"}),
        ('caller.claims.dept == "x"', {"caller", "caller.claims"}),
        ("has(caller.claims.dept)", {"caller", "caller.claims"}),
        ('args.items.exists(x, x == "a") && caller.id == "x"', {"args", "caller"}),
    ],
)
def test_a_condition_knows_what_it_reads(text: str, reads: set[str]) -> None:
    assert compile_condition(text, POLICY).reads == reads


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_an_empty_expression_is_refused(text: str) -> None:
    assert refused(text) == "must be a non-empty CEL expression"


def test_an_expression_longer_than_the_cap_is_refused() -> None:
    at_cap = 'args.s == "' + "a" * (MAX_CONDITION_CHARS - 12) + '"'
    assert len(at_cap) == MAX_CONDITION_CHARS
    compile_condition(at_cap, POLICY)
    assert refused(at_cap + " ") == f"longer than {MAX_CONDITION_CHARS} characters"


@pytest.mark.parametrize(
    "text",
    [
        "args.text.matches(args.pattern)",  # the caller would choose the regex
        "matches(args.text, args.pattern)",  # the global form too
        'args.text.matches("^" + args.prefix)',
        'args.text.matches("a" + "b")',  # built, even from literals
        "args.patterns.exists(p, args.text.matches(p))",
        "args.text.matches(tool.name)",
    ],
)
def test_matches_with_a_pattern_that_is_not_a_literal_is_refused(text: str) -> None:
    assert refused(text) == "matches(): the pattern must be a string literal"


@pytest.mark.parametrize(
    ("sql", "dropped"),
    [("DROP TABLE users", True), ("drop\ttable users", True), ("x; Drop  Table t", True),
     ("select * from users", False), ("backdrop tables", False), ("drop tables", False)],
)  # fmt: skip
def test_a_literal_re2_pattern_works(sql: str, dropped: bool) -> None:
    assert holds(DROP_TABLE, {"sql": sql}) is dropped


def test_re2_syntax_that_python_lacks_works() -> None:
    # Unicode classes (over a tool's name: over 1 MiB of arguments \pL's
    # 1,201 instructions cost more than the limit, see the estimates below)
    assert holds(r'tool.name.matches("^\\pL+$")', tool=ToolFacts("Größe", "safe"))
    assert holds(r'args.s.matches("^(?P<user>[a-z]+)@")', {"s": "ann@example.com"})
    assert not holds(r'tool.name.matches("^\\pL+$")', tool=ToolFacts("a1", "safe"))


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (r"(a)\\1", "invalid escape sequence"),  # RE2 has no backreferences
        (r"(?=a)b", "invalid perl operator: (?="),  # nor lookarounds
        ("(unclosed", "missing )"),
        ("a{1001}", "invalid repetition size: {1001}"),  # RE2 repeats at most 1000 times
    ],
)
def test_a_pattern_re2_cannot_compile_is_refused_at_load(pattern: str, why: str) -> None:
    # Before: accepted, then every call it was evaluated for erred. A deny
    # rule's typo would have refused every call of its tools, an approval
    # rule's every call too, instead of the policy refusing to load.
    message = refused(f'args.s.matches("{pattern}")')
    assert message.startswith("matches(): the pattern is not valid RE2")
    assert why in message


def test_compiling_is_cached_by_text_and_scope() -> None:
    assert compile_condition('args.env == "prod"', POLICY) is compile_condition(
        'args.env == "prod"', POLICY
    )
    assert compile_condition('args.env == "prod"', GUARD).scope is GUARD


# ------------------------------------------------------------------ the cost limit

# Expressions that loop in a loop, or build or scan whole strings of the
# arguments many times: each must be refused at load, whatever the call.
EXPENSIVE = {
    "a loop in a loop": "args.a.exists(x, args.b.exists(y, x == y))",
    "strings built per element": "args.items.map(x, args.s + args.s + args.s).size() > 0",
    "the whole arguments scanned per element": "args.items.exists(x, args.sql.contains(x))",
    "a loop in a loop in a literal": f"{TEN}.exists(i, args.items.exists(x, x == string(i)))",
    "a huge string built": "size(" + " + ".join(["args.s"] * 17) + ") > 0",
    "the same string compared many times": " || ".join(["args.s == args.t"] * 33),
    # A needle from the call: a naive substring search is |text| x |needle|
    # (2.5 s for a 768 KiB text and a 256 KiB needle, by hand, before).
    "contains() of a needle from the call": "args.text.contains(args.needle)",
    # map() and filter() build their list by appending one element a step,
    # copying the list built so far: quadratic (2 s for 8,000 elements).
    "map() over the arguments": "args.items.map(x, x).size() > 0",
    "filter() over the arguments": 'args.items.filter(x, x == "a").size() > 0',
    # A regex whose DFA would outgrow RE2's cache: RE2 falls back to its NFA,
    # |text| x |positions| (by hand, on 1 MiB, before: 4.3 s, 1.3 s, 0.5 s,
    # 0.2 s, 0.13 s).
    "a regex repeated a thousand times": r'args.s.matches("[ab]*a[ab]{1000}c")',
    "a regex repeated two hundred times": r'args.s.matches("[ab]*a[ab]{200}c")',
    "a regex with a window after a character": r'args.s.matches("a.{0,30}b")',
    "the same, after a word": r'args.s.matches("key.{0,50}=")',
    "a regex with fourteen undecided places": r'args.s.matches("[ab]*a[ab]{14}c")',
    "the same, written out": 'args.s.matches("[ab]*a' + "[ab]" * 14 + 'c")',
    "a regex with a wide window": r'args.s.matches("(?s)BEGIN.{0,1000}END")',
}


@pytest.mark.parametrize("name", EXPENSIVE)
def test_expressions_that_loop_or_build_huge_strings_are_refused(name: str) -> None:
    message = refused(EXPENSIVE[name])
    assert message.startswith("may cost up to "), message
    assert f"over the limit of {COST_LIMIT:,}" in message


def test_the_cost_message_names_what_to_do() -> None:
    message = refused(EXPENSIVE["map() over the arguments"])
    assert "a loop inside a loop" in message and "map() or filter()" in message


ORDINARY = [
    'args.env == "prod"',
    DROP_TABLE,
    r'args.sql.matches("(?i)\\b(drop|truncate|delete)\\s+(table|from)\\b")',
    r'args.sql.matches("(?i)drop\\s+table")',
    r'args.commit.matches("^[0-9a-f]{40}$")',
    r'args.name.matches("^[a-z0-9_-]{1,64}$")',
    r'args.text.matches("(?i)(password|secret|token)\\s*[:=]\\s*\\S{8,}")',
    'args.tables.exists(t, t == "users")',
    'args.tables.all(t, t.startsWith("tmp_"))',
    'args.tables.exists_one(t, t == "users")',
    '"users" in args.tables',
    '"sre" in caller.groups',
    "now.getHours() < 18",
    'has(args.env) && args.env in ["prod", "staging"]',
    'args.path.startsWith("/work/") && !args.path.contains("..")',
    'args.sql.contains("DROP")',  # two over 1 MiB are over the limit: about 21 ms each
    "size(args.sql + args.sql) > 0",
    'caller.claims.department == "eng" && tool.owner != caller.id',
    f"{TEN}.exists(a, {TEN}.exists(b, a + b == 18))",  # literal: 100 iterations
    f"{TEN}.map(i, i * 2).exists(x, x == 18)",  # map() over a literal
    r'args.s.matches("a.{0,8}b")',  # a window RE2's DFA caches
    'args.s.matches("(' + "|".join(f"x{i}y" for i in range(300)) + ')")',  # long, tame
    r'tool.name.matches("a.{0,30}b")',  # explodes, over a short text: bounded
]


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_expressions_are_accepted(text: str) -> None:
    assert 0 < compile_condition(text, POLICY).cost <= COST_LIMIT


def test_four_nested_loops_over_literals_pass_the_estimate_and_stop_on_the_budget() -> None:
    # 10 x 10 x 10 x 10 iterations, bounded since literal: the estimate lets
    # it through; cel-cpp's iteration budget (about 10,000 a evaluation)
    # stops it, and the call is refused rather than run (fail closed).
    inner = "a + b + c + d < 0"
    for name in "dcba":
        inner = f"{TEN}.exists({name}, {inner})"
    condition = compile_condition(inner, POLICY)
    assert condition.cost <= COST_LIMIT
    assert fails(inner) == "Iteration budget exceeded"
    # three levels (1,110 iterations) run
    three = f"{TEN}.exists(a, {TEN}.exists(b, {TEN}.exists(c, a + b + c == 27)))"
    assert holds(three)


def test_the_iteration_budget_also_stops_a_loop_over_a_long_argument() -> None:
    """A loop the estimate accepts, over a list of 20,000 elements: refused
    (fail closed), as a deny rule over it would refuse the call. The budget
    is the whole evaluation's: two loops of 6,000 exceed it too."""
    text = 'args.tables.exists(t, t == "users")'
    assert not holds(text, {"tables": ["t"] * 1_000})
    assert fails(text, {"tables": ["t"] * 20_000}) == "Iteration budget exceeded"
    both = 'args.a.exists(x, x == "z") || args.b.exists(x, x == "z")'
    assert not holds(both, {"a": ["t"] * 4_000, "b": ["t"] * 4_000})
    assert fails(both, {"a": ["t"] * 6_000, "b": ["t"] * 6_000}) == "Iteration budget exceeded"


@pytest.mark.parametrize(
    ("text", "passes"),
    [
        ('args.s == "x"', 1),
        ('args.s.contains("x")', 1),
        ('args.s.startsWith("x") || args.s.endsWith("x")', 2),
        (r'args.s.matches("x+")', 2),  # RE2: a scan, and the automaton's work
        ("size(args.s + args.s) > 0", 4),  # read twice, a copy twice as large, its size
        ('args.items.exists(x, x == "users")', 1),
    ],
)
def test_the_estimate_is_at_least_the_bytes_the_expression_reads(text: str, passes: int) -> None:
    """Soundness, roughly: an expression that reads the largest argument a
    call can carry ``passes`` times costs at least that many bytes."""
    assert compile_condition(text, POLICY).cost >= passes * ARGUMENTS_BOUND


def test_the_estimate_counts_a_loop_over_the_arguments_once_per_possible_element() -> None:
    # 1 MiB of JSON holds at most ARGUMENTS_BOUND / 2 elements ("1,"); each
    # iteration is at least one unit.
    assert compile_condition("args.items.all(x, true)", POLICY).cost >= ARGUMENTS_BOUND // 2


def test_a_pattern_costs_a_pass_while_its_dfa_fits_and_its_nfa_beyond() -> None:
    def cost(text: str) -> int:
        return compile_condition(text, POLICY).cost

    # long but tame: as many DFA states as places in a run of hex digits; a
    # DFA pass (PASS_UNITS a byte), the read, and 82 instructions' share
    assert cost(r'args.s.matches("^[0-9a-f]{40}$")') < 12 * ARGUMENTS_BOUND
    assert regex_cost._re2_automaton("^[0-9a-f]{40}$") == (40, 41)
    # 2^8 sets of places where an "a" was: RE2 caches them; 2^9 it thrashes
    assert regex_cost._re2_automaton("[ab]*a[ab]{8}c")[1] <= regex_cost.DFA_STATES_CAP
    assert regex_cost._re2_automaton("[ab]*a[ab]{9}c")[1] > regex_cost.DFA_STATES_CAP
    nfa = 17 * regex_cost.NFA_UNITS * TOOL_BOUND  # 17 positions over a tool's name
    assert cost(r'tool.name.matches("[ab]*a[ab]{14}c")') >= nfa


@pytest.mark.parametrize(
    "pattern",
    ["(" * 300 + "a" + ")" * 300, "((a|b){30}){30}", "[ab]*a" + "[ab]" * 500 + "c"],
)
def test_a_pattern_too_deep_or_too_large_to_analyse_counts_as_exploding(pattern: str) -> None:
    assert regex_cost._re2_automaton(pattern)[1] > regex_cost.DFA_STATES_CAP
    assert refused(f'args.s.matches("{pattern}")').startswith("may cost up to")


def test_a_long_needle_costs_more_than_a_short_one() -> None:
    def cost(text: str) -> int:
        return compile_condition(text, POLICY).cost

    # a substring search compares the needle at each place of the text
    assert cost('args.s.contains("' + "x" * 40 + '")') > 5 * cost('args.s.contains("x")')
    assert "may cost up to" in refused('args.s.contains("' + "x" * 200 + '")')


@pytest.mark.parametrize(
    ("pattern", "size"),
    [
        ("drop", 4),
        (r"(?i)drop\s+table", 10),  # flags, a class and its + add nothing
        ("a{10}", 10),
        ("(ab{10}){10}", 110),  # nested: copies of copies
        ("[ab]{2,5}", 5),  # ab(a(a(a)?)?)?
        ("^a$", 1),  # anchors match no character
        ("x{3,}", 3),  # xxx+: two copies and one that loops
        ("(?P<user>[a-z]+)@", 2),
        ("[]a-z]{4}", 4),  # a ] first in a class is a character
        (r"[[:alpha:]\]]{4}", 4),
        (r"\p{Greek}{3}\pL{2}", 5),
        (r"\x{263a}{3}", 3),
        (r"\Qa.b{9}\E", 6),  # a literal run: no repetition in it
        ("a|b|c", 3),
    ],
)
def test_the_size_of_a_pattern_is_what_re2_expands_it_to(pattern: str, size: int) -> None:
    assert regex_cost._re2_size(pattern) == size


# ------------------------------------------------------------------ evaluating


def test_a_missing_field_fails_closed() -> None:
    assert fails('args.env == "prod"') == 'Key not found in map : "env"'
    # Written to be false when absent:
    assert not holds('has(args.env) && args.env == "prod"')
    assert not holds('"env" in args && args.env == "prod"')


@pytest.mark.parametrize(
    ("text", "result"),
    [
        # CEL's logic absorbs an error when the other side decides, in either
        # order (commutative, unlike short-circuit evaluation):
        ('false && args.env == "prod"', False),
        ('args.env == "prod" && false', False),
        ('true || args.env == "prod"', True),
        ('args.env == "prod" || true', True),
        # ... and the error stands when the other side does not decide:
        ('true && args.env == "prod"', None),
        ('false || args.env == "prod"', None),
        ('!(args.env == "prod")', None),
        ('args.env == "prod" ? true : false', None),
        ('[1].exists(x, args.env == "prod")', None),
        ('[1].all(x, args.env == "prod")', None),
    ],
)
def test_and_and_or_absorb_an_error_only_when_the_other_side_decides(
    text: str, result: bool | None
) -> None:
    if result is None:
        assert "Key not found" in fails(text)
    else:
        assert holds(text) is result


@pytest.mark.parametrize(
    ("value", "outcome"),
    [("5", "fails"), (True, "fails"), (None, "fails"), ([4], "fails"),
     (5, True), (2, False), (3.5, True)],  # ints and doubles compare as numbers
)  # fmt: skip
def test_a_wrong_type_at_run_time_fails_closed(value: Any, outcome: Any) -> None:
    if outcome == "fails":
        assert "No matching overloads found" in fails("args.count > 3", {"count": value})
    else:
        assert holds("args.count > 3", {"count": value}) is outcome


def test_comparing_values_of_different_types_is_false_not_an_error() -> None:
    # docs/how-to/approvals.md: heterogeneous equality; ordering them is an error
    assert not holds('args.replicas == "3"', {"replicas": 3})
    assert holds('args.replicas != "3"', {"replicas": 3})
    assert not holds("args.tags == 3", {"tags": ["a"]})
    assert "No matching overloads" in fails('args.replicas < "3"', {"replicas": 3})


def test_the_documented_examples_of_absorbed_errors() -> None:
    prod = {"env": "prod"}  # and no x
    assert holds('args.x == 1 || args.env == "prod"', prod)
    assert not holds('args.x == 1 && args.env == "dev"', prod)


def test_an_integer_beyond_64_bits_anywhere_in_the_arguments_fails_closed() -> None:
    # JSON has no bound on integers; CEL's are 64 bits. The arguments are
    # converted whole on their first read, so every condition reading `args`
    # errs (a deny rule denies, an approval rule refuses); others still run.
    args = {"env": "prod", "n": 2**70}
    assert "beyond 64 bits" in fails('args.env == "prod"', args)
    assert holds('caller.id == ""', args)


@pytest.mark.parametrize(
    "args",
    [{"n": 2**70}, {"a'b": 2**70}, {"k": [1, {"x'] -> y": -(2**70)}]}, {'"q"': 2**64}],
)
def test_no_value_of_the_arguments_reaches_a_failure_detail(args: dict[str, Any]) -> None:
    # Before: a key with a quote made the value's digits reach the detail
    # (the audit row, the log line and the caller's message carry it).
    detail = fails("args.n == 1", args)
    assert "1180591620717411303424" not in detail and "18446744073709551616" not in detail


def test_a_value_of_the_call_missing_from_a_map_is_not_quoted() -> None:
    detail = fails("args.limits[args.key] == 1", {"limits": {}, "key": "hunter2"})
    assert "hunter2" not in detail
    assert detail == "Key not found in map : '…'"


def test_caller_claims_are_readable_up_to_the_cap_and_not_shown_above_it() -> None:
    claims = {"department": "eng", "groups": ["sre", "dba"], "level": 3}
    caller = CallerFacts("carol", claims=claims)
    assert holds('caller.claims.department == "eng"', caller=caller)
    assert holds('"dba" in caller.claims.groups && caller.claims.level == 3', caller=caller)
    big = CallerFacts("carol", claims={**claims, "blob": "x" * MAX_CLAIMS_BYTES})
    assert not holds('"department" in caller.claims', caller=big)
    assert "Key not found" in fails('caller.claims.department == "eng"', caller=big)
    # with none at all, the same
    assert "Key not found" in fails('caller.claims.department == "eng"', caller=CallerFacts("c"))


def test_now_is_the_calls_time_and_nothing_else() -> None:
    at = datetime(2001, 2, 3, 4, 5, 6, tzinfo=UTC)
    assert holds('now == timestamp("2001-02-03T04:05:06Z")', now=at)
    assert holds("now.getFullYear() == 2001 && now.getHours() == 4", now=at)
    assert holds('now.getHours("Europe/Paris") == 5', now=at)
    # without a time, a condition reading it fails closed (never the clock)
    assert "now" in fails("now.getHours() < 18")


def test_tool_and_caller_read_what_the_facts_hold() -> None:
    tool = ToolFacts(
        "deploy", "dangerous", ("ops", "prod"), "team-a", "d" * 64, ("api.example.com",)
    )
    caller = CallerFacts("agent", ("execute",), ("sre",))
    facts = {"tool": tool, "caller": caller}
    assert holds('tool.name == "deploy" && tool.level == "dangerous"', **facts)
    assert holds('"prod" in tool.categories && tool.owner == "team-a"', **facts)
    assert holds('tool.digest.startsWith("ddd") && "api.example.com" in tool.egress_hosts', **facts)
    assert holds('caller.id == "agent" && "execute" in caller.roles', **facts)
    assert holds('"sre" in caller.groups && !("dba" in caller.groups)', **facts)


def test_without_tool_or_caller_their_fields_are_empty() -> None:
    assert holds('tool.name == "" && caller.id == "" && size(caller.groups) == 0')


def test_the_activation_is_made_once_per_call_and_again_only_for_a_condition_reading_more() -> None:
    facts = CallFacts({"env": "prod"}, reads=frozenset({"args"}))
    args_only = facts.activation(frozenset({"args"}))
    assert facts.activation(frozenset({"args"})) is args_only
    with_tool = facts.activation(frozenset({"tool"}))
    assert with_tool is not args_only
    assert facts.activation(frozenset({"args", "tool"})) is with_tool
    # a condition reading the tool after that one holds against the same values
    assert compile_condition('tool.name == ""', POLICY).holds(facts) is True


def test_first_failing_reports_the_first_guard_that_does_not_hold() -> None:
    guards = [
        (compile_condition('args.path.startsWith("/work/")', GUARD), "must be under /work/"),
        (compile_condition("args.size <= 10", GUARD), "at most 10"),
    ]
    assert first_failing(guards, CallFacts({"path": "/work/a", "size": 1})) is None
    assert first_failing(guards, CallFacts({"path": "/etc", "size": 99})) == "must be under /work/"
    assert first_failing(guards, CallFacts({"path": "/work/a", "size": 99})) == "at most 10"
    # an error counts as not holding, its reason after the message
    assert first_failing(guards, CallFacts({"path": "/work/a"})) == (
        'at most 10 (the check could not be evaluated: Key not found in map : "size")'
    )
