"""Admission control: one budget for every sandbox the server keeps, running
or waiting in a warm pool.

At most ``max_running`` containers exist at once and their memory limits add
up to at most ``memory_budget_mb``. A call takes a slot (waiting in a bounded
queue when none is free); a warm container holds a *reservation*, taken only
when no call is waiting, and a call that takes the warm container turns the
reservation into its slot. When a call must wait while warm containers hold
room, the pool is asked to give one back (``on_pressure``): callers come
before containers kept on speculation.

A call past the queue is refused at once (RESOURCE_EXHAUSTED) rather than
piling up threads and memory; a waiting call whose client goes away leaves
the queue without ever starting a container.

The queue is fair across clients (docs/how-to/deploying.md, "Sharing a server"):
each client waits in its own line, first come first served within it, and
a freed slot goes to the head of the line whose client has the fewest
running calls (the earliest among equals). A client may also be capped:
``ClientLimits`` says how many sandboxes it may run at once and how many of
its calls may wait, so one busy client never takes every slot and every
place in the queue.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from registry_server.domain.errors import AtCapacity, QuotaExceeded

CANCEL_CHECK_S = 0.05  # seconds between checks of a waiting call's cancel event
DEFAULT_MEMORY_BUDGET_MB = 4096  # MiB of sandbox memory limits, summed, server-wide
RETRY_AFTER_FULL_S = 1.0  # seconds a refused call is told to wait (RetryInfo)


@dataclass(frozen=True)
class ClientLimits:
    """One client's share of this server (None: no cap beyond the server's)."""

    max_running: int | None = None  # sandboxes running at once, warm ones it took included
    max_queued: int | None = None  # calls waiting for a slot


NO_LIMITS = ClientLimits()


@dataclass(eq=False)
class _Waiter:
    client: str
    memory_mb: int
    order: int  # arrival order, server-wide
    granted: bool = False


class Cancelled(Exception):
    """The caller went away while waiting for a slot."""


@dataclass(eq=False)
class Reservation:
    """Room held for one warm container (memory in MiB)."""

    memory_mb: int
    released: bool = False


@dataclass
class _Lines:
    """The waiting calls, one first-come-first-served line per client."""

    by_client: dict[str, deque[_Waiter]] = field(default_factory=dict)
    count: int = 0

    def add(self, waiter: _Waiter) -> None:
        self.by_client.setdefault(waiter.client, deque()).append(waiter)
        self.count += 1

    def remove(self, waiter: _Waiter) -> None:
        line = self.by_client.get(waiter.client)
        if line is not None and waiter in line:
            line.remove(waiter)
            self.count -= 1
            if not line:
                del self.by_client[waiter.client]

    def of(self, client: str) -> int:
        return len(self.by_client.get(client, ()))


class Admission:
    def __init__(
        self,
        max_running: int,
        max_waiting: int,
        memory_budget_mb: int = DEFAULT_MEMORY_BUDGET_MB,
        limits_of: Callable[[str], ClientLimits] = lambda _client: NO_LIMITS,
    ) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.memory_budget_mb = memory_budget_mb
        self._limits_of = limits_of
        self._cond = threading.Condition()
        self._running = 0
        self._reserved = 0
        self._memory_mb = 0  # of running and reserved containers
        self._on_pressure: Callable[[], bool] | None = None
        self._lines = _Lines()
        self._arrivals = itertools.count()
        self._running_by: Counter[str] = Counter()  # holds included
        self.refused_by: Counter[tuple[str, str]] = Counter()  # (client, limit) -> refusals

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return self._lines.count

    def by_client(self) -> dict[str, tuple[int, int]]:
        """client -> (running, queued), for the metrics."""
        with self._cond:
            clients = set(self._running_by) | set(self._lines.by_client)
            return {c: (self._running_by[c], self._lines.of(c)) for c in clients}

    def running_of(self, client: str) -> int:
        return self._running_by[client]

    def waiting_of(self, client: str) -> int:
        return self._lines.of(client)

    @property
    def reserved(self) -> int:
        return self._reserved

    @property
    def memory_mb(self) -> int:
        return self._memory_mb

    def on_pressure(self, reclaim: Callable[[], bool]) -> None:
        """``reclaim()`` gives back one reservation if it can (True) or not."""
        self._on_pressure = reclaim

    def _fits(self, memory_mb: int) -> bool:
        return (
            self._running + self._reserved < self.max_running
            and self._memory_mb + memory_mb <= self.memory_budget_mb
        )

    @contextmanager
    def slot(
        self, cancel: threading.Event | None = None, memory_mb: int = 0, client: str = ""
    ) -> Iterator[None]:
        """Hold room for one running call of ``memory_mb`` for ``client``,
        waiting in its line if need be."""
        if memory_mb > self.memory_budget_mb:
            raise AtCapacity(
                f"a sandbox of {memory_mb} MiB is larger than this server's whole sandbox"
                f" memory budget ({self.memory_budget_mb} MiB)"
            )
        self._enter(cancel, memory_mb, client)
        try:
            yield
        finally:
            self._leave(memory_mb, client)

    def _cap(self, client: str) -> int:
        limit = self._limits_of(client).max_running
        return self.max_running if limit is None else min(limit, self.max_running)

    def _enter(self, cancel: threading.Event | None, memory_mb: int, client: str) -> None:
        with self._cond:
            waiter = _Waiter(client, memory_mb, next(self._arrivals))
            self._refuse_if_full(client, memory_mb)
            self._lines.add(waiter)
            self._grant()
        try:
            while True:
                with self._cond:
                    if waiter.granted:
                        return
                    if cancel is not None and cancel.is_set():
                        self._lines.remove(waiter)
                        self._grant()  # its place may have held up the line behind it
                        raise Cancelled()
                    squeezed = self._reserved > 0
                if not (squeezed and self._reclaim()):
                    with self._cond:
                        if not waiter.granted:
                            self._cond.wait(CANCEL_CHECK_S)
        except BaseException:
            with self._cond:
                if waiter.granted:  # granted while it was leaving: give the slot back
                    self._release(memory_mb, client)
            raise

    def _refuse_if_full(self, client: str, memory_mb: int) -> None:
        queued = self._lines.of(client)
        limit = self._limits_of(client).max_queued
        if limit is not None and queued >= limit and not self._could_run_now(client, memory_mb):
            self.refused_by[(client, "max_queued")] += 1
            raise QuotaExceeded(
                f"client '{client}' already has {queued} calls queued (its limit, max_queued,"
                f" is {limit}); retry later",
                subject=f"client:{client}", limit="max_queued",
                retry_after_s=RETRY_AFTER_FULL_S,
            )  # fmt: skip
        if self._lines.count >= self.max_waiting and not self._could_run_now(client, memory_mb):
            self.refused_by[(client, "server")] += 1
            raise QuotaExceeded(
                f"server at capacity: {self._running} sandboxes running,"
                f" {self._reserved} warm and {self._lines.count} calls queued; retry later",
                subject="server", limit="max_queued", retry_after_s=RETRY_AFTER_FULL_S,
            )  # fmt: skip

    def _could_run_now(self, client: str, memory_mb: int) -> bool:
        """Whether a call of ``client`` would get a slot at once (it never queues)."""
        return (
            not self._lines.count
            and self._running_by[client] < self._cap(client)
            and self._fits(memory_mb)
        )

    def _grant(self) -> None:
        """Hand free slots to waiting calls: the head of the line whose client
        runs the fewest calls goes first (the earliest among equals). A client
        at its cap waits however much room there is. Caller holds the lock."""
        granted = False
        while self._lines.count:
            heads = [
                line[0]
                for client, line in self._lines.by_client.items()
                if self._running_by[client] < self._cap(client)
            ]
            if not heads:
                break
            best = min(heads, key=lambda w: (self._running_by[w.client], w.order))
            if not self._fits(best.memory_mb):
                break  # room is coming back; nobody overtakes the one it is for
            self._lines.remove(best)
            best.granted = True
            self._take(best.memory_mb, best.client)
            granted = True
        if granted:
            self._cond.notify_all()

    def _reclaim(self) -> bool:
        reclaim = self._on_pressure
        return reclaim is not None and reclaim()

    def _take(self, memory_mb: int, client: str) -> None:
        self._running += 1
        self._memory_mb += memory_mb
        self._running_by[client] += 1

    def _release(self, memory_mb: int, client: str) -> None:
        self._running -= 1
        self._memory_mb -= memory_mb
        self._running_by[client] -= 1
        if self._running_by[client] <= 0:
            del self._running_by[client]
        self._grant()
        self._cond.notify_all()

    def _leave(self, memory_mb: int, client: str) -> None:
        with self._cond:
            self._release(memory_mb, client)

    # -- warm containers -----------------------------------------------------------

    def reserve(self, memory_mb: int) -> Reservation | None:
        """Room for one more warm container, or None: no room, or calls wait."""
        with self._cond:
            if self._lines.count > 0 or not self._fits(memory_mb):
                return None
            self._reserved += 1
            self._memory_mb += memory_mb
            return Reservation(memory_mb)

    def release(self, reservation: Reservation) -> None:
        """The warm container is gone unused. Releasing twice is harmless."""
        with self._cond:
            if reservation.released:
                return
            reservation.released = True
            self._reserved -= 1
            self._memory_mb -= reservation.memory_mb
            self._grant()
            self._cond.notify_all()

    def may_take_warm(self, client: str) -> bool:
        """Whether ``client`` is below its cap, so a warm container may be its
        (a warm container adds no room in use: its reservation already held it)."""
        with self._cond:
            return self._running_by[client] < self._cap(client)

    @contextmanager
    def claim(self, reservation: Reservation, client: str = "") -> Iterator[None]:
        """A call takes the warm container: its reservation becomes the call's
        slot, with no wait (the room was already held). Raises QuotaExceeded
        when the client reached its cap meanwhile (``may_take_warm`` said yes
        to two of its calls at once)."""
        with self._cond:
            if reservation.released:
                raise RuntimeError("a released reservation cannot be claimed")
            if self._running_by[client] >= self._cap(client):
                raise QuotaExceeded(
                    f"client '{client}' already runs {self._running_by[client]} sandboxes"
                    f" (its limit, max_concurrent, is {self._cap(client)})",
                    subject=f"client:{client}", limit="max_concurrent",
                    retry_after_s=RETRY_AFTER_FULL_S,
                )  # fmt: skip
            reservation.released = True
            self._reserved -= 1
            self._running += 1
            self._running_by[client] += 1
        try:
            yield
        finally:
            self._leave(reservation.memory_mb, client)
