"""Re-attaching through any server on a shared store (PostgreSQL).

The server running a streamed call publishes it to the store's ``kept_calls``
table from a background thread: its output so far and, once ended, its
result. Never on the call's own path: the call only appends to its in-memory
log (call_log.py); the relay writes whatever changed every
``PUBLISH_INTERVAL_S``, and re-publishes a quiet running call every
``BEAT_INTERVAL_S`` so readers can tell it is still alive.

A server asked to attach to a call it does not run itself polls that row. A
call without a result whose row has not been published for ``DEAD_AFTER_S``
belongs to a server that died: the follower ends with a SANDBOX_ERROR result
saying so (docs/how-to/scaling.md "Re-attaching across servers").
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

from registry_server.domain.errors import AtCapacity, NotFound, StoreError, ToolregError
from registry_server.domain.outcome import Outcome, Status
from registry_server.execution.call_log import NOT_KEPT, CallEvent, CallLog, KeptCall
from registry_server.store.base import KeptCallRecord, Store

log = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.25  # seconds between publications of new output
BEAT_INTERVAL_S = 2.0  # seconds: a running call is re-published at least this often
DEAD_AFTER_S = 10.0  # seconds without a publication after which the call's server is dead
POLL_S = 0.2  # seconds between a remote follower's reads of the row
# Seconds a follower looks for a call's row before NOT_FOUND: a call is published
# within PUBLISH_INTERVAL_S of its start, and a client whose stream broke at once
# may re-attach through another server before that. Unknown and foreign ids wait
# as long, so the answer's timing does not tell another client's call from none.
APPEAR_WITHIN_S = 1.0
PRUNE_EVERY_S = 30.0  # seconds between deletions of expired rows
PRUNE_BATCH = 500  # rows deleted at most per pruning
MAX_PUBLISHED_BYTES = 1024 * 1024  # bytes per stream a call publishes (the result has all)
# Each publication rewrites the call's whole row: a call whose published output is
# large is published less often, so that one chatty tool writes at most about this
# many bytes a second to the shared database (a 1 MiB row: once a second).
PUBLISH_BYTES_PER_S = 1024 * 1024
SERVER_GONE = (
    "the server running this call stopped before the call ended; its output after"
    " that point and its result are lost"
)
FAILED_ON_SERVER = "the call failed on the server"
# Open AttachExecution streams: each holds a gRPC thread for as long as its call
# runs, so they are capped per server (config.grpc_threads counts them) and per
# client, as approval watches are: else one client's attachments to one call
# would take every thread and starve every other client's RPCs.
MAX_ATTACHED = 64
MAX_ATTACHED_PER_CLIENT = 8


def failed_call(exc: BaseException, execution_id: str) -> Outcome:
    """The result kept for a started call whose execution raised (no engine,
    no audit record): what a re-attached client receives in place of one."""
    reason = exc.message if isinstance(exc, ToolregError) else FAILED_ON_SERVER
    return Outcome(Status.SANDBOX_ERROR, error=reason, execution_id=execution_id)


def outcome_json(outcome: Outcome) -> str:
    """A started call's outcome as stored (it never carries an approval request)."""
    fields = {
        "status": outcome.status.value, "content": outcome.content,
        "data_json": outcome.data_json, "error": outcome.error,
        "exit_code": outcome.exit_code, "stderr": outcome.stderr,
        "duration_ms": outcome.duration_ms, "output_truncated": outcome.output_truncated,
        "execution_id": outcome.execution_id,
    }  # fmt: skip
    return json.dumps(fields)


def outcome_from_json(text: str) -> Outcome:
    fields = json.loads(text)
    return Outcome(
        Status(fields["status"]), content=str(fields["content"]),
        data_json=str(fields["data_json"]), error=str(fields["error"]),
        exit_code=int(fields["exit_code"]), stderr=str(fields["stderr"]),
        duration_ms=int(fields["duration_ms"]),
        output_truncated=bool(fields["output_truncated"]),
        execution_id=str(fields["execution_id"]),
    )  # fmt: skip


