"""Pure helpers for reading a container's output: Docker's stream framing and byte caps.

With tty=False, an attach stream multiplexes stdout and stderr as frames: an 8-byte header
(stream id, three zero bytes, big-endian uint32 payload size) followed by the payload.
The demultiplexer hands out payload pieces as soon as they arrive, so neither a big frame
nor a slow tool makes us buffer more than one socket read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

__all__ = [
    "INIT_EXIT",
    "INIT_FAILED",
    "INIT_HELLO",
    "INIT_READY",
    "STDERR",
    "STDOUT",
    "CappedBuffer",
    "FrameDemuxer",
    "FramingError",
    "InitDecoder",
    "InitExit",
]

STDOUT: Final = "stdout"
STDERR: Final = "stderr"

_HEADER_SIZE: Final = 8
# 0 is stdin (Docker echoes it on stdout's side); 3 is the engine's own error stream.
_STREAMS: Final[dict[int, str]] = {0: STDOUT, 1: STDOUT, 2: STDERR, 3: STDERR}


class FramingError(ValueError):
    """The attach stream is not Docker's multiplexed format."""


class FrameDemuxer:
    """Incremental decoder: feed() raw socket bytes, get (stream, payload piece) pairs."""

    __slots__ = ("_header", "_remaining", "_stream")

    def __init__(self) -> None:
        self._header = bytearray()
        self._stream: str = STDOUT
        self._remaining = 0

    @property
    def mid_frame(self) -> bool:
        """True when the bytes fed so far end inside a frame (a cut-off stream)."""
        return bool(self._header) or self._remaining > 0

    def feed(self, data: bytes) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        view = memoryview(data)
        pos, end = 0, len(data)
        while pos < end:
            if self._remaining == 0:
                take = min(_HEADER_SIZE - len(self._header), end - pos)
                self._header += view[pos : pos + take]
                pos += take
                if len(self._header) < _HEADER_SIZE:
                    break
                stream_id = self._header[0]
                if stream_id not in _STREAMS or self._header[1:4] != b"\0\0\0":
                    raise FramingError(f"bad frame header {bytes(self._header).hex()}")
                (self._remaining,) = struct.unpack_from(">I", self._header, 4)
                self._stream = _STREAMS[stream_id]
                self._header.clear()
                continue
            take = min(self._remaining, end - pos)
            out.append((self._stream, bytes(view[pos : pos + take])))
            pos += take
            self._remaining -= take
        return out


class CappedBuffer:
    """Stores at most `cap` bytes; anything beyond is dropped and marks the buffer truncated."""

    __slots__ = ("_cap", "_parts", "_size", "truncated")

    def __init__(self, cap: int) -> None:
        if cap < 0:
            raise ValueError("cap must be >= 0")
        self._cap = cap
        self._parts: list[bytes] = []
        self._size = 0
        self.truncated = False

    def __len__(self) -> int:
        return self._size

    def add(self, chunk: bytes) -> bytes:
        """Store what fits of `chunk`; returns the stored part (b"" when nothing fit)."""
        room = self._cap - self._size
        if len(chunk) > room:
            self.truncated = True
            chunk = chunk[:room]
        if chunk:
            self._parts.append(chunk)
            self._size += len(chunk)
        return chunk

    def getvalue(self) -> bytes:
        if len(self._parts) > 1:
            self._parts = [b"".join(self._parts)]
        return self._parts[0] if self._parts else b""


# -- the sandbox init's frames (protocol v3, sandbox_runner/init/toolreg_init.c) ---------------

INIT_HELLO: Final = "hello"
INIT_EXIT: Final = "exit"
# Prestart only (warm_interpreter.py), right after the hello: the interpreter is ready
# (no payload), or it could not be made ready (payload: why, as text).
INIT_READY: Final = "ready"
INIT_FAILED: Final = "failed"
_INIT_HEADER_SIZE: Final = 5  # type byte + big-endian uint32 payload length
_INIT_MAX_FRAME: Final = 1 << 20  # bytes; the init sends at most 64 KiB per frame
_INIT_TYPES: Final[dict[int, str]] = {
    ord("H"): INIT_HELLO, ord("O"): STDOUT, ord("E"): STDERR, ord("X"): INIT_EXIT,
    ord("R"): INIT_READY, ord("F"): INIT_FAILED,
}  # fmt: skip


@dataclass(frozen=True)
class InitExit:
    """How the tool ended, as the init saw it."""

    signal: int  # the signal that killed it, or 0
    status: int  # its exit status (when not killed)

    @property
    def exit_code(self) -> int:
        """As a shell reports it: the status, or 128 + the signal."""
        return 128 + self.signal if self.signal else self.status


class InitDecoder:
    """Incremental decoder of the init's frames inside its stdout stream: feed()
    bytes, get (kind, value) events: (STDOUT|STDERR, bytes) pieces as they arrive,
    (INIT_HELLO, version) and (INIT_EXIT, InitExit). Anything that is not a frame
    raises FramingError: the stream is the init's, never the tool's."""

    __slots__ = ("_header", "_kind", "_payload", "_remaining", "exited")

    def __init__(self) -> None:
        self._header = bytearray()
        self._kind = ""
        self._remaining = 0
        self._payload = bytearray()  # hello and exit are kept whole; output is streamed
        self.exited: InitExit | None = None

    @property
    def mid_frame(self) -> bool:
        return bool(self._header) or self._remaining > 0

    def feed(self, data: bytes) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        view = memoryview(data)
        pos, end = 0, len(data)
        while pos < end:
            if self.exited is not None:
                raise FramingError("bytes after the exit frame")
            if self._remaining == 0 and not self._kind:
                take = min(_INIT_HEADER_SIZE - len(self._header), end - pos)
                self._header += view[pos : pos + take]
                pos += take
                if len(self._header) < _INIT_HEADER_SIZE:
                    break
                kind = _INIT_TYPES.get(self._header[0])
                (size,) = struct.unpack_from(">I", self._header, 1)
                if kind is None or size > _INIT_MAX_FRAME:
                    raise FramingError(f"bad init frame header {bytes(self._header).hex()}")
                if (
                    (kind == INIT_HELLO and size != 1)
                    or (kind == INIT_EXIT and size != 5)
                    or (kind == INIT_READY and size != 0)
                ):
                    raise FramingError(f"bad {kind} frame of {size} bytes")
                self._header.clear()
                self._kind, self._remaining = kind, size
                if size == 0:
                    self._kind = ""
                    if kind in (INIT_READY, INIT_FAILED):
                        out.append((kind, b""))
                continue
            take = min(self._remaining, end - pos)
            chunk = bytes(view[pos : pos + take])
            pos += take
            self._remaining -= take
            if self._kind in (STDOUT, STDERR):
                out.append((self._kind, chunk))
            else:
                self._payload += chunk
            if self._remaining == 0:
                out += self._complete()
        return out

    def _complete(self) -> list[tuple[str, object]]:
        kind, payload = self._kind, bytes(self._payload)
        self._kind = ""
        self._payload.clear()
        if kind == INIT_HELLO:
            return [(INIT_HELLO, payload[0])]
        if kind == INIT_EXIT:
            how, value = payload[0], struct.unpack_from(">I", payload, 1)[0]
            if how not in (0, 1):
                raise FramingError(f"bad exit frame {payload.hex()}")
            self.exited = InitExit(signal=value if how == 1 else 0, status=value if how == 0 else 0)
            return [(INIT_EXIT, self.exited)]
        if kind == INIT_FAILED:
            return [(INIT_FAILED, payload)]
        return []
