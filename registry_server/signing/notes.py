"""Signed notes (c2sp.org/signed-note) with Ed25519, the checkpoints a
transparency log signs (c2sp.org/tlog-checkpoint), and offline inclusion
proofs (c2sp.org/tlog-proof): the formats of the audit log's checkpoints
(docs/how-to/audit.md). Text in, text out; the tree is domain/merkle.py's.

A note is text ending in a newline, a blank line, and signature lines
``— <key name> <base64(4-byte key ID || signature)>``. The key ID is the
first four bytes of SHA-256(key name || 0x0A || 0x01 || 32-byte public key)
for Ed25519 (type byte 0x01), and a verifier key is shared as
``<name>+<key ID, 8 hex digits>+<base64(0x01 || public key)>`` (the form of
Go's golang.org/x/mod/sumdb/note, which other tools read).

A checkpoint is a note whose text is the log's origin, its tree size and
its root hash (base64), one per line, then optional extension lines. The log
signs with the origin as its key name, so a verifier holding the key knows
which log a checkpoint is of.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from registry_server.domain.merkle import HASH_BYTES

ED25519 = 0x01  # the signature type byte of Ed25519 (signed-note)
KEY_ID_BYTES = 4
SIGNATURE_BYTES = 64  # an Ed25519 signature
MAX_NOTE_BYTES = 1024 * 1024  # a note or proof read from anywhere: 1 MiB at most
MAX_SIGNATURES = 100  # signature lines read from one note (the spec asks for at least 16)
SIGNATURE_PREFIX = "\u2014 "  # em dash, space
TLOG_PROOF_HEADER = "c2sp.org/tlog-proof@v1"
_DECIMAL = re.compile(r"^(0|[1-9][0-9]*)$")
_KEY_ID_HEX = re.compile(r"^[0-9a-f]{8}$")
_VERIFIER_KEY = re.compile(r"^[^+\s]+\+[0-9A-Fa-f]{8}\+\S+$")  # name+id+key, one line


class NoteError(ValueError):
    """A note, checkpoint, key or proof that is malformed or does not verify:
    the message says which and why, never quoting key material."""


def _b64decode(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise NoteError(f"{what}: invalid base64") from None


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def check_key_name(name: str) -> str:
    """A key name (and so an origin) as signed-note allows it: non-empty, no
    Unicode space, no '+', no control character."""
    if not name:
        raise NoteError("a key name must not be empty")
    if any(c.isspace() or c == "+" or ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        raise NoteError(f"key name {name!r} has a space, '+' or control character")
    return name


def key_id(name: str, public_key: Ed25519PublicKey, key_type: int = ED25519) -> bytes:
    """SHA-256(name || 0x0A || type || public key)[:4]: 0x01 a note's (a log's)
    Ed25519 key, 0x04 a witness's cosignature/v1 key (cosignatures.py)."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    digest = hashlib.sha256(name.encode() + b"\n" + bytes([key_type]) + raw)
    return digest.digest()[:KEY_ID_BYTES]


def read_verifier_key(vkey: str, key_type: int, what: str) -> tuple[str, Ed25519PublicKey]:
    """(name, public key) of ``<name>+<key ID hex>+<base64(type || key)>``,
    its type and key ID checked; ``what`` names it in errors."""
    parts = vkey.strip().split("+", 2)
    if len(parts) != 3:
        raise NoteError(f"not a {what} (expected <name>+<key ID>+<base64 key>)")
    name, id_hex, key_b64 = parts
    check_key_name(name)
    if not _KEY_ID_HEX.match(id_hex):
        raise NoteError(f"{what}: the key ID is not 8 lowercase hex digits")
    typed = _b64decode(key_b64, what)
    if len(typed) != 1 + 32:
        raise NoteError(f"{what}: not a 32-byte Ed25519 key")
    if typed[0] != key_type:
        raise NoteError(
            f"{what}: type 0x{typed[0]:02x}, expected 0x{key_type:02x} (0x01 is a log's key,"
            " 0x04 a witness's cosignature/v1 key)"
        )
    public_key = Ed25519PublicKey.from_public_bytes(typed[1:])
    if key_id(name, public_key, key_type).hex() != id_hex:
        raise NoteError(f"{what}: the key ID does not match the name and key")
    return name, public_key


