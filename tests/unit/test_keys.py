"""Approver private key files, encrypted with a passphrase or not
(registry_server/signing/keys.py)."""

from __future__ import annotations

import base64

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from registry_server.signing.keys import (
    PassphraseRequired,
    WrongPassphrase,
    generate_keypair,
    is_encrypted,
    load_private_key,
    public_key_from_text,
    public_key_text,
)

PASSPHRASE = b"correct horse battery staple"


@pytest.fixture(scope="module")
def encrypted() -> tuple[bytes, str]:
    return generate_keypair(PASSPHRASE)


def test_an_encrypted_key_loads_with_its_passphrase(encrypted: tuple[bytes, str]) -> None:
    pem, public = encrypted
    assert pem.startswith(b"-----BEGIN ENCRYPTED PRIVATE KEY-----") and is_encrypted(pem)
    key = load_private_key(pem, PASSPHRASE)
    assert public_key_text(key.public_key()) == public
    assert public_key_from_text(public).verify(key.sign(b"m"), b"m") is None


def test_a_wrong_passphrase_is_refused_without_echoing_it(encrypted: tuple[bytes, str]) -> None:
    with pytest.raises(WrongPassphrase, match="wrong passphrase") as caught:
        load_private_key(encrypted[0], b"Tr0ub4dor&3")
    assert "Tr0ub4dor" not in str(caught.value) and "PRIVATE" not in str(caught.value)


@pytest.mark.parametrize("missing", [None, b""])
def test_an_encrypted_key_without_a_passphrase_says_so(
    encrypted: tuple[bytes, str], missing: bytes | None
) -> None:
    with pytest.raises(PassphraseRequired, match="encrypted"):
        load_private_key(encrypted[0], missing)


def test_an_unencrypted_key_still_loads_and_ignores_a_passphrase() -> None:
    pem, public = generate_keypair()
    assert pem.startswith(b"-----BEGIN PRIVATE KEY-----") and not is_encrypted(pem)
    for passphrase in (None, PASSPHRASE):  # TOOLREG_KEY_PASSPHRASE may be set for another key
        assert public_key_text(load_private_key(pem, passphrase).public_key()) == public


def test_an_encrypted_key_of_another_kind_is_refused() -> None:
    other = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(PASSPHRASE),
    )
    with pytest.raises(ValueError, match=r"not an Ed25519 private key \(found ECPrivateKey\)"):
        load_private_key(other, PASSPHRASE)


def test_a_damaged_file_is_refused() -> None:
    with pytest.raises(ValueError, match="not an Ed25519 private key") as caught:
        load_private_key(b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    assert not isinstance(caught.value, WrongPassphrase | PassphraseRequired)


def test_an_empty_passphrase_encrypts_nothing() -> None:
    with pytest.raises(ValueError, match="empty"):
        generate_keypair(b"")


# What the approval console's page decrypts (console.js): PBES2 with PBKDF2
# (HMAC-SHA256) and AES-256-CBC, a 16-byte salt and IV. A cryptography upgrade
# that writes something else fails here first.
OIDS = {
    "PBES2": "06092a864886f70d01050d",
    "PBKDF2": "06092a864886f70d01050c",
    "hmacWithSHA256": "06082a864886f70d0209",
    "aes256-CBC": "060960864801650304012a",
}


def test_the_encryption_written_is_what_the_console_reads(encrypted: tuple[bytes, str]) -> None:
    body = "".join(encrypted[0].decode().splitlines()[1:-1])
    hex_der = base64.b64decode(body).hex()
    for name, oid in OIDS.items():
        assert oid in hex_der, name
