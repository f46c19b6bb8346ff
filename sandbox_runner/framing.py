"""Pure helpers for reading a container's output: Docker's stream framing and byte caps.

With tty=False, an attach stream multiplexes stdout and stderr as frames: an 8-byte header
(stream id, three zero bytes, big-endian uint32 payload size) followed by the payload.
The demultiplexer hands out payload pieces as soon as they arrive, so neither a big frame
nor a slow tool makes us buffer more than one socket read.
"""

from __future__ import annotations

import struct
from typing import Final

__all__ = ["STDERR", "STDOUT", "CappedBuffer", "FrameDemuxer", "FramingError"]

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
