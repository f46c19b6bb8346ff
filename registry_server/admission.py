"""Admission control: at most N sandboxes run at once, at most M calls wait.

A call past the queue is refused at once (RESOURCE_EXHAUSTED) rather than
piling up threads and memory; a waiting call whose client goes away leaves
the queue without ever starting a container.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from registry_server.errors import AtCapacity

CANCEL_CHECK_S = 0.05  # seconds between checks of a waiting call's cancel event


class Cancelled(Exception):
    """The caller went away while waiting for a slot."""


class Admission:
    def __init__(self, max_running: int, max_waiting: int) -> None:
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._running = 0
        self._waiting = 0

    @property
    def running(self) -> int:
        return self._running

    @property
    def waiting(self) -> int:
        return self._waiting

    @contextmanager
    def slot(self, cancel: threading.Event | None = None) -> Iterator[None]:
        with self._cond:
            if self._running >= self.max_running:
                if self._waiting >= self.max_waiting:
                    raise AtCapacity(
                        f"server at capacity: {self._running} sandboxes running and"
                        f" {self._waiting} calls queued; retry later"
                    )
                self._waiting += 1
                try:
                    while self._running >= self.max_running:
                        if cancel is not None and cancel.is_set():
                            raise Cancelled()
                        self._cond.wait(CANCEL_CHECK_S)
                finally:
                    self._waiting -= 1
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify()
