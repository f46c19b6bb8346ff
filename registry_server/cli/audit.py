"""`toolreg audit`: the audit log (read from the store): verify its hash chain,
or that it extends an old signed checkpoint; tail it; print or make its
latest checkpoint; write and check inclusion proofs (docs/how-to/audit.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from registry_server.cli.common import fail
from registry_server.domain.errors import ToolregError

if TYPE_CHECKING:
    from registry_server.cli.audit_witnesses import Witnessed
    from registry_server.signing.cosignatures import CosignatureVerifier
    from registry_server.signing.notes import Checkpoint, Verifier

    Witnesses = tuple[list[CosignatureVerifier], int]  # trusted witnesses, how many required

audit_app = typer.Typer(help="The audit log: hash chain, Merkle tree, checkpoints.",
                        no_args_is_help=True)  # fmt: skip


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

KeyOpt = Annotated[
    str | None,
    typer.Option(
        "--key",
        help="The log's public key: a file or the text of a verifier key"
        " (name+id+base64) or of an Ed25519 public key (base64 or PEM).",
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


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"{what} {path}: {getattr(exc, 'strerror', None) or exc}", 2)


def _signed_checkpoint(note: str, key: str | None, what: str) -> tuple[Checkpoint, Verifier]:
    """The checkpoint of ``note`` once the log's key (``--key``) verifies it; exit 1 if not."""
    from registry_server.signing.notes import (
        NoteError,
        open_checkpoint,
        parse_checkpoint,
        parse_note,
        verifier_for,
    )

    if key is None:
        fail("--key is needed: the log's public key checks the checkpoint's signature", 2)
    key_path = Path(key)
    key_text = _read(key_path, "key") if key_path.is_file() else key
    try:
        origin = parse_checkpoint(parse_note(note).text).origin
        verifier = verifier_for(key_text, origin)
        return open_checkpoint(note, verifier), verifier
    except NoteError as exc:
        fail(f"{what}: {exc}")


@audit_app.command("verify")
def audit_verify(
    data_dir: DataDirOpt = None,
    store_url: StoreUrlOpt = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint",
            help="Prove that the log extends this older signed checkpoint (needs --key).",
        ),
    ] = None,
    proof: Annotated[
        Path | None,
        typer.Option(
            "--proof",
            help="Check an inclusion proof (`audit prove`) offline, with --key alone: no store.",
        ),
    ] = None,
    key: KeyOpt = None,
    witness: Annotated[
        list[str] | None,
        typer.Option(
            "--witness",
            help="A witness you trust: its verifier key (name+id+base64, type 0x04), or a file"
            " holding it. Repeatable. docs/how-to/audit.md, Witnesses",
        ),
    ] = None,
    min_witnesses: Annotated[
        int | None,
        typer.Option(
            "--min-witnesses",
            min=0,
            help="How many of the --witness keys must have cosigned the log at or beyond the"
            " checkpoint (with --proof: the proof's checkpoint). Default: 1 with --witness.",
        ),
    ] = None,
) -> None:
    """Walk the hash chain (exit 1 at the first broken record); with
    --checkpoint, also prove the log extends that checkpoint; with --proof,
    check a record's inclusion proof without the store; with --witness,
    require witnesses' cosignatures too."""
    witnesses = _witnesses(witness or [], min_witnesses, checkpoint or proof)
    if proof is not None:
        _verify_proof(proof, key, witnesses)
        return
    if checkpoint is not None:
        _verify_extends(checkpoint, key, data_dir, store_url, witnesses)
        return
    from registry_server.store import audit_chain as audit

    store = _open_store(data_dir, store_url)
    verdict = audit.verify(store)
    store.close()
    typer.echo(str(verdict))
    if not verdict.ok:
        raise typer.Exit(1)


def _witnesses(texts: list[str], k: int | None, given: Path | None) -> Witnesses:
    """The trusted witnesses and how many must have cosigned; exit 2 on a bad one."""
    from registry_server.cli.audit_witnesses import witness_verifiers
    from registry_server.signing.notes import NoteError

    required = (1 if texts else 0) if k is None else k
    if (texts or required) and given is None:
        fail("--witness and --min-witnesses go with --checkpoint or --proof", 2)
    try:
        verifiers = witness_verifiers(texts)
    except (NoteError, OSError) as exc:
        fail(str(exc), 2)
    if required > len(verifiers):
        fail(f"--min-witnesses {required}: only {len(verifiers)} --witness key(s) given", 2)
    return verifiers, required


