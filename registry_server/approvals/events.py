"""Approval events: every change of an approval request, stored with the
audit entry that records it, and fanned out to the watches open on this
server (docs/how-to/approvals.md, "Watching requests").

One ordered log serves every reader. An event takes the seq of its audit
entry, and audit appends line up (SQLite has one writer; PostgreSQL takes
an advisory lock), so seq order is commit order on every server: a reader
that remembers the last seq it saw misses nothing and sees nothing twice.
Hooks run inside the unit of work that stores the event, so what they
write (webhook deliveries, say) commits or rolls back with it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from registry_server.store import audit_chain as audit
from registry_server.store.base import (
    ApprovalEventRecord,
    ApprovalRequestRecord,
    Store,
    UnitOfWork,
)

log = logging.getLogger(__name__)

OPENED, APPROVAL_ADDED, APPROVED = "OPENED", "APPROVAL_ADDED", "APPROVED"
REJECTED, CONSUMED, EXPIRED = "REJECTED", "CONSUMED", "EXPIRED"
VOIDED = "VOIDED"  # its tool was deleted or disabled (the event's reason says which, and why)
EVENT_TYPES = (OPENED, APPROVAL_ADDED, APPROVED, REJECTED, CONSUMED, EXPIRED, VOIDED)

SWEEP_INTERVAL_S = 1.0  # seconds between looks for requests whose time ran out
SWEEP_BATCH = 100  # expired requests stored per sweep (the rest wait a second)
READ_BATCH = 500  # events read from the store at once
SUBSCRIBER_QUEUE = 1_024  # events a watch may fall behind before it is ended

# Called inside the unit of work that stores ``event``, with the request as it
# is after it: what the hook writes commits with the event, or not at all.
EventHook = Callable[[UnitOfWork, ApprovalEventRecord, ApprovalRequestRecord], None]


def record(
    uow: UnitOfWork,
    type_: str,
    request_id: str,
    audit_record: dict[str, Any] | None,
    hooks: Sequence[EventHook] = (),
    *,
    actor: str = "",
    reason: str = "",
    audit_seq: int = 0,
) -> ApprovalEventRecord:
    """Store one event in ``uow``: with a new audit entry (``audit_record``,
    kind "approval"), or with the entry the caller just appended
    (``audit_seq``: a call's execution record for CONSUMED)."""
    seq = audit_seq or audit.append(uow, "approval", audit_record or {})
    event = ApprovalEventRecord(seq, request_id, type_, actor, reason, round(time.time(), 6))
    uow.add_event(event)
    if hooks:  # read the request only for those who need it (webhooks)
        request = uow.request(request_id)
        if request is not None:
            for hook in hooks:
                hook(uow, event, request)
    return event


@dataclass
class Subscription:
    """One watch: a bounded queue of events it may see. ``overflowed`` is set
    (and the queue closed) when its reader fell more than SUBSCRIBER_QUEUE
    events behind: it must watch again rather than hold the server's memory."""

    wants: Callable[[ApprovalEventRecord], bool]
    events: queue.Queue[ApprovalEventRecord | None]
    overflowed: bool = False
    closed: bool = False


class EventHub:
    """Reads new events from the store when poked (after a local commit, or
    when another server announces one) and hands each to the subscriptions
    that want it. One reader at a time, in seq order."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._cursor = 0  # the last seq handed out
        self._subs: list[Subscription] = []
        self._wakers: list[Callable[[], None]] = []
        self._closed = False

    def start(self) -> None:
        self._store.watch_approvals(self.poke)

    def on_event(self, waker: Callable[[], None]) -> None:
        """Also call ``waker()`` after every poke (a webhook dispatcher wakes)."""
        self._wakers.append(waker)

    def subscribe(self, wants: Callable[[ApprovalEventRecord], bool]) -> Subscription:
        """A subscription that gets every event stored from now on that it
        wants. Subscribe before reading the current state: an event in
        between is then seen twice (harmless), never missed."""
        sub = Subscription(wants, queue.Queue(SUBSCRIBER_QUEUE))
        with self._lock:
            if self._closed:
                sub.closed = True
                sub.events.put_nowait(None)
                return sub
            if not self._subs:
                # Nobody was reading: start from the head, not from history.
                with self._store.reading() as reads:
                    self._cursor = max(self._cursor, reads.last_event_seq())
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def poke(self) -> None:
        with self._lock:
            if self._subs:
                self._deliver()
        for waker in self._wakers:
            try:
                waker()
            except Exception:  # a waker's failure must not stop the hub
                log.exception("approval event waker failed")

    def _deliver(self) -> None:
        while True:
            with self._store.reading() as reads:
                batch = reads.events_after(self._cursor, READ_BATCH)
            for event in batch:
                self._cursor = event.seq
                for sub in list(self._subs):
                    if sub.wants(event):
                        self._offer(sub, event)
            if len(batch) < READ_BATCH:
                return

    def _offer(self, sub: Subscription, event: ApprovalEventRecord) -> None:
        try:
            sub.events.put_nowait(event)
        except queue.Full:
            sub.overflowed = True
            self._subs.remove(sub)
            end_subscription(sub)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for sub in self._subs:
                end_subscription(sub)
            self._subs.clear()


def end_subscription(sub: Subscription) -> None:
    """Wake the reader with the end marker, even when its queue is full."""
    sub.closed = True
    while True:
        try:
            sub.events.put_nowait(None)
            return
        except queue.Full:
            with contextlib.suppress(queue.Empty):
                sub.events.get_nowait()


class ExpirySweeper:
    """Stores each request whose time ran out as EXPIRED, with its event, once
    a second. Every server sweeps; the store's conditional update lets one
    of them record each expiry."""

    def __init__(
        self, store: Store, hub: EventHub, hooks: Sequence[EventHook] = (),
        interval_s: float = SWEEP_INTERVAL_S,
    ) -> None:  # fmt: skip
        self._store = store
        self._hub = hub
        self._hooks = hooks
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="approval-expiry", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def sweep(self, now: float | None = None) -> int:
        """Expire what is due; returns how many this server recorded."""
        now = time.time() if now is None else now
        with self._store.reading() as reads:
            due = reads.expired_open_requests(now, SWEEP_BATCH)
        recorded = 0
        for request_id in due:
            with self._store.unit_of_work() as uow:
                if uow.expire_request(request_id, now):
                    record(uow, EXPIRED, request_id, {"event": "expired", "request_id": request_id},
                           self._hooks)  # fmt: skip
                    recorded += 1
        if recorded:
            self._hub.poke()
        return recorded

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.sweep()
            except Exception:  # the store may be down: try again next time
                log.warning("approval expiry sweep failed; retrying", exc_info=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
