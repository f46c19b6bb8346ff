"""Conditions: CEL expressions over one call, in the policy (approval rules'
``when``, deny rules) and in tools' guards (docs/how-to/approvals.md, "Conditions").

CEL through ``cel-expr-python`` (Google's own runtime, cel-cpp): it
type-checks against declared variables (a misspelt field is an error at load,
not a surprise at call time), its ``matches()`` is RE2, and it has no I/O,
no clock and no loops beyond the macros over a value's elements. What it
lacks is a cost limit, so every expression gets a static worst-case cost when
it is compiled (``estimate_cost``, after Kubernetes' CEL cost estimator) and
one above ``COST_LIMIT`` is refused: nothing reaches a call that could build
huge strings or loop over loops. A ``matches()`` pattern must be a literal
that RE2 compiles (checked at load: a typo must not refuse every call); one
whose automaton would outgrow RE2's cache costs what RE2's NFA does, and a
substring search what comparing the needle at every place of the text does.
cel-cpp's own iteration budget (about 10,000 iterations an evaluation) stops
a comprehension that runs long anyway (a second line, never the first).

A call runs all its tool's guards and may run every condition of the
policy, so each expression's limit is not enough: a tool's guards together
are held under GUARDS_COST_LIMIT (its registrant is not trusted; checked at
registration, catalog/guards.py) and the policy's under POLICY_COST_LIMIT
(checked at load, policy/schema.py), which bounds a call's conditions by
CALL_COST_BUDGET. The units are calibrated against measured CPU time
(bench/conditions_calibration.py; regex_cost.NS_PER_UNIT).

A condition reads only what ``CallFacts`` holds: the tool, the call's
validated arguments, the caller and the call's time. Evaluating fails closed:
an error (a missing field, a wrong type, the iteration budget) raises
``ConditionFailed`` and the caller of ``holds`` refuses the call.
"""

from __future__ import annotations

import enum
import functools
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from cel_expr_python import cel
from google.protobuf import any_pb2, descriptor_pb2, descriptor_pool, message_factory, struct_pb2
from google.protobuf.message import DecodeError, Message

from registry_server.policy.regex_cost import re2_cost

MAX_CONDITION_CHARS = 2_048  # characters of one expression
ARGUMENTS_BOUND = 1024 * 1024  # bytes: what a call's arguments can be (domain/arguments.py)
TOOL_BOUND = 16 * 1024  # bytes: a tool's name, level, categories, owner, digest and hosts
CALLER_BOUND = 16 * 1024  # bytes: a caller's id, roles, groups and claims (claims are capped)
MAX_CLAIMS_BYTES = 8 * 1024  # bytes of JSON claims a condition sees; larger claims are not shown
# Units of work (a node visited, a byte compared or copied; one unit is about
# regex_cost.NS_PER_UNIT = 0.5 ns of the calibration machine, measured by
# bench/conditions_cost.py) an expression may cost at worst: 64 passes over
# the largest arguments a call can carry (about 34 ms).
COST_LIMIT = 64 * ARGUMENTS_BOUND
# Units all the guards of one tool may cost together (its registrant's, not
# trusted: sixteen of them at the limit each would be 0.5 s a call): two
# expressions' worth, about 67 ms.
GUARDS_COST_LIMIT = 2 * COST_LIMIT
# Units all the policy's conditions may cost together (the operator's; an
# upper bound of what one call evaluates: every deny rule's and approval
# rule's `when`): eight expressions' worth, about 0.27 s.
POLICY_COST_LIMIT = 8 * COST_LIMIT
# Units the conditions one call evaluates may cost: its tool's guards and
# the policy's, each held under its own cap (about 0.34 s at worst, on
# arguments of 1 MiB; making the read arguments into CEL values comes on top,
# bounded by their size like parse_arguments).
CALL_COST_BUDGET = GUARDS_COST_LIMIT + POLICY_COST_LIMIT
_PACKAGE = "toolreg.conditions"
VARIABLES = ("args", "tool", "caller", "caller.claims", "now")  # what a condition may read


class Scope(enum.Enum):
    """Which variables an expression may read."""

    POLICY = "policy"  # tool, args, caller, now: approval and deny rules
    GUARD = "guard"  # args only: a tool's guard, written by its registrant