@dataclass(frozen=True)
class Verifier:
    """A public key under a name: it verifies that name's signature lines."""

    name: str
    public_key: Ed25519PublicKey = field(compare=False)
    id: bytes = b""

    def __post_init__(self) -> None:
        check_key_name(self.name)
        if not self.id:
            object.__setattr__(self, "id", key_id(self.name, self.public_key))

    @classmethod
    def from_text(cls, vkey: str) -> Verifier:
        """From ``<name>+<key ID hex>+<base64(0x01 || public key)>``."""
        return cls(*read_verifier_key(vkey, ED25519, "verifier key"))

    def __str__(self) -> str:
        raw = self.public_key.public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        return f"{self.name}+{self.id.hex()}+{_b64(bytes([ED25519]) + raw)}"

    def verifies(self, text: str, signature: bytes) -> bool:
        if len(signature) != SIGNATURE_BYTES:
            return False
        try:
            self.public_key.verify(signature, text.encode())
        except InvalidSignature:
            return False
        return True


class Signer:
    """A private key under a name: it signs notes."""

    def __init__(self, name: str, private_key: Ed25519PrivateKey) -> None:
        self.name = check_key_name(name)
        self._key = private_key
        self.verifier = Verifier(name, private_key.public_key())

    def sign(self, text: str) -> str:
        """The signed note of ``text``."""
        _check_text(text)
        signature = self.verifier.id + self._key.sign(text.encode())
        return f"{text}\n{SIGNATURE_PREFIX}{self.name} {_b64(signature)}\n"


@dataclass(frozen=True)
class Signature:
    name: str
    id: bytes
    signature: bytes  # without the key ID


@dataclass(frozen=True)
class Note:
    text: str  # what the signatures sign: ends in a newline
    signatures: tuple[Signature, ...]


def _check_text(text: str) -> None:
    if not text.endswith("\n"):
        raise NoteError("a note's text must end in a newline")
    if any(ord(c) < 0x20 and c != "\n" for c in text):
        raise NoteError("a note must not hold control characters other than newline")


def parse_note(note: str) -> Note:
    """A note's text and signature lines, checked for form only."""
    if len(note.encode()) > MAX_NOTE_BYTES:
        raise NoteError(f"note larger than {MAX_NOTE_BYTES} bytes")
    _check_text(note)
    split = note.rfind("\n\n")
    if split < 0:
        raise NoteError("not a signed note: no blank line before the signatures")
    text, lines = note[: split + 1], note[split + 2 :].splitlines()
    if not lines:
        raise NoteError("not a signed note: no signature lines")
    if len(lines) > MAX_SIGNATURES:
        raise NoteError(f"more than {MAX_SIGNATURES} signatures")
    signatures = []
    for line in lines:
        if not line.startswith(SIGNATURE_PREFIX):
            raise NoteError("malformed signature line (expected '\u2014 <name> <signature>')")
        name, space, sig_b64 = line[len(SIGNATURE_PREFIX) :].partition(" ")
        if not space or " " in sig_b64:
            raise NoteError("malformed signature line (expected '\u2014 <name> <signature>')")
        check_key_name(name)
        blob = _b64decode(sig_b64, f"signature of {name}")
        if len(blob) < KEY_ID_BYTES + 1:
            raise NoteError(f"signature of {name}: too short")
        signatures.append(Signature(name, blob[:KEY_ID_BYTES], blob[KEY_ID_BYTES:]))
    return Note(text, tuple(signatures))


def open_note(note: str, verifiers: Sequence[Verifier]) -> Note:
    """The note, once a signature of one of ``verifiers`` verifies. Signatures
    of other keys are ignored; one of a known key that fails rejects the note
    (the spec's SHOULD)."""
    parsed = parse_note(note)
    known = {(v.name, v.id): v for v in verifiers}
    verified = False
    for sig in parsed.signatures:
        verifier = known.get((sig.name, sig.id))
        if verifier is None:
            continue
        if not verifier.verifies(parsed.text, sig.signature):
            raise NoteError(f"the signature of {sig.name} does not verify (altered note?)")
        verified = True
    if not verified:
        names = ", ".join(f"{v.name}+{v.id.hex()}" for v in verifiers) or "none"
        raise NoteError(f"no signature by a known key ({names}) on this note")
    return parsed


