"""Kept calls: the output and result of each streamed call, kept while it runs
and for a grace period after it ends, so a client whose stream broke can
re-attach (AttachExecution) and receive what it missed, then the result
(docs/how-to/from-your-agent.md, "Re-attaching to a running call").

What is kept is what the stream carried: the redacted chunks, within the
tool's output caps (plus a hard per-stream bound here). Ended calls are
bounded in number and in bytes; the oldest go first. Only the client that
made a call may follow it: any other caller, or an unknown or expired id, is
the same NOT_FOUND, so ids cannot be probed.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from registry_server.domain.errors import FailedPrecondition, InvalidArgument, NotFound, Violation
from registry_server.domain.models import MAX_OUTPUT_BYTES
from registry_server.domain.outcome import Outcome

DEFAULT_GRACE_S = 120.0  # seconds an ended call stays attachable
MAX_GRACE_S = 3600.0  # seconds: the most an operator may set
DEFAULT_MAX_ENDED = 1000  # ended calls kept at once, per server
DEFAULT_MAX_ENDED_BYTES = 256 * 1024 * 1024  # bytes of output kept for ended calls, per server
# Ended calls kept per client: one busy client's calls push out its own oldest,
# never another client's still in their grace (the server-wide bounds alone let
# one client's stream of short calls evict every other client's results).
DEFAULT_MAX_ENDED_PER_CLIENT = 100
CLOSE_WAIT_S = 5.0  # seconds a stopping server waits for the calls it cancelled
WAIT_SLICE_S = 0.5  # seconds a follower waits before checking whether its RPC ended
EXECUTION_ID_PATTERN = re.compile(r"^[0-9a-f]{32}$")  # what the executor issues (uuid4 hex)
NOT_KEPT = "no such call is kept for this client"
NOT_RUNNING = "no such call runs on this server for this client"
MAX_CANCEL_REASON_CHARS = 1000  # characters of a CancelExecution reason


class CallCancel(threading.Event):
    """A call's cancel event (the runner kills the container when set) that
    also says who asked to stop it and why, when CancelExecution did: the
    executor then reports CANCELLED and records both in the audit."""

    def __init__(self) -> None:
        super().__init__()
        self.by = ""
        self.reason = ""

    def cancel(self, by: str, reason: str) -> None:
        if not self.is_set():  # the first ask stands (a second one is a no-op)
            self.by, self.reason = by, reason
        self.set()


@dataclass(frozen=True)
class CallEvent:
    """One thing a follower receives: a chunk of ``stdout`` or ``stderr``, or
    (last) the call's ``outcome``."""

    stream: str  # "stdout", "stderr" or "result"
    data: bytes = b""
    outcome: Outcome | None = None


@dataclass
class KeptCall:
    execution_id: str
    caller: str
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    outcome: Outcome | None = None
    ended_at: float | None = None  # the log's clock
    version: int = 0  # bumped on every change (what the relay publishes)
    cancel: threading.Event | None = field(default=None, repr=False)  # stops the call
    end_seq: int = 0  # its place in the order calls ended (1, 2, ...; 0 while running)

    @property
    def kept_bytes(self) -> int:
        return len(self.stdout) + len(self.stderr)


def check_cancel(execution_id: str, reason: str) -> None:
    """A malformed CancelExecution is refused before any look-up."""
    violations = []
    if not EXECUTION_ID_PATTERN.fullmatch(execution_id):
        rule = "not an execution id (32 lowercase hex digits)"
        violations.append(Violation("execution_id", rule))
    if len(reason) > MAX_CANCEL_REASON_CHARS:
        violations.append(Violation("reason", f"longer than {MAX_CANCEL_REASON_CHARS} characters"))
    elif any(ord(c) < 32 or 127 <= ord(c) < 160 for c in reason):
        violations.append(Violation("reason", "holds control characters"))
    if violations:
        raise InvalidArgument("; ".join(str(v) for v in violations), violations)


def check_attach(execution_id: str, stdout_offset: int, stderr_offset: int) -> None:
    """A malformed request is refused before any look-up (and the id never echoed)."""
    violations = []
    if not EXECUTION_ID_PATTERN.fullmatch(execution_id):
        rule = "not an execution id (32 lowercase hex digits)"
        violations.append(Violation("execution_id", rule))
    for name, offset in (("stdout_offset", stdout_offset), ("stderr_offset", stderr_offset)):
        if offset < 0:
            violations.append(Violation(name, "must not be negative"))
    if violations:
        raise InvalidArgument("; ".join(str(v) for v in violations), violations)