def _verify_extends(
    path: Path,
    key: str | None,
    data_dir: Path | None,
    store_url: str | None,
    witnesses: Witnesses = ([], 0),
) -> None:
    """What an auditor holding an old checkpoint and the log's public key asks:
    is today's log that log, grown? Every check is printed; exit 1 on any failure."""
    from registry_server.signing.notes import NoteError
    from registry_server.store import audit_tree

    old_note = _read(path, "checkpoint")
    old, verifier = _signed_checkpoint(old_note, key, f"checkpoint {path}")
    typer.echo(
        f"checkpoint {path}: log {old.origin}, {old.size} records, root {old.root.hex()[:16]};"
        f" signature verified ({verifier.name}+{verifier.id.hex()})"
    )
    store = _open_store(data_dir, store_url)
    try:
        log = audit_tree.read_log(store)
        with store.reading() as reads:
            latest = reads.latest_checkpoint(old.origin)
            cosignatures = reads.latest_cosignatures(old.origin) if witnesses[0] else []
    finally:
        store.close()
    failures: list[str] = []
    typer.echo(str(log.chain))
    if not log.chain.ok:
        failures.append(str(log.chain))
    extension = audit_tree.extends(log, old)
    if extension.ok:
        typer.echo(f"the log extends the checkpoint: {extension.reason}")
    else:
        failures.append(f"the log does not extend the checkpoint: {extension.reason}")
    if latest is None:
        typer.echo(f"no checkpoint of {old.origin} in the store")
    else:
        what = f"the store's last checkpoint ({latest.size} records)"
        try:
            stored = audit_tree.checkpoint_of(latest, verifier)
        except NoteError as exc:
            failures.append(f"{what}: {exc}")
        else:
            outcome = audit_tree.extends(log, stored)
            if outcome.ok:
                typer.echo(f"{what}: signature verified; {outcome.reason}")
            else:
                failures.append(f"{what}: signature verified, but {outcome.reason}")
    if witnesses[0]:
        from registry_server.cli.audit_witnesses import witnessed

        seen = witnessed(old_note, old, log, cosignatures, witnesses[0])
        failures += _count_witnesses(seen, witnesses[1], f"the log at or beyond {old.size} records")
    if failures:
        for failure in failures:
            typer.echo(f"FAILED: {failure}")
        raise typer.Exit(1)
    typer.echo(f"verified: the log ({log.size} records) extends {path} ({old.size} records)")


def _count_witnesses(seen: Witnessed, required: int, what: str) -> list[str]:
    for line in seen.shown:
        typer.echo(line)
    if seen.count < required:
        return [f"{seen.count} of the --witness keys cosigned {what}; {required} required"]
    typer.echo(f"witnessed: {seen.count} of the --witness keys cosigned {what}"
               f" ({required} required)")  # fmt: skip
    return []


def _verify_proof(path: Path, key: str | None, witnesses: Witnesses = ([], 0)) -> None:
    """A tlog-proof checked as the RFC says, with the log's key alone."""
    from registry_server.domain import merkle
    from registry_server.signing.notes import NoteError, parse_tlog_proof

    try:
        bundle = parse_tlog_proof(_read(path, "proof"))
    except NoteError as exc:
        fail(f"proof {path}: {exc}")
    checkpoint, verifier = _signed_checkpoint(bundle.checkpoint, key, f"proof {path}")
    if bundle.extra is None:
        fail(f"proof {path}: it carries no record (no extra line)")
    try:
        entry = json.loads(bundle.extra)
        seq = int(entry["seq"])
    except (ValueError, KeyError, TypeError):
        fail(f"proof {path}: its extra data is not an audit record")
    if seq != bundle.index + 1:
        fail(f"proof {path}: record {seq} given for index {bundle.index}")
    leaf = merkle.leaf_hash(bundle.extra)
    if not merkle.verify_inclusion(bundle.index, checkpoint.size, leaf, bundle.path,
                                   checkpoint.root):  # fmt: skip
        fail(f"proof {path}: the record is not in the checkpoint's tree (altered record or path)")
    typer.echo(
        f"verified: record {seq} is in log {checkpoint.origin} of {checkpoint.size} records"
        f" (root {checkpoint.root.hex()[:16]}, signed by {verifier.name}+{verifier.id.hex()})"
    )
    typer.echo(json.dumps({**entry, "record": json.loads(entry["record"])}, ensure_ascii=False))
    if witnesses[0]:
        from registry_server.cli.audit_witnesses import proof_witnessed

        seen = proof_witnessed(bundle.checkpoint, witnesses[0])
        for failure in _count_witnesses(seen, witnesses[1], "the proof's checkpoint"):
            fail(f"proof {path}: {failure}")


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


