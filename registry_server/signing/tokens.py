"""Approval tokens: Ed25519-signed JWTs that approve one call (docs/how-to/approvals.md).

An approver signs, with a private key that never reaches the server, a token
naming exactly one tool definition (``sub`` + ``tool_digest``), one argument
object (``args_digest``) and the client whose call it approves
(``requester``), so one agent can never spend an approval given to another.
The server holds only public keys and accepts a token only when every rule
below holds; each failure has its own short reason, since the reason goes
back to an LLM agent and to the operator.

The algorithm is pinned to EdDSA: the header is checked here before PyJWT sees
the token, and PyJWT is told ``algorithms=["EdDSA"]`` as well, so a token can
never choose ``none`` or an HMAC keyed with the public key. Time checks are done
here (not by PyJWT) so that ``now`` can be injected and claim types are exact.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

TOKEN_TYPE = "toolreg-approval+jwt"
ALGORITHM = "EdDSA"
MIN_JTI_BITS = 128  # bits of randomness a jti must carry to be unguessable and unique
JTI_BYTES = MIN_JTI_BITS // 8  # bytes of randomness per minted jti
# seconds: a minted token's lifetime when neither the approver nor the request
# (its rule's max_token_ttl_s) says
DEFAULT_TTL_S = 300
MIN_JTI_CHARS = 22  # base64url characters that hold MIN_JTI_BITS (6 bits each, rounded up)
MAX_JTI_CHARS = 128  # characters; a jti is stored forever, so keep it small
MAX_REQUEST_ID_CHARS = 128  # characters of the optional `req` claim (ids are 32 hex)
MAX_TOKEN_CHARS = 8_192  # characters; a real token is ~500, refuse to parse megabytes
MAX_SHOWN_CHARS = 64  # characters of a token-supplied value quoted in a reason

# Claims every token must carry (PyJWT checks presence; this module checks types).
REQUIRED_CLAIMS = (
    "iss", "aud", "sub", "tool_digest", "args_digest", "requester", "iat", "exp", "jti",
)  # fmt: skip
# Header fields a token may carry. Anything else (crit, b64, jku, x5u, ...)
# asks for processing we do not do, so it is refused rather than ignored.
ALLOWED_HEADER_FIELDS = frozenset({"alg", "typ", "kid"})

_JTI_CHARS = re.compile(r"^[A-Za-z0-9_-]+$")


class TokenRejected(Exception):
    """A token does not approve this call; ``reason`` says precisely why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class PasskeyEvidence:
    """What a verified passkey assertion (signing/passkeys.py) says of its
    authenticator, for the counter rule and the audit log."""

    credential_id: str
    sign_count: int
    user_present: bool
    user_verified: bool
    backup_eligible: bool
    backed_up: bool

    def flags(self) -> dict[str, bool]:
        return {
            "UP": self.user_present, "UV": self.user_verified,
            "BE": self.backup_eligible, "BS": self.backed_up,
        }  # fmt: skip

    def audit(self) -> dict[str, object]:
        return {
            "credential_id": self.credential_id,
            "sign_count": self.sign_count,
            "flags": self.flags(),
        }


@dataclass(frozen=True)
class VerifiedApproval:
    approver: str  # the token's iss, a known approver whose key verified it
    jti: str
    issued_at: int  # seconds since the epoch
    expires_at: int  # seconds since the epoch
    request_id: str | None  # the approval request it was signed for, if any
    requester: str = ""  # the client whose call it approves
    # A passkey approval (signing/passkeys.py): its credential, counter and flags
    passkey: PasskeyEvidence | None = None


# -------------------------------------------------------------------- minting


