"""Docker's attach-stream framing and the output caps."""

from __future__ import annotations

import struct

import pytest

from sandbox_runner.framing import (
    INIT_EXIT,
    INIT_HELLO,
    STDERR,
    STDOUT,
    CappedBuffer,
    FrameDemuxer,
    FramingError,
    InitDecoder,
    InitExit,
)


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


# -- the init's frames (protocol v2) ---------------------------------------------------------


def init_frame(kind: bytes, payload: bytes) -> bytes:
    return kind + struct.pack(">I", len(payload)) + payload


INIT_STREAM = (
    init_frame(b"H", b"\x02")
    + init_frame(b"O", b"out")
    + init_frame(b"E", b"err")
    + init_frame(b"O", b"")
    + init_frame(b"X", b"\x01\x00\x00\x00\x09")
)


@pytest.mark.parametrize("step", [1, 2, 5, 7, len(INIT_STREAM)])
def test_init_frames_decode_however_the_bytes_arrive(step: int) -> None:
    decoder = InitDecoder()
    events: list[tuple[str, object]] = []
    for i in range(0, len(INIT_STREAM), step):
        events += decoder.feed(INIT_STREAM[i : i + step])
    out = b"".join(v for k, v in events if k == STDOUT)  # type: ignore[misc]
    err = b"".join(v for k, v in events if k == STDERR)  # type: ignore[misc]
    assert (out, err) == (b"out", b"err")
    assert events[0] == (INIT_HELLO, 2)
    assert events[-1] == (INIT_EXIT, InitExit(signal=9, status=0))
    assert decoder.exited is not None and decoder.exited.exit_code == 137
    assert not decoder.mid_frame


@pytest.mark.parametrize(
    ("stream", "problem"),
    [
        (b"Z\x00\x00\x00\x00", "bad init frame header"),
        (b"O\x00\x20\x00\x00", "bad init frame header"),  # 2 MiB: above the frame cap
        (init_frame(b"H", b"\x02\x02"), "bad hello frame"),
        (init_frame(b"X", b"\x00\x00"), "bad exit frame"),
        (init_frame(b"X", b"\x07\x00\x00\x00\x00"), "bad exit frame"),
        (init_frame(b"X", b"\x00\x00\x00\x00\x00") + b"O", "after the exit frame"),
    ],
)
def test_anything_but_init_frames_is_refused(stream: bytes, problem: str) -> None:
    with pytest.raises(FramingError, match=problem):
        InitDecoder().feed(stream)


def test_a_cut_init_stream_is_mid_frame() -> None:
    decoder = InitDecoder()
    decoder.feed(init_frame(b"O", b"abcdef")[:-2])
    assert decoder.mid_frame
