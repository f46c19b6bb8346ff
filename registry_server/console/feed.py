"""Live approval requests for the console's pages: one WatchApprovalRequests
per approver client, with that client's own bearer, shared by every page it
has open.

The registry caps watches per client and per server, so pages never open
their own: a client's first open page starts its watch, the last one to close
stops it. The watch is read on a thread of its own (gRPC streams block) and
each event is handed to the event loop, which keeps the open requests as last
seen (so a page opened later starts from them) and copies the event to every
page's queue. A page whose queue fills is told to resync (its stream ends and
the browser reconnects to a fresh start) rather than holding the others up.
When the watch ends (the registry stops, or ends a watch that fell behind)
pages are told, and it is opened again after a pause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.client.registry_client import RegistryClient, describe_rpc_error
from registry_server.client.terminal import escape
from registry_server.console import views
from registry_server.wire import convert

log = logging.getLogger("toolreg.console")

PAGE_QUEUE_SIZE = 256  # events waiting for one page before it is told to resync
RETRY_DELAYS_S = (1.0, 2.0, 5.0, 10.0)  # seconds before re-opening an ended watch, growing

Item = dict[str, Any]  # one message for a page (JSON-ready, text escaped)


class Page:
    """One open event stream: what the loop delivers to it."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Item] = asyncio.Queue(PAGE_QUEUE_SIZE)

    def deliver(self, item: Item) -> bool:
        """Queue ``item``; False when the page is behind (told to resync instead)."""
        try:
            self.queue.put_nowait(item)
            return True
        except asyncio.QueueFull:
            self.last_word({"kind": "resync"})
            return False

    def last_word(self, item: Item) -> None:
        """Replace whatever waits with ``item``: the page's stream ends on it."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(item)


class _Watch(threading.Thread):
    """The registry watch of one client, re-opened when it ends, until stopped."""

    def __init__(
        self,
        client: RegistryClient,
        on_event: Callable[[_Watch, pb.ApprovalEvent], None],
        on_end: Callable[[_Watch, str], None],
    ) -> None:
        super().__init__(name="console-watch", daemon=True)
        self._client = client
        self._on_event = on_event
        self._on_end = on_end
        self._stopped = threading.Event()
        self._call: Any = None

    def run(self) -> None:
        attempt = 0
        while not self._stopped.is_set():
            call = self._client.stub.WatchApprovalRequests(pb.WatchApprovalRequestsRequest())
            self._call = call
            if self._stopped.is_set():  # stop() ran before the call was there to cancel
                call.cancel()
                return
            try:
                for message in call:
                    self._on_event(self, message)
                    attempt = 0
                reason = "the registry ended the watch"
            except grpc.RpcError as err:
                reason = describe_rpc_error(err).splitlines()[0]
            except Exception as exc:
                # An event this console cannot read: start over rather than let
                # the thread die and leave every page waiting in silence.
                log.exception("approval watch: unreadable event")
                call.cancel()
                reason = f"an event this console could not read ({type(exc).__name__})"
            if self._stopped.is_set():
                return
            log.warning("approval watch ended (%s); opening it again", reason)
            self._on_end(self, reason)
            self._stopped.wait(RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)])
            attempt += 1

    def stop(self) -> None:
        self._stopped.set()
        call = self._call
        if call is not None:
            call.cancel()


class Feed:
    """The open requests one client may approve, and its open pages."""

    def __init__(self, client: RegistryClient) -> None:
        self._client = client
        self._pages: set[Page] = set()
        self._open: dict[str, Item] = {}  # request id -> its last summary event
        self._synced = False
        self._watch: _Watch | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def join(self, page: Page) -> None:
        """Start ``page`` from the open requests as last seen, then keep it current."""
        page.deliver({"kind": "start"})
        for item in self._open.values():
            page.deliver(dict(item, event="CURRENT"))
        if self._synced:
            page.deliver({"kind": "synced"})
        self._pages.add(page)
        if self._watch is None:
            self._loop = asyncio.get_running_loop()
            self._watch = _Watch(self._client, self._received, self._ended)
            self._watch.start()

    def leave(self, page: Page) -> None:
        self._pages.discard(page)
        if not self._pages:
            self.stop()

    def stop(self) -> None:
        """Stop the watch (no page left, or shutting down); a later page starts anew."""
        if self._watch is not None:
            self._watch.stop()
        self._watch = None
        self._open.clear()
        self._synced = False

    # The watch's thread hands each event to the loop; a stopped watch's
    # late events are dropped there (it is no longer self._watch).

    def _received(self, watch: _Watch, message: pb.ApprovalEvent) -> None:
        self._to_loop(self._apply, watch, convert.approval_event_from_pb(message))

    def _ended(self, watch: _Watch, reason: str) -> None:
        self._to_loop(self._reset, watch, reason)

    def _to_loop(self, handler: Callable[..., None], *args: Any) -> None:
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: shutting down
                self._loop.call_soon_threadsafe(handler, *args)

    def _apply(self, watch: _Watch, event: Any) -> None:
        if watch is not self._watch:
            return
        if event.type == "SYNCED":
            self._synced = True
            self._broadcast({"kind": "synced"})
            return
        item = views.event(event)
        if item is None:
            return
        if event.request.state in views.OPEN_STATES:
            self._open[event.request.id] = item
        else:
            self._open.pop(event.request.id, None)
        self._broadcast(item)

    def _reset(self, watch: _Watch, reason: str) -> None:
        if watch is not self._watch:
            return
        self._open.clear()
        self._synced = False
        self._broadcast({"kind": "reset", "error": escape(reason)})

    def _broadcast(self, item: Item) -> None:
        # A page that is behind resyncs: its stream ends and the browser rejoins.
        behind = [page for page in self._pages if not page.deliver(item)]
        self._pages.difference_update(behind)
        if behind and not self._pages:
            self.stop()


class Feeds:
    """One Feed per client id, made on the first page it opens."""

    def __init__(self, client_for: Callable[[str], RegistryClient]) -> None:
        self._client_for = client_for
        self._by_client: dict[str, Feed] = {}

    def of(self, client_id: str) -> Feed:
        feed = self._by_client.get(client_id)
        if feed is None:
            feed = self._by_client[client_id] = Feed(self._client_for(client_id))
        return feed

    def stop_all(self) -> None:
        for feed in self._by_client.values():
            feed.stop()
