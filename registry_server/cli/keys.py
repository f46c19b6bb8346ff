"""`toolreg keys`: approver key pairs; and reading a key file to sign with, which
may be encrypted with a passphrase.

A passphrase is never an argument (argv is visible to other users): it comes
from TOOLREG_KEY_PASSPHRASE, else it is asked on the terminal (getpass, not
echoed). It is never printed, not even in an error."""

from __future__ import annotations

import getpass
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from registry_server.cli.common import fail

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

PASSPHRASE_ENV = "TOOLREG_KEY_PASSPHRASE"
MIN_PASSPHRASE_CHARS = 8  # for a new key: the file's PBKDF2 is cheap to guess against

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
    encrypt: Annotated[
        bool,
        typer.Option(
            "--encrypt",
            help=f"Encrypt the private key with a passphrase: {PASSPHRASE_ENV}, else asked"
            f" twice on the terminal (at least {MIN_PASSPHRASE_CHARS} characters).",
        ),
    ] = False,
) -> None:
    """Make an approver key pair; print the public key to paste into the policy."""
    from registry_server.signing.keys import generate_keypair

    if out.exists():
        fail(f"{out} exists; refusing to overwrite a key", 2)
    passphrase = _new_passphrase(out) if encrypt else None
    private_pem, public_text = generate_keypair(passphrase)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    approver = out.name.split(".")[0]
    public_file = out.with_name(f"{approver}.pub")
    public_file.write_text(public_text + "\n")
    kept = "encrypted with your passphrase; " if encrypt else ""
    typer.echo(f"private key: {out} ({kept}keep it secret; it never goes to the server)")
    typer.echo(f"public key:  {public_text}")
    typer.echo(f'policy entry: {{id: {approver}, public_key: "{public_text}", groups: [...]}}')
    if install is not None:
        target = install / "approvers" / f"{approver}.pub"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(public_text + "\n")
        typer.echo(f"trusted in development mode as approver '{approver}': {target}")


def read_signing_key(path: Path) -> Ed25519PrivateKey:
    """The Ed25519 private key in ``path``; an encrypted one is decrypted with the
    passphrase from the environment or the terminal. Any problem: one line, exit 2."""
    from registry_server.signing.keys import is_encrypted, load_private_key

    try:
        data = path.read_bytes()
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}", 2)
    passphrase = _passphrase_of(path) if is_encrypted(data) else None
    try:
        return load_private_key(data, passphrase)
    except ValueError as exc:
        fail(f"{path}: {exc}", 2)


def _passphrase_of(path: Path) -> bytes:
    given = os.environ.get(PASSPHRASE_ENV)
    if given:
        return given.encode()
    if not _on_terminal():
        fail(
            f"{path} is encrypted: set {PASSPHRASE_ENV} to its passphrase, or run this on"
            " a terminal to be asked for it",
            2,
        )
    typed = _ask(f"Passphrase for {path}: ")
    if not typed:
        fail(f"{path}: no passphrase given", 2)
    return typed.encode()


def _new_passphrase(out: Path) -> bytes:
    given = os.environ.get(PASSPHRASE_ENV)
    if given:
        typed = given
    elif not _on_terminal():
        fail(
            f"--encrypt needs a passphrase: set {PASSPHRASE_ENV}, or run this on a terminal"
            " to be asked for one",
            2,
        )
    else:
        typed = _ask(f"Passphrase for {out}: ")
        if typed != _ask("The same passphrase again: "):
            fail(f"the passphrases differ; {out} was not written", 2)
    if len(typed) < MIN_PASSPHRASE_CHARS:
        fail(
            f"the passphrase is shorter than {MIN_PASSPHRASE_CHARS} characters;"
            f" {out} was not written",
            2,
        )
    return typed.encode()


def _on_terminal() -> bool:
    return sys.stdin.isatty()


def _ask(prompt: str) -> str:
    try:
        return getpass.getpass(prompt)
    except EOFError:
        fail("no passphrase given (end of input)", 2)
