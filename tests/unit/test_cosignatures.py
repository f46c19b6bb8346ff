"""Witness cosignatures (signing/cosignatures.py, c2sp.org/tlog-cosignature
v1) and the witness protocol's wire format (signing/tlog_witness.py): the
spec's example read as the spec lays it out, a cosignature checked by hand
from the spec's definitions, and every altered one refused."""

from __future__ import annotations

import base64
import hashlib

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from registry_server.domain import merkle
from registry_server.signing.cosignatures import (
    CosignatureVerifier,
    Cosigner,
    check_cosignatures,
    parse_signature_lines,
    with_signature_lines,
)
from registry_server.signing.notes import (
    Checkpoint,
    NoteError,
    Signer,
    Verifier,
    open_note,
    parse_note,
)
from registry_server.signing.tlog_witness import (
    MAX_PROOF_LINES,
    AddCheckpoint,
    parse_add_checkpoint,
    parse_size,
)

ORIGIN = "toolreg.example/log"
WITNESS = "witness.example/w1"
# The example of c2sp.org/tlog-cosignature: its cosignature line, and the time
# its signed message shows.
SPEC_LINE = (
    "\u2014 witness.example.com/w1 jWbPPwAAAABkGFDLEZMHwSRaJNiIDoe9DYn/zXcrtPHeolMI5OWXEhZCB9dlrDJs"
    "X3b2oyin1nPZqhf5nNo0xUe+mbIUBkBIfZ+qnA=="
)
SPEC_TIME = 1679315147


def checkpoint_note(size: int = 10, log: Signer | None = None) -> tuple[str, Signer]:
    log = log or Signer(ORIGIN, Ed25519PrivateKey.generate())
    leaves = [merkle.leaf_hash(bytes([i])) for i in range(size)]
    return log.sign(Checkpoint(ORIGIN, size, merkle.root(leaves)).body()), log


def cosigner(name: str = WITNESS) -> Cosigner:
    return Cosigner(name, Ed25519PrivateKey.generate())


def test_the_spec_example_is_laid_out_as_the_spec_says() -> None:
    """4-byte key ID, 8-byte big-endian time, 64-byte Ed25519 signature."""
    note = "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n"
    sig = parse_note(f"{note}\n{SPEC_LINE}\n").signatures[0]
    assert sig.name == "witness.example.com/w1"
    assert len(sig.id) == 4
    assert len(sig.signature) == 8 + 64
    assert int.from_bytes(sig.signature[:8], "big") == SPEC_TIME


def test_a_cosignature_checks_out_by_hand_from_the_spec() -> None:
    note, _log = checkpoint_note()
    witness = cosigner()
    text = parse_note(note).text
    line = witness.cosign(text, 1_700_000_000)
    assert line.startswith(f"\u2014 {WITNESS} ") and line.endswith("\n")
    blob = base64.b64decode(line.split(" ")[2])
    raw = witness.verifier.public_key.public_bytes(
        serialization.Encoding.Raw, serialization.PublicFormat.Raw
    )
    assert blob[:4] == hashlib.sha256(WITNESS.encode() + b"\n\x04" + raw).digest()[:4]
    assert int.from_bytes(blob[4:12], "big") == 1_700_000_000
    message = b"cosignature/v1\ntime 1700000000\n" + text.encode()
    witness.verifier.public_key.verify(blob[12:], message)  # raises if not
    # A verifier key with type 0x04, read back.
    vkey = str(witness.verifier)
    assert vkey.split("+", 2)[2] == base64.b64encode(b"\x04" + raw).decode()
    assert CosignatureVerifier.from_text(vkey) == witness.verifier


def test_a_cosigned_checkpoint_still_opens_with_the_log_key_alone() -> None:
    note, log = checkpoint_note()
    witness = cosigner()
    cosigned = with_signature_lines(
        note, [witness.cosign(parse_note(note).text, 1_700_000_000).rstrip("\n")]
    )
    assert open_note(cosigned, [log.verifier]).text == parse_note(note).text
    check = check_cosignatures(cosigned, [witness.verifier])
    assert check.count() == 1 and check.valid[0].timestamp == 1_700_000_000
    assert check.invalid == ()
    # The same line again is not added twice; counting is per witness key.
    again = with_signature_lines(cosigned, [check.valid[0].line])
    assert again == cosigned