def mint(
    private_key: Ed25519PrivateKey,
    *,
    issuer: str,
    audience: str,
    tool_name: str,
    tool_digest: str,
    args_digest: str,
    requester: str,
    ttl_s: int,
    request_id: str | None = None,
    now: float | None = None,
) -> str:
    """A signed approval token for exactly this tool definition, these arguments
    and this requesting client."""
    if ttl_s < 1:
        raise ValueError(f"ttl_s must be at least 1 second, got {ttl_s}")
    for name, value in (
        ("issuer", issuer), ("audience", audience), ("tool_name", tool_name),
        ("requester", requester),
    ):  # fmt: skip
        if not value:
            raise ValueError(f"{name} must not be empty")
    issued_at = int(time.time() if now is None else now)
    claims: dict[str, Any] = {
        "iss": issuer,
        "aud": audience,
        "sub": tool_name,
        "tool_digest": tool_digest,
        "args_digest": args_digest,
        "requester": requester,
        "iat": issued_at,
        "exp": issued_at + ttl_s,
        "jti": secrets.token_urlsafe(JTI_BYTES),
    }
    if request_id:
        claims["req"] = request_id
    return jwt.encode(claims, private_key, algorithm=ALGORITHM, headers={"typ": TOKEN_TYPE})


class Approvable(Protocol):
    """What an approval request says (the proto message or the client's domain object)."""

    @property
    def id(self) -> str: ...
    @property
    def audience(self) -> str: ...
    @property
    def tool_name(self) -> str: ...
    @property
    def tool_digest(self) -> str: ...
    @property
    def arguments_digest(self) -> str: ...
    @property
    def requested_by(self) -> str: ...
    @property
    def max_token_ttl_s(self) -> int: ...


def mint_for(
    private_key: Ed25519PrivateKey,
    *,
    issuer: str,
    request: Approvable,
    ttl_s: int | None = None,
    bind_request: bool = False,
) -> str:
    """A token approving exactly what `request` asks to run: its lifetime is `ttl_s`,
    else the request's maximum, else DEFAULT_TTL_S; `bind_request` names the request."""
    return mint(
        private_key,
        issuer=issuer,
        audience=request.audience,
        tool_name=request.tool_name,
        tool_digest=request.tool_digest,
        args_digest=request.arguments_digest,
        requester=request.requested_by,
        ttl_s=ttl_s or request.max_token_ttl_s or DEFAULT_TTL_S,
        request_id=request.id if bind_request else None,
    )


# --------------------------------------------------------------- verification


def peek_issuer(token: str) -> str | None:
    """The token's ``iss`` WITHOUT verifying anything: for messages and key choice only."""
    try:
        payload = _unverified_payload(token)
    except TokenRejected:
        return None
    issuer = payload.get("iss")
    return issuer if isinstance(issuer, str) else None


def verify(
    token: str,
    *,
    keys: Mapping[str, Ed25519PublicKey],
    audience: str,
    tool_name: str,
    tool_digest: str,
    args_digest: str,
    requester: str,
    max_ttl_s: int,
    now: float | None = None,
    leeway_s: int = 30,
) -> VerifiedApproval:
    """Check every token rule (docs/how-to/approvals.md) that needs no store, or raise
    TokenRejected.

    Eligibility, the caller-is-not-the-approver rule, m-of-n and jti reuse are
    the caller's business (they need the policy rule and the store)."""
    current = time.time() if now is None else now
    _check_header(token)
    issuer = _unverified_payload(token).get("iss")
    if issuer is None or issuer == "":
        raise TokenRejected("missing claim 'iss'")
    if not isinstance(issuer, str):
        raise TokenRejected("claim 'iss' must be a string")
    key = keys.get(issuer)
    if key is None:
        raise TokenRejected(f"unknown approver {_shown(issuer)}")
    claims = _verified_claims(token, key)
    if claims["iss"] != issuer:  # the lenient peek and PyJWT's strict parse must agree
        raise TokenRejected("not a valid JWT (issuer unreadable)")

    # Only a signed token gets reasons about its content.
    return check_claims(
        claims, issuer, audience=audience, tool_name=tool_name, tool_digest=tool_digest,
        args_digest=args_digest, requester=requester, max_ttl_s=max_ttl_s, now=current,
        leeway_s=leeway_s,
    )  # fmt: skip


