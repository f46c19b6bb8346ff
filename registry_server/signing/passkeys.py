"""Passkey approvals: a WebAuthn assertion over an approval's claims
(docs/how-to/approvals.md, "Passkeys").

An approver may hold WebAuthn credentials (passkeys) instead of, or next to,
an Ed25519 key: the policy lists each one's credential id and COSE public
key. To approve, the approver's authenticator signs (``navigator.credentials
.get``, user verification required) a challenge that is the SHA-256 of the
approval's claims in RFC 8785 canonical form: the same claims an Ed25519
token carries (aud, sub, tool_digest, args_digest, requester, req, iat, exp,
jti), with ``typ`` naming what they are. The claims and the assertion travel
as one string where a token does (``SubmitApproval.token``,
``approval_tokens``):

    toolreg-passkey.v1.<base64url(JSON {claims, credential_id,
                        authenticator_data, client_data_json, signature})>

py_webauthn verifies the assertion (client data type, challenge, origin,
relying party id hash, UP and UV flags, signature); this module checks the
envelope's shape and size before parsing it, maps the library's refusals to
fixed reasons (none echoes what the envelope holds), and then checks the
claims with the very rules an Ed25519 token's claims get
(``tokens.check_claims``). The signature counter, jti reuse, eligibility and
m-of-n are the approval service's, since they need the store and the rule.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import rfc8785

from registry_server.domain import strict_json
from registry_server.domain.errors import InvalidArgument
from registry_server.signing.tokens import (
    DEFAULT_TTL_S,
    JTI_BYTES,
    MAX_TOKEN_CHARS,
    Approvable,
    PasskeyEvidence,
    TokenRejected,
    VerifiedApproval,
    check_claims,
)

if TYPE_CHECKING:
    from webauthn.helpers.exceptions import InvalidAuthenticationResponse

# py_webauthn (about 80 ms to import, with its certificate-chain checks) is
# imported where a passkey is read or verified, not with this module: the
# policy model imports it, so every `toolreg` command would pay for it.

PREFIX = "toolreg-passkey.v1."  # what makes a token string a passkey approval
CLAIMS_TYPE = "toolreg-passkey-approval"  # the claims' typ: what the challenge commits to
MAX_ENVELOPE_CHARS = MAX_TOKEN_CHARS  # checked before anything is decoded
# WebAuthn Level 3 caps credential ids at 1,023 bytes; fewer than 16 is not random enough.
MIN_CREDENTIAL_ID_BYTES = 16
MAX_CREDENTIAL_ID_BYTES = 1023
MAX_PUBLIC_KEY_BYTES = 1024  # a COSE key (an RSA-2048 one is ~270 bytes)
MAX_CLIENT_DATA_BYTES = 2048
MAX_AUTHENTICATOR_DATA_BYTES = 1024
MAX_SIGNATURE_BYTES = 1024
MAX_ORIGINS = 16
MAX_RP_ID_CHARS = 253
# The algorithms the console asks authenticators for, as COSE algorithm ids
# (IANA; py_webauthn's COSEAlgorithmIdentifier): ES256, EdDSA, RS256.
ALGORITHMS = (-7, -8, -257)
_ALGORITHM_NAMES = {-7: "ECDSA_SHA_256", -8: "EDDSA", -257: "RSASSA_PKCS1_v1_5_SHA_256"}
CLAIM_NAMES = (
    "typ", "aud", "sub", "tool_digest", "args_digest", "requester", "req", "iat", "exp", "jti",
)  # fmt: skip
ENVELOPE_FIELDS = (
    "claims", "credential_id", "authenticator_data", "client_data_json", "signature",
)  # fmt: skip

_B64URL = re.compile(r"^[A-Za-z0-9_-]*$")
_ENVELOPE_BODY = re.compile(r"^[A-Za-z0-9_-]+={0,2}$")
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
_RP_ID = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")
_ORIGIN = re.compile(r"^(https?)://([a-z0-9.-]+)(:[0-9]{1,5})?$")

# py_webauthn's refusal (its message's start) -> ours: fixed text that echoes
# nothing the envelope carries (its messages may quote the origin it holds).
_LIBRARY_REASONS = (
    ("Client data challenge was not expected", "the assertion was not made for these claims"
     " (its challenge is not their digest)"),
    ("Unexpected client data origin", "the assertion was made on an origin the policy does"
     " not allow (webauthn.origins)"),
    ("Unexpected RP ID hash", "the assertion was made for another relying party"
     " (webauthn.rp_id)"),
    ("User was not present", "the authenticator did not see the user (UP flag not set)"),
    ("User verification is required", "the authenticator did not verify the user"
     " (UV flag not set; user verification is required)"),
    ("Could not verify authentication signature", "bad signature"),
    ("Unexpected client data type", "clientDataJSON is not of type webauthn.get"),
    ("clientDataJSON was malformed", "clientDataJSON is unreadable"),
    ("authenticatorData was malformed", "authenticatorData is unreadable"),
)  # fmt: skip


@dataclass(frozen=True)
class PasskeyCredential:
    """One WebAuthn credential the policy trusts, and whose it is."""

    approver: str
    credential_id: str  # base64url, no padding (canonical)
    public_key: bytes = field(repr=False)  # COSE_Key


@dataclass(frozen=True)
class WebAuthnSettings:
    """The relying party passkey approvals are made for (the policy's ``webauthn``)."""

    rp_id: str
    origins: tuple[str, ...]


@dataclass(frozen=True)
class Envelope:
    claims: dict[str, Any]
    credential_id: str  # canonical base64url
    authenticator_data: bytes
    client_data_json: bytes
    signature: bytes


# ------------------------------------------------------------------ encoding


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def from_b64url(text: str, what: str, *, max_bytes: int) -> bytes:
    """base64url (padding optional) of at most ``max_bytes``; ValueError naming ``what``."""
    if not isinstance(text, str) or not _B64URL.match(text.rstrip("=")):
        raise ValueError(f"{what} is not base64url")
    if len(text) > (max_bytes * 4 + 2) // 3 + 2:
        raise ValueError(f"{what} is longer than {max_bytes} bytes")
    stripped = text.rstrip("=")
    try:
        data = base64.urlsafe_b64decode(stripped + "=" * (-len(stripped) % 4))
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not base64url") from None
    if len(data) > max_bytes:
        raise ValueError(f"{what} is longer than {max_bytes} bytes")
    return data


def canonical_credential_id(text: str) -> str:
    """A credential id as the policy and the store key it; ValueError when it is none."""
    raw = from_b64url(text, "credential id", max_bytes=MAX_CREDENTIAL_ID_BYTES)
    if len(raw) < MIN_CREDENTIAL_ID_BYTES:
        raise ValueError(f"credential id is shorter than {MIN_CREDENTIAL_ID_BYTES} bytes")
    return b64url(raw)


def public_key_from_text(text: str) -> bytes:
    """A COSE public key (base64url) of an algorithm passkey approvals accept;
    ValueError with the reason."""
    from webauthn.helpers import decode_credential_public_key

    data = from_b64url(text, "passkey public key", max_bytes=MAX_PUBLIC_KEY_BYTES)
    try:
        decoded = decode_credential_public_key(data)
    except Exception:  # the library raises several kinds for bad CBOR or COSE
        raise ValueError("passkey public key is not a COSE key (base64url)") from None
    if decoded.alg not in ALGORITHMS:
        names = ", ".join(_ALGORITHM_NAMES[a] for a in ALGORITHMS)
        raise ValueError(f"passkey public key algorithm {decoded.alg} is not one of {names}")
    return data


def check_rp_id(value: str) -> str:
    if not _RP_ID.match(value) or value.rsplit(".", 1)[-1].isdigit():  # no IP address
        raise ValueError(
            f"{value[:64]!r} is not a relying party id (a lowercase domain name, no scheme"
            " or port: e.g. approvals.example.com, or localhost)"
        )
    return value


def check_origin(value: str, rp_id: str) -> str:
    """An origin passkey approvals may be made on: https, or http on localhost;
    its host the relying party id or under it."""
    found = _ORIGIN.match(value)
    if found is None:
        raise ValueError(
            f"{value[:100]!r} is not an origin (scheme://host[:port], lowercase, no path)"
        )
    scheme, host = found.group(1), found.group(2)
    if scheme == "http" and host != "localhost" and not host.endswith(".localhost"):
        raise ValueError(f"{value!r}: http is allowed only on localhost (browsers ask https)")
    if host != rp_id and not host.endswith("." + rp_id):
        raise ValueError(f"{value!r}: its host is not {rp_id!r} nor under it (webauthn.rp_id)")
    return value


# -------------------------------------------------------------------- claims


def claims_for(
    request: Approvable, *, ttl_s: int | None = None, now: float | None = None
) -> dict[str, Any]:
    """The claims an approver's passkey signs for ``request``: what an Ed25519
    token bound to it would say, with a fresh jti (128 random bits) each time."""
    issued_at = int(time.time() if now is None else now)
    lifetime = ttl_s or request.max_token_ttl_s or DEFAULT_TTL_S
    return {
        "typ": CLAIMS_TYPE,
        "aud": request.audience,
        "sub": request.tool_name,
        "tool_digest": request.tool_digest,
        "args_digest": request.arguments_digest,
        "requester": request.requested_by,
        "req": request.id,
        "iat": issued_at,
        "exp": issued_at + lifetime,
        "jti": secrets.token_urlsafe(JTI_BYTES),
    }


def canonical(claims: Mapping[str, Any]) -> bytes:
    """The claims' RFC 8785 bytes: what the challenge is the digest of."""
    return bytes(rfc8785.dumps(dict(claims)))


def challenge_for(claims: Mapping[str, Any]) -> bytes:
    return hashlib.sha256(canonical(claims)).digest()


# ------------------------------------------------------------------ envelope


def is_envelope(token: str) -> bool:
    return isinstance(token, str) and token.startswith(PREFIX)


def wrap(
    claims: Mapping[str, Any], *, credential_id: str, authenticator_data: bytes,
    client_data_json: bytes, signature: bytes,
) -> str:  # fmt: skip
    body = {
        "claims": dict(claims),
        "credential_id": credential_id,
        "authenticator_data": b64url(authenticator_data),
        "client_data_json": b64url(client_data_json),
        "signature": b64url(signature),
    }
    text = json.dumps(body, separators=(",", ":"), ensure_ascii=True)
    return PREFIX + b64url(text.encode("ascii"))


def parse(token: str) -> Envelope:
    """The envelope's parts, or TokenRejected; the size is checked before
    anything is decoded, and no reason quotes what it holds."""
    if not is_envelope(token):
        raise TokenRejected(f"not a passkey approval (it starts with {PREFIX!r})")
    if len(token) > MAX_ENVELOPE_CHARS:
        raise TokenRejected(f"passkey approval longer than {MAX_ENVELOPE_CHARS} characters")
    body = token[len(PREFIX) :]
    if not body.isascii() or not _ENVELOPE_BODY.match(body):
        raise TokenRejected("passkey approval is not base64url after its prefix")
    try:
        raw = base64.urlsafe_b64decode(body.rstrip("=") + "=" * (-len(body.rstrip("=")) % 4))
        value = strict_json.loads(raw.decode("utf-8"), "passkey approval")
    except (binascii.Error, ValueError, InvalidArgument):
        raise TokenRejected("passkey approval is not base64url of a JSON object") from None
    if not isinstance(value, dict):
        raise TokenRejected("passkey approval is not base64url of a JSON object")
    unknown = sorted(set(value) - set(ENVELOPE_FIELDS))
    missing = [name for name in ENVELOPE_FIELDS if name not in value]
    if unknown:
        raise TokenRejected(f"passkey approval has an unknown field ({len(unknown)} of them)")
    if missing:
        raise TokenRejected(f"passkey approval lacks {missing[0]!r}")
    claims = value["claims"]
    if not isinstance(claims, dict):
        raise TokenRejected("passkey approval's claims are not a JSON object")
    extra = sorted(set(claims) - set(CLAIM_NAMES))
    if extra:
        raise TokenRejected("passkey approval's claims hold a claim that is not an approval's")
    for name in CLAIM_NAMES:
        if name not in claims:
            raise TokenRejected(f"missing claim {name!r}")
    if claims["typ"] != CLAIMS_TYPE:
        raise TokenRejected(f"claim 'typ' is not {CLAIMS_TYPE!r}")
    try:
        credential_id = canonical_credential_id(value["credential_id"])
        return Envelope(
            claims=claims,
            credential_id=credential_id,
            authenticator_data=from_b64url(
                value["authenticator_data"], "authenticatorData",
                max_bytes=MAX_AUTHENTICATOR_DATA_BYTES,
            ),
            client_data_json=from_b64url(
                value["client_data_json"], "clientDataJSON", max_bytes=MAX_CLIENT_DATA_BYTES
            ),
            signature=from_b64url(value["signature"], "signature", max_bytes=MAX_SIGNATURE_BYTES),
        )  # fmt: skip
    except ValueError as exc:
        raise TokenRejected(f"passkey approval: {exc}") from None


# -------------------------------------------------------------- verification


def verify(
    token: str,
    *,
    credentials: Mapping[str, PasskeyCredential],
    webauthn: WebAuthnSettings | None,
    audience: str,
    tool_name: str,
    tool_digest: str,
    args_digest: str,
    requester: str,
    max_ttl_s: int,
    now: float | None = None,
    leeway_s: int = 30,
) -> VerifiedApproval:
    """Every rule on a passkey approval that needs no store (the counter and
    the jti are the caller's), or TokenRejected. ``credentials``: by
    canonical credential id."""
    from webauthn import verify_authentication_response
    from webauthn.helpers import parse_authenticator_data
    from webauthn.helpers.exceptions import InvalidAuthenticationResponse
    from webauthn.helpers.structs import (
        AuthenticationCredential,
        AuthenticatorAssertionResponse,
        PublicKeyCredentialType,
    )

    current = time.time() if now is None else now
    envelope = parse(token)
    credential = credentials.get(envelope.credential_id)
    if credential is None or webauthn is None:
        raise TokenRejected("unknown passkey (its credential id is in no approver's passkeys)")
    try:
        challenge = challenge_for(envelope.claims)
    except Exception:  # rfc8785 refuses e.g. integers beyond 2**53
        raise TokenRejected("passkey approval's claims have no canonical form (RFC 8785)") from None
    assertion = AuthenticationCredential(
        id=envelope.credential_id,
        raw_id=from_b64url(
            envelope.credential_id, "credential id", max_bytes=MAX_CREDENTIAL_ID_BYTES
        ),
        response=AuthenticatorAssertionResponse(
            client_data_json=envelope.client_data_json,
            authenticator_data=envelope.authenticator_data,
            signature=envelope.signature,
        ),
        type=PublicKeyCredentialType.PUBLIC_KEY,
    )
    try:
        # The counter is checked by the caller against the store, after the
        # signature: 0 here lets py_webauthn accept any count.
        verify_authentication_response(
            credential=assertion,
            expected_challenge=challenge,
            expected_rp_id=webauthn.rp_id,
            expected_origin=list(webauthn.origins),
            credential_public_key=credential.public_key,
            credential_current_sign_count=0,
            require_user_verification=True,
        )
        data = parse_authenticator_data(envelope.authenticator_data)
    except InvalidAuthenticationResponse as exc:
        raise TokenRejected(f"passkey assertion refused: {_library_reason(exc)}") from None
    except Exception as exc:  # a verifier must answer "no", never crash the call
        raise TokenRejected(f"passkey assertion unreadable ({type(exc).__name__})") from None
    approval = check_claims(
        envelope.claims, credential.approver, audience=audience, tool_name=tool_name,
        tool_digest=tool_digest, args_digest=args_digest, requester=requester,
        max_ttl_s=max_ttl_s, now=current, leeway_s=leeway_s,
    )  # fmt: skip
    if approval.request_id is None:
        raise TokenRejected("claim 'req' is required in a passkey approval")
    evidence = PasskeyEvidence(
        credential_id=envelope.credential_id,
        sign_count=data.sign_count,
        user_present=data.flags.up,
        user_verified=data.flags.uv,
        backup_eligible=data.flags.be,
        backed_up=data.flags.bs,
    )
    return VerifiedApproval(
        approver=approval.approver, jti=approval.jti, issued_at=approval.issued_at,
        expires_at=approval.expires_at, request_id=approval.request_id,
        requester=approval.requester, passkey=evidence,
    )  # fmt: skip


def _library_reason(exc: InvalidAuthenticationResponse) -> str:
    text = str(exc)
    for start, reason in _LIBRARY_REASONS:
        if text.startswith(start):
            return reason
    if "sign count" in text:  # not reached: the count is checked by the caller
        return "signature counter did not advance"
    return "the assertion is not valid WebAuthn"


def counter_advances(last: int | None, new: int) -> bool:
    """The clone rule: a credential's signature counter only goes up. An
    authenticator that does not count (0 every time, as synced passkeys do)
    stays acceptable at 0; one that counted once may never go back to 0."""
    if last is None:
        return True
    if new == 0 and last == 0:
        return True
    return new > last
