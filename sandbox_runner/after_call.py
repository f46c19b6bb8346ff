"""Engine work a call leaves behind waits until the call has its answer.

A call's answer waits for its audit record to be durable, and on one disk
that fsync waits behind whatever the engine writes meanwhile: removing a
container, or starting its replacement in a warm pool, makes the engine write
and sync its own state files. Measured on this project's machine, a warm
call's commit took 8.4 ms (median) when its container's removal and its
pool's refill started as the tool ended, and 1.0 ms when they started 100 ms
later. So a call holds back the work it causes itself (its container's
removal, its pool's refill) until it has answered:

    with after_call.deferred():
        ...  # run the call, write its record
    # the held-back jobs run here

Outside a ``deferred`` block, ``later`` runs its job at once. A job handed to
``later`` after its block ended (a thread that copied the context and
outlived it) also runs at once: nothing is ever dropped.

Background engine work also yields to other calls in flight: the remover, the
warm pools' refiller and the egress network pool's ``yield_to_calls`` before
each engine request, waiting until no call is in its ``deferred`` block, for at
most ``YIELD_S`` from when the work was asked for. Four warm calls at once
then finish before the first one's removal and refill compete with the other
three for two cores; under sustained load the bound keeps removals flowing, at
most ``YIELD_S`` late.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Final

Job = Callable[[], object]

YIELD_S: Final = 0.25  # seconds background engine work waits at most for calls in flight


class _Held:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: list[Job] | None = []

    def add(self, job: Job) -> bool:
        """True when held; False when the block has ended (run it now)."""
        with self._lock:
            if self._jobs is None:
                return False
            self._jobs.append(job)
            return True

    def release(self) -> list[Job]:
        with self._lock:
            jobs, self._jobs = self._jobs or [], None
            return jobs


_held: ContextVar[_Held | None] = ContextVar("toolreg_after_call", default=None)
_calls = threading.Condition()
_in_flight = 0  # calls in a deferred() block, in this process


@contextmanager
def deferred() -> Iterator[None]:
    """Hold back every ``later`` job of this block until it ends (however it ends)."""
    global _in_flight
    held = _Held()
    token = _held.set(held)
    with _calls:
        _in_flight += 1
    try:
        yield
    finally:
        _held.reset(token)
        with _calls:
            _in_flight -= 1
            if _in_flight == 0:
                _calls.notify_all()
        for job in held.release():
            job()


def yield_to_calls(asked_at: float, max_wait_s: float = YIELD_S) -> None:
    """Wait until no call is in flight, or until ``asked_at + max_wait_s``
    (monotonic seconds): background work goes after the calls it would slow."""
    until = asked_at + max_wait_s
    with _calls:
        while _in_flight > 0:
            left = until - time.monotonic()
            if left <= 0:
                return
            _calls.wait(left)


def later(job: Job) -> None:
    """Run ``job`` when the current call has answered (at once outside a call)."""
    held = _held.get()
    if held is None or not held.add(job):
        job()
