"""Refused requests on the record, folded (docs/how-to/audit.md, "Refused requests").

Every UNAUTHENTICATED, PERMISSION_DENIED and RESOURCE_EXHAUSTED answer is a
``Refusal``. Identical refusals (same source, method, tool and reason code)
share one audit record per interval: the first of a burst is written at once,
the rest are counted and written as one record (``count``, ``first_at``,
``last_at``) when the interval ends. A flood of refusals therefore costs the
log a bounded number of records, and the counts still add up to every refusal.

The table of open groups is bounded too: one source has at most
``MAX_KEYS_PER_SOURCE`` groups (its further refusals fold into its own
overflow group of their reason: method "(overflow)", no tool), and past
``max_keys`` groups in all a new one is folded into the table's overflow
group of its reason (there are only as many reasons as codes in this
program), so an attacker varying whatever it controls (tool names,
addresses) fills the table, never the memory or the log.

Pure: the clock is passed in; ``RefusalLog`` (execution/refusal_log.py) adds
the lock, the store and the flusher thread.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final

DEFAULT_FOLD_S: Final = 10.0  # seconds: identical refusals within one interval share a record
MAX_FOLD_S: Final = 3_600.0  # seconds: a longer interval would hide a flood for too long
DEFAULT_MAX_KEYS: Final = 1_024  # distinct groups folded at once; more go to an overflow group
# Groups of one source at once; more of its refusals fold into its own overflow group per
# reason: a caller varying tool names costs the log a few records, not the whole table.
MAX_KEYS_PER_SOURCE: Final = 32
MAX_TEXT_CHARS: Final = 300  # characters of a refusal's text kept in its record
UNKNOWN_CREDENTIAL: Final = "unknown credential"  # who, when no client is known
OVERFLOW: Final = "(overflow)"  # the source and method of an overflow group

# The kinds of credential a caller presented (never the credential itself).
BEARER: Final = "bearer"  # a static bearer token of the policy
IDP_JWT: Final = "idp_jwt"  # a bearer JWT from an identity provider
MTLS: Final = "mtls"  # a TLS client certificate
MALFORMED: Final = "malformed"  # an authorization header that is not "Bearer <token>"
NO_CREDENTIAL: Final = "none"


@dataclass(frozen=True)
class Refusal:
    """One refused request. Every field is either the server's own (codes,
    texts, method names) or client input that passed its rule (a tool name
    that is a name, a peer address gRPC reports): never a credential."""

    status: str  # the gRPC code answered: UNAUTHENTICATED, PERMISSION_DENIED, RESOURCE_EXHAUSTED
    code: str  # stable reason code, e.g. unknown_bearer_token, missing_role, quota_rate
    text: str  # short reason, as the client was told
    method: str  # the RPC, e.g. ExecuteTool
    client: str = ""  # the client id when the credential was known
    credential: str = ""  # what kind of credential was presented (BEARER, MTLS, ...)
    peer: str = ""  # the peer's address, without its port
    tool: str = ""  # the tool the request names, when it names one
    provider: str = ""  # an identity provider's id in the policy (IdP tokens)

    @property
    def source(self) -> str:
        """Who the refusal is counted against: a known client by its id, anyone
        else by the address it connects from (never by what it presented)."""
        return f"client:{self.client}" if self.client else f"peer:{self.peer or '-'}"

    def key(self) -> tuple[str, str, str, str]:
        return (self.source, self.method, self.tool, self.code)


@dataclass
class _Group:
    first: Refusal  # what the group's records say (its first refusal's fields)
    window_start: float
    pending: int = 0  # refusals not yet on the record
    pending_first_at: float = 0.0
    last_at: float = 0.0
    overflow: bool = False
    folded: set[str] = field(default_factory=set)  # overflow: distinct sources folded in
    capped: bool = False  # overflow: more sources than ``folded`` may hold


class Folder:
    """``add`` each refusal; write what it returns at once, and what ``due``
    returns when asked (the flusher), and what ``drain`` returns at the end."""

    def __init__(
        self,
        *,
        interval_s: float = DEFAULT_FOLD_S,
        max_keys: int = DEFAULT_MAX_KEYS,
        max_per_source: int = MAX_KEYS_PER_SOURCE,
        clock: Callable[[], float],
    ) -> None:
        if interval_s <= 0 or max_keys < 1 or max_per_source < 1:
            raise ValueError("interval_s must be > 0, max_keys and max_per_source >= 1")
        self.interval_s = interval_s
        self.max_keys = max_keys
        self.max_per_source = max_per_source
        self._per_source: Counter[str] = Counter()  # open groups of each source
        self._clock = clock
        self._groups: dict[tuple[str, str, str, str], _Group] = {}
        self._overflow: dict[str, _Group] = {}  # by reason code

    def __len__(self) -> int:
        """Open groups, overflow groups included."""
        return len(self._groups) + len(self._overflow)

    def add(self, refusal: Refusal) -> dict[str, Any] | None:
        """The record to write now (the first refusal of a burst), or None
        (counted; ``due`` writes it with the others of its interval)."""
        now = self._clock()
        key = refusal.key()
        group = self._groups.get(key)
        if group is None and self._per_source[refusal.source] >= self.max_per_source:
            refusal = replace(refusal, method=OVERFLOW, tool="")  # the source's own overflow
            key = refusal.key()
            group = self._groups.get(key)
        if group is None and len(self._groups) >= self.max_keys:
            group = self._overflow.get(refusal.code)
            if group is None:
                group = self._overflow[refusal.code] = _Group(
                    _overflowing(refusal), now, overflow=True
                )
                group.folded.add(refusal.source)
                first = _record(group, 1, now, now, self.interval_s)
                group.folded.clear()  # what the next record says counts its own refusals
                return first
            if len(group.folded) < self.max_keys:  # a count of sources, itself bounded
                group.folded.add(refusal.source)
            elif refusal.source not in group.folded:
                group.capped = True
        elif group is None:
            self._groups[key] = group = _Group(refusal, now)
            self._per_source[refusal.source] += 1
            return _record(group, 1, now, now, self.interval_s)
        if group.pending == 0:
            group.pending_first_at = now
        group.pending += 1
        group.last_at = now
        return None

    def due(self) -> list[dict[str, Any]]:
        """Records of the groups whose interval has ended with refusals not yet
        written; such a group goes on with a new interval (a steady flood is
        one record per interval), a group that stayed quiet is dropped."""
        now = self._clock()
        out: list[dict[str, Any]] = []
        for table in (self._groups, self._overflow):
            for key, group in list(table.items()):
                if now - group.window_start < self.interval_s:
                    continue
                if group.pending == 0:
                    del table[key]  # type: ignore[arg-type]
                    if not group.overflow:
                        self._forget_source(group.first.source)
                    continue
                out.append(self._take(group))
                group.window_start = now
        return out

    def drain(self) -> list[dict[str, Any]]:
        """Every refusal not yet written, as records (at shutdown)."""
        out = [
            self._take(g) for t in (self._groups, self._overflow) for g in t.values() if g.pending
        ]
        self._groups.clear()
        self._overflow.clear()
        self._per_source.clear()
        return out

    def _forget_source(self, source: str) -> None:
        self._per_source[source] -= 1
        if self._per_source[source] <= 0:
            del self._per_source[source]

    def _take(self, group: _Group) -> dict[str, Any]:
        record = _record(
            group, group.pending, group.pending_first_at, group.last_at, self.interval_s
        )
        group.pending = 0
        group.folded.clear()
        group.capped = False
        return record


def _overflowing(refusal: Refusal) -> Refusal:
    """The overflow group of a reason: what it says of its refusals is what
    they share (the reason); their sources are counted, not named."""
    return Refusal(
        status=refusal.status, code=refusal.code, text=refusal.text, method=OVERFLOW,
        peer=OVERFLOW, credential=refusal.credential if refusal.client == "" else "",
    )  # fmt: skip


def _record(
    group: _Group, count: int, first_at: float, last_at: float, interval_s: float
) -> dict[str, Any]:
    """The audit record (kind "refusal") of ``count`` refusals of ``group``."""
    r = group.first
    source: dict[str, Any] = {"peer": r.peer} if r.peer else {}
    if r.client:
        source["client"] = r.client
    record: dict[str, Any] = {
        "status": r.status,
        "who": r.client or UNKNOWN_CREDENTIAL,
        "method": r.method,
        "reason": {"code": r.code, "text": r.text[:MAX_TEXT_CHARS]},
        "source": source,
        "count": count,
        "first_at": round(first_at, 6),
        "last_at": round(last_at, 6),
        "interval_s": interval_s,
    }
    if r.credential:
        record["credential"] = r.credential
    if r.tool:
        record["tool"] = r.tool
    if r.provider:
        record["provider"] = r.provider
    if group.overflow:
        record["overflow"] = True
        record["sources"] = len(group.folded)  # distinct sources, up to max_keys
        if group.capped:
            record["sources_capped"] = True
    return record
