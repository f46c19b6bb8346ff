"""`toolreg witness`: a witness of audit logs (docs/how-to/audit.md, "Witnesses"):
make its key, print its verifier key, and serve c2sp.org/tlog-witness."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from registry_server.cli.common import fail
from registry_server.domain.errors import ToolregError

if TYPE_CHECKING:
    from registry_server.signing.cosignatures import Cosigner
    from registry_server.signing.notes import Verifier

witness_app = typer.Typer(
    help="A witness of audit logs: cosigns a log's checkpoints that extend the last one it"
    " cosigned, and refuses forks (c2sp.org/tlog-witness).",
    no_args_is_help=True,
)

NameOpt = Annotated[
    str,
    typer.Option(
        "--name", help="The witness's name in its cosignatures, e.g. witness.example.com/w1."
    ),
]


@witness_app.command("keygen")
def witness_keygen(
    out: Annotated[Path, typer.Option("--out", help="Where to write the key (PEM, mode 600).")],
    name: NameOpt,
) -> None:
    """Make a witness key; print its verifier key (for the log servers'
    --witness and auditors' --witness)."""
    from registry_server.signing.cosignatures import Cosigner
    from registry_server.signing.keys import generate_keypair, load_private_key
    from registry_server.signing.notes import NoteError

    if out.exists():
        fail(f"{out} exists; refusing to overwrite a key", 2)
    # Unencrypted: the witness signs unattended, as a server does with its log key.
    pem, _public = generate_keypair()
    try:
        cosigner = Cosigner(name, load_private_key(pem))
    except NoteError as exc:
        fail(f"--name: {exc}", 2)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    typer.echo(f"witness key: {out} (keep it secret; readable by the witness's user only)",
               err=True)  # fmt: skip
    typer.echo(str(cosigner.verifier))


@witness_app.command("verifier-key")
def witness_verifier_key(
    key: Annotated[Path, typer.Option("--key", help="The witness's key (PEM).")],
    name: NameOpt,
) -> None:
    """Print the witness's verifier key, <name>+<key ID>+<base64(0x04 || key)>."""
    typer.echo(str(_cosigner(key, name).verifier))


@witness_app.command("serve")
def witness_serve(
    key: Annotated[Path, typer.Option("--key", help="The witness's key (PEM, mode 600).")],
    name: NameOpt,
    logs: Annotated[
        list[str],
        typer.Option(
            "--log",
            help="A log to witness: its verifier key (origin+id+base64, as `toolreg audit"
            " verifier-key` prints it), or ORIGIN=KEY with its public key (text or file)."
            " Repeatable; several keys of one origin are all trusted.",
        ),
    ],
    state: Annotated[
        Path,
        typer.Option(
            "--state", help="The witness's state (JSON), kept across restarts; back it up."
        ),
    ],
    listen: Annotated[
        str, typer.Option("--listen", metavar="HOST:PORT", help="Where to serve (port 0: any).")
    ] = "127.0.0.1:7380",
    prefix: Annotated[
        str, typer.Option("--prefix", help="The submission prefix, e.g. /witness (default none).")
    ] = "",
    allow_host: Annotated[
        list[str] | None, typer.Option("--allow-host", help="Another Host to accept, NAME:PORT.")
    ] = None,
    tls_cert: Annotated[Path | None, typer.Option("--tls-cert", help="Serve HTTPS (PEM).")] = None,
    tls_key: Annotated[Path | None, typer.Option("--tls-key", help="The TLS key.")] = None,
    log_level: Annotated[str, typer.Option("--log-level", envvar="TOOLREG_LOG_LEVEL")] = "INFO",
    log_format: Annotated[
        str, typer.Option("--log-format", envvar="TOOLREG_LOG_FORMAT", help="auto, json or text.")
    ] = "auto",
) -> None:
    """Serve the witness protocol (POST <prefix>/add-checkpoint) until SIGTERM/SIGINT."""
    from registry_server.api import logs as log_setup
    from registry_server.web.listener import parse_endpoint
    from registry_server.witness.core import Witness
    from registry_server.witness.state import FileState
    from registry_server.witness.web import serve_witness

    try:
        log_setup.configure(log_level, log_format)
    except ValueError as exc:
        fail(f"--log-format/--log-level: {exc}", 2)
    cosigner = _cosigner(key, name)
    trusted: dict[str, list[Verifier]] = {}
    for text in logs:
        verifier = log_verifier(text)
        trusted.setdefault(verifier.name, []).append(verifier)
    try:
        host, port = parse_endpoint(listen)
        witness_state = FileState(state)
    except ToolregError as exc:
        fail(exc.message.replace("--http", "--listen"), 2)
    unknown = sorted(set(witness_state.origins) - set(trusted))
    if unknown:
        # Kept, not forgotten: the log may be named again later.
        typer.echo(f"toolreg witness: the state holds logs no --log names: {', '.join(unknown)}",
                   err=True)  # fmt: skip
    try:
        serve_witness(
            Witness(cosigner, trusted, witness_state), host=host, port=port, prefix=prefix,
            allowed_hosts=tuple(allow_host or ()), tls_cert=tls_cert, tls_key=tls_key,
        )  # fmt: skip
    except ToolregError as exc:
        fail(exc.message, 2)
    finally:
        witness_state.close()


def log_verifier(text: str) -> Verifier:
    """A ``--log`` value: a log's verifier key, or ORIGIN=KEY (the key's text or file)."""
    from registry_server.signing.notes import NoteError, Verifier, verifier_for

    origin, eq, key = text.strip().partition("=")
    try:
        if eq and "+" not in origin:
            key_path = Path(key)
            key_text = key_path.read_text(encoding="utf-8") if key_path.is_file() else key
            verifier = verifier_for(key_text, origin)
            if verifier.name != origin:
                raise NoteError(f"the key is {verifier.name!r}'s, not {origin!r}'s")
            return verifier
        return Verifier.from_text(text)
    except (NoteError, OSError) as exc:
        fail(f"--log {text.strip()[:60]!r}: {exc}", 2)


def _cosigner(path: Path, name: str) -> Cosigner:
    """The witness key: readable by its user only (whoever reads it can cosign
    a fork), and not encrypted (the witness signs unattended)."""
    from registry_server.signing.cosignatures import Cosigner
    from registry_server.signing.keys import is_encrypted, load_private_key
    from registry_server.signing.notes import NoteError

    try:
        mode = path.stat().st_mode & 0o777
        data = path.read_bytes()
    except OSError as exc:
        fail(f"witness key {path}: {exc.strerror}", 2)
    if mode & 0o077:
        fail(f"witness key {path} is open to others (mode {mode:o}); chmod 600 it", 2)
    if is_encrypted(data):
        fail(f"witness key {path} is encrypted; the witness reads it unattended", 2)
    try:
        return Cosigner(name, load_private_key(data))
    except NoteError as exc:
        fail(f"--name: {exc}", 2)
    except ValueError as exc:
        fail(f"witness key {path}: {exc}", 2)
