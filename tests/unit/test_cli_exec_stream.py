"""`toolreg exec --stream`: at a terminal Ctrl-C means "stop the tool", and the
server cannot tell that from a dropped connection, so the CLI asks for
re-attachment (a call that outlives its stream) only with --reattach."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server.cli import app
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


@pytest.mark.parametrize(("flags", "reattach"), [((), False), (("--reattach",), True)])
def test_the_cli_reattaches_only_when_asked(
    asked: list[bool], flags: tuple[str, ...], reattach: bool
) -> None:
    result = CliRunner().invoke(
        app, ["exec", "echo", "--stream", *flags, "--address", "127.0.0.1:1"],
        env={"TOOLREG_TOKEN": "t"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout == "hi\n"
    assert asked == [reattach]
