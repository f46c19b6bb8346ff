"""`toolreg audit`: verify and tail the hash-chained audit log (read from the store)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from registry_server.client.cli.common import fail
from registry_server.domain.errors import ToolregError

audit_app = typer.Typer(help="The hash-chained audit log.", no_args_is_help=True)


DataDirOpt = Annotated[
    Path | None,
    typer.Option("--data-dir", envvar="TOOLREG_DATA_DIR", help="The server's data directory."),
]


StoreUrlOpt = Annotated[
    str | None,
    typer.Option(
        "--store-url",
        envvar="TOOLREG_STORE_URL",
        help="The server's store (default: in --data-dir).",
    ),
]


def _open_store(data_dir: Path | None, store_url: str | None) -> Any:
    from registry_server.api.app import open_store
    from registry_server.api.config import DEFAULT_DATA_DIR, default_store_url

    url = store_url or default_store_url(data_dir or DEFAULT_DATA_DIR)
    try:
        return open_store(url, must_exist=True)
    except ToolregError as exc:
        fail(exc.message, 2)


@audit_app.command("verify")
def audit_verify(data_dir: DataDirOpt = None, store_url: StoreUrlOpt = None) -> None:
    """Walk the hash chain; exit 1 at the first broken record."""
    from registry_server.store import audit_chain as audit

    store = _open_store(data_dir, store_url)
    verdict = audit.verify(store)
    store.close()
    typer.echo(str(verdict))
    if not verdict.ok:
        raise typer.Exit(1)


@audit_app.command("tail")
def audit_tail(
    count: Annotated[int, typer.Option("-n", help="How many records.")] = 20,
    data_dir: DataDirOpt = None,
    store_url: StoreUrlOpt = None,
) -> None:
    """Show the most recent audit records, one JSON line each."""
    from registry_server.store import audit_chain as audit

    store = _open_store(data_dir, store_url)
    for entry in audit.tail(store, count):
        typer.echo(json.dumps(entry, ensure_ascii=False))
    store.close()
