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
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from registry_server.domain.errors import AtCapacity

CANCEL_CHECK_S = 0.05  # seconds between checks of a waiting call's cancel event
DEFAULT_MEMORY_BUDGET_MB = 4096  # MiB of sandbox memory limits, summed, server-wide


class Cancelled(Exception):
    """The caller went away while waiting for a slot."""


@dataclass(eq=False)
class Reservation:
    """Room held for one warm container (memory in MiB)."""

    memory_mb: int
    released: bool = False


class Admission:
    def __init__(
        self,
        max_running: int,
        max_waiting: int,
        memory_budget_mb: int = DEFAULT_MEMORY_BUDGET_MB,
    ) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.memory_budget_mb = memory_budget_mb
        self._cond = threading.Condition()
        self._running = 0
        self._waiting = 0
        self._reserved = 0
        self._memory_mb = 0  # of running and reserved containers
        self._on_pressure: Callable[[], bool] | None = None

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return self._waiting

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
    def slot(self, cancel: threading.Event | None = None, memory_mb: int = 0) -> Iterator[None]:
        """Hold room for one running call of ``memory_mb``, waiting if need be."""
        if memory_mb > self.memory_budget_mb:
            raise AtCapacity(
                f"a sandbox of {memory_mb} MiB is larger than this server's whole sandbox"
                f" memory budget ({self.memory_budget_mb} MiB)"
            )
        self._enter(cancel, memory_mb)
        try:
            yield
        finally:
            self._leave(memory_mb)

    def _enter(self, cancel: threading.Event | None, memory_mb: int) -> None:
        with self._cond:
            if self._fits(memory_mb):
                self._take(memory_mb)
                return
            if self._waiting >= self.max_waiting:
                raise AtCapacity(
                    f"server at capacity: {self._running} sandboxes running,"
                    f" {self._reserved} warm and {self._waiting} calls queued; retry later"
                )
            self._waiting += 1
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    raise Cancelled()
                with self._cond:
                    if self._fits(memory_mb):
                        self._take(memory_mb)
                        return
                    squeezed = self._reserved > 0
                if not (squeezed and self._reclaim()):
                    with self._cond:
                        if not self._fits(memory_mb):
                            self._cond.wait(CANCEL_CHECK_S)
        finally:
            with self._cond:
                self._waiting -= 1

    def _reclaim(self) -> bool:
        reclaim = self._on_pressure
        return reclaim is not None and reclaim()

    def _take(self, memory_mb: int) -> None:
        self._running += 1
        self._memory_mb += memory_mb

    def _leave(self, memory_mb: int) -> None:
        with self._cond:
            self._running -= 1
            self._memory_mb -= memory_mb
            self._cond.notify_all()

    # -- warm containers -----------------------------------------------------------

    def reserve(self, memory_mb: int) -> Reservation | None:
        """Room for one more warm container, or None: no room, or calls wait."""
        with self._cond:
            if self._waiting > 0 or not self._fits(memory_mb):
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
            self._cond.notify_all()

    @contextmanager
    def claim(self, reservation: Reservation) -> Iterator[None]:
        """A call takes the warm container: its reservation becomes the call's
        slot, with no wait (the room was already held)."""
        with self._cond:
            if reservation.released:
                raise RuntimeError("a released reservation cannot be claimed")
            reservation.released = True
            self._reserved -= 1
            self._running += 1
        try:
            yield
        finally:
            self._leave(reservation.memory_mb)
