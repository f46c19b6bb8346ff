"""How many wrong sign-ins the console hears out, and how many refusals it
logs one by one: pure logic over a clock, bounded in memory.

``SignInThrottle``: a sign-in whose token matches no client is a failure.
Failures are counted per source address and overall, in fixed windows that
begin at a window's first failure. A source with MAX_FAILURES_PER_SOURCE
failures in its window, or every source once MAX_FAILURES_OVERALL failed in
the overall window, is refused (429, ``Retry-After``) until that window
ends: before its token is even looked at, so the right token is refused
too. A refused attempt is not a failure (it tells the guesser nothing), so
one source's flood never locks the others out; only failures from many
sources, past the overall limit, do. The per-source table holds at most
MAX_SOURCES sources: a window that ended is forgotten first, then the one
that began first (with the overall limit below MAX_SOURCES, forgetting a
source whose window is live takes more failures than a window allows).

``LogBudget``: refusals of one kind (a refused sign-in, a Host/Origin
refusal, a CSRF refusal) are logged one by one up to LOG_LINES_PER_WINDOW
per LOG_WINDOW_S; beyond, they are counted, by reason and by source (at
most MAX_SUMMARY_SOURCES sources named, the rest as "others"), and summed
up in one line when the window ends. A flood costs a bounded number of lines.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_FAILURES_PER_SOURCE = 10  # failed sign-ins per source per window; then 429 until it ends
MAX_FAILURES_OVERALL = 100  # failed sign-ins from all sources together per window; then 429 for all
DEFAULT_WINDOW_S = 300.0  # seconds a throttle window lasts, from its first failure
MIN_WINDOW_S = 1.0  # seconds: the shortest window the console accepts
MAX_WINDOW_S = 3_600.0  # seconds: the longest window the console accepts
MAX_SOURCES = 1_024  # source addresses tracked at once (each a few hundred bytes)
IPV6_SOURCE_PREFIX = 64  # bits: an IPv6 source is its /64 (one host often holds the whole /64)
LOG_LINES_PER_WINDOW = 20  # refusal lines of one kind logged one by one per log window
LOG_WINDOW_S = 60.0  # seconds of a log window; its refusals beyond the lines are summed up
MAX_SUMMARY_SOURCES = 5  # sources a summary names; the rest are counted as "others"

PER_SOURCE, OVERALL = "source", "overall"  # which limit a throttled sign-in hit


@dataclass(frozen=True)
class Throttled:
    limit: str  # PER_SOURCE or OVERALL
    retry_after_s: int  # whole seconds until the window ends (at least 1)


@dataclass
class _Window:
    started: float
    failures: int = 0


def source_key(address: str) -> str:
    """The key a source is counted under: its IPv4 address, its IPv6 /64,
    or the text as given when it is no address."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address[:64]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, IPV6_SOURCE_PREFIX), strict=False))
    return str(ip)


class SignInThrottle:
    def __init__(
        self,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        per_source: int = MAX_FAILURES_PER_SOURCE,
        overall: int = MAX_FAILURES_OVERALL,
        max_sources: int = MAX_SOURCES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0 or per_source < 1 or overall < 1 or max_sources < 1:
            raise ValueError("the throttle's window and limits must be positive")
        self.window_s = window_s
        self.per_source = per_source
        self.overall = overall
        self.max_sources = max_sources
        self._clock = clock
        self._sources: OrderedDict[str, _Window] = OrderedDict()  # oldest window first
        self._all: _Window | None = None

    def __len__(self) -> int:
        return len(self._sources)

    def check(self, address: str) -> Throttled | None:
        """Whether a sign-in from ``address`` may be heard out now; asked
        before the token is looked at."""
        now = self._clock()
        window = self._live(self._sources.get(source_key(address)), now)
        if window is not None and window.failures >= self.per_source:
            return Throttled(PER_SOURCE, self._retry_after(window, now))
        everyone = self._live(self._all, now)
        if everyone is not None and everyone.failures >= self.overall:
            return Throttled(OVERALL, self._retry_after(everyone, now))
        return None

    def failed(self, address: str) -> None:
        """A sign-in from ``address`` was heard out and its token matched no client."""
        now = self._clock()
        key = source_key(address)
        window = self._live(self._sources.get(key), now)
        if window is None:
            self._sources.pop(key, None)
            self._make_room(now)
            window = self._sources[key] = _Window(now)  # at the end: the newest window
        window.failures += 1
        everyone = self._live(self._all, now)
        if everyone is None:
            everyone = self._all = _Window(now)
        everyone.failures += 1

    def _live(self, window: _Window | None, now: float) -> _Window | None:
        return window if window is not None and now - window.started < self.window_s else None

    def _retry_after(self, window: _Window, now: float) -> int:
        return max(1, math.ceil(window.started + self.window_s - now))

    def _make_room(self, now: float) -> None:
        """Forget ended windows (oldest first), then, while full, the oldest live one."""
        while self._sources:
            oldest = next(iter(self._sources.values()))
            if self._live(oldest, now) is not None and len(self._sources) < self.max_sources:
                return
            self._sources.popitem(last=False)


@dataclass
class _Tally:
    started: float
    logged: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    sources: Counter[str] = field(default_factory=Counter)

    @property
    def held_back(self) -> int:
        return sum(self.reasons.values())


class LogBudget:
    """Which refusals to log one by one; the rest summed up per window."""

    def __init__(
        self,
        *,
        lines: int = LOG_LINES_PER_WINDOW,
        window_s: float = LOG_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lines = lines
        self.window_s = window_s
        self._clock = clock
        self._tallies: dict[str, _Tally] = {}  # one per kind; the kinds are the caller's constants

    def note(self, kind: str, source: str, reason: str) -> tuple[bool, str | None]:
        """A refusal of ``kind``: whether to log it one by one, and the summary
        of the kind's window that just ended, if one is due (log it first).
        ``reason`` is one of the caller's fixed texts, never a client's."""
        now = self._clock()
        tally = self._tallies.get(kind)
        summary = None
        if tally is None or now - tally.started >= self.window_s:
            summary = self._summary(kind, tally, now) if tally is not None else None
            tally = self._tallies[kind] = _Tally(now)
        if tally.logged < self.lines:
            tally.logged += 1
            return True, summary
        tally.reasons[reason] += 1
        if source in tally.sources or len(tally.sources) < MAX_SUMMARY_SOURCES:
            tally.sources[source] += 1
        else:
            tally.sources["others"] += 1
        return False, summary

    def summaries(self, *, all_now: bool = False) -> list[str]:
        """The summaries due: of every kind whose window ended (every kind,
        when ``all_now``: at shutdown). Those windows are over."""
        now = self._clock()
        due = []
        for kind, tally in list(self._tallies.items()):
            if all_now or now - tally.started >= self.window_s:
                del self._tallies[kind]
                if (summary := self._summary(kind, tally, now)) is not None:
                    due.append(summary)
        return due

    @staticmethod
    def _summary(kind: str, tally: _Tally, now: float) -> str | None:
        if not tally.held_back:
            return None
        reasons = ", ".join(f"{r} {n}" for r, n in tally.reasons.most_common())
        sources = ", ".join(f"{s} {n}" for s, n in tally.sources.most_common())
        return (
            f"{tally.held_back} more {kind} refusals in {now - tally.started:.0f} s not logged"
            f" one by one: {reasons}; from {sources}"
        )