class ConditionError(ValueError):
    """An expression that does not compile, is not a bool, or costs too much
    (the message says where in the expression and why)."""


class ConditionFailed(Exception):
    """Evaluating a condition did not give true or false: the call must be
    refused (fail closed). ``detail`` is CEL's reason, without values."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


# ------------------------------------------------------------------ the variables


def _file() -> descriptor_pb2.FileDescriptorProto:
    """The message types conditions read (`tool.name`, `caller.groups`), so
    the checker knows every field and its type; plus a small copy of CEL's
    own syntax tree (cel/expr/syntax.proto) to read a checked expression
    back for its cost."""
    f = descriptor_pb2.FileDescriptorProto(
        name="toolreg_conditions.proto", package=_PACKAGE, syntax="proto3",
        dependency=["google/protobuf/struct.proto"],
    )  # fmt: skip
    T = descriptor_pb2.FieldDescriptorProto
    one, many = T.LABEL_OPTIONAL, T.LABEL_REPEATED

    def message(name: str, *fields: tuple[str, int, int, int, str]) -> None:
        m = f.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            added = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                added.type_name = type_name

    s, i64, b, msg = T.TYPE_STRING, T.TYPE_INT64, T.TYPE_BOOL, T.TYPE_MESSAGE
    message(
        "Tool", ("name", 1, s, one, ""), ("level", 2, s, one, ""), ("categories", 3, s, many, ""),
        ("owner", 4, s, one, ""), ("digest", 5, s, one, ""), ("egress_hosts", 6, s, many, ""),
    )  # fmt: skip
    message(
        "Caller", ("id", 1, s, one, ""), ("roles", 2, s, many, ""), ("groups", 3, s, many, ""),
        ("claims", 4, msg, one, ".google.protobuf.Struct"),
    )  # fmt: skip
    # cel.expr syntax, the fields the cost estimate needs (same numbers).
    e = f".{_PACKAGE}.Expr"
    message("Constant", ("string_value", 6, s, one, ""), ("bytes_value", 7, T.TYPE_BYTES, one, ""))
    message("Ident", ("name", 1, s, one, ""))
    message("Select", ("operand", 1, msg, one, e), ("field", 2, s, one, ""),
            ("test_only", 3, b, one, ""))  # fmt: skip
    message("Call", ("target", 1, msg, one, e), ("function", 2, s, one, ""),
            ("args", 3, msg, many, e))  # fmt: skip
    message("CreateList", ("elements", 1, msg, many, e))
    message("Entry", ("map_key", 3, msg, one, e), ("value", 4, msg, one, e))
    message("CreateStruct", ("entries", 2, msg, many, f".{_PACKAGE}.Entry"))
    message(
        "Comprehension", ("iter_var", 1, s, one, ""), ("iter_range", 2, msg, one, e),
        ("accu_var", 3, s, one, ""), ("accu_init", 4, msg, one, e),
        ("loop_condition", 5, msg, one, e), ("loop_step", 6, msg, one, e),
        ("result", 7, msg, one, e), ("iter_var2", 8, s, one, ""),
    )  # fmt: skip
    message(
        "Expr", ("id", 2, i64, one, ""), ("const_expr", 3, msg, one, f".{_PACKAGE}.Constant"),
        ("ident_expr", 4, msg, one, f".{_PACKAGE}.Ident"),
        ("select_expr", 5, msg, one, f".{_PACKAGE}.Select"),
        ("call_expr", 6, msg, one, f".{_PACKAGE}.Call"),
        ("list_expr", 7, msg, one, f".{_PACKAGE}.CreateList"),
        ("struct_expr", 8, msg, one, f".{_PACKAGE}.CreateStruct"),
        ("comprehension_expr", 9, msg, one, f".{_PACKAGE}.Comprehension"),
    )  # fmt: skip
    message("CheckedExpr", ("expr", 4, msg, one, e))
    return f


@functools.cache
def _pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    pool.Add(descriptor_pb2.FileDescriptorProto.FromString(
        struct_pb2.DESCRIPTOR.serialized_pb))  # fmt: skip
    pool.Add(_file())
    return pool


def _class(name: str) -> type[Message]:
    return message_factory.GetMessageClass(_pool().FindMessageTypeByName(f"{_PACKAGE}.{name}"))


@functools.cache
def _env(scope: Scope) -> Any:
    T = cel.Type
    variables: dict[str, Any] = {"args": T.Map(T.STRING, T.DYN)}
    if scope is Scope.POLICY:
        variables |= {
            "tool": T(f"{_PACKAGE}.Tool"), "caller": T(f"{_PACKAGE}.Caller"), "now": T.TIMESTAMP,
        }  # fmt: skip
    return cel.NewEnv(descriptor_pool=_pool(), variables=variables)


# ------------------------------------------------------------------ compiling

_CEL_POSITION = re.compile(r"<input>:(\d+):(\d+): ")
_BOUNDS = {"args": ARGUMENTS_BOUND, "tool": TOOL_BOUND, "caller": CALLER_BOUND, "now": 1}


@dataclass(frozen=True)
class Condition:
    """One compiled, checked expression (its text kept for messages)."""

    text: str
    scope: Scope
    cost: int  # the static worst case, in units of COST_LIMIT
    _program: Any = field(repr=False, compare=False)
    # What it reads: of "args", "tool", "caller", "caller.claims", "now"
    # (a call's facts are made into CEL values only as far as some condition reads them).
    reads: frozenset[str] = frozenset(VARIABLES)
    # The top-level fields of ``args`` it reads (`args.path`, `args["a b"]`);
    # None when it reads ``args`` whole (`size(args)`, `"k" in args`, a macro
    # over it): only those fields are made into CEL values for it.
    arg_fields: frozenset[str] | None = None

    def holds(self, facts: CallFacts) -> bool:
        """True or False; raises ConditionFailed when it is neither."""
        try:
            value = self._program.eval(facts.activation(self.reads, self.arg_fields))
        except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
            # cel-cpp's iteration budget, a value CEL cannot hold, and the like
            raise ConditionFailed(_plain(str(exc), self.text)) from None
        result = value.value()
        if result is True or result is False:
            return result
        raise ConditionFailed(_plain(str(result), self.text))


@functools.lru_cache(maxsize=1024)
def compile_condition(text: str, scope: Scope) -> Condition:
    """Compile, type-check and cost ``text``; raises ConditionError. Cached:
    a policy's reload, and every call's guards, compile what they compiled."""
    if not isinstance(text, str) or not text.strip():
        raise ConditionError("must be a non-empty CEL expression")
    if len(text) > MAX_CONDITION_CHARS:
        raise ConditionError(f"longer than {MAX_CONDITION_CHARS} characters")
    try:
        program = _env(scope).compile(text)
    except RuntimeError as exc:
        raise ConditionError(_compile_message(str(exc))) from None
    returns = program.return_type()
    if returns != cel.Type.BOOL:
        raise ConditionError(f"must be a bool, not {returns.name().lower()}")
    syntax = _syntax(program)
    cost = estimate_cost(syntax)
    if cost > COST_LIMIT:
        raise ConditionError(
            f"may cost up to {cost:,} units at worst, over the limit of {COST_LIMIT:,}"
            " (a loop inside a loop, map() or filter() over the arguments, a loop whose"
            " body reads or builds whole strings of the arguments, contains() of a"
            " needle from the call, or a regex RE2 cannot run in one pass, like"
            " a.{0,30}b; compare with startsWith or ==, use exists() or all(), or test"
            " a smaller part)"
        )
    return Condition(text, scope, cost, program, _reads(syntax), _arg_fields(syntax))


def total_cost(conditions: Iterable[Condition | None]) -> int:
    """What evaluating all of ``conditions`` for one call may cost at worst."""
    return sum(c.cost for c in conditions if c is not None)


def fields_read(conditions: Iterable[Condition | None]) -> frozenset[str] | None:
    """The top-level argument fields any of ``conditions`` reads; None when
    one reads ``args`` whole."""
    fields: set[str] = set()
    for c in conditions:
        if c is None or "args" not in c.reads:
            continue
        if c.arg_fields is None:
            return None
        fields |= c.arg_fields
    return frozenset(fields)


def _compile_message(raw: str) -> str:
    """CEL's checker message, one line: "line 1, column 11: undeclared ..."."""
    body = raw.removeprefix("INVALID_ARGUMENT: ").removeprefix("ERROR: ")
    first = (body.splitlines()[0] if body else raw).replace(" (in container '')", "")
    found = _CEL_POSITION.search(first)
    if found is None:
        return first.strip()
    line, column = found.groups()
    return f"line {line}, column {column}: {first[found.end() :].strip()}"


