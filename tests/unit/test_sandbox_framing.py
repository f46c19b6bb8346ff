"""Docker's attach-stream framing and the output caps."""

from __future__ import annotations

import struct

import pytest

from sandbox_runner.framing import CappedBuffer, FrameDemuxer, FramingError


def frame(stream: int, payload: bytes) -> bytes:
    return struct.pack(">BxxxI", stream, len(payload)) + payload


def collect(demux: FrameDemuxer, chunks: list[bytes]) -> dict[str, bytes]:
    out = {"stdout": b"", "stderr": b""}
    for chunk in chunks:
        for stream, piece in demux.feed(chunk):
            out[stream] += piece
    return out


WIRE = (
    frame(1, b"hello ")
    + frame(2, b"oops\n")
    + frame(1, b"")  # empty frames happen and must be skipped
    + frame(1, b"world\n" * 100)
    + frame(2, bytes(range(256)))
)
EXPECTED = {"stdout": b"hello " + b"world\n" * 100, "stderr": b"oops\n" + bytes(range(256))}


def test_whole_stream_at_once() -> None:
    assert collect(FrameDemuxer(), [WIRE]) == EXPECTED


@pytest.mark.parametrize("size", [1, 2, 3, 7, 8, 9, 13, 64, 1000])
def test_any_split_of_the_stream(size: int) -> None:
    demux = FrameDemuxer()
    chunks = [WIRE[i : i + size] for i in range(0, len(WIRE), size)]
    assert collect(demux, chunks) == EXPECTED
    assert not demux.mid_frame


def test_every_single_split_point() -> None:
    for cut in range(len(WIRE) + 1):
        assert collect(FrameDemuxer(), [WIRE[:cut], WIRE[cut:]]) == EXPECTED


def test_payload_pieces_are_emitted_before_the_frame_completes() -> None:
    demux = FrameDemuxer()
    big = frame(1, b"x" * 1_000_000)
    assert demux.feed(big[:8]) == []
    assert demux.feed(big[8:1008]) == [("stdout", b"x" * 1000)]
    assert demux.mid_frame


def test_stream_zero_and_three() -> None:
    assert collect(FrameDemuxer(), [frame(0, b"a"), frame(3, b"b")]) == {
        "stdout": b"a",
        "stderr": b"b",
    }


@pytest.mark.parametrize(
    "header", [b"\x07\0\0\0\0\0\0\x01", b"\x01\0\x01\0\0\0\0\x01", b"HTTP/1.1"]
)
def test_garbage_is_a_framing_error(header: bytes) -> None:
    with pytest.raises(FramingError):
        FrameDemuxer().feed(header + b"x")


def test_capped_buffer() -> None:
    buf = CappedBuffer(10)
    assert buf.add(b"12345") == b"12345"
    assert not buf.truncated
    assert buf.add(b"67890") == b"67890"
    assert not buf.truncated  # exactly at the cap is not truncated
    assert buf.add(b"x") == b""
    assert buf.truncated
    assert buf.getvalue() == b"1234567890"
    assert len(buf) == 10


def test_capped_buffer_splits_the_crossing_chunk() -> None:
    buf = CappedBuffer(4)
    assert buf.add(b"abcdef") == b"abcd"
    assert buf.truncated and buf.getvalue() == b"abcd"


def test_zero_cap() -> None:
    buf = CappedBuffer(0)
    assert buf.add(b"a") == b"" and buf.truncated and buf.getvalue() == b""