def test_cosignatures_of_other_keys_are_ignored_and_bad_ones_refused() -> None:
    note, _log = checkpoint_note()
    text = parse_note(note).text
    trusted, stranger = cosigner(), cosigner("witness.example/other")
    same_name = cosigner()  # another key under the trusted one's name: another key ID
    lines = [w.cosign(text, 1_700_000_000).rstrip("\n") for w in (stranger, same_name)]
    assert check_cosignatures(with_signature_lines(note, lines), [trusted.verifier]).count() == 0
    good = trusted.cosign(text, 1_700_000_000).rstrip("\n")
    name, blob = good.split(" ")[1], bytearray(base64.b64decode(good.split(" ")[2]))
    for index in (4, 11, 12, 75):  # the time, and the signature, altered
        altered = blob.copy()
        altered[index] ^= 1
        line = f"\u2014 {name} {base64.b64encode(bytes(altered)).decode()}"
        check = check_cosignatures(with_signature_lines(note, [line]), [trusted.verifier])
        assert check.count() == 0 and check.invalid == (WITNESS,)
    # On another checkpoint (another size), it does not verify.
    other, _ = checkpoint_note(11)
    check = check_cosignatures(with_signature_lines(other, [good]), [trusted.verifier])
    assert check.count() == 0 and check.invalid == (WITNESS,)
    # A log's signature (type 0x01) never passes for a cosignature (0x04), even
    # with the same key and name.
    key = Ed25519PrivateKey.generate()
    as_log, as_witness = Signer(WITNESS, key), Cosigner(WITNESS, key)
    assert as_log.verifier.id != as_witness.verifier.id
    log_line = as_log.sign(text).split("\n\n")[1].rstrip("\n")
    assert check_cosignatures(with_signature_lines(note, [log_line]),
                              [as_witness.verifier]).count() == 0  # fmt: skip


def test_witness_verifier_keys_are_checked() -> None:
    witness = cosigner()
    vkey = str(witness.verifier)
    name, id_hex, key_b64 = vkey.split("+", 2)
    log_vkey = str(Verifier(WITNESS, witness.verifier.public_key))  # type 0x01
    for bad in (
        f"{name}+{id_hex}",
        f"{name}+00000000+{key_b64}",
        f"other+{id_hex}+{key_b64}",
        log_vkey,
        f"{name}+{id_hex}+{key_b64[:-4]}",
        f"{name}+{id_hex}+not*base64",
    ):
        with pytest.raises(NoteError):
            CosignatureVerifier.from_text(bad)
    with pytest.raises(NoteError, match="0x04"):
        CosignatureVerifier.from_text(log_vkey)


def test_a_witness_answer_is_signature_lines() -> None:
    note, _ = checkpoint_note()
    line = cosigner().cosign(parse_note(note).text, 1)
    assert parse_signature_lines(line + line) == [line[:-1], line[:-1]]
    for bad in ("", line[:-1], "hello\n", line + "\n", "\u2014 name\n", "\u2014 a b c\n"):
        with pytest.raises(NoteError):
            parse_signature_lines(bad)


def test_add_checkpoint_bodies_round_trip_and_malformed_ones_are_refused() -> None:
    note, _ = checkpoint_note()
    proof = tuple(hashlib.sha256(bytes([i])).digest() for i in range(3))
    request = AddCheckpoint(5, proof, note)
    body = request.body()
    assert body.startswith(b"old 5\n") and b"\n\n" + note.encode() in body
    assert parse_add_checkpoint(body) == request
    assert parse_add_checkpoint(AddCheckpoint(0, (), note).body()) == AddCheckpoint(0, (), note)
    h = base64.b64encode(proof[0]).decode()
    for bad in (
        b"old 5\n" + note.encode(),  # no empty line
        b"old 05\n\n" + note.encode(),
        b"old -1\n\n" + note.encode(),
        b"new 5\n\n" + note.encode(),
        f"old 5\n{h[:-2]}\n\n{note}".encode(),  # not base64
        f"old 5\n{base64.b64encode(b'short').decode()}\n\n{note}".encode(),
        ("old 5\n" + f"{h}\n" * (MAX_PROOF_LINES + 1) + "\n" + note).encode(),
        b"old 5\n\n",  # no checkpoint
        b"old 5\n\n\xff\xfe",
    ):
        with pytest.raises(NoteError):
            parse_add_checkpoint(bad)
    assert parse_size(b"42\n") == 42
    for bad_size in (b"42", b"042\n", b"x\n", b""):
        with pytest.raises(NoteError):
            parse_size(bad_size)
