"""MCP progress notifications from a streamed tool call (``bridge.py``).

A call whose ``tools/call`` carries ``_meta.progressToken`` runs through
StreamExecuteTool; each stdout/stderr chunk is fed to a ``ProgressReporter``,
which turns it into ``notifications/progress``: ``progress`` is the number of
output bytes so far (both streams, so it only grows, as the MCP spec asks),
``total`` is unknown, ``message`` a short preview of the chunk.

A tool can write a byte per flush, and every chunk would become a message to
the MCP client: notifications are sent at most once per
``PROGRESS_MIN_INTERVAL_S``, the chunks in between counted in the next one, and
``finish`` sends the last count when some were held back.

``EventStream`` reads the call's events one at a time from worker threads and
can stop the call from the event loop while a read blocks (the MCP request was
cancelled): the server then stops the sandbox.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.client.terminal import escape

PROGRESS_MIN_INTERVAL_S = 0.05  # seconds between two notifications of one call
PROGRESS_MESSAGE_CHARS = 120  # characters of a notification's message, at most

SendProgress = Callable[[float, float | None, str | None], Awaitable[None]]
"""``ServerSession.report_progress``: (progress, total, message)."""


def preview(stream: str, chunk: bytes) -> str:
    """``stdout: <the chunk's last non-empty line>``, bounded, with control
    characters escaped: MCP hosts show this text, often on a terminal."""
    # Only the tail can matter, so decode no more than that (a chunk may be large).
    tail = chunk[-4 * PROGRESS_MESSAGE_CHARS :].decode("utf-8", "replace")
    lines = [line for line in tail.splitlines() if line.strip()]
    text = escape(lines[-1].strip()) if lines else f"{len(chunk)} bytes"
    message = f"{stream}: {text}"
    if len(message) > PROGRESS_MESSAGE_CHARS:
        message = message[: PROGRESS_MESSAGE_CHARS - 3] + "..."
    return message


class ProgressReporter:
    """Counts a call's output and reports it, throttled, through ``send``."""

    def __init__(
        self,
        send: SendProgress,
        *,
        min_interval_s: float = PROGRESS_MIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._send = send
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._last_sent_at: float | None = None
        self.output_bytes = 0  # stdout and stderr so far
        self.chunks = 0
        self.reported_bytes = 0  # the progress value last sent
        self.notifications = 0

    async def chunk(self, stream: str, data: bytes) -> None:
        """One chunk of ``stream`` ("stdout" or "stderr") arrived."""
        if not data:  # progress must grow with every notification
            return
        self.output_bytes += len(data)
        self.chunks += 1
        now = self._clock()
        if self._last_sent_at is not None and now - self._last_sent_at < self._min_interval_s:
            return
        self._last_sent_at = now
        await self._report(preview(stream, data))

    async def finish(self) -> None:
        """Report the final count if the last chunks were held back."""
        if self.output_bytes != self.reported_bytes:
            await self._report(f"{self.output_bytes} bytes of output in {self.chunks} chunk(s)")

    async def _report(self, message: str) -> None:
        self.reported_bytes = self.output_bytes
        self.notifications += 1
        await self._send(float(self.output_bytes), None, message)


class StreamCall(Protocol):
    """What a gRPC stub hands back for a server-streaming call."""

    def __iter__(self) -> Iterator[pb.ExecutionEvent]: ...
    def __next__(self) -> pb.ExecutionEvent: ...
    def cancel(self) -> bool: ...


class EventStream:
    """The events of one StreamExecuteTool call: ``read`` blocks (call it in a
    worker thread); ``stop`` may come from any thread, even during a read, and
    cancels the call, which the server sees at once (it kills the sandbox)."""

    def __init__(self, call: StreamCall) -> None:
        self._call = call
        self._stopped = threading.Event()

    def read(self) -> pb.ExecutionEvent | None:
        """The next event, or None at the end (or once stopped)."""
        if self._stopped.is_set():
            return None
        try:
            return next(self._call, None)
        except Exception:
            if self._stopped.is_set():
                return None  # the read our own cancel ended
            raise

    def stop(self) -> None:
        """End the call if it still runs (idempotent; a no-op once it ended)."""
        self._stopped.set()
        self._call.cancel()
