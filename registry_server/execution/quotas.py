"""Call rates per client: a token bucket each (docs/how-to/deploying.md, "Sharing a
server"). A client's bucket holds up to ``burst`` calls and refills at
``rate_per_s``; a call that finds it empty is refused at once with the time
until the next token, before anything else is done for it.

The buckets live in this server's memory: with N servers each holds its own
share (the policy's ``quotas.servers`` divides the rate and the burst), so no
shared counter sits on the path of every call.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from registry_server.domain.errors import QuotaExceeded
from registry_server.execution.admission import ClientLimits
from registry_server.policy.model import Policy


@dataclass(frozen=True)
class Rate:
    per_s: float  # tokens added each second
    burst: int  # tokens the bucket holds at most


@dataclass
class _Bucket:
    rate: Rate
    tokens: float
    at: float


class RateLimits:
    def __init__(
        self,
        rate_of: Callable[[str], Rate | None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rate_of = rate_of
        self._clock = clock
        self._lock = threading.Lock()
        # One bucket per client id; ids come from the policy, so this stays small.
        self._buckets: dict[str, _Bucket] = {}
        self.refused: Counter[str] = Counter()  # client -> calls refused for rate

    def check(self, client: str) -> None:
        """Spend one token of ``client``'s bucket, or raise QuotaExceeded
        (limit "rate") with the seconds until one is there."""
        rate = self._rate_of(client)
        if rate is None:
            return
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(client)
            if bucket is None or bucket.rate != rate:  # new, or the policy changed it
                bucket = self._buckets[client] = _Bucket(rate, float(rate.burst), now)
            bucket.tokens = min(rate.burst, bucket.tokens + (now - bucket.at) * rate.per_s)
            bucket.at = now
            if bucket.tokens >= 1.0:
                bucket.tokens -= 1.0
                return
            wait_s = (1.0 - bucket.tokens) / rate.per_s
            self.refused[client] += 1
        raise QuotaExceeded(
            f"client '{client}' is over its call rate ({_rate_text(rate)});"
            f" retry in {math.ceil(wait_s * 1000)} ms",
            subject=f"client:{client}", limit="rate", retry_after_s=wait_s,
        )  # fmt: skip


def _rate_text(rate: Rate) -> str:
    return f"{rate.per_s:g}/s, burst {rate.burst}"


class Shares:
    """Each client's share of this server, as the policy says it now: the
    limits admission enforces and the rate its bucket refills at. Where the
    policy sets nothing and several clients may execute, a client may take
    all slots but one and half the queue: one busy client never starves the
    others, whatever the operator forgot to write."""

    def __init__(self, policy: Callable[[], Policy], max_running: int, max_waiting: int) -> None:
        self._policy = policy
        self._max_running = max_running
        self._max_waiting = max_waiting

    def limits(self, client: str) -> ClientLimits:
        policy = self._policy()
        quota = policy.quota_for(client)
        shared = policy.shared
        running, queued = quota.max_concurrent, quota.max_queued
        if running is None and shared and self._max_running > 1:
            running = self._max_running - 1
        if queued is None and shared:
            queued = max(1, self._max_waiting // 2)
        return ClientLimits(running, queued)

    def rate(self, client: str) -> Rate | None:
        """The client's rate on this server: its policy rate split across
        ``quotas.servers`` (burst likewise, at least one call)."""
        policy = self._policy()
        quota = policy.quota_for(client)
        if quota.rate_per_s is None:
            return None
        servers = policy.quotas.servers
        burst = quota.burst if quota.burst is not None else max(1, math.ceil(quota.rate_per_s))
        return Rate(quota.rate_per_s / servers, max(1, math.ceil(burst / servers)))
