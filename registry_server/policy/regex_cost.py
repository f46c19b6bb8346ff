r"""What RE2 does with a pattern, for the cost of a condition's `matches()`
(policy/conditions.py): worked out from the pattern at load, never by
running it.
RE2 searches with a DFA it builds as it reads: a state for each set of the
pattern's positions alive at once. While their number stays small the
search is one pass of the text; when it outgrows RE2's cache (a position
that can be alive or not within a window: `a.{0,30}b`, `[ab]*a[ab]{14}c`),
RE2 falls back to its NFA, which steps every alive position at every byte
(measured: 0.5 s and 1.3 s over 1 MiB, for patterns that look harmless).
So the same automaton is built here, from the pattern's positions
(Glushkov's construction), up to DFA_STATES_CAP states: within it, the
pattern costs a pass and the states RE2 builds (cel-expr-python compiles
the pattern again at each evaluation, so at each call); beyond it, the
NFA's text x positions x NFA_UNITS as well.

The positions are code points, but RE2 runs over UTF-8 bytes: a Unicode
class (`\p{L}`: 1,201 instructions) or a case-folded one is a tree of byte
ranges, and both its DFA's states and its NFA's threads are made of those
instructions. So RE2's own program size (google-re2 compiles the pattern
here, as cel-cpp's RE2 does) prices what the positions cannot: compiling it
at each evaluation, and every byte of text a share of it (measured, on
1 MiB: `[\p{L}]{0,7}b` 5.5 ms to compile and 7 ms to scan; `\p{L}{0,30}b`
0.1 s to compile and 2-3 s to scan, where RE2's DFA gives up).

Units: one unit stands for about NS_PER_UNIT of the calibration machine's
time (bench/conditions_cost.py measures every kind of call against its
estimate: docs/how-to/writing-tools.md, "Guards").
"""

from __future__ import annotations

import functools
import operator
import re
from typing import Any

import re2

DFA_STATES_CAP = 1_000  # DFA states a pattern may need (RE2 caches some 10,000)
DFA_STATE_UNITS = 6_000  # units a DFA state costs RE2 to build (some 3 us, measured)
MAX_POSITIONS = 2_048  # positions (characters and classes, repeats expanded) analysed at all
NFA_UNITS = 8  # units a position and a byte cost RE2's NFA (some 4 ns; a unit is ~0.5 ns)
NS_PER_UNIT = 0.5  # ns of the calibration machine's time a unit stands for (bench: conditions)
PASS_UNITS = 3  # units a byte costs RE2's DFA with a small program (measured 1.2-1.4 ns)
COMPILE_UNITS = 6_000  # units an instruction of the program costs to compile (up to 2.8 us)
# Units a byte costs per 1,000 instructions of the program: its DFA's states
# and NFA's threads are byte ranges of them (measured, CPU time: up to 0.001
# ns an instruction and a byte while the program is small, `[\p{L}]{0,7}`
# 8,385 instructions 7.3 ns a byte; 0.082 ns beyond, where RE2's DFA runs
# out of memory and its NFA steps them all: `\p{L}{0,30}` 2-3 us a byte).
INSTRUCTION_MILLIUNITS = 8  # 0.004 ns, up to LARGE_PROGRAM instructions
LARGE_PROGRAM = 16_384  # instructions beyond which RE2's DFA does not keep up (cliff: ~20,000)
LARGE_INSTRUCTION_MILLIUNITS = 200  # 0.1 ns an instruction and a byte, beyond LARGE_PROGRAM
UNKNOWN_PROGRAM = 1 << 20  # instructions assumed of a pattern google-re2 does not compile
_REPEAT = re.compile(r"\{(\d+)(?:(,)(\d*))?\}")
_MAX_CHAR = 0x10FFFF
Ranges = tuple[tuple[int, int], ...]  # code points, sorted and disjoint
_ANY: Ranges = ((0, _MAX_CHAR),)
_DIGIT: Ranges = ((48, 57),)
_ALPHA: Ranges = ((65, 90), (97, 122))
_WORD: Ranges = ((48, 57), (65, 90), (95, 95), (97, 122))
_CLASSES = {"d": _DIGIT, "w": _WORD, "s": ((9, 10), (12, 13), (32, 32))}
_UNICODE: Ranges = ((48, 57), (65, 90), (97, 122), (0x80, _MAX_CHAR))  # \pL, \p{Greek}: roughly
_POSIX = {
    "alpha": _ALPHA, "digit": _DIGIT, "alnum": ((48, 57), *_ALPHA), "word": _WORD,
    "upper": ((65, 90),), "lower": ((97, 122),), "space": ((9, 13), (32, 32)),
    "xdigit": ((48, 57), (65, 70), (97, 102)),
}  # fmt: skip
_CONTROLS = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7}
_EMPTY: tuple[Any, ...] = ("cat", ())