def check_claims(
    claims: Mapping[str, Any],
    approver: str,
    *,
    audience: str,
    tool_name: str,
    tool_digest: str,
    args_digest: str,
    requester: str,
    max_ttl_s: int,
    now: float,
    leeway_s: int = 30,
) -> VerifiedApproval:
    """The rules on signed approval claims that an Ed25519 token and a passkey
    approval share (what they bind, times, lifetime, jti, req); raises
    TokenRejected. Only claims whose signature verified may be checked here."""
    current = now
    aud = claims["aud"]
    if not isinstance(aud, str) or aud != audience:
        raise TokenRejected(
            f"wrong audience: token is for {_shown(aud)}, this server is {audience!r}"
        )
    sub = claims["sub"]
    if not isinstance(sub, str) or sub != tool_name:
        raise TokenRejected(f"token is for tool {_shown(sub)}, not {tool_name!r}")
    if not _same(claims["tool_digest"], tool_digest):
        raise TokenRejected("tool definition changed since approval (tool_digest)")
    if not _same(claims["args_digest"], args_digest):
        raise TokenRejected("arguments do not match (args_digest)")
    if not _same(claims["requester"], requester):
        raise TokenRejected(
            f"token approves a call by {_shown(claims['requester'])}, not by {requester!r}"
        )

    issued_at = _int_claim(claims, "iat")
    expires_at = _int_claim(claims, "exp")
    if expires_at <= issued_at:
        raise TokenRejected("exp is not after iat")
    if current >= expires_at + leeway_s:
        raise TokenRejected(f"token expired {int(current - expires_at)}s ago")
    if issued_at > current + leeway_s:
        raise TokenRejected("token issued in the future (iat)")
    if claims.get("nbf") is not None:
        not_before = _int_claim(claims, "nbf")
        if not_before > current + leeway_s:
            raise TokenRejected("token not valid yet (nbf)")
    lifetime = expires_at - issued_at
    if lifetime > max_ttl_s:
        raise TokenRejected(f"lifetime {lifetime}s exceeds the policy maximum {max_ttl_s}s")

    jti = claims["jti"]
    if not isinstance(jti, str):
        raise TokenRejected("claim 'jti' must be a string")
    if len(jti) < MIN_JTI_CHARS:
        raise TokenRejected(
            f"jti too short: {len(jti)} characters, at least {MIN_JTI_CHARS}"
            f" ({MIN_JTI_BITS} random bits) required"
        )
    if len(jti) > MAX_JTI_CHARS:
        raise TokenRejected(f"jti too long: at most {MAX_JTI_CHARS} characters")
    if not _JTI_CHARS.match(jti):
        raise TokenRejected("jti must use only base64url characters (A-Z a-z 0-9 - _)")

    request_id = claims.get("req")
    if request_id is not None and not (
        isinstance(request_id, str)
        and request_id.isascii()
        and request_id.isprintable()
        and len(request_id) <= MAX_REQUEST_ID_CHARS
    ):
        raise TokenRejected(
            f"claim 'req' must be printable ASCII of at most {MAX_REQUEST_ID_CHARS} characters"
        )
    return VerifiedApproval(
        approver=approver,
        jti=jti,
        issued_at=issued_at,
        expires_at=expires_at,
        request_id=request_id or None,
        requester=requester,
    )