@audit_app.command("checkpoint")
def audit_checkpoint(
    data_dir: DataDirOpt = None,
    store_url: StoreUrlOpt = None,
    origin: Annotated[
        str | None,
        typer.Option("--origin", help="The log (default: the latest checkpoint's)."),
    ] = None,
    make: Annotated[
        bool,
        typer.Option("--make", help="Sign one now, of the whole log (needs --log-key)."),
    ] = False,
    log_key: Annotated[
        Path | None,
        typer.Option("--log-key", help="The log key (as the server's --log-key)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Also write the checkpoint to this file.")
    ] = None,
) -> None:
    """Print the latest signed checkpoint of the audit log, with the
    witnesses' cosignatures of it; with --make, sign one of the log as it is
    now (refused when its chain is broken or it does not extend the last
    checkpoint)."""
    from registry_server.cli.audit_witnesses import cosigned_note
    from registry_server.store import audit_tree

    store = _open_store(data_dir, store_url)
    try:
        with store.reading() as reads:
            latest = reads.latest_checkpoint(origin)
        if make:
            from registry_server.cli.keys import read_signing_key
            from registry_server.signing.notes import NoteError, Signer

            if log_key is None:
                fail("--make needs --log-key", 2)
            name = origin or (latest.origin if latest is not None else None)
            if name is None:
                fail("no checkpoint yet: give --origin (the server's is toolreg/<audience>)", 2)
            try:
                signer = Signer(name, read_signing_key(log_key))
            except NoteError as exc:
                fail(f"--origin: {exc}", 2)
            try:
                latest = audit_tree.checkpoint_now(store, signer)
            except audit_tree.CheckpointRefused as exc:
                fail(f"not signed: {exc}")
        if latest is None:
            fail("no checkpoint in the store (a server signs them with --log-key)")
        with store.reading() as reads:  # with the witnesses' cosignatures of it
            note = cosigned_note(reads, latest)
    finally:
        store.close()
    if out is not None:
        out.write_text(note, encoding="utf-8")
    typer.echo(note, nl=False)


@audit_app.command("verifier-key")
def audit_verifier_key(
    key: Annotated[
        str,
        typer.Option("--key", help="The log's public key (a file, or base64 or PEM text)."),
    ],
    origin: Annotated[str, typer.Option("--origin", help="The log's origin (its key name).")],
) -> None:
    """Print the log's verifier key, <origin>+<key ID>+<base64 key>, the form
    signed-note tools take (the server logs it at start too)."""
    from registry_server.signing.notes import NoteError, verifier_for

    key_path = Path(key)
    try:
        verifier = verifier_for(_read(key_path, "key") if key_path.is_file() else key, origin)
    except NoteError as exc:
        fail(str(exc), 2)
    if verifier.name != origin:
        fail(f"that verifier key is {verifier.name!r}'s, not {origin!r}'s", 2)
    typer.echo(str(verifier))


@audit_app.command("prove")
def audit_prove(
    record: Annotated[int, typer.Option("--record", help="The record's seq (1, 2, ...).")],
    data_dir: DataDirOpt = None,
    store_url: StoreUrlOpt = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint", help="Prove against this checkpoint (default: the latest stored)."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Write the proof here (default: standard output)."),
    ] = None,
) -> None:
    """Write an inclusion proof of one record (c2sp.org/tlog-proof@v1): the
    record's canonical bytes, its audit path and the signed checkpoint. Anyone
    with the log's public key can check it offline (`audit verify --proof`)."""
    from registry_server.cli.audit_witnesses import cosigned_note
    from registry_server.domain import merkle
    from registry_server.signing.notes import (
        NoteError,
        TlogProof,
        parse_checkpoint,
        parse_note,
    )
    from registry_server.store import audit_tree

    store = _open_store(data_dir, store_url)
    try:
        log = audit_tree.read_log(store)
        if checkpoint is not None:
            note = _read(checkpoint, "checkpoint")
        else:
            with store.reading() as reads:
                latest = reads.latest_checkpoint()
                # The witnesses' cosignatures of it travel with the proof.
                note = cosigned_note(reads, latest) if latest is not None else ""
            if latest is None:
                fail(
                    "no checkpoint in the store to prove against (a server signs them with"
                    " --log-key; `toolreg audit checkpoint --make` signs one now)"
                )
    finally:
        store.close()
    try:
        signed = parse_checkpoint(parse_note(note).text)
    except NoteError as exc:
        fail(f"checkpoint: {exc}")
    if not 1 <= record <= signed.size:
        fail(f"record {record} is not in the checkpoint ({signed.size} records); prove it"
             " against a newer one (`toolreg audit checkpoint --make`)")  # fmt: skip
    if signed.size > log.size or log.root(signed.size) != signed.root:
        fail(f"the log no longer matches the checkpoint of {signed.size} records (`toolreg"
             " audit verify --checkpoint` says why)")  # fmt: skip
    index = record - 1
    path = merkle.inclusion_proof(log.leaves, index, signed.size)
    if not merkle.verify_inclusion(index, signed.size, log.leaves[index], path, signed.root):
        fail(f"the proof of record {record} does not verify (a bug: please report it)")
    text = TlogProof(index, tuple(path), note, extra=log.leaf_bytes(record)).text()
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text, encoding="utf-8")
        typer.echo(f"wrote the proof of record {record} in {signed.origin} ({signed.size}"
                   f" records) to {out}")  # fmt: skip
