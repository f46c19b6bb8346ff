"""typer's CliRunner turns the app into a click command again on every
``invoke``, reading every command's signature and type hints: about 35 ms for
toolreg's CLI, most of the in-process CLI tests' time. The command built from
an app never changes, so it is built once per app here. Should typer rename
the hook, the tests still run, only slower."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import typer.testing


@pytest.fixture(scope="session", autouse=True)
def _cli_command_built_once() -> Iterator[None]:
    build = getattr(typer.testing, "_get_command", None)
    if build is None:
        yield
        return
    typer.testing._get_command = functools.cache(build)  # type: ignore[attr-defined]
    yield
    typer.testing._get_command = build  # type: ignore[attr-defined]
