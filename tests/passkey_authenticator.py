"""A software WebAuthn authenticator for tests: an EC P-256 key (ES256) that
builds authenticatorData and clientDataJSON and signs them the way a real
authenticator and browser do, so py_webauthn's real verification runs on
what it makes. Each field can be made wrong on purpose (no UV, another
origin, a counter that goes back)."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from typing import Any

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from webauthn.helpers import encode_cbor

from registry_server.signing import passkeys

RP_ID = "localhost"
ORIGIN = "http://localhost:8780"

FLAG_UP = 0x01
FLAG_UV = 0x04
FLAG_BE = 0x08
FLAG_BS = 0x10


class SoftAuthenticator:
    def __init__(self, approver: str, *, rp_id: str = RP_ID, origin: str = ORIGIN) -> None:
        self.approver = approver
        self.rp_id = rp_id
        self.origin = origin
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.credential_id = passkeys.b64url(os.urandom(32))
        self.counter = 0

    def cose_public_key(self) -> bytes:
        numbers = self.key.public_key().public_numbers()
        return bytes(
            encode_cbor(
                {
                    1: 2,  # kty: EC2
                    3: -7,  # alg: ES256
                    -1: 1,  # crv: P-256
                    -2: numbers.x.to_bytes(32, "big"),
                    -3: numbers.y.to_bytes(32, "big"),
                }
            )
        )

    def policy_entry(self) -> str:
        """The approver's passkeys line, as the console's enrolment prints it."""
        return (
            f'{{id: "{self.credential_id}",'
            f' public_key: "{passkeys.b64url(self.cose_public_key())}"}}'
        )

    def assertion(
        self,
        challenge: bytes,
        *,
        flags: int = FLAG_UP | FLAG_UV,
        counter: int | None = None,
        origin: str | None = None,
        rp_id: str | None = None,
        client_type: str = "webauthn.get",
    ) -> tuple[bytes, bytes, bytes]:
        """(authenticatorData, clientDataJSON, signature) over ``challenge``;
        the counter goes up by one unless ``counter`` says what it is."""
        if counter is None:
            self.counter += 1
            counter = self.counter
        rp_hash = hashlib.sha256((rp_id or self.rp_id).encode()).digest()
        authenticator_data = rp_hash + bytes([flags]) + struct.pack(">I", counter)
        client_data = json.dumps(
            {
                "type": client_type,
                "challenge": passkeys.b64url(challenge),
                "origin": origin or self.origin,
                "crossOrigin": False,
            }
        ).encode()
        signed = authenticator_data + hashlib.sha256(client_data).digest()
        signature = self.key.sign(signed, ec.ECDSA(hashes.SHA256()))
        return authenticator_data, client_data, signature

    def approve(self, claims: Mapping[str, Any], **options: Any) -> str:
        """An envelope approving ``claims``; ``options`` go to ``assertion``."""
        signed_claims = options.pop("signed_claims", claims)  # sign other claims than sent
        data, client, signature = self.assertion(passkeys.challenge_for(signed_claims), **options)
        return passkeys.wrap(
            claims,
            credential_id=self.credential_id,
            authenticator_data=data,
            client_data_json=client,
            signature=signature,
        )