class CallRelay:
    """Publishes this server's calls to the store and follows other servers'."""

    def __init__(
        self,
        calls: CallLog,
        store: Store,
        server_id: str,
        clock: Callable[[], float] = time.time,
        appear_within_s: float = APPEAR_WITHIN_S,
    ) -> None:
        self._calls = calls
        self._store = store
        self._server = server_id
        self._clock = clock
        self._appear_within_s = appear_within_s
        # execution id -> (version, at, bytes) of its last publication
        self._published: dict[str, tuple[int, float, int]] = {}
        self._last_prune = 0.0
        self._last_end_seq = 0  # the calls that ended up to this one are published
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="call-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)
        self.publish_once()  # the last results, so attachers elsewhere get them

    def _loop(self) -> None:
        while not self._stop.wait(PUBLISH_INTERVAL_S):
            try:
                self.publish_once()
            except StoreError as exc:
                log.warning("could not publish running calls: %s", exc)

    def publish_once(self) -> None:
        now = self._clock()
        running = self._calls.running()
        ended = self._calls.ended_after(self._last_end_seq)
        due = [c for c in running + ended if self._due(c, now)]
        if due:
            with self._store.unit_of_work() as uow:
                for call in due:
                    record, version = self._record(call, now)
                    uow.put_kept_call(record)
                    size = len(record.stdout) + len(record.stderr)
                    self._published[call.execution_id] = (version, now, size)
        for call in ended:  # published with its result: nothing more to send
            self._published.pop(call.execution_id, None)
            self._last_end_seq = max(self._last_end_seq, call.end_seq)
        # A call that ended and left the log (its grace, the log's bounds) before
        # this look is in neither list: forget it too, or this map grows forever.
        if len(self._published) > len(running):
            live = {c.execution_id for c in running}
            self._published = {k: v for k, v in self._published.items() if k in live}
        if now - self._last_prune >= PRUNE_EVERY_S:
            with self._store.unit_of_work() as uow:
                pruned = uow.prune_kept_calls(now - self._calls.grace_s, PRUNE_BATCH)
            # A full batch: more are due (short calls end faster than one batch
            # per PRUNE_EVERY_S), so prune again at the next look, not in 30 s:
            # else the table grows without bound.
            self._last_prune = now if pruned < PRUNE_BATCH else now - PRUNE_EVERY_S

    def _due(self, call: KeptCall, now: float) -> bool:
        version, at, size = self._published.get(call.execution_id, (-1, 0.0, 0))
        if call.outcome is not None:
            return call.version != version  # its result goes out at once
        if call.version != version and now - at >= size / PUBLISH_BYTES_PER_S:
            return True
        return now - at >= BEAT_INTERVAL_S

    def _record(self, call: KeptCall, now: float) -> tuple[KeptCallRecord, int]:
        stdout, stderr, outcome, version = self._calls.snapshot(call)
        record = KeptCallRecord(
            execution_id=call.execution_id, caller=call.caller, server=self._server,
            stdout=stdout[:MAX_PUBLISHED_BYTES], stderr=stderr[:MAX_PUBLISHED_BYTES],
            result_json=outcome_json(outcome) if outcome is not None else "",
            beat_at=now, ended_at=now if outcome is not None else None,
        )  # fmt: skip
        return record, version

    def follow(
        self,
        execution_id: str,
        caller: str,
        stdout_offset: int,
        stderr_offset: int,
        stopped: threading.Event,
    ) -> Iterator[CallEvent]:
        """Another server's call, read from the store until it has a result
        (or its server is found dead)."""
        sent = {"stdout": stdout_offset, "stderr": stderr_offset}
        first = True
        looks = max(1, round(self._appear_within_s / POLL_S) + 1)  # the first look and the polls
        while not stopped.is_set():
            with self._store.reading() as reads:
                row = reads.kept_call(execution_id)
            now = self._clock()
            if row is None or row.caller != caller or self._expired(row, now):
                if first:
                    looks -= 1
                    if looks > 0:
                        stopped.wait(POLL_S)  # not published yet, perhaps
                        continue
                    raise NotFound(NOT_KEPT)
                # Pruned while followed: its server stopped publishing long ago.
                yield self._gone(execution_id)
                return
            first = False
            for stream, data in (("stdout", row.stdout), ("stderr", row.stderr)):
                if len(data) > sent[stream]:
                    yield CallEvent(stream, data[sent[stream] :])
                    sent[stream] = len(data)
            if row.result_json:
                yield CallEvent("result", outcome=outcome_from_json(row.result_json))
                return
            if now - row.beat_at > DEAD_AFTER_S:
                yield self._gone(execution_id)
                return
            stopped.wait(POLL_S)

    def _expired(self, row: KeptCallRecord, now: float) -> bool:
        return row.ended_at is not None and now - row.ended_at > self._calls.grace_s

    @staticmethod
    def _gone(execution_id: str) -> CallEvent:
        outcome = Outcome(Status.SANDBOX_ERROR, error=SERVER_GONE, execution_id=execution_id)
        return CallEvent("result", outcome=outcome)


class Attachments:
    """AttachExecution's domain: this server's own calls from memory, others'
    through the relay (when the store is shared)."""

    def __init__(
        self,
        calls: CallLog,
        relay: CallRelay | None,
        *,
        max_open: int = MAX_ATTACHED,
        max_per_client: int = MAX_ATTACHED_PER_CLIENT,
    ) -> None:
        self._calls = calls
        self._relay = relay
        self._max_open = max_open
        self._max_per_client = max_per_client
        self._lock = threading.Lock()
        self._open: Counter[str] = Counter()

    def follow(
        self,
        execution_id: str,
        caller: str,
        stdout_offset: int,
        stderr_offset: int,
        stopped: threading.Event,
    ) -> Iterator[CallEvent]:
        """The call's events; AtCapacity (before any look-up) when the server
        or the caller has every attachment it may have open."""
        self._open_one(caller)
        try:
            if self._calls.find(execution_id, caller) is not None or self._relay is None:
                events = self._calls.follow(
                    execution_id, caller, stdout_offset, stderr_offset, stopped
                )
            else:
                events = self._relay.follow(
                    execution_id, caller, stdout_offset, stderr_offset, stopped
                )
            yield from events
        finally:
            with self._lock:
                self._open[caller] -= 1
                if self._open[caller] <= 0:
                    del self._open[caller]

    def _open_one(self, caller: str) -> None:
        with self._lock:
            if sum(self._open.values()) >= self._max_open:
                raise AtCapacity(
                    f"this server has {self._max_open} attachments open (its maximum); retry later"
                )
            if self._open[caller] >= self._max_per_client:
                raise AtCapacity(
                    f"client '{caller}' already has {self._max_per_client} attachments open"
                    " (its maximum); close one first"
                )
            self._open[caller] += 1
