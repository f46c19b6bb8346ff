"""Turns for heavy request work, shared fairly between clients
(docs/explanation/speed.md, "Large arguments share the CPU").

A call whose arguments are large (``heavy_arguments_bytes``) has its
parsing, schema validation and guards done by a worker process
(``heavy_work.py``), and it must first get a *turn*: at most ``turns``
calls do heavy work at once, server-wide, and at most one per client. The
rest wait, each client in its own line; a freed turn goes to the client
that was served least recently (round robin), so one client's stream of
large calls never keeps another's waiting for more than one turn each.

Waiting is bounded three ways, each refused at once with RESOURCE_EXHAUSTED
and a time to retry, as admission.py refuses sandboxes: a client already
holding ``max_queued_per_client`` waiting calls, the server holding
``max_queued`` waiting calls in all, and a turn that does not come within
``max_wait_s``. Light calls never come here: they wait behind no heavy work.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from registry_server.domain.errors import QuotaExceeded
from registry_server.execution.admission import Cancelled

CANCEL_CHECK_S = 0.05  # seconds between checks of a waiting call's cancel event
RETRY_AFTER_S = 1.0  # seconds a refused call is told to wait (RetryInfo)
PER_CLIENT_TURNS = 1  # heavy calls of one client worked on at once

# Refusal reasons: the only values of the metrics' reason label.
CLIENT_QUEUE, SERVER_QUEUE, WAIT = "client_queue", "server_queue", "wait"


@dataclass(eq=False)
class _Waiter:
    client: str
    order: int  # arrival order, server-wide
    granted: bool = False


class HeavyGate:
    def __init__(
        self, turns: int, max_queued: int, max_queued_per_client: int, max_wait_s: float
    ) -> None:
        self.turns = turns
        self.max_queued = max_queued
        self.max_queued_per_client = max_queued_per_client
        self.max_wait_s = max_wait_s
        self._cond = threading.Condition()
        self._lines: dict[str, deque[_Waiter]] = {}
        self._waiting = 0
        self._working: Counter[str] = Counter()
        self._arrivals = itertools.count()
        self._served = itertools.count()
        self._last_served: dict[str, int] = {}  # client -> when it last got a turn
        self.refused: Counter[str] = Counter()  # reason -> refusals
        self.refused_by: Counter[tuple[str, str]] = Counter()  # (client, limit) -> refusals
        # Told the seconds each granted turn was waited for (the metrics' histogram).
        self.on_wait: Callable[[float], None] = lambda _seconds: None

    @property
    def working(self) -> int:
        return sum(self._working.values())

    @property
    def waiting(self) -> int:
        return self._waiting

    @contextmanager
    def turn(
        self, client: str, cancel: threading.Event | None = None, deadline: float | None = None
    ) -> Iterator[float]:
        """Hold one turn of heavy work for ``client``; yields the seconds it
        waited. ``deadline`` (time.monotonic()) is the client's own: past it
        nobody reads the answer, so the wait ends there too (Cancelled)."""
        started = time.monotonic()
        self._enter(client, cancel, deadline, started)
        waited = time.monotonic() - started
        try:
            self.on_wait(waited)
            yield waited
        finally:
            with self._cond:
                self._working[client] -= 1
                if self._working[client] <= 0:
                    del self._working[client]
                self._grant()

    def _enter(
        self, client: str, cancel: threading.Event | None, deadline: float | None, started: float
    ) -> None:
        gave_up = started + self.max_wait_s
        with self._cond:
            self._refuse_if_full(client)
            waiter = _Waiter(client, next(self._arrivals))
            self._lines.setdefault(client, deque()).append(waiter)
            self._waiting += 1
            self._grant()
            while not waiter.granted:
                now = time.monotonic()
                cancelled = cancel is not None and cancel.is_set()
                if cancelled or (deadline is not None and now >= deadline):
                    self._leave_line(waiter)
                    raise Cancelled()
                if now >= gave_up:
                    self._leave_line(waiter)
                    self._count(client, WAIT)
                    raise QuotaExceeded(
                        f"no turn for heavy work within {self.max_wait_s:g} s"
                        f" ({self.working} calls with large arguments being checked,"
                        f" {self._waiting} waiting); retry later",
                        subject=f"client:{client}", limit="heavy_wait",
                        retry_after_s=RETRY_AFTER_S,
                    )  # fmt: skip
                self._cond.wait(min(CANCEL_CHECK_S, gave_up - now))

    def _refuse_if_full(self, client: str) -> None:
        queued = len(self._lines.get(client, ()))
        if queued >= self.max_queued_per_client and not self._could_start_now(client):
            self._count(client, CLIENT_QUEUE)
            raise QuotaExceeded(
                f"client '{client}' already has {queued} calls with large arguments waiting"
                f" (the limit, heavy_queue_per_client, is {self.max_queued_per_client});"
                " retry later",
                subject=f"client:{client}", limit="heavy_queue_per_client",
                retry_after_s=RETRY_AFTER_S,
            )  # fmt: skip
        if self._waiting >= self.max_queued and not self._could_start_now(client):
            self._count(client, SERVER_QUEUE)
            raise QuotaExceeded(
                f"server at capacity for large arguments: {self._waiting} calls waiting"
                f" (heavy_max_queued is {self.max_queued}); retry later",
                subject="server", limit="heavy_max_queued", retry_after_s=RETRY_AFTER_S,
            )  # fmt: skip

    def _could_start_now(self, client: str) -> bool:
        return (
            not self._waiting
            and self.working < self.turns
            and self._working[client] < PER_CLIENT_TURNS
        )

    def _count(self, client: str, reason: str) -> None:
        self.refused[reason] += 1
        limit = {CLIENT_QUEUE: "heavy_queue_per_client", SERVER_QUEUE: "heavy_max_queued"}
        self.refused_by[(client, limit.get(reason, "heavy_wait"))] += 1

    def _leave_line(self, waiter: _Waiter) -> None:
        line = self._lines.get(waiter.client)
        if line is not None and waiter in line:
            line.remove(waiter)
            self._waiting -= 1
            if not line:
                del self._lines[waiter.client]
        self._grant()  # its place may have held up the line behind it

    def _grant(self) -> None:
        """Free turns to the heads of the lines: among clients with no turn
        in use, the one served least recently first (never served: first of
        all; the earliest arrival among equals). Caller holds the lock."""
        granted = False
        while self.working < self.turns:
            heads = [
                line[0]
                for client, line in self._lines.items()
                if self._working[client] < PER_CLIENT_TURNS
            ]
            if not heads:
                break
            best = min(heads, key=lambda w: (self._last_served.get(w.client, -1), w.order))
            line = self._lines[best.client]
            line.popleft()
            if not line:
                del self._lines[best.client]
            self._waiting -= 1
            best.granted = True
            self._working[best.client] += 1
            self._last_served[best.client] = next(self._served)
            granted = True
        if granted:
            self._cond.notify_all()
