"""The SIEM exporter: follows the committed audit log with a cursor kept in
the store, one thread per destination (docs/how-to/audit.md, "SIEM export").

* It reads only committed entries, on its own thread, and a batch at a
  time: no call ever waits for it, and a destination that is down or slow
  only makes it fall behind (the lag metrics say by how much).
* The cursor moves only once the destination has confirmed a batch
  (sinks.py), and it lives in the store: a restart, or another server,
  resumes from it. A destination that can tell how far it goes (the JSON
  Lines file) moves the cursor up to its own last event at start, so a
  crash between a write and the cursor's update writes nothing twice.
* With several servers on one PostgreSQL database, one exports to a
  destination at a time: the cursor row carries a lease, renewed with each
  batch and released at close; a dead server's lapses and another takes
  the destination over, at once when it can prove that server's process
  gone (claimant.py, as webhook deliveries: its own before a crash).
* A failed write is tried again after a growing pause (capped); the log
  line names the destination and the reason, never an event's content.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence

from registry_server.domain.errors import StoreError
from registry_server.notify.claimant import claimant, claimant_gone
from registry_server.notify.siem import ocsf
from registry_server.notify.siem.sinks import Line, Sink, SinkError
from registry_server.store.base import AuditEntry, Store, StoreReads
from sandbox_runner.ownership import OwnerIdentity, process_alive

log = logging.getLogger(__name__)

DEFAULT_BATCH = 500  # events written, and confirmed, at a time
DEFAULT_LEASE_S = 15.0  # seconds a destination stays this server's without news from it
POLL_S = 0.5  # seconds between looks at the log when it has nothing new
RETRY_S = (0.5, 30.0)  # seconds before trying a failed destination again: first, at most
GONE_CHECK_S = 5.0  # seconds between looks at whether another holder's process is gone
CLOSE_DRAIN_S = 5.0  # seconds close() spends sending what is left before it stops


class Exporter:
    """Exports the audit log to one destination (``sink``)."""

    def __init__(
        self,
        store: Store,
        sink: Sink,
        source: ocsf.Source,
        *,
        batch: int = DEFAULT_BATCH,
        lease_s: float = DEFAULT_LEASE_S,
        poll_s: float = POLL_S,
        clock: Callable[[], float] = time.time,
        owner_alive: Callable[[int, int], bool] = process_alive,
    ) -> None:
        self._store = store
        self.sink = sink
        self._source = source
        self._batch = batch
        self._lease_s = lease_s
        self._poll_s = poll_s
        self._clock = clock
        self._me = OwnerIdentity.current()
        self._owner_alive = owner_alive
        self.owner = claimant(self._me)
        self._gone_checked_at = 0.0  # when a holder was last checked for being gone
        self._lock = threading.Lock()  # one pump at a time (the thread, close, tests)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._held_until = 0.0  # when this server's lease lapses (0: not held)
        self.cursor = 0  # every entry up to this seq is confirmed by the destination
        self.head = 0  # the log's last seq, at the last look
        self.lag_seconds = 0.0  # age of the oldest entry not yet confirmed (0: none)
        self.exported = 0  # events this server delivered
        self.failures = 0  # failed attempts to deliver a batch
        self.last_error = ""
        self._failing = False  # the last attempt failed

    @property
    def holds(self) -> bool:
        return self._held_until > self._clock()

    @property
    def lag_records(self) -> int:
        return max(0, self.head - self.cursor)

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name=f"siem-export-{self.sink.label}", daemon=True
        )
        self._thread.start()

    def close(self, drain_s: float = CLOSE_DRAIN_S) -> None:
        """Stop; first send what is committed and unsent, for up to ``drain_s``,
        unless the destination was failing (a stop must not wait on it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=drain_s + 1)
            if self._thread.is_alive():  # stuck in a write: its lease lapses by itself
                log.warning("SIEM export to %s: stopped in the middle of a write; %d record(s)"
                            " left for the next start", self.sink.id, self.lag_records)  # fmt: skip
                return
        deadline = time.monotonic() + drain_s
        try:
            while not self._failing and time.monotonic() < deadline:
                if self.pump() < self._batch:
                    break
        except (SinkError, StoreError) as exc:
            log.warning("SIEM export to %s: %d record(s) left for the next start: %s",
                        self.sink.id, self.lag_records, exc)  # fmt: skip
        try:
            if self._held_until:
                with self._store.unit_of_work() as uow:
                    uow.release_export(self.sink.id, self.owner)
        except StoreError as exc:
            log.warning("SIEM export to %s: lease not released (%s)", self.sink.id, exc)
        self.sink.close()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                sent = self.pump()
            except SinkError as exc:
                failures += 1
                self._failed(str(exc), failures)
                continue
            except StoreError as exc:
                failures += 1
                self._failed(f"the store failed: {exc}", failures)
                continue
            except Exception:  # a bug must not end the export for good
                failures += 1
                self._failing = True
                log.exception("SIEM export to %s: unexpected failure", self.sink.id)
                self._stop.wait(_pause(failures))
                continue
            if failures:
                log.info("SIEM export to %s: delivering again", self.sink.id)
            failures = 0
            self._failing = False
            if sent < self._batch:
                self._stop.wait(self._poll_s)

    def _failed(self, reason: str, failures: int) -> None:
        self._failing = True
        self.failures += 1
        self.last_error = reason
        pause = _pause(failures)
        log.warning("SIEM export to %s failed (%d record(s) behind): %s; trying again in %.1f s",
                    self.sink.id, self.lag_records, reason, pause)  # fmt: skip
        self._stop.wait(pause)

    def pump(self) -> int:
        """Deliver the next batch, if this server holds the destination;
        returns how many events were delivered."""
        with self._lock:
            if not self._claim():
                return 0
            with self._store.reading() as reads:
                entries = reads.audit_entries_after(self.cursor, self._batch)
                tail = reads.audit_tail(1)
                requests = _requests(reads, entries)
            self.head = tail[-1].seq if tail else 0
            if not entries:
                self.lag_seconds = 0.0
                return 0
            self.lag_seconds = max(0.0, self._clock() - entries[0].at)
            self.sink.write([self._line(e, requests) for e in entries])
            last = entries[-1].seq
            now = self._clock()
            with self._store.unit_of_work() as uow:
                kept = uow.advance_export(self.sink.id, self.owner, last, now, now + self._lease_s)
            if not kept:
                # Another server took the destination over (this one was too slow
                # to renew): it resends from the stored cursor.
                log.warning("SIEM export to %s: the lease passed to another server",
                            self.sink.id)  # fmt: skip
                self._held_until = 0.0
                return 0
            self._held_until = now + self._lease_s
            self.cursor = last
            self.exported += len(entries)
            self.lag_seconds = 0.0 if last >= self.head else self.lag_seconds
            return len(entries)

    def _claim(self) -> bool:
        """Hold the destination's lease (claimed, or renewed when a third of it
        is gone); else read how far the holder has got, for the lag metrics."""
        now = self._clock()
        if self._held_until - now > self._lease_s * 2 / 3:
            return True
        held_before = self._held_until > now
        with self._store.unit_of_work() as uow:
            cursor = uow.claim_export(self.sink.id, self.owner, now, now + self._lease_s)
            theirs = None if cursor is not None else uow.export_cursor(self.sink.id)
            if theirs is not None and self._holder_gone(theirs.owner, now):
                uow.release_export(self.sink.id, theirs.owner)
                cursor = uow.claim_export(self.sink.id, self.owner, now, now + self._lease_s)
            if cursor is None:
                self._held_until = 0.0
        if cursor is None:
            self._follow(theirs.seq if theirs is not None else 0)
            return False
        self._held_until = now + self._lease_s
        if not held_before:  # newly this server's: from the stored cursor, or the sink's own
            self.cursor = cursor.seq
            self._resume_from_sink(now)
            log.info("SIEM export to %s: from record %d", self.sink.id, self.cursor + 1)
        return True

    def _holder_gone(self, holder: str, now: float) -> bool:
        """Whether the lease's holder is a process provably gone (at most one
        look every GONE_CHECK_S: a live holder is the usual answer)."""
        if holder == self.owner or now - self._gone_checked_at < GONE_CHECK_S:
            return False
        self._gone_checked_at = now
        reason = claimant_gone(holder, me=self._me, owner_alive=self._owner_alive)
        if reason is not None:
            log.info("SIEM export to %s: taken from %s before its lease lapsed: %s",
                     self.sink.id, holder.split(";")[0], reason)  # fmt: skip
        return reason is not None

    def _follow(self, seq: int) -> None:
        with self._store.reading() as reads:
            tail = reads.audit_tail(1)
            following = reads.audit_entries_after(seq, 1)
        self.cursor = seq
        self.head = tail[-1].seq if tail else 0
        self.lag_seconds = max(0.0, self._clock() - following[0].at) if following else 0.0

    def _resume_from_sink(self, now: float) -> None:
        """Past the destination's own last event, when it says one that the
        log holds (same seq, same hash): it has everything up to it."""
        written = self.sink.last_written()
        if written is None or written.seq <= self.cursor:
            return
        with self._store.reading() as reads:
            found = reads.audit_entries_after(written.seq - 1, 1)
        if not found or found[0].seq != written.seq or found[0].hash != written.hash:
            log.warning("SIEM export to %s: its last event (record %d of %s) is not this log's;"
                        " following the stored cursor (%d)", self.sink.id, written.seq,
                        written.log_name, self.cursor)  # fmt: skip
            return
        with self._store.unit_of_work() as uow:
            kept = uow.advance_export(
                self.sink.id, self.owner, written.seq, now, now + self._lease_s
            )
        if kept:
            log.info("SIEM export to %s: it already holds records up to %d", self.sink.id,
                     written.seq)  # fmt: skip
            self.cursor = written.seq

    def _line(self, entry: AuditEntry, requests: dict[str, ocsf.RequestFacts]) -> Line:
        event = ocsf.event(entry, self._source, requests)
        return Line(entry.seq, entry.at, entry.kind, int(event["severity_id"]), entry.hash,
                    ocsf.dumps(event))  # fmt: skip


def _requests(reads: StoreReads, entries: Sequence[AuditEntry]) -> dict[str, ocsf.RequestFacts]:
    """Who asked, for what tool, for the approval events that do not say."""
    facts: dict[str, ocsf.RequestFacts] = {}
    for entry in entries:
        wanted = ocsf.request_wanted(entry)
        if wanted and wanted not in facts:
            request = reads.request(wanted)
            if request is not None:
                facts[wanted] = ocsf.RequestFacts(request.requested_by, request.tool_name)
    return facts


def _pause(failures: int) -> float:
    """Seconds before the next attempt after ``failures`` in a row: doubling, capped, jittered."""
    nominal = min(RETRY_S[1], RETRY_S[0] * 2 ** (failures - 1))
    return float(nominal * random.uniform(0.75, 1.25))
