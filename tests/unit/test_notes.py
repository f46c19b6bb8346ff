"""Signed notes, checkpoints and tlog-proofs (signing/notes.py): the example
of Go's golang.org/x/mod/sumdb/note signed and opened byte for byte, and
every altered note, key or proof refused."""

from __future__ import annotations

import base64
import hashlib

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from registry_server.signing.keys import generate_keypair, load_private_key
from registry_server.signing.notes import (
    Checkpoint,
    NoteError,
    Signer,
    TlogProof,
    Verifier,
    open_checkpoint,
    open_note,
    parse_checkpoint,
    parse_note,
    parse_tlog_proof,
    verifier_for,
)

# The example of golang.org/x/mod/sumdb/note's documentation.
GO_SIGNER = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
GO_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
GO_TEXT = (
    "If you think cryptography is the answer to your problem,\n"
    "then you don't know what your problem is.\n"
)
GO_NOTE = (
    GO_TEXT + "\n\u2014 PeterNeumann "
    "x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n"
)
ROOT = hashlib.sha256(b"root").digest()


def go_signer() -> Signer:
    seed = base64.b64decode(GO_SIGNER.split("+", 4)[4])
    assert seed[0] == 0x01
    return Signer("PeterNeumann", Ed25519PrivateKey.from_private_bytes(seed[1:]))


def log_signer(origin: str = "toolreg/test") -> Signer:
    return Signer(origin, Ed25519PrivateKey.generate())


def test_the_go_example_is_signed_and_opened_byte_for_byte() -> None:
    signer = go_signer()
    assert str(signer.verifier) == GO_VKEY
    assert signer.verifier.id.hex() == "c74f20a3"
    assert signer.sign(GO_TEXT) == GO_NOTE
    verifier = Verifier.from_text(GO_VKEY)
    assert str(verifier) == GO_VKEY
    assert open_note(GO_NOTE, [verifier]).text == GO_TEXT


def test_an_altered_note_is_refused() -> None:
    verifier = Verifier.from_text(GO_VKEY)
    with pytest.raises(NoteError, match="does not verify"):
        open_note(GO_NOTE.replace("cryptography", "cryptographY"), [verifier])
    other = log_signer("PeterNeumann").verifier  # the same name, another key: unknown
    with pytest.raises(NoteError, match="no signature by a known key"):
        open_note(GO_NOTE, [other])


def test_unknown_signatures_are_ignored_and_a_bad_known_one_rejects() -> None:
    a, b = log_signer("a.example/log"), log_signer("b.example/log")
    note_a = a.sign("hello\n")
    both = note_a + b.sign("hello\n").split("\n\n", 1)[1]  # two signature lines
    assert open_note(both, [b.verifier]).text == "hello\n"
    assert len(parse_note(both).signatures) == 2
    forged = note_a + note_a.split("\n\n", 1)[1].replace("\u2014 a.example", "\u2014 b.example")
    with pytest.raises(NoteError):  # b's name, a's key ID: unknown, and no other of b
        open_note(forged, [b.verifier])


@pytest.mark.parametrize(
    "note",
    [
        "no blank line\n\u2014 a sig\n",
        "text\n\n",  # no signatures
        "text\n\n- a AAAA\n",  # not an em dash
        "text\n\n\u2014 a\n",  # no signature
        "text\n\n\u2014 a !!!!\n",  # not base64
        "text\n\n\u2014 a AAA=\n",  # shorter than a key ID
        "text\n\n\u2014 a+b AAAAAAA=\n",  # '+' in the key name
        "text\twith a tab\n\n\u2014 a AAAAAAA=\n",
        "text\n\n\u2014 a AAAAAAA=",  # no final newline
    ],
)
def test_malformed_notes(note: str) -> None:
    with pytest.raises(NoteError):
        parse_note(note)


@pytest.mark.parametrize(
    "vkey",
    [
        "PeterNeumann+c74f20a4+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # wrong ID
        "PeterNeumann+C74F20A3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # upper case ID
        "Peter Neumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",
        "PeterNeumann+c74f20a3+AhpC2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # type 2
        "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10",  # short key
        "PeterNeumann+c74f20a3",
        "PeterNeumann+c74f20a3+!!!!",
    ],
)
def test_malformed_verifier_keys(vkey: str) -> None:
    with pytest.raises(NoteError):
        Verifier.from_text(vkey)