_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


def _plain(raw: str, expression: str) -> str:
    """CEL's runtime reason without its status prefix or the `[CODE]` suffix,
    and with every quoted value that is not text of the expression itself
    left out: CEL quotes the call's values ("Integer value '...' out of
    range"), and the call's arguments never reach an error, an audit row or
    a log line that way."""
    text = re.sub(r"^[A-Z_]+: ", "", raw.strip())
    text = re.sub(r"\s*\[[A-Z_]+\]$", "", text).splitlines()[0] if text else "error"
    if " for '" in text and " -> " in text:
        # cel-expr-python converting a value of the call: "Integer value '...'
        # out of range for 'args['key'] -> value'." The key is the caller's
        # and may hold quotes, so no quoting rule can keep the value out.
        what = "an integer beyond 64 bits" if text.startswith("Integer value") else "a value"
        return f"{what} in the arguments, which CEL cannot hold"
    text = _QUOTED.sub(lambda m: m[0] if m[0][1:-1] in expression else "'…'", text)
    return text[:300]


def _syntax(program: Any) -> Message:
    wrapped = any_pb2.Any.FromString(program.serialize())
    try:
        return _class("CheckedExpr").FromString(wrapped.value).expr  # type: ignore[attr-defined,no-any-return]
    except DecodeError as exc:  # pragma: no cover - the runtime's own output
        raise ConditionError(f"cannot read the checked expression back: {exc}") from None


