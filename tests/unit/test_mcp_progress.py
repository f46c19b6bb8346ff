"""Progress from a streamed call (mcp/progress.py): the preview, the
throttle, the final count, and stopping a call while a read blocks."""

from __future__ import annotations

import threading

import anyio
import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.mcp.progress import (
    PROGRESS_MESSAGE_CHARS,
    EventStream,
    ProgressReporter,
    preview,
)


def test_preview_is_the_last_line_bounded_and_escaped() -> None:
    assert preview("stdout", b"first\nsecond\n\n") == "stdout: second"
    assert preview("stderr", b"\x1b[2Jboom\x07") == "stderr: \\u001b[2Jboom\\u0007"
    assert preview("stdout", b"\n\n") == "stdout: 2 bytes"
    assert preview("stdout", b"\xff\xfeok") == "stdout: \ufffd\ufffdok"
    long = preview("stdout", b"x" * 100_000)
    assert len(long) == PROGRESS_MESSAGE_CHARS and long.endswith("...")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_reporter_counts_bytes_throttles_and_sends_the_last_count() -> None:
    sent: list[tuple[float, float | None, str | None]] = []
    clock = Clock()

    async def send(progress: float, total: float | None, message: str | None) -> None:
        sent.append((progress, total, message))

    async def run() -> None:
        reporter = ProgressReporter(send, min_interval_s=0.05, clock=clock)
        await reporter.chunk("stdout", b"ab")  # sent: the first
        clock.now = 0.01
        await reporter.chunk("stderr", b"cde")  # held back: too soon
        await reporter.chunk("stdout", b"")  # nothing: progress must grow
        clock.now = 0.2
        await reporter.chunk("stdout", b"f\n")  # sent, counting the held-back chunk
        clock.now = 0.21
        await reporter.chunk("stdout", b"g")  # held back
        await reporter.finish()  # the last count
        await reporter.finish()  # nothing new

    anyio.run(run)
    assert sent == [
        (2.0, None, "stdout: ab"),
        (7.0, None, "stdout: f"),
        (8.0, None, "8 bytes of output in 4 chunk(s)"),
    ]


def test_reporter_finish_sends_nothing_when_all_was_reported() -> None:
    sent: list[float] = []

    async def send(progress: float, total: float | None, message: str | None) -> None:
        sent.append(progress)

    async def run() -> None:
        reporter = ProgressReporter(send)
        await reporter.chunk("stdout", b"only")
        await reporter.finish()

    anyio.run(run)
    assert sent == [4.0]


class BlockingCall:
    """A stand-in for a gRPC streaming call: ``__next__`` blocks until an event
    is released or the call is cancelled (then raises, as gRPC does)."""

    def __init__(self) -> None:
        self.released = threading.Semaphore(0)
        self.cancelled = threading.Event()
        self.waiting = threading.Event()

    def __iter__(self) -> BlockingCall:
        return self

    def __next__(self) -> pb.ExecutionEvent:
        self.waiting.set()
        while not self.released.acquire(timeout=0.01):
            if self.cancelled.is_set():
                raise RuntimeError("cancelled")
        return pb.ExecutionEvent(stdout=b"x")

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


def read_in_thread(stream: EventStream) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []

    def run() -> None:
        try:
            out.append(stream.read())
        except RuntimeError as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_stop_cancels_a_call_while_a_read_blocks() -> None:
    call = BlockingCall()
    stream = EventStream(call)
    call.released.release()
    assert stream.read() == pb.ExecutionEvent(stdout=b"x")  # a first event came
    thread, out = read_in_thread(stream)
    assert call.waiting.wait(5)
    stream.stop()  # from another thread, while the read blocks
    thread.join(5)
    assert not thread.is_alive()
    assert call.cancelled.is_set()
    assert out == [None]  # the read our cancel ended is the end, not an error
    assert stream.read() is None  # stopped: no more reads


def test_an_error_the_stream_was_not_stopped_for_is_raised() -> None:
    call = BlockingCall()
    call.cancelled.set()  # as if the server ended it
    with pytest.raises(RuntimeError):
        EventStream(call).read()


class OneEvent:
    """A call that sends one event and ends."""

    def __init__(self) -> None:
        self.events = iter([pb.ExecutionEvent(stdout=b"a")])
        self.cancels = 0

    def __iter__(self) -> OneEvent:
        return self

    def __next__(self) -> pb.ExecutionEvent:
        return next(self.events)

    def cancel(self) -> bool:
        self.cancels += 1
        return False  # gRPC: nothing to cancel once the call ended


def test_stop_after_the_end_is_harmless() -> None:
    call = OneEvent()
    stream = EventStream(call)
    assert stream.read() == pb.ExecutionEvent(stdout=b"a")
    assert stream.read() is None
    stream.stop()
    stream.stop()
    assert stream.read() is None
