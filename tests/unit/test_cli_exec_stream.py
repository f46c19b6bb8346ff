"""`toolreg exec --stream`: the CLI asks for re-attachment (a call that
outlives its stream) by default, so a dropped connection does not end the
call; Ctrl-C then cancels it (CancelExecution). --no-reattach keeps the old
behaviour: the stream's end stops the call, Ctrl-C included."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from typer.testing import CliRunner

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.cli import app
from registry_server.cli.execute import CANCEL_REASON
from registry_server.client.registry_client import RegistryClient


@pytest.fixture
def asked(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    seen: list[bool] = []

    def stream(self: RegistryClient, name: str, arguments: str = "{}", **kw: Any
               ) -> Iterator[pb.ExecutionEvent]:  # fmt: skip
        seen.append(kw["reattach"])
        yield pb.ExecutionEvent(started=pb.ExecutionStarted(execution_id="e" * 32))
        yield pb.ExecutionEvent(stdout=b"hi\n")
        yield pb.ExecutionEvent(result=pb.ToolResult(success=True, status=pb.EXECUTION_STATUS_OK))

    monkeypatch.setattr(RegistryClient, "stream", stream)
    return seen


@pytest.mark.parametrize(
    ("flags", "reattach"),
    [((), True), (("--reattach",), True), (("--no-reattach",), False)],
)
def test_the_cli_reattaches_unless_told_not_to(
    asked: list[bool], flags: tuple[str, ...], reattach: bool
) -> None:
    result = CliRunner().invoke(
        app, ["exec", "echo", "--stream", *flags, "--address", "127.0.0.1:1"],
        env={"TOOLREG_TOKEN": "t"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout == "hi\n"
    assert asked == [reattach]


class Interrupted:
    """A stream interrupted by Ctrl-C after ``started`` (or before it), and the
    CancelExecution calls the CLI makes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, started: bool) -> None:
        self.reattach: list[bool] = []
        self.cancelled: list[tuple[str, str]] = []
        self.closed = False
        self.refuse: grpc.StatusCode | None = None
        outer = self

        def stream(self: RegistryClient, name: str, arguments: str = "{}", **kw: Any
                   ) -> Iterator[pb.ExecutionEvent]:  # fmt: skip
            outer.reattach.append(kw["reattach"])
            try:
                if started:
                    yield pb.ExecutionEvent(started=pb.ExecutionStarted(execution_id="e" * 32))
                yield pb.ExecutionEvent(stdout=b"working\n")
                raise KeyboardInterrupt
            finally:
                outer.closed = True

        def cancel(self: RegistryClient, execution_id: str, reason: str = "", **kw: Any
                   ) -> pb.CancelExecutionResponse:  # fmt: skip
            outer.cancelled.append((execution_id, reason))
            if outer.refuse is not None:
                raise Refused(outer.refuse)  # type: ignore[abstract]  # only what the CLI reads
            return pb.CancelExecutionResponse(execution_id=execution_id)

        monkeypatch.setattr(RegistryClient, "stream", stream)
        monkeypatch.setattr(RegistryClient, "cancel", cancel)

    def run(self, *flags: str) -> Any:
        return CliRunner().invoke(
            app, ["exec", "sleeper", "--stream", *flags, "--address", "127.0.0.1:1"],
            env={"TOOLREG_TOKEN": "t"},
        )  # fmt: skip


class Refused(grpc.RpcError, grpc.Call):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "refused"

    def trailing_metadata(self) -> tuple[()]:
        return ()


def test_ctrl_c_cancels_a_reattachable_call(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = Interrupted(monkeypatch, started=True)
    result = stream.run()
    assert result.exit_code == 130, result.output
    assert stream.reattach == [True]
    assert stream.cancelled == [("e" * 32, CANCEL_REASON)]
    assert stream.closed
    assert f"call {'e' * 32} cancelled" in result.stderr


def test_ctrl_c_without_reattach_only_ends_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = Interrupted(monkeypatch, started=True)
    result = stream.run("--no-reattach")
    assert result.exit_code == 130, result.output
    assert stream.reattach == [False] and stream.cancelled == [] and stream.closed
    assert "stopped with its stream" in result.stderr


def test_ctrl_c_before_started_has_nothing_to_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server stops a call whose stream ends before it started."""
    stream = Interrupted(monkeypatch, started=False)
    result = stream.run()
    assert result.exit_code == 130, result.output
    assert stream.cancelled == [] and stream.closed


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (grpc.StatusCode.FAILED_PRECONDITION, "had already ended"),
        (grpc.StatusCode.UNAVAILABLE, "it runs on to its timeout"),
    ],
)
def test_a_refused_cancel_is_reported(
    monkeypatch: pytest.MonkeyPatch, code: grpc.StatusCode, said: str
) -> None:
    stream = Interrupted(monkeypatch, started=True)
    stream.refuse = code
    result = stream.run()
    assert result.exit_code == 130, result.output
    assert len(stream.cancelled) == 1 and said in result.stderr
