"""Refusals written to the audit log (kind "refusal"), folded by
domain/refusals.py: the first of a burst on the refusing thread, before the
answer; the rest by a flusher thread at the end of each interval, and at close.

A refusal is refused whatever happens to its record: a store that cannot take
it costs a warning, never an answer (the caller was refused, fail closed).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from registry_server.domain.refusals import (
    DEFAULT_FOLD_S,
    DEFAULT_MAX_KEYS,
    MAX_KEYS_PER_SOURCE,
    Folder,
    Refusal,
)
from registry_server.store.base import Store
from registry_server.store.group_commit import AuditAppender

log = logging.getLogger(__name__)

KIND: Final = "refusal"  # the audit entries' kind
FLUSH_TICKS_PER_INTERVAL: Final = 4  # the flusher looks this often per interval


class RefusalLog:
    def __init__(
        self,
        store: Store,
        *,
        interval_s: float = DEFAULT_FOLD_S,
        max_keys: int = DEFAULT_MAX_KEYS,
        max_per_source: int = MAX_KEYS_PER_SOURCE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._appender = AuditAppender(store)
        self._folder = Folder(
            interval_s=interval_s, max_keys=max_keys, max_per_source=max_per_source, clock=clock
        )
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="refusal-flush", daemon=True)
        self._thread.start()

    def refuse(self, refusal: Refusal) -> None:
        with self._lock:
            record = self._folder.add(refusal)
        if record is not None:
            self._write([record])

    def flush(self) -> None:
        """Write the groups whose interval has ended."""
        with self._lock:
            records = self._folder.due()
        self._write(records)

    def close(self) -> None:
        """Stop the flusher; every refusal counted so far goes on the record."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            records = self._folder.drain()
        self._write(records)

    def _run(self) -> None:
        tick = self._folder.interval_s / FLUSH_TICKS_PER_INTERVAL
        while not self._stop.wait(tick):
            self.flush()

    def _write(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            try:
                self._appender.append(KIND, record)
            except Exception as exc:  # whatever the store raises: the refusal's answer stands
                log.warning(
                    "could not store a refusal record (%s, %d refusal(s)): %s",
                    record["reason"]["code"], record["count"], exc,
                )  # fmt: skip
