"""`toolreg keys`: approver key pairs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from registry_server.client.cli.common import fail

keys_app = typer.Typer(help="Approver key pairs (Ed25519).", no_args_is_help=True)


@keys_app.command("generate")
def keys_generate(
    out: Annotated[
        Path, typer.Option("--out", help="Where to write the private key (PEM, mode 600).")
    ],
    install: Annotated[
        Path | None,
        typer.Option(
            "--install", help="Development mode: also trust this key in this data directory."
        ),
    ] = None,
) -> None:
    """Make an approver key pair; print the public key to paste into the policy."""
    import os

    from registry_server.signing.keys import generate_keypair

    if out.exists():
        fail(f"{out} exists; refusing to overwrite a key", 2)
    private_pem, public_text = generate_keypair()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    approver = out.name.split(".")[0]
    public_file = out.with_name(f"{approver}.pub")
    public_file.write_text(public_text + "\n")
    typer.echo(f"private key: {out} (keep it secret; it never goes to the server)")
    typer.echo(f"public key:  {public_text}")
    typer.echo(f'policy entry: {{id: {approver}, public_key: "{public_text}", groups: [...]}}')
    if install is not None:
        target = install / "approvers" / f"{approver}.pub"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(public_text + "\n")
        typer.echo(f"trusted in development mode as approver '{approver}': {target}")