def _reads(expr: Any) -> frozenset[str]:
    """The variables ``expr`` reads, and "caller.claims" when it reads the
    caller's claims (or the caller whole)."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        kind = _kind(node)
        if kind == "ident_expr":
            name = node.ident_expr.name
            if name in VARIABLES:
                found.add(name)
            if name == "caller":
                found.add("caller.claims")  # the caller whole: every field of it
            return
        if kind == "select_expr":
            operand = node.select_expr.operand
            if _kind(operand) == "ident_expr" and operand.ident_expr.name == "caller":
                found.add("caller")
                if node.select_expr.field == "claims":
                    found.add("caller.claims")
                return
        for child in _children(node, kind):
            walk(child)

    walk(expr)
    return frozenset(found)


def _arg_fields(expr: Any) -> frozenset[str] | None:
    """The top-level fields of ``args`` that ``expr`` selects (`args.x`,
    `has(args.x)`, `args["x"]`), or None when it uses ``args`` any other way:
    then the whole arguments must be there for it."""
    fields: set[str] = set()
    whole = False

    def is_args(node: Any) -> bool:
        return _kind(node) == "ident_expr" and node.ident_expr.name == "args"

    def walk(node: Any) -> None:
        nonlocal whole
        kind = _kind(node)
        if kind == "ident_expr":
            whole = whole or node.ident_expr.name == "args"
            return
        if kind == "select_expr" and is_args(node.select_expr.operand):
            fields.add(node.select_expr.field)
            return
        if kind == "call_expr":
            call = node.call_expr
            if (
                call.function == "_[_]" and not call.HasField("target") and len(call.args) == 2
                and is_args(call.args[0]) and _kind(call.args[1]) == "const_expr"
                and call.args[1].const_expr.string_value  # (a key of no other kind type-checks)
            ):  # fmt: skip
                fields.add(call.args[1].const_expr.string_value)
                return
        for child in _children(node, kind):
            walk(child)

    walk(expr)
    return None if whole else frozenset(fields)


def _children(node: Any, kind: str | None) -> list[Any]:
    if kind == "select_expr":
        return [node.select_expr.operand]
    if kind == "call_expr":
        call = node.call_expr
        return ([call.target] if call.HasField("target") else []) + list(call.args)
    if kind == "list_expr":
        return list(node.list_expr.elements)
    if kind == "struct_expr":
        return [p for e in node.struct_expr.entries for p in (e.map_key, e.value)]
    if kind == "comprehension_expr":
        c = node.comprehension_expr
        return [c.iter_range, c.accu_init, c.loop_condition, c.loop_step, c.result]
    return []


# ------------------------------------------------------------------ the cost estimate

# Functions whose answer is a bool or a number (size 1 whatever they read).
_SMALL = frozenset({
    "_==_", "_!=_", "_<_", "_<=_", "_>_", "_>=_", "_&&_", "_||_", "!_", "@in", "size",
    "contains", "startsWith", "endsWith", "matches", "@not_strictly_false", "int", "uint",
    "double", "bool", "timestamp", "duration", "_-_", "_*_", "_/_", "_%_", "-_",
    "getFullYear", "getMonth", "getDayOfYear", "getDayOfMonth", "getDate", "getDayOfWeek",
    "getHours", "getMinutes", "getSeconds", "getMilliseconds", "type",
})  # fmt: skip
# Functions that read nothing but their operands' flags (short-circuit logic).
_FREE = frozenset({"_&&_", "_||_", "!_", "@not_strictly_false", "_?_:_"})


def estimate_cost(expr: Message) -> int:
    """The most work ``expr`` can do, given the largest values its variables
    can hold. Sizes and costs are upper bounds; a loop's body is counted once
    per element with its element empty, and once with the whole range as its
    element (the elements' sizes add up to at most the range's)."""
    return _estimate(expr, dict(_BOUNDS))[1] + _EVALUATION_UNITS


_KINDS = ("const_expr", "ident_expr", "select_expr", "call_expr", "list_expr", "struct_expr",
          "comprehension_expr")  # fmt: skip


def _kind(expr: Any) -> str | None:
    return next((k for k in _KINDS if expr.HasField(k)), None)


def _estimate(expr: Any, sizes: dict[str, int]) -> tuple[int, int]:
    """(largest size of the value, most work) of one node."""
    kind = _kind(expr)
    if kind == "const_expr":
        c = expr.const_expr
        return max(1, len(c.string_value.encode()), len(c.bytes_value)), 1  # bytes, as texts
    if kind == "ident_expr":
        return sizes.get(expr.ident_expr.name, 1), 1
    if kind == "select_expr":
        size, cost = _estimate(expr.select_expr.operand, sizes)
        return size, cost + 1
    if kind == "list_expr":
        parts = [_estimate(e, sizes) for e in expr.list_expr.elements]
        return sum(s for s, _ in parts) + len(parts), sum(c for _, c in parts) + 1
    if kind == "struct_expr":
        parts = [_estimate(p, sizes) for en in expr.struct_expr.entries
                 for p in (en.map_key, en.value)]  # fmt: skip
        return sum(s for s, _ in parts) + len(parts), sum(c for _, c in parts) + 1
    if kind == "call_expr":
        return _estimate_call(expr.call_expr, sizes)
    if kind == "comprehension_expr":
        return _estimate_loop(expr.comprehension_expr, sizes)
    return 1, 1


def _estimate_call(call: Any, sizes: dict[str, int]) -> tuple[int, int]:
    operands = ([call.target] if call.HasField("target") else []) + list(call.args)
    parts = [_estimate(o, sizes) for o in operands]
    cost = 1 + sum(c for _, c in parts)
    read = sum(s for s, _ in parts)
    name = call.function
    if name not in _FREE:
        cost += read  # a scan, a comparison, a copy: linear in what it reads
    if name == "matches":
        if not operands or _kind(operands[-1]) != "const_expr":
            # A pattern from the call would be the caller's to choose.
            raise ConditionError("matches(): the pattern must be a string literal")
        pattern = operands[-1].const_expr.string_value
        problem = _re2_problem(pattern)
        if problem is not None:
            # Else every call it is evaluated for would err: found at load.
            raise ConditionError(f"matches(): the pattern is not valid RE2: {problem}")
        # RE2: compiling the pattern (at every evaluation), a pass with its
        # DFA priced by the program's size, and its NFA's work when the DFA
        # would not fit its cache (policy/regex_cost.py).
        cost += re2_cost(pattern, parts[0][0])
    if name == "contains" and len(parts) == 2:
        text, needle = parts[0][0], parts[1][0]
        last = operands[-1]
        single = _kind(last) == "const_expr" and len(last.const_expr.string_value.encode()) == 1
        if not single:
            # A substring search stops at each place the needle's first byte
            # occurs and compares the rest there: the text chosen to be that
            # byte over and over, every place costs (measured up to 4.4 ns a
            # byte of 1 MiB, "ab" in "aaa..."), and a long needle compares
            # more of itself (text x needle / _COMPARED_AT_ONCE).
            cost += text * _CONTAINS_UNITS + text * needle // _COMPARED_AT_ONCE
    if name == "size" and parts:
        # A string's size counts its code points (UTF-8 decoded: 0.66 ns a byte).
        cost += parts[0][0] * _DECODE_UNITS
    if name == "_+_":
        cost += read * _COPY_UNITS  # the joined string or list is a new copy
    if name in ("_==_", "_!=_") and len(parts) == 2:
        # Lists and maps compare element by element, as many as the smaller
        # holds (measured up to 11 ns a byte of 1 MiB: equal lists of ints);
        # strings of unequal length compare at once, equal ones by memcmp.
        cost += min(parts[0][0], parts[1][0]) // 2 * _EQUAL_ELEMENT_UNITS
    if name == "@in" and len(parts) == 2:
        # `x in list` compares x with each element (a map looks it up, but
        # the checker leaves `args.x` dyn): as many as 2 bytes of JSON hold.
        cost += parts[1][0] // 2 * _ELEMENT_UNITS
    if name in _SMALL:
        return 1, cost
    if name == "_?_:_":
        return max(s for s, _ in parts[1:]), cost
    if name == "_[_]" and parts:
        return parts[0][0], cost
    return max(1, read), cost  # "_+_", string(), dyn(), ...: as large as its inputs


def _estimate_loop(loop: Any, sizes: dict[str, int]) -> tuple[int, int]:
    range_size, range_cost = _estimate(loop.iter_range, sizes)
    which = _kind(loop.iter_range)
    if which == "list_expr":
        count = len(loop.iter_range.list_expr.elements)
    elif which == "struct_expr":
        count = len(loop.iter_range.struct_expr.entries)
    else:
        count = range_size // 2  # every element takes two bytes at least ("1,")
    init_size, init_cost = _estimate(loop.accu_init, sizes)

    def body(element: int) -> tuple[int, int]:
        inner = dict(sizes)
        for name in (loop.iter_var, loop.iter_var2):
            if name:
                inner[name] = element
        inner[loop.accu_var] = 0  # the accumulator's growth is counted below
        condition = _estimate(loop.loop_condition, inner)
        step = _estimate(loop.loop_step, inner)
        return step[0], condition[1] + step[1]

    empty_size, empty_cost = body(0)
    whole_size, whole_cost = body(range_size)
    accumulated = init_size + count * empty_size + (whole_size - empty_size)
    work = range_cost + init_cost + count * empty_cost + (whole_cost - empty_cost)
    if _kind(loop.accu_init) == "list_expr":
        # map() and filter(): each step appends to the list built so far,
        # which cel-cpp copies: up to its final size at every step.
        work += count * accumulated
    after = dict(sizes)
    after[loop.accu_var] = accumulated
    result_size, result_cost = _estimate(loop.result, after)
    return result_size, work + result_cost


_COMPARED_AT_ONCE = 4  # bytes a substring search compares for a unit (memcmp, measured)
_CONTAINS_UNITS = 16  # units a byte of text costs contains() with a needle of 2+ bytes (8 ns)
_DECODE_UNITS = 2  # units a byte costs size() of a string beyond reading it (1 ns)
_COPY_UNITS = 2  # units a byte costs to copy into a new string or list (1 ns)
_ELEMENT_UNITS = 16  # units `in` costs an element of a list it compares with (8 ns)
_EQUAL_ELEMENT_UNITS = 64  # units == costs an element of two lists or maps (32 ns)
_EVALUATION_UNITS = 20_000  # units any evaluation costs, whatever it reads (3-9 us measured)


@functools.cache
def _re2_probe() -> Any:
    return _env(Scope.GUARD).compile('"".matches(args.p)')


@functools.lru_cache(maxsize=256)
def _re2_problem(pattern: str) -> str | None:
    """Why cel-cpp's RE2 refuses ``pattern`` (a backreference, a lookaround,
    a repeat over 1,000, a parenthesis left open), or None."""
    value = _re2_probe().eval(_env(Scope.GUARD).Activation({"args": {"p": pattern}}))
    if value.type() != cel.Type.ERROR:
        return None
    return _plain(str(value.value()), pattern).removeprefix("invalid regular expression: ")


# ------------------------------------------------------------------ the facts of one call


@dataclass(frozen=True)
class ToolFacts:
    name: str
    level: str
    categories: tuple[str, ...] = ()
    owner: str = ""
    digest: str = ""
    egress_hosts: tuple[str, ...] = ()


@dataclass(frozen=True)
class CallerFacts:
    id: str
    roles: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    claims: Mapping[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class CallFacts:
    """What conditions may read about one call. Made into CEL values once per
    call, shared by every condition evaluated for it (guards' and the
    policy's), and only as far as they read: ``reads`` names what the
    conditions that may run read (policy.reads), ``arg_fields`` the top-level
    arguments they read (None: all of them), and a condition reading more
    makes them again. Making 1 MiB of arguments into CEL values costs tens of
    ms; a field no condition reads costs nothing."""

    args: Mapping[str, Any]
    tool: ToolFacts | None = None
    caller: CallerFacts | None = None
    now: datetime | None = None
    reads: frozenset[str] = frozenset(VARIABLES)
    arg_fields: frozenset[str] | None = None
    _activation: Any = field(default=None, repr=False)
    _made_for: frozenset[str] = field(default=frozenset(), repr=False)
    _fields_made: frozenset[str] | None = field(default=frozenset(), repr=False)

    def activation(self, reads: frozenset[str], arg_fields: frozenset[str] | None = None) -> Any:
        made = self._fields_made
        fields_covered = made is None or (arg_fields is not None and arg_fields <= made)
        if self._activation is None or not reads <= self._made_for or not fields_covered:
            self._made_for = self._made_for | reads | self.reads
            if made is None or arg_fields is None or self.arg_fields is None:
                self._fields_made = None
            else:
                self._fields_made = made | arg_fields | self.arg_fields
            self._activation = _env(Scope.POLICY).Activation(
                self._data(self._made_for, self._fields_made)
            )
        return self._activation

    def _data(
        self, reads: frozenset[str], arg_fields: frozenset[str] | None = None
    ) -> dict[str, Any]:
        if arg_fields is None:
            args = dict(self.args)
        else:  # a field absent from the call stays absent: `has()` and errors alike
            args = {k: self.args[k] for k in arg_fields if k in self.args}
        data: dict[str, Any] = {"args": args}
        if "tool" in reads:
            data["tool"] = _tool_message(self.tool or ToolFacts("", ""))
        if "caller" in reads or "caller.claims" in reads:
            caller = self.caller or CallerFacts("")
            claims = ""
            if "caller.claims" in reads and caller.claims:
                claims = json.dumps(caller.claims, sort_keys=True, default=str)
                claims = claims if len(claims) <= MAX_CLAIMS_BYTES else ""
            data["caller"] = _caller_message(caller.id, caller.roles, caller.groups, claims)
        if self.now is not None and "now" in reads:
            data["now"] = self.now
        return data


# Calls of one tool, and of one caller, read the same messages: made once
# (the cache holds at most some MiB: claims are capped at MAX_CLAIMS_BYTES).
@functools.lru_cache(maxsize=1024)
def _tool_message(tool: ToolFacts) -> Message:
    return _class("Tool")(
        name=tool.name, level=tool.level, categories=list(tool.categories), owner=tool.owner,
        digest=tool.digest, egress_hosts=list(tool.egress_hosts),
    )  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _caller_message(
    caller_id: str, roles: tuple[str, ...], groups: tuple[str, ...], claims_json: str
) -> Message:
    claims = struct_pb2.Struct()
    if claims_json:
        claims.update(json.loads(claims_json))
    return _class("Caller")(id=caller_id, roles=list(roles), groups=list(groups), claims=claims)


def first_failing(conditions: Sequence[tuple[Condition, str]], facts: CallFacts) -> str | None:
    """The message of the first ``(condition, message)`` that does not hold
    (a guard), or None when all hold. An error counts as not holding."""
    for condition, message in conditions:
        try:
            if not condition.holds(facts):
                return message
        except ConditionFailed as failed:
            return f"{message} (the check could not be evaluated: {failed.detail})"
    return None
