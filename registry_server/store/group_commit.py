"""Group commit for audit records: calls that finish together share one
transaction, so one fsync.

Every cautious or dangerous call's record is durable before its answer (no
durable record, no answer). Written one by one, four calls that end at once
wait for four commits in a row: SQLite has one writer, and PostgreSQL's
appends line up behind the audit lock. Here the first caller that finds no
commit under way writes every record waiting at that moment, in one unit of
work; the others wait for that commit and get their seq back, or its error.
A batch commits whole or not at all, and each caller then decides what a
failed record means for its call, exactly as when it wrote alone.

A caller alone pays nothing extra: it finds no commit under way and writes
its own record at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Final

from registry_server.store import audit_chain
from registry_server.store.base import Store

MAX_BATCH: Final = 64  # records per transaction at most


@dataclass(eq=False)
class _Ticket:
    kind: str
    record: dict[str, Any]
    seq: int = 0
    error: BaseException | None = None
    done: bool = field(default=False)


class AuditAppender:
    """``append(kind, record)``: the record is durable in the chain when it returns."""

    def __init__(self, store: Store, *, max_batch: int = MAX_BATCH) -> None:
        self._store = store
        self._max_batch = max_batch
        self._cond = threading.Condition()
        self._waiting: list[_Ticket] = []
        self._writing = False

    def append(self, kind: str, record: dict[str, Any]) -> int:
        """Its seq once committed; the commit's error (StoreError and the like)
        when the batch it went in could not be stored."""
        ticket = _Ticket(kind, record)
        with self._cond:
            self._waiting.append(ticket)
        while True:
            with self._cond:
                while self._writing and not ticket.done:
                    self._cond.wait()
                if ticket.done:
                    break
                batch = self._waiting[: self._max_batch]
                del self._waiting[: self._max_batch]
                self._writing = True
            self._write(batch)
        if ticket.error is not None:
            raise ticket.error
        return ticket.seq

    def _write(self, batch: list[_Ticket]) -> None:
        try:
            with self._store.unit_of_work() as uow:
                seqs = [audit_chain.append(uow, t.kind, t.record) for t in batch]
        except BaseException as exc:  # the whole batch failed: every caller hears why
            for t in batch:
                t.error = exc
        else:
            for t, seq in zip(batch, seqs, strict=True):
                t.seq = seq
        finally:
            with self._cond:
                for t in batch:
                    t.done = True
                self._writing = False
                self._cond.notify_all()