class CallLog:
    """This server's kept calls. Thread-safe: the call's thread appends, any
    number of followers read, all under one condition variable."""

    def __init__(
        self,
        grace_s: float = DEFAULT_GRACE_S,
        max_ended: int = DEFAULT_MAX_ENDED,
        max_ended_bytes: int = DEFAULT_MAX_ENDED_BYTES,
        clock: Callable[[], float] = time.monotonic,
        max_ended_per_client: int = DEFAULT_MAX_ENDED_PER_CLIENT,
    ) -> None:
        self._grace_s = grace_s
        self._max_ended = max_ended
        self._max_ended_bytes = max_ended_bytes
        self._max_per_client = max_ended_per_client
        self._ended_by: Counter[str] = Counter()  # caller -> its ended calls kept
        self._clock = clock
        self._changed = threading.Condition()
        self._running: dict[str, KeptCall] = {}
        self._ended: OrderedDict[str, KeptCall] = OrderedDict()  # oldest end first
        self._ended_bytes = 0
        self._end_seq = 0

    @property
    def grace_s(self) -> float:
        return self._grace_s

    def start(
        self, execution_id: str, caller: str, cancel: threading.Event | None = None
    ) -> KeptCall:
        call = KeptCall(execution_id, caller, cancel=cancel)
        with self._changed:
            self._running[execution_id] = call
        return call

    def append(self, call: KeptCall, stream: str, chunk: bytes) -> None:
        buffer = call.stdout if stream == "stdout" else call.stderr
        room = MAX_OUTPUT_BYTES - len(buffer)
        if room <= 0 or not chunk:
            return
        with self._changed:
            buffer += chunk[:room]
            call.version += 1
            self._changed.notify_all()

    def finish(self, call: KeptCall, outcome: Outcome) -> None:
        with self._changed:
            call.outcome, call.ended_at = outcome, self._clock()
            call.version += 1
            self._end_seq += 1
            call.end_seq = self._end_seq
            if self._running.pop(call.execution_id, None) is not None:
                self._ended[call.execution_id] = call
                self._ended_bytes += call.kept_bytes
                self._ended_by[call.caller] += 1
                if self._ended_by[call.caller] > self._max_per_client:
                    oldest = next(c for c in self._ended.values() if c.caller == call.caller)
                    self._forget(oldest)
            self._trim()
            self._changed.notify_all()

    def find(self, execution_id: str, caller: str) -> KeptCall | None:
        """The caller's kept call, or None (unknown, expired, or another's)."""
        with self._changed:
            self._trim()
            call = self._running.get(execution_id) or self._ended.get(execution_id)
        if call is None or call.caller != caller:
            return None
        return call

    def cancel(self, execution_id: str, caller: str, *, admin: bool, reason: str) -> KeptCall:
        """Ask a running call to stop (CancelExecution): the call's own client,
        or an admin. Another client's call is NotFound, as an unknown id; an
        ended one FailedPrecondition. Asking again while it stops is a no-op."""
        with self._changed:
            self._trim()
            call = self._running.get(execution_id) or self._ended.get(execution_id)
        if call is None or not (admin or call.caller == caller):
            raise NotFound(NOT_RUNNING)
        if call.outcome is not None or not isinstance(call.cancel, CallCancel):
            raise FailedPrecondition("the call has already ended; its result stands")
        call.cancel.cancel(caller, reason)
        return call

    def follow(
        self,
        execution_id: str,
        caller: str,
        stdout_offset: int,
        stderr_offset: int,
        stopped: threading.Event,
    ) -> Iterator[CallEvent]:
        """The call's output after the offsets as it comes, then its outcome.
        Offsets past what was kept mean "nothing more of that stream". Ends
        without an outcome only when ``stopped`` is set (the RPC ended)."""
        call = self.find(execution_id, caller)
        if call is None:
            raise NotFound(NOT_KEPT)
        sent = {"stdout": stdout_offset, "stderr": stderr_offset}
        while not stopped.is_set():
            with self._changed:
                if not self._news(call, sent) and call.outcome is None:
                    self._changed.wait(WAIT_SLICE_S)
                chunks = [(s, bytes(b[sent[s] :])) for s, b in self._buffers(call)]
                outcome = call.outcome
            for stream, data in chunks:
                if data:
                    sent[stream] += len(data)
                    yield CallEvent(stream, data)
            if outcome is not None:
                yield CallEvent("result", outcome=outcome)
                return

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """The server stops: calls still running for a client that may come back
        are stopped now rather than left to their timeouts, and waited for
        (within bounds) so their audit records are written before the store closes."""
        for call in self.running():
            if call.cancel is not None:
                call.cancel.set()
        until = time.monotonic() + wait_s
        with self._changed:
            while self._running and (left := until - time.monotonic()) > 0:
                self._changed.wait(left)

    def running(self) -> list[KeptCall]:
        with self._changed:
            return list(self._running.values())

    def ended_after(self, end_seq: int) -> list[KeptCall]:
        """The kept calls that ended after the one numbered ``end_seq``, in order."""
        with self._changed:
            return [c for c in self._ended.values() if c.end_seq > end_seq]

    def snapshot(self, call: KeptCall) -> tuple[bytes, bytes, Outcome | None, int]:
        """A consistent copy: output, outcome (None while running), version."""
        with self._changed:
            return bytes(call.stdout), bytes(call.stderr), call.outcome, call.version

    @staticmethod
    def _buffers(call: KeptCall) -> tuple[tuple[str, bytearray], tuple[str, bytearray]]:
        return ("stdout", call.stdout), ("stderr", call.stderr)

    def _news(self, call: KeptCall, sent: dict[str, int]) -> bool:
        return any(len(buffer) > sent[stream] for stream, buffer in self._buffers(call))

    def _trim(self) -> None:
        """Drop ended calls past their grace, then the oldest beyond the bounds.
        Called with the lock held."""
        horizon = self._clock() - self._grace_s
        while self._ended:
            oldest = next(iter(self._ended.values()))
            expired = oldest.ended_at is not None and oldest.ended_at < horizon
            too_many = len(self._ended) > self._max_ended
            if not (expired or too_many or self._ended_bytes > self._max_ended_bytes):
                return
            self._forget(oldest)

    def _forget(self, call: KeptCall) -> None:
        """Drop an ended call. Called with the lock held."""
        del self._ended[call.execution_id]
        self._ended_bytes -= call.kept_bytes
        self._ended_by[call.caller] -= 1
        if self._ended_by[call.caller] <= 0:
            del self._ended_by[call.caller]