def _union(*sets: Ranges) -> Ranges:
    merged: list[tuple[int, int]] = []
    for low, high in sorted(r for s in sets for r in s):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return tuple(merged)


def _negate(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for low, high in _union(ranges):
        if low > start:
            out.append((start, low - 1))
        start = high + 1
    if start <= _MAX_CHAR:
        out.append((start, _MAX_CHAR))
    return tuple(out)


def _fold(ranges: Ranges) -> Ranges:
    """(?i): an ASCII letter matches in both cases."""
    extra = [
        (max(low, a) + shift, min(high, b) + shift)
        for low, high in ranges
        for a, b, shift in ((65, 90, 32), (97, 122, -32))
        if low <= b and high >= a
    ]
    return _union(ranges, tuple(extra))


class _Pattern:
    """RE2's syntax read into ("set", ranges), ("cat", parts), ("alt",
    branches), ("rep", part, low, high or None); anchors and word boundaries
    match nothing (empty), so the positions alive are, if anything, more."""

    def __init__(self, pattern: str) -> None:
        self.text, self.i, self.fold = pattern, 0, False

    def peek(self) -> str:
        return self.text[self.i : self.i + 1]

    def alternation(self) -> tuple[Any, ...]:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", tuple(branches))

    def sequence(self) -> tuple[Any, ...]:
        parts = []
        while self.i < len(self.text) and self.peek() not in "|)":
            parts.append(self.repeated(self.atom()))
        return ("cat", tuple(parts))

    def repeated(self, atom: tuple[Any, ...]) -> tuple[Any, ...]:
        while True:
            c = self.peek()
            if c and c in "*+?":
                self.i += 1
                atom = ("rep", atom, 1 if c == "+" else 0, 1 if c == "?" else None)
            elif c == "{" and (found := _REPEAT.match(self.text, self.i)):
                low, comma, high = found.groups()
                most = int(high) if high else None if comma else int(low)
                atom, self.i = ("rep", atom, int(low), most), found.end()
            else:
                return atom
            if self.peek() == "?":  # lazy: the same language
                self.i += 1

    def atom(self) -> tuple[Any, ...]:
        c = self.text[self.i]
        self.i += 1
        if c == "(":
            return self.group()
        if c == "[":
            return self.chars(self.char_class())
        if c == ".":
            return ("set", _ANY)
        if c in "^$":
            return _EMPTY
        if c == "\\":
            return self.escape()
        return self.chars(((ord(c), ord(c)),))

    def chars(self, ranges: Ranges) -> tuple[Any, ...]:
        return ("set", _fold(ranges) if self.fold else ranges)

    def group(self) -> tuple[Any, ...]:
        saved = self.fold
        if self.peek() == "?":
            if self.text.startswith(("?P<", "?<"), self.i):
                self.i = self.text.index(">", self.i) + 1
            else:  # flags: (?i) for the rest of the group, (?i:...) for its own
                end = self.i
                while self.text[end] not in ":)":
                    end += 1
                on, _, off = self.text[self.i + 1 : end].partition("-")
                self.fold = "i" in on or (self.fold and "i" not in off)
                self.i = end + 1
                if self.text[end] == ")":
                    return _EMPTY
        inner = self.alternation()
        self.i += 1  # its )
        self.fold = saved
        return inner

    def escape(self) -> tuple[Any, ...]:
        c = self.text[self.i]
        self.i += 1
        if c == "Q":  # a literal run, to \E
            end = self.text.find("\\E", self.i)
            end = len(self.text) if end < 0 else end
            run = self.text[self.i : end]
            self.i = min(len(self.text), end + 2)
            return ("cat", tuple(self.chars(((ord(x), ord(x)),)) for x in run))
        if c in "bBAz":
            return _EMPTY
        return self.chars(self.escaped(c))

    def escaped(self, c: str) -> Ranges:
        """The characters of the escape whose backslash and ``c`` were read."""
        if c.lower() in _CLASSES:
            return _negate(_CLASSES[c.lower()]) if c.isupper() else _CLASSES[c.lower()]
        if c in "pP":
            self.i = self.text.index("}", self.i) + 1 if self.peek() == "{" else self.i + 1
            return _UNICODE if c == "p" else _ANY
        if c == "C":
            return _ANY
        if c == "x":
            if self.peek() == "{":
                end = self.text.index("}", self.i)
                code, self.i = int(self.text[self.i + 1 : end], 16), end + 1
            else:
                code, self.i = int(self.text[self.i : self.i + 2], 16), self.i + 2
            return ((code, code),)
        if c in "01234567":
            digits = c
            while len(digits) < 3 and self.peek() and self.peek() in "01234567":
                digits += self.text[self.i]
                self.i += 1
            return ((int(digits, 8), int(digits, 8)),)
        code = _CONTROLS.get(c, ord(c))
        return ((code, code),)

    def char_class(self) -> Ranges:
        negated = self.peek() == "^"
        self.i += negated
        parts: list[Ranges] = []
        first = True
        while self.i < len(self.text) and (first or self.peek() != "]"):
            first = False
            if self.text.startswith("[:", self.i) and (end := self.text.find(":]", self.i)) > 0:
                name = self.text[self.i + 2 : end]
                parts.append(_POSIX.get(name, ((0, 127),)) if name[:1] != "^" else _ANY)
                self.i = end + 2
                continue
            low = self.class_char(parts)
            if low is None:
                continue
            if self.peek() == "-" and self.text[self.i + 1 : self.i + 2] not in ("]", ""):
                self.i += 1
                high = self.class_char(parts)
                parts.append(((low, low if high is None else high),))
            else:
                parts.append(((low, low),))
        self.i += 1  # its ]
        ranges = _union(*parts)
        return _negate(ranges) if negated else ranges

    def class_char(self, parts: list[Ranges]) -> int | None:
        """One character of a class, or None for a class within it (\\d)."""
        c = self.text[self.i]
        self.i += 1
        if c != "\\":
            return ord(c)
        c = self.text[self.i]
        self.i += 1
        ranges = self.escaped(c)
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            return ranges[0][0]
        parts.append(ranges)
        return None


class _TooLarge(Exception):
    pass


class _Positions:
    """Glushkov's automaton: each character or class of the pattern (its
    repeats expanded, as RE2 does) a position; which can follow which."""

    def __init__(self) -> None:
        self.sets: list[Ranges] = []
        self.follow: list[int] = []  # a bit set of positions, for each position

    def build(self, node: tuple[Any, ...]) -> tuple[bool, int, int]:
        """(matches empty, its first positions, its last positions)."""
        if node[0] == "set":
            if len(self.sets) >= MAX_POSITIONS:
                raise _TooLarge
            self.sets.append(node[1])
            self.follow.append(0)
            bit = 1 << (len(self.sets) - 1)
            return False, bit, bit
        if node[0] == "alt":
            built = [self.build(branch) for branch in node[1]]
            return (
                any(b[0] for b in built),
                functools.reduce(operator.or_, (b[1] for b in built), 0),
                functools.reduce(operator.or_, (b[2] for b in built), 0),
            )
        if node[0] == "cat":
            return self.sequence([self.build(part) for part in node[1]])
        # As RE2 compiles them: x{2,} is xx+, x{2,4} is xx(x(x)?)? (a copy
        # reached only through the one before: the positions say how far).
        _, inner, low, high = node
        copies = [self.build(inner) for _ in range(low - 1 if high is None and low else low)]
        if high is None:  # a loop: its last positions lead back to its first
            empty, first, last = self.build(inner)
            self.link(last, first)
            copies.append((empty or not low, first, last))
        elif high > low:
            tail = [self.build(inner) for _ in range(high - low)]
            _, first, _ = self.sequence(tail)
            copies.append((True, first, functools.reduce(operator.or_, (t[2] for t in tail), 0)))
        return self.sequence(copies)

    def sequence(self, parts: list[tuple[bool, int, int]]) -> tuple[bool, int, int]:
        empty, first, last = True, 0, 0
        for part_empty, part_first, part_last in parts:
            self.link(last, part_first)
            first |= part_first if empty else 0
            last = part_last | (last if part_empty else 0)
            empty = empty and part_empty
        return empty, first, last

    def link(self, last: int, first: int) -> None:
        while last:
            bit = last & -last
            self.follow[bit.bit_length() - 1] |= first
            last ^= bit

    def dfa_states(self, first: int, cap: int) -> int:
        """The states of the DFA of an unanchored search (a match may start
        at every byte), counted up to just over ``cap``."""
        by_set: dict[Ranges, int] = {}
        for p, ranges in enumerate(self.sets):
            by_set[ranges] = by_set.get(ranges, 0) | 1 << p
        bounds = sorted(
            {0, *(r[0] for s in by_set for r in s), *(r[1] + 1 for s in by_set for r in s)}
        )
        symbols = {
            functools.reduce(
                operator.or_,
                (bits for ranges, bits in by_set.items() if any(a <= c <= b for a, b in ranges)),
                0,
            )
            for c in bounds
            if c <= _MAX_CHAR
        } - {0}
        seen, todo = {0}, [0]
        while todo:
            state = todo.pop()
            reach = first
            while state:
                bit = state & -state
                reach |= self.follow[bit.bit_length() - 1]
                state ^= bit
            for symbol in symbols:
                step = reach & symbol
                if step not in seen:
                    seen.add(step)
                    todo.append(step)
                    if len(seen) > cap:
                        return len(seen)
        return len(seen)


@functools.lru_cache(maxsize=256)
def _re2_automaton(pattern: str) -> tuple[int, int]:
    """(positions, DFA states up to just over DFA_STATES_CAP) of a pattern RE2
    compiles; (MAX_POSITIONS + 1, DFA_STATES_CAP + 1) when too large to tell."""
    positions = _Positions()
    try:
        parsed = _Pattern(pattern).alternation()
        _, first, _ = positions.build(parsed)
    except (_TooLarge, ValueError, IndexError, RecursionError):  # groups 300 deep, say
        return MAX_POSITIONS + 1, DFA_STATES_CAP + 1
    return len(positions.sets), positions.dfa_states(first, DFA_STATES_CAP)


def _re2_size(pattern: str) -> int:
    """The positions of ``pattern``: its characters and classes, repeats expanded."""
    return _re2_automaton(pattern)[0]


@functools.lru_cache(maxsize=256)
def re2_program_size(pattern: str) -> int:
    """RE2's instructions for ``pattern`` (UTF-8, as cel-cpp compiles it);
    UNKNOWN_PROGRAM when google-re2 does not compile it (priced as the
    largest, never as free)."""
    options = re2.Options()
    options.log_errors = False
    try:
        return int(re2.compile(pattern, options).programsize)
    except (re2.error, ValueError, TypeError):
        return UNKNOWN_PROGRAM


def re2_cost(pattern: str, text: int) -> int:
    """What RE2 costs to compile ``pattern`` and search ``text`` bytes with
    it: compiling its program (at every evaluation), a pass of the DFA whose
    every byte costs a share of the program (Unicode classes and case folding
    are large programs), the DFA states it builds (at most one a byte), and
    when they would not fit RE2's cache, its NFA's work too, every position
    at every byte."""
    positions, states = _re2_automaton(pattern)
    program = re2_program_size(pattern)
    per_thousand = (
        INSTRUCTION_MILLIUNITS if program <= LARGE_PROGRAM else LARGE_INSTRUCTION_MILLIUNITS
    )
    cost = program * COMPILE_UNITS + text * PASS_UNITS
    cost += -(-text * program * per_thousand // 1000)  # rounded up
    cost += min(states, text) * DFA_STATE_UNITS
    if states > DFA_STATES_CAP and text > DFA_STATES_CAP:
        cost += text * positions * NFA_UNITS
    return cost
