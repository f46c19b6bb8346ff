"""`toolreg identities`: the group-mapped IdP clients the store remembers
(docs/how-to/identity.md, "Remembered clients"): list them, or forget one.
An operator's tool, run on the server's host against its store, as `toolreg
audit` is: it needs the store's credentials, not a client's."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from typing import Annotated

import typer

from registry_server.cli.audit import DataDirOpt, StoreUrlOpt, _open_store
from registry_server.cli.common import fail
from registry_server.policy.clients import ID_PATTERN
from registry_server.store.base import IdentityRecord

identities_app = typer.Typer(
    help="Group-mapped identity provider clients remembered in the store.", no_args_is_help=True
)

PAGE = 500  # rows read per query while listing
MAX_LISTED = 100_000  # rows `list` prints at most (--limit)


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")


def _row(record: IdentityRecord) -> dict[str, object]:
    return {
        "client": record.client_id, "provider": record.provider, "subject": record.subject,
        "groups": list(record.groups), "first_seen": _when(record.first_seen),
        "last_seen": _when(record.last_seen),
    }  # fmt: skip


@identities_app.command("list")
def list_identities(
    data_dir: DataDirOpt = None,
    store_url: StoreUrlOpt = None,
    limit: Annotated[
        int, typer.Option("--limit", min=1, max=MAX_LISTED, help="List at most this many.")
    ] = 1_000,
) -> None:
    """One JSON object per line, by client id: its provider, subject, groups
    (the token's, not roles: those are the policy's) and when it was seen."""
    store = _open_store(data_dir, store_url)
    try:
        after, shown = "", 0
        while shown < limit:
            with store.reading() as reads:
                page = reads.identities(after, min(PAGE, limit - shown))
            for record in page:
                typer.echo(json.dumps(_row(record)))
            shown += len(page)
            if len(page) < PAGE:
                break
            after = page[-1].client_id
    finally:
        store.close()


@identities_app.command("forget")
def forget(
    client_id: Annotated[str, typer.Argument(help="The client's id, as `list` shows it.")],
    data_dir: DataDirOpt = None,
    store_url: StoreUrlOpt = None,
) -> None:
    """Delete a remembered client. Running servers stop knowing it within
    30 s (policy/seen.py RECHECK_S), its tools stop being served; its next
    token makes it known again. To keep it out, deny its subject in the policy."""
    if not re.fullmatch(ID_PATTERN, client_id):
        fail(f"client_id: not a client id (must match {ID_PATTERN})", 2)
    store = _open_store(data_dir, store_url)
    try:
        with store.unit_of_work() as work:
            forgotten = work.forget_identity(client_id)
    finally:
        store.close()
    if not forgotten:
        fail(f"no remembered client '{client_id}'", 1)
    typer.echo(f"forgot {client_id}")
