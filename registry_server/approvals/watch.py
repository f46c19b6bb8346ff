"""Watching approval requests: what is open now, then every change as it is
stored (docs/how-to/approvals.md, "Watching requests").

A watch holds a server thread for as long as it is open, so watches are
capped per client and per server, and a watch whose reader falls behind is
ended (its queue is bounded) rather than left to hold memory.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime

from registry_server.approvals.events import Subscription, end_subscription
from registry_server.approvals.service import MAX_LISTED, Approvals, Viewer
from registry_server.domain.errors import Aborted, AtCapacity, InvalidArgument
from registry_server.domain.outcome import ApprovalEventView, ApprovalRequestView
from registry_server.signing.tokens import MAX_REQUEST_ID_CHARS
from registry_server.store.base import APPROVED, PENDING

DEFAULT_MAX_WATCHES = 64  # open watches per server (each holds a gRPC thread)
DEFAULT_MAX_WATCHES_PER_CLIENT = 8  # open watches per client
CURRENT, SYNCED = "CURRENT", "SYNCED"


class Watches:
    def __init__(
        self, approvals: Approvals, *, max_watches: int = DEFAULT_MAX_WATCHES,
        max_per_client: int = DEFAULT_MAX_WATCHES_PER_CLIENT,
    ) -> None:  # fmt: skip
        self._approvals = approvals
        self.max_watches = max_watches
        self._max_per_client = max_per_client
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()
        self._watches: set[Watch] = set()

    def open(self, viewer: Viewer, request_id: str = "") -> Watch:
        """Raises AtCapacity when the caller or the server has every watch it
        may; NotFound when ``request_id`` names no request the viewer sees."""
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidArgument(f"request_id: longer than {MAX_REQUEST_ID_CHARS} characters")
        with self._lock:
            if sum(self._open.values()) >= self.max_watches:
                raise AtCapacity(
                    f"this server has {self.max_watches} approval watches open (its maximum);"
                    " retry later"
                )
            if self._open[viewer.client_id] >= self._max_per_client:
                raise AtCapacity(
                    f"client '{viewer.client_id}' already has {self._max_per_client} approval"
                    " watches open (its maximum); close one first"
                )
            self._open[viewer.client_id] += 1
        try:
            watch = Watch(self, self._approvals, viewer, request_id)
        except BaseException:
            self._closed(viewer.client_id, None)
            raise
        with self._lock:
            self._watches.add(watch)
        return watch

    def end_all(self, reason: str) -> None:
        """End every open watch with ABORTED and ``reason``: after a policy
        reload each client must watch again, and so be authenticated and
        shown what it may see under the policy now in force (a revoked
        client's open stream must not go on)."""
        with self._lock:
            ending = list(self._watches)
        for watch in ending:
            watch.end(reason)

    def _closed(self, client_id: str, watch: Watch | None) -> None:
        with self._lock:
            self._watches.discard(watch)
            self._open[client_id] -= 1
            if self._open[client_id] <= 0:
                del self._open[client_id]


class Watch:
    def __init__(
        self, watches: Watches, approvals: Approvals, viewer: Viewer, request_id: str
    ) -> None:
        self._watches = watches
        self._approvals = approvals
        self._viewer = viewer
        self._request_id = request_id
        # Subscribe first, read the current state second: nothing in between is lost.
        self._sub: Subscription = approvals.hub.subscribe(
            (lambda e: e.request_id == request_id) if request_id else (lambda e: True)
        )
        self._done = False
        self._ended = ""  # why the server ended it, if it did
        try:
            self._current = self._read_current()
        except BaseException:
            self.close()
            raise

    def _read_current(self) -> list[ApprovalRequestView]:
        if self._request_id:
            # One request: its state now, whatever it is (an agent waiting for
            # a request that was approved meanwhile sees that at once).
            self._approvals.get_for(self._request_id, self._viewer)  # NotFound when unseen
            listed = self._approvals.listed(self._request_id)
            return [listed] if listed is not None else []
        found = [
            # Every open request it may see, up to the listing cap of each state.
            *self._approvals.list_requests(PENDING, MAX_LISTED, self._viewer),
            *self._approvals.list_requests(APPROVED, MAX_LISTED, self._viewer),
        ]
        return sorted(found, key=lambda r: r.created_at)

    @property
    def overflowed(self) -> bool:
        return self._sub.overflowed

    def __iter__(self) -> Iterator[ApprovalEventView]:
        try:
            for request in self._current:
                yield ApprovalEventView(CURRENT, request)
            yield ApprovalEventView(SYNCED, None)
            while (event := self._sub.events.get()) is not None:
                now = self._approvals.listed(event.request_id)
                if now is None or not self._approvals.visible(now, self._viewer):
                    continue
                at = datetime.fromtimestamp(event.at, UTC)
                yield ApprovalEventView(event.type, now, event.actor, event.reason, at, event.seq)
            if self._sub.overflowed:
                raise Aborted("this watch fell too far behind the events; watch again")
            if self._ended:
                raise Aborted(self._ended)
        finally:
            self.close()

    def end(self, reason: str) -> None:
        """End the stream with ABORTED and ``reason`` (the server's doing)."""
        self._ended = reason
        end_subscription(self._sub)

    def close(self) -> None:
        """Idempotent; also wakes a reader blocked on the queue."""
        if self._done:
            return
        self._done = True
        self._approvals.hub.unsubscribe(self._sub)
        end_subscription(self._sub)
        self._watches._closed(self._viewer.client_id, self)