def test_a_checkpoint_round_trips_and_is_opened_with_its_logs_key() -> None:
    signer = log_signer()
    checkpoint = Checkpoint("toolreg/test", 1000, ROOT)
    body = checkpoint.body()
    assert body == f"toolreg/test\n1000\n{base64.b64encode(ROOT).decode()}\n"
    note = signer.sign(body)
    assert note.startswith(body + "\n\u2014 toolreg/test ")
    assert open_checkpoint(note, signer.verifier) == checkpoint
    with_ext = Checkpoint("toolreg/test", 0, ROOT, ("made 2026",))
    assert parse_checkpoint(with_ext.body()) == with_ext
    # The key of another log, under its own name, does not open it.
    other = log_signer("toolreg/other")
    with pytest.raises(NoteError, match="no signature by a known key"):
        open_checkpoint(note, other.verifier)
    # Signed by the right key under another origin line: refused by name.
    renamed = signer.sign(Checkpoint("toolreg/elsewhere", 1, ROOT).body())
    with pytest.raises(NoteError, match="elsewhere"):
        open_checkpoint(renamed, signer.verifier)


@pytest.mark.parametrize(
    "text",
    [
        "toolreg/test\n1000\n",  # no root
        "\n1000\nAAAA\n",
        "toolreg/test\n01000\n" + base64.b64encode(ROOT).decode() + "\n",
        "toolreg/test\n-1\n" + base64.b64encode(ROOT).decode() + "\n",
        "toolreg/test\n10\n" + base64.b64encode(ROOT[:31]).decode() + "\n",
        "toolreg/test\n10\n" + base64.b64encode(ROOT).decode() + "\n\n",  # empty extension
    ],
)
def test_malformed_checkpoints(text: str) -> None:
    with pytest.raises(NoteError):
        parse_checkpoint(text)


def test_an_altered_checkpoint_is_refused() -> None:
    signer = log_signer()
    note = signer.sign(Checkpoint("toolreg/test", 1000, ROOT).body())
    with pytest.raises(NoteError, match="does not verify"):
        open_checkpoint(note.replace("\n1000\n", "\n990\n"), signer.verifier)


def test_verifier_from_what_an_auditor_holds() -> None:
    pem, public_b64 = generate_keypair()
    key = load_private_key(pem)
    signer = Signer("toolreg/test", key)
    note = signer.sign(Checkpoint("toolreg/test", 3, ROOT).body())
    as_vkey = verifier_for(str(signer.verifier), "ignored")
    as_raw = verifier_for(public_b64 + "\n", "toolreg/test")
    for verifier in (as_vkey, as_raw):
        assert verifier == signer.verifier
        assert open_checkpoint(note, verifier).size == 3
    with pytest.raises(NoteError, match="PRIVATE"):
        verifier_for(pem.decode(), "toolreg/test")


def test_a_tlog_proof_round_trips() -> None:
    signer = log_signer()
    note = signer.sign(Checkpoint("toolreg/test", 5, ROOT).body())
    proof = TlogProof(3, (ROOT, hashlib.sha256(b"x").digest()), note, extra=b'{"seq":4}')
    text = proof.text()
    assert text.startswith("c2sp.org/tlog-proof@v1\nextra eyJzZXEiOjR9\nindex 3\n")
    assert text.endswith("\n\n" + note)
    assert parse_tlog_proof(text) == proof
    bare = TlogProof(0, (), note)
    assert bare.text() == "c2sp.org/tlog-proof@v1\nindex 0\n\n" + note
    assert parse_tlog_proof(bare.text()) == bare


@pytest.mark.parametrize(
    "text",
    [
        "c2sp.org/tlog-proof@v2\nindex 0\n\nnote\n",
        "c2sp.org/tlog-proof@v1\n\nnote\n",  # no index
        "c2sp.org/tlog-proof@v1\nindex 01\n\nnote\n",
        "c2sp.org/tlog-proof@v1\nindex 0\nAAAA\n\nnote\n",  # a 3-byte hash
        "c2sp.org/tlog-proof@v1\nindex 0\n",  # no checkpoint
    ],
)
def test_malformed_tlog_proofs(text: str) -> None:
    with pytest.raises(NoteError):
        parse_tlog_proof(text)
