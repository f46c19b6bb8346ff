"""Sends the outbox (outbox.py): one thread per server claims due deliveries
and hands each to a small pool of sender threads, so a receiver that is down
or slow costs at most ``concurrency`` threads waiting ``timeout_s`` each,
never an RPC's time.

* Claims are leases (store/base.py ``claim_webhook_deliveries``): with
  several servers on PostgreSQL each delivery is claimed by one of them, and
  a server that dies mid-send has its claims taken over once they lapse, or
  at once by a server that can prove its process gone (claimant.py: its own
  previous process after a crash, or another one on the same host).
  Only as many are claimed as there are free senders, so a claim is never
  held by a delivery waiting in a queue.
* Every attempt is signed with the ``standardwebhooks`` library (webhook-id
  stays the same across attempts; webhook-timestamp is the attempt's own, as
  receivers refuse old ones). 2xx is delivered; anything else, a redirect
  included, is tried again after ``outbox.retry_delay`` until the attempts
  run out, then the delivery is failed, logged and counted.
* The dispatcher wakes when an event commits here, when another server
  announces one (EventHub.on_event), and at the next due retry.

Logs name the endpoint by its policy id, never by its URL (Slack's URLs are
credentials) and never show a body or a secret.
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from typing import Protocol

import httpx

from registry_server.domain.errors import StoreError
from registry_server.domain.text import escape
from registry_server.notify.claimant import claimant, claimant_gone
from registry_server.notify.endpoints import Endpoint
from registry_server.notify.outbox import (
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_RETRY_BASE_S,
    retry_delay,
)
from registry_server.policy.webhooks import MAX_WEBHOOK_TIMEOUT_S
from registry_server.store.base import (
    DELIVERED,
    DELIVERY_FAILED,
    Store,
    WebhookDeliveryRecord,
)
from sandbox_runner.ownership import OwnerIdentity, process_alive

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 4  # deliveries in flight at once, per server
POLL_S = 5.0  # seconds between looks at the outbox when nothing wakes the dispatcher
# A claim outlives the slowest attempt twice over: it lapses (and another
# server takes the delivery) only when its server is gone.
CLAIM_LEASE_S = 2 * MAX_WEBHOOK_TIMEOUT_S + 10
MAX_ERROR_CHARS = 300  # characters of an attempt's error kept in the outbox
KEEP_FINISHED_S = 7 * 86_400  # seconds delivered and failed rows stay (for inspection)
PRUNE_EVERY_S = 3_600.0  # seconds between prunes of old finished rows
PRUNE_BATCH = 1_000  # rows deleted per prune
CLOSE_WAIT_S = 2.0  # seconds close() waits for attempts in flight
MIN_WAIT_S = 0.01  # seconds: the shortest wait between two looks at the outbox
# seconds between looks for claims of dead processes while a due delivery is
# claimed elsewhere (the first look is at the dispatcher's first turn)
GONE_CHECK_S = 5.0
USER_AGENT = "toolreg-webhooks/1"
# Outcomes (the metric's label values)
OUT_DELIVERED, OUT_RETRIED, OUT_FAILED = "delivered", "retried", "failed"
UNKNOWN_ENDPOINT = "(not in policy)"


class DeliveryError(Exception):
    """An attempt that got no HTTP answer; the message is safe to store and log."""


class Transport(Protocol):
    def post(self, endpoint: Endpoint, body: bytes, headers: Mapping[str, str]) -> int:
        """POST ``body``; the HTTP status, or DeliveryError."""
        ...

    def close(self) -> None: ...


class HttpTransport:
    """httpx, one client per endpoint (its own TLS verification and timeout).
    No redirects (a signed body must not be handed on to wherever a 3xx
    points), no proxies or certificates from the environment (what is
    trusted is the policy's to say), and the answer's body is never read."""

    def __init__(self, endpoints: Mapping[str, Endpoint]) -> None:
        self._clients = {
            e.id: httpx.Client(
                # the system's CAs (httpx alone would use certifi's), or the endpoint's ca_file
                verify=e.tls if e.tls is not None else ssl.create_default_context(),
                timeout=httpx.Timeout(e.spec.timeout_s),
                follow_redirects=False,
                trust_env=False,
                headers={"user-agent": USER_AGENT},
            )
            for e in endpoints.values()
        }

    def post(self, endpoint: Endpoint, body: bytes, headers: Mapping[str, str]) -> int:
        try:
            with self._clients[endpoint.id].stream(
                "POST", endpoint.spec.url, content=body, headers=dict(headers)
            ) as answer:
                return answer.status_code
        except httpx.HTTPError as exc:
            # httpx messages may quote the URL; ours may hold a credential.
            reason = str(exc).replace(endpoint.spec.url, "<url>") or "no answer"
            raise DeliveryError(f"{type(exc).__name__}: {reason}") from None

    def close(self) -> None:
        for client in self._clients.values():
            client.close()


def signed_headers(endpoint: Endpoint, webhook_id: str, body: str, now: float) -> dict[str, str]:
    """The Standard Webhooks headers for one attempt at time ``now``."""
    timestamp = datetime.fromtimestamp(int(now), UTC)
    return {
        "content-type": "application/json",
        "webhook-id": webhook_id,
        "webhook-timestamp": str(int(now)),
        "webhook-signature": endpoint.signer.sign(webhook_id, timestamp, body),
    }


class Dispatcher:
    def __init__(
        self,
        store: Store,
        endpoints: Mapping[str, Endpoint],
        transport: Transport | None = None,
        *,
        concurrency: int = DEFAULT_CONCURRENCY,
        retry_base_s: float = DEFAULT_RETRY_BASE_S,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        observe: Callable[[str, str], None] = lambda endpoint, outcome: None,
        clock: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
        poll_s: float = POLL_S,
        owner_alive: Callable[[int, int], bool] = process_alive,
    ) -> None:
        self._store = store
        self._endpoints = dict(endpoints)
        self._transport = transport if transport is not None else HttpTransport(endpoints)
        self._concurrency = concurrency
        self._retry_base_s = retry_base_s
        self._max_attempts = max_attempts
        self._observe = observe
        self._clock = clock
        self._rng = rng
        self._poll_s = poll_s
        self._me = OwnerIdentity.current()
        self._owner_alive = owner_alive
        self.owner = claimant(self._me)
        self._gone_checked_at: float | None = None  # None: not yet
        self.backlog = 0  # pending deliveries at the last look (a gauge reads it)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="webhook")
        self._thread = threading.Thread(target=self._run, name="webhook-dispatcher", daemon=True)
        self._pruned_at = 0.0

    # -- the loop ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """An event was stored (here or on another server): look now. Cheap,
        and never blocks: the hub calls it on the RPC's thread."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before looking: a wake during the turn is kept
            wait_s = self._poll_s
            try:
                wait_s = self._turn()
            except StoreError as exc:
                log.warning("webhook dispatcher: the store failed (%s); retrying", exc)
            except Exception:  # a bug must not end delivery for good
                log.exception("webhook dispatcher: unexpected failure; retrying")
            self._wake.wait(max(0.0, wait_s))

    def _turn(self) -> float:
        """Claim and hand out what is due; seconds until the next look."""
        if self._gone_checked_at is None:
            self.take_back_from_the_gone()  # a crash's leftovers, before the first claim
        with self._lock:
            free = self._concurrency - self._in_flight
        claimed = self._claim(free) if free > 0 else []
        for delivery in claimed:
            with self._lock:
                self._in_flight += 1
            self._pool.submit(self._send_and_release, delivery)
        self._prune_now_and_then()
        with self._store.reading() as reads:
            backlog = reads.webhook_backlog()
        self.backlog = backlog.pending
        if claimed and len(claimed) == free:
            return self._poll_s  # senders busy: their ends wake the loop
        if backlog.next_due is None:
            return self._poll_s
        wait = backlog.next_due - self._clock()
        if wait <= 0:
            # Due but not claimable: in flight here (a sender's end wakes the
            # loop) or claimed by another server. Never spin on it; look
            # again at once only when that server proved to be gone.
            checked = self._gone_checked_at
            if (checked is None or self._clock() - checked >= GONE_CHECK_S) and (
                self.take_back_from_the_gone()
            ):
                return MIN_WAIT_S
            return self._poll_s
        return max(MIN_WAIT_S, min(self._poll_s, wait))

    def take_back_from_the_gone(self) -> int:
        """Release the claims of dispatchers whose process is provably gone
        (claimant.py), so they are claimed now rather than when their lease
        lapses; how many. A live claimant's claims, or another host's, stay."""
        now = self._clock()
        self._gone_checked_at = now
        with self._store.reading() as reads:
            holders = reads.webhook_claimants(now)
        released = 0
        for holder in holders:
            if holder == self.owner:
                continue
            reason = claimant_gone(holder, me=self._me, owner_alive=self._owner_alive)
            if reason is None:
                continue
            with self._store.unit_of_work() as uow:
                count = uow.release_webhook_claims(holder)
            released += count
            if count:
                log.info("webhook outbox: %d delivery(ies) claimed by %s taken back before"
                         " their claim lapsed: %s", count, holder.split(";")[0],
                         reason)  # fmt: skip
        return released

    def _claim(self, limit: int) -> list[WebhookDeliveryRecord]:
        now = self._clock()
        with self._store.unit_of_work() as uow:
            return uow.claim_webhook_deliveries(self.owner, now, now + CLAIM_LEASE_S, limit)

    def _send_and_release(self, delivery: WebhookDeliveryRecord) -> None:
        try:
            self.attempt(delivery)
        except Exception as exc:  # the claim lapses and the delivery is tried again
            if self._stop.is_set():  # cut short by close(): expected, not a fault
                log.info("webhook %s: attempt cut short by shutdown (%s); it is sent again"
                         " once its claim lapses", delivery.webhook_id,
                         type(exc).__name__)  # fmt: skip
            else:
                log.exception("webhook %s: attempt failed unexpectedly", delivery.webhook_id)
        finally:
            with self._lock:
                self._in_flight -= 1
                self._idle.notify_all()
            self._wake.set()  # a sender is free: there may be more to claim

    def pump(self) -> int:
        """Claim and attempt what is due now, on this thread (tests drive it)."""
        self.take_back_from_the_gone()
        claimed = self._claim(self._concurrency)
        for delivery in claimed:
            self.attempt(delivery)
        return len(claimed)

    # -- one attempt -------------------------------------------------------------------

    def attempt(self, delivery: WebhookDeliveryRecord) -> str:
        """Send a claimed delivery once and store the outcome; returns it
        (delivered, retried, failed)."""
        endpoint = self._endpoints.get(delivery.endpoint)
        if endpoint is None:
            # The policy no longer names it (the servers must share one policy).
            error = f"endpoint {delivery.endpoint!r} is not in this server's policy"
            return self._finish(delivery, None, error, label=UNKNOWN_ENDPOINT, give_up=True)
        now = self._clock()
        headers = signed_headers(endpoint, delivery.webhook_id, delivery.payload, now)
        try:
            status = self._transport.post(endpoint, delivery.payload.encode(), headers)
        except DeliveryError as exc:
            return self._finish(delivery, None, str(exc), label=endpoint.id)
        if 200 <= status < 300:
            return self._finish(delivery, status, "", label=endpoint.id)
        note = " (redirects are not followed)" if 300 <= status < 400 else ""
        return self._finish(delivery, status, f"HTTP {status}{note}", label=endpoint.id)

    def _finish(
        self, delivery: WebhookDeliveryRecord, status: int | None, error: str, *, label: str,
        give_up: bool = False,
    ) -> str:  # fmt: skip
        now = self._clock()
        attempts = delivery.attempts + 1
        if not error:
            outcome = OUT_DELIVERED
            done = replace(delivery, state=DELIVERED, attempts=attempts, delivered_at=now,
                           last_error="")  # fmt: skip
        elif give_up or attempts >= self._max_attempts:
            outcome = OUT_FAILED
            done = replace(delivery, state=DELIVERY_FAILED, attempts=attempts,
                           last_error=_capped(error))  # fmt: skip
        else:
            outcome = OUT_RETRIED
            wait = retry_delay(attempts, self._retry_base_s, self._rng)
            done = replace(delivery, attempts=attempts, next_attempt_at=now + wait,
                           last_error=_capped(error))  # fmt: skip
        with self._store.unit_of_work() as uow:
            kept = uow.finish_webhook_delivery(done, self.owner)
        if not kept:
            log.info("webhook %s: claim lapsed before the outcome was stored (%s); another"
                     " server has it", delivery.webhook_id, outcome)  # fmt: skip
        self._observe(label, outcome)
        if outcome == OUT_FAILED:
            log.error("webhook %s to endpoint %s failed for good after %d attempt(s): %s",
                      delivery.webhook_id, delivery.endpoint, attempts,
                      done.last_error)  # fmt: skip
        elif outcome == OUT_RETRIED:
            log.warning("webhook %s to endpoint %s: attempt %d failed (%s); next in %.0f s",
                        delivery.webhook_id, delivery.endpoint, attempts, done.last_error,
                        done.next_attempt_at - now)  # fmt: skip
        else:
            log.debug("webhook %s delivered to %s (HTTP %s)", delivery.webhook_id,
                      delivery.endpoint, status)  # fmt: skip
        return outcome

    def _prune_now_and_then(self) -> None:
        now = self._clock()
        if now - self._pruned_at < PRUNE_EVERY_S:
            return
        self._pruned_at = now
        with self._store.unit_of_work() as uow:
            pruned = uow.prune_webhook_deliveries(now - KEEP_FINISHED_S, PRUNE_BATCH)
        if pruned:
            log.info("webhook outbox: removed %d finished deliveries older than %d days",
                     pruned, KEEP_FINISHED_S // 86_400)  # fmt: skip

    def close(self) -> None:
        """Stop claiming, give attempts in flight CLOSE_WAIT_S to end, then
        close the connections. An attempt cut short keeps its claim until the
        lease lapses; the delivery is then sent again (same webhook-id)."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=CLOSE_WAIT_S)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._transport.close()


def _capped(error: str) -> str:
    error = escape(error)
    return error if len(error) <= MAX_ERROR_CHARS else error[: MAX_ERROR_CHARS - 1] + "…"