def _check_header(token: str) -> None:
    """The header, read before any key is used: only EdDSA, only our token type."""
    if not isinstance(token, str) or not token.strip():
        raise TokenRejected("not a JWT: empty")
    if len(token) > MAX_TOKEN_CHARS:
        raise TokenRejected(f"not a JWT: longer than {MAX_TOKEN_CHARS} characters")
    if not token.isascii():
        # A compact JWS is base64url and dots; anything else is not one of ours.
        raise TokenRejected("not a JWT: non-ASCII characters")
    if token.count(".") != 2:
        raise TokenRejected("not a JWT: expected 3 dot-separated parts (compact JWS)")
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError as exc:
        raise TokenRejected(f"not a JWT: unreadable header ({_pyjwt_detail(exc)})") from None
    except Exception as exc:  # a verifier must answer "no", never crash the call
        raise TokenRejected(f"not a JWT: unreadable header ({type(exc).__name__})") from None
    alg = header.get("alg")
    if alg is None:
        raise TokenRejected(f"no algorithm in the header (only {ALGORITHM} is allowed)")
    if alg != ALGORITHM:
        raise TokenRejected(f"algorithm {_shown(alg)} is not allowed (only {ALGORITHM})")
    if header.get("typ") != TOKEN_TYPE:
        raise TokenRejected(
            f"wrong token type {_shown(header.get('typ'))}, expected {TOKEN_TYPE!r}"
        )
    extra = sorted(set(header) - ALLOWED_HEADER_FIELDS)
    if extra:
        raise TokenRejected(f"unsupported header field {_shown(extra[0])}")


def _unverified_payload(token: str) -> dict[str, Any]:
    if (
        not isinstance(token, str)
        or not token.isascii()
        or token.count(".") != 2
        or len(token) > MAX_TOKEN_CHARS
    ):
        raise TokenRejected("not a JWT")
    segment = token.split(".")[1]
    try:
        raw = base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
        payload = json.loads(raw)
    except (binascii.Error, ValueError, RecursionError):
        raise TokenRejected("not a JWT: unreadable payload") from None
    if not isinstance(payload, dict):
        raise TokenRejected("not a JWT: payload is not a JSON object")
    return payload


def _verified_claims(token: str, key: Ed25519PublicKey) -> dict[str, Any]:
    """Signature (with the issuer's key, EdDSA only) and claim presence, via PyJWT."""
    try:
        claims: dict[str, Any] = jwt.decode(
            token,
            key,
            algorithms=[ALGORITHM],
            options={
                "require": list(REQUIRED_CLAIMS),
                "verify_signature": True,
                # Checked above/below with the injectable clock and exact types.
                "verify_exp": False,
                "verify_iat": False,
                "verify_nbf": False,
                "verify_aud": False,
                "verify_iss": False,
                "verify_sub": False,
                "verify_jti": False,
            },
        )
    except jwt.InvalidSignatureError:
        raise TokenRejected("bad signature") from None
    except jwt.MissingRequiredClaimError as exc:
        raise TokenRejected(f"missing claim {exc.claim!r}") from None
    except jwt.InvalidAlgorithmError:
        raise TokenRejected(f"algorithm is not allowed (only {ALGORITHM})") from None
    except jwt.PyJWTError as exc:
        raise TokenRejected(f"not a valid JWT ({_pyjwt_detail(exc)})") from None
    except Exception as exc:  # a verifier must answer "no", never crash the call
        raise TokenRejected(f"not a valid JWT ({type(exc).__name__})") from None
    return claims


def _int_claim(claims: Mapping[str, Any], name: str) -> int:
    value = claims.get(name)
    # bool is an int subclass; `true` seconds is never a time.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TokenRejected(f"claim {name!r} must be an integer (seconds since the epoch)")
    return value


def _same(actual: object, expected: str) -> bool:
    if not isinstance(actual, str):
        return False
    # Bytes, because compare_digest refuses non-ASCII str; surrogatepass keeps a
    # lone surrogate (valid in JSON) from raising instead of answering "no".
    return hmac.compare_digest(
        actual.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass")
    )


def _shown(value: object) -> str:
    """A token-supplied value, quoted, cut short and free of control characters."""
    text = value if isinstance(value, str) else json.dumps(value)
    text = "".join(c if c.isprintable() else "?" for c in text)
    if len(text) > MAX_SHOWN_CHARS:
        text = text[:MAX_SHOWN_CHARS] + "..."
    return f"'{text}'"


def _pyjwt_detail(exc: jwt.PyJWTError) -> str:
    return str(exc)[:MAX_SHOWN_CHARS] or type(exc).__name__