@dataclass(frozen=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes
    extensions: tuple[str, ...] = ()

    def body(self) -> str:
        lines = [self.origin, str(self.size), _b64(self.root), *self.extensions]
        return "".join(f"{line}\n" for line in lines)


def parse_checkpoint(text: str) -> Checkpoint:
    """A checkpoint from a note's text (not its signatures)."""
    _check_text(text)
    lines = text[:-1].split("\n")
    if len(lines) < 3:
        raise NoteError("not a checkpoint: fewer than three lines (origin, size, root hash)")
    origin, size, root_b64, *extensions = lines
    if not origin:
        raise NoteError("not a checkpoint: empty origin line")
    if not _DECIMAL.match(size):
        raise NoteError("not a checkpoint: the tree size is not a decimal without leading zeros")
    root = _b64decode(root_b64, "checkpoint root hash")
    if len(root) != HASH_BYTES:
        raise NoteError(f"checkpoint root hash: {len(root)} bytes, expected {HASH_BYTES}")
    if any(not line for line in extensions):
        raise NoteError("not a checkpoint: an empty extension line")
    return Checkpoint(origin, int(size), root, tuple(extensions))


def open_checkpoint(note: str, verifier: Verifier) -> Checkpoint:
    """The checkpoint of a note that ``verifier`` signed; its origin must be
    the verifier's name (the log the key speaks for)."""
    checkpoint = parse_checkpoint(open_note(note, [verifier]).text)
    if checkpoint.origin != verifier.name:
        raise NoteError(
            f"checkpoint of log {checkpoint.origin!r}, but the key is {verifier.name!r}'s"
        )
    return checkpoint


def verifier_for(key_text: str, origin: str) -> Verifier:
    """A verifier from what an auditor was given: a verifier key
    (``name+id+base64``), or an Ed25519 public key (raw base64 or PEM, as
    `toolreg keys generate` writes it) taken as the key of log ``origin``."""
    from registry_server.signing.keys import public_key_from_text

    stripped = key_text.strip()
    if _VERIFIER_KEY.match(stripped):
        return Verifier.from_text(stripped)
    try:
        public_key = public_key_from_text(stripped)
    except ValueError as exc:
        raise NoteError(str(exc)) from None
    return Verifier(check_key_name(origin), public_key)


@dataclass(frozen=True)
class TlogProof:
    """An offline proof that one entry is in a log (c2sp.org/tlog-proof@v1):
    the entry's index, its audit path in the checkpoint's tree, the signed
    checkpoint, and ``extra`` data (toolreg: the entry's leaf bytes, so the
    proof carries the record it proves)."""

    index: int  # zero-based
    path: tuple[bytes, ...]
    checkpoint: str  # the signed checkpoint note, verbatim
    extra: bytes | None = None

    def text(self) -> str:
        lines = [TLOG_PROOF_HEADER]
        if self.extra is not None:
            lines.append(f"extra {_b64(self.extra)}")
        lines.append(f"index {self.index}")
        lines += [_b64(h) for h in self.path]
        return "".join(f"{line}\n" for line in lines) + "\n" + self.checkpoint


def parse_tlog_proof(text: str) -> TlogProof:
    if len(text.encode()) > MAX_NOTE_BYTES:
        raise NoteError(f"proof larger than {MAX_NOTE_BYTES} bytes")
    head, blank, checkpoint = text.partition("\n\n")
    if not blank:
        raise NoteError("not a tlog-proof: no blank line before the checkpoint")
    lines = head.split("\n")
    if lines[0] != TLOG_PROOF_HEADER:
        raise NoteError(f"not a tlog-proof: the first line is not {TLOG_PROOF_HEADER}")
    rest = lines[1:]
    extra = None
    if rest and rest[0].startswith("extra "):
        extra = _b64decode(rest.pop(0)[len("extra ") :], "tlog-proof extra data")
    if not rest or not rest[0].startswith("index "):
        raise NoteError("not a tlog-proof: no index line")
    index = rest.pop(0)[len("index ") :]
    if not _DECIMAL.match(index):
        raise NoteError("tlog-proof: the index is not a decimal without leading zeros")
    path = []
    for line in rest:
        node = _b64decode(line, "tlog-proof path hash")
        if len(node) != HASH_BYTES:
            raise NoteError(f"tlog-proof path hash: {len(node)} bytes, expected {HASH_BYTES}")
        path.append(node)
    return TlogProof(int(index), tuple(path), checkpoint, extra)
