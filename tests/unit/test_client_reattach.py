"""The Python client's re-attachment (client/reattach.py) with a fake stub:
which broken streams it re-attaches, from which offsets, how often."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.client.reattach import broke_in_transit, reattaching

ID = "a" * 32


class Broken(grpc.RpcError, grpc.Call):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _events(*items: pb.ExecutionEvent | Exception) -> Iterator[pb.ExecutionEvent]:
    for item in items:
        if isinstance(item, Exception):
            raise item
        yield item


STARTED = pb.ExecutionEvent(started=pb.ExecutionStarted(execution_id=ID))
RESULT = pb.ExecutionEvent(result=pb.ToolResult(success=True, execution_id=ID))
CUT = Broken(grpc.StatusCode.UNAVAILABLE, "Socket closed")


class FakeStub:
    def __init__(self, *answers: Iterator[pb.ExecutionEvent]) -> None:
        self.answers = list(answers)
        self.requests: list[pb.AttachExecutionRequest] = []

    def AttachExecution(self, request: pb.AttachExecutionRequest, timeout: Any = None) -> Any:
        self.requests.append(request)
        return self.answers.pop(0)


def test_a_cut_stream_is_reattached_from_the_bytes_received() -> None:
    first = _events(STARTED, pb.ExecutionEvent(stdout=b"one\n"),
                    pb.ExecutionEvent(stderr=b"e"), CUT)  # fmt: skip
    stub = FakeStub(_events(pb.ExecutionEvent(stdout=b"two\n"), RESULT))
    got = list(reattaching(stub, first, first_pause_s=0))
    assert [e.WhichOneof("event") for e in got] == [
        "started",
        "stdout",
        "stderr",
        "stdout",
        "result",
    ]
    (request,) = stub.requests
    assert (request.execution_id, request.stdout_offset, request.stderr_offset) == (ID, 4, 1)


def test_a_server_status_or_a_break_before_started_is_raised() -> None:
    denied = Broken(grpc.StatusCode.PERMISSION_DENIED, "no")
    with pytest.raises(grpc.RpcError) as info:
        list(reattaching(FakeStub(), _events(STARTED, denied), first_pause_s=0))
    assert info.value is denied
    with pytest.raises(grpc.RpcError):
        list(reattaching(FakeStub(), _events(CUT), first_pause_s=0))


def test_reattachment_gives_up_after_its_tries() -> None:
    stub = FakeStub(*(_events(CUT) for _ in range(3)))
    with pytest.raises(grpc.RpcError):
        list(reattaching(stub, _events(STARTED, CUT), tries=2, first_pause_s=0))
    assert len(stub.requests) == 2


@pytest.mark.parametrize(
    ("code", "details", "broke"),
    [
        (grpc.StatusCode.UNAVAILABLE, "Connection reset by peer", True),
        (grpc.StatusCode.INTERNAL, "Received RST_STREAM with error code 2", True),
        (grpc.StatusCode.CANCELLED, "Cancelled", True),
        (grpc.StatusCode.CANCELLED, "Locally cancelled by application!", False),
        (grpc.StatusCode.INTERNAL, "Exception serializing response!", False),
        (grpc.StatusCode.NOT_FOUND, "", False),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "", False),
    ],
)
def test_which_errors_are_breaks_in_transit(
    code: grpc.StatusCode, details: str, broke: bool
) -> None:
    assert broke_in_transit(Broken(code, details)) is broke
