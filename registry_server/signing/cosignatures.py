"""Witness cosignatures (c2sp.org/tlog-cosignature, the Ed25519 type,
``cosignature/v1``) on the audit log's checkpoints (docs/how-to/audit.md,
"Witnesses"). Text in, text out; the notes and checkpoints are notes.py's.

A cosignature is a signed-note signature line on a checkpoint,
``— <witness name> <base64(key ID || timestamp || signature)>``:

* the key ID is SHA-256(name || 0x0A || 0x04 || 32-byte public key)[:4],
  0x04 being the cosignature/v1 type byte (a log's own Ed25519 signature
  uses 0x01, so one never passes for the other);
* the timestamp is 8 bytes, big-endian, POSIX seconds, at most 2^63 - 1;
* the signature is Ed25519 over ``cosignature/v1\\n``, ``time <timestamp>\\n``
  and the checkpoint's whole note text (origin, size, root and any
  extension lines, with the final newline; no signature lines).

By it the witness states that, at that time, the largest checkpoint of that
log it had verified as consistent with every one it saw before has that
root. A verifier key of a witness is ``<name>+<key ID hex>+<base64(0x04 ||
public key)>`` (signed-note's vkey form with the cosignature type byte).
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from registry_server.signing import notes
from registry_server.signing.notes import (
    SIGNATURE_BYTES,
    SIGNATURE_PREFIX,
    NoteError,
    Signature,
    check_key_name,
    parse_note,
    read_verifier_key,
)

COSIGNATURE_V1 = 0x04  # the key ID's type byte of an Ed25519 cosignature/v1
HEADER = "cosignature/v1"  # the signed message's first line (domain separation)
TIMESTAMP_BYTES = 8  # u64, big-endian
MAX_TIMESTAMP = 2**63 - 1  # the spec's bound on a cosignature's time
COSIGNATURE_BYTES = TIMESTAMP_BYTES + SIGNATURE_BYTES  # after the key ID


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _raw(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(name: str, public_key: Ed25519PublicKey) -> bytes:
    """SHA-256(name || 0x0A || 0x04 || public key)[:4]."""
    return notes.key_id(name, public_key, COSIGNATURE_V1)


def signed_message(text: str, timestamp: int) -> bytes:
    """What a cosignature/v1 signs: the header line, the time line, then the
    checkpoint's note text (ending in a newline)."""
    if not 0 <= timestamp <= MAX_TIMESTAMP:
        raise NoteError(f"cosignature time {timestamp} out of range (0..2^63-1)")
    if not text.endswith("\n"):
        raise NoteError("a note's text must end in a newline")
    return f"{HEADER}\ntime {timestamp}\n{text}".encode()


@dataclass(frozen=True)
class Cosignature:
    """A cosignature that verified: whose, when, and its line as published."""

    name: str
    key_id: bytes
    timestamp: int
    line: str  # "— <name> <base64>", no newline


@dataclass(frozen=True)
class CosignatureVerifier:
    """A witness's public key under its name: verifies its cosignatures."""

    name: str
    public_key: Ed25519PublicKey = field(compare=False)
    id: bytes = b""

    def __post_init__(self) -> None:
        check_key_name(self.name)
        if not self.id:
            object.__setattr__(self, "id", key_id(self.name, self.public_key))

    @classmethod
    def from_text(cls, vkey: str) -> CosignatureVerifier:
        """From ``<name>+<key ID hex>+<base64(0x04 || public key)>``."""
        return cls(*read_verifier_key(vkey, COSIGNATURE_V1, "witness verifier key"))

    def __str__(self) -> str:
        typed = bytes([COSIGNATURE_V1]) + _raw(self.public_key)
        return f"{self.name}+{self.id.hex()}+{_b64(typed)}"

    def matches(self, signature: Signature) -> bool:
        return (signature.name, signature.id) == (self.name, self.id)

    def timestamp_of(self, text: str, signature: Signature) -> int | None:
        """The cosignature's time when it is this key's and verifies on the
        note text ``text``; None when it does not."""
        if not self.matches(signature) or len(signature.signature) != COSIGNATURE_BYTES:
            return None
        timestamp = int.from_bytes(signature.signature[:TIMESTAMP_BYTES], "big")
        if timestamp > MAX_TIMESTAMP:
            return None
        try:
            self.public_key.verify(
                signature.signature[TIMESTAMP_BYTES:], signed_message(text, timestamp)
            )
        except InvalidSignature:
            return None
        return timestamp


class Cosigner:
    """A witness's private key under its name."""

    def __init__(self, name: str, private_key: Ed25519PrivateKey) -> None:
        self.name = check_key_name(name)
        self._key = private_key
        self.verifier = CosignatureVerifier(name, private_key.public_key())

    def cosign(self, text: str, timestamp: int) -> str:
        """The cosignature line (with its newline) on a checkpoint's note text."""
        signature = self._key.sign(signed_message(text, timestamp))
        blob = self.verifier.id + timestamp.to_bytes(TIMESTAMP_BYTES, "big") + signature
        return f"{SIGNATURE_PREFIX}{self.name} {_b64(blob)}\n"


@dataclass(frozen=True)
class CosignatureCheck:
    """The cosignatures on one note by the witnesses a verifier trusts."""

    valid: tuple[Cosignature, ...]  # at most one per witness key, the latest
    invalid: tuple[str, ...] = ()  # names of trusted witnesses whose line fails

    def count(self) -> int:
        return len({(c.name, c.key_id) for c in self.valid})


def check_cosignatures(note: str, witnesses: Sequence[CosignatureVerifier]) -> CosignatureCheck:
    """The valid cosignatures on the signed note ``note`` (a checkpoint with
    its signature lines) by ``witnesses``. Lines of other keys are ignored,
    as the spec says a client must; a line of a trusted key that does not
    verify is named in ``invalid`` and not counted. NoteError if the note is
    malformed."""
    parsed = parse_note(note)
    best: dict[tuple[str, bytes], Cosignature] = {}
    invalid: list[str] = []
    for sig in parsed.signatures:
        for witness in witnesses:
            if not witness.matches(sig):
                continue
            timestamp = witness.timestamp_of(parsed.text, sig)
            if timestamp is None:
                invalid.append(witness.name)
                continue
            line = f"{SIGNATURE_PREFIX}{sig.name} {_b64(sig.id + sig.signature)}"
            key = (witness.name, witness.id)
            if key not in best or best[key].timestamp < timestamp:
                best[key] = Cosignature(witness.name, witness.id, timestamp, line)
    return CosignatureCheck(tuple(best.values()), tuple(invalid))


def parse_signature_lines(body: str) -> list[str]:
    """The signature lines of a witness's answer (each ``— <name> <base64>``
    ending in a newline), without their newlines. NoteError if it is not that."""
    if not body.endswith("\n"):
        raise NoteError("a cosignature answer must end in a newline")
    lines = body[:-1].split("\n")
    for line in lines:
        name, space, sig_b64 = line.removeprefix(SIGNATURE_PREFIX).partition(" ")
        if not line.startswith(SIGNATURE_PREFIX) or not space or " " in sig_b64:
            raise NoteError("a cosignature answer holds a line that is not a signature line")
        check_key_name(name)
    return lines


def with_signature_lines(note: str, lines: Sequence[str]) -> str:
    """The signed note with these signature lines added after its own (the
    ones it holds already are not repeated)."""
    have = set(note.rstrip("\n").split("\n"))
    extra = [line for line in dict.fromkeys(lines) if line not in have]
    return note + "".join(f"{line}\n" for line in extra)
