"""Approval tokens (docs/how-to/approvals.md): every rule of verification, one case per row."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import rfc8785
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed448 import Ed448PrivateKey
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from registry_server.signing.keys import (
    generate_keypair,
    load_private_key,
    public_key_from_text,
    public_key_text,
)
from registry_server.signing.tokens import (
    ALGORITHM,
    MIN_JTI_BITS,
    TOKEN_TYPE,
    TokenRejected,
    VerifiedApproval,
    mint,
    mint_for,
    peek_issuer,
    verify,
)

NOW = 1_700_000_000  # seconds since the epoch: the verifier's clock in every case
AUDIENCE = "toolreg-test"
TOOL = "write_file"
TOOL_DIGEST = hashlib.sha256(b"write_file definition v1").hexdigest()
MAX_TTL_S = 900  # seconds: the policy maximum in every case
ARGS = {"path": "/workspace/notes.txt", "content": "hello"}


def digest(arguments: dict[str, Any]) -> str:
    return hashlib.sha256(rfc8785.dumps(arguments)).hexdigest()


ARGS_DIGEST = digest(ARGS)
REQUESTER = "agent-1"  # the client whose call the approval is for

ALICE_PEM, _ = generate_keypair()
ALICE = load_private_key(ALICE_PEM)
BOB = Ed25519PrivateKey.generate()
MALLORY = Ed25519PrivateKey.generate()  # a valid key the policy does not know
KEYS = {"alice": ALICE.public_key(), "bob": BOB.public_key()}
ALICE_RAW_PUBLIC = ALICE.public_key().public_bytes(
    serialization.Encoding.Raw, serialization.PublicFormat.Raw
)


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def good(**overrides: Any) -> str:
    """A valid token from alice, with mint() arguments replaced."""
    params: dict[str, Any] = {
        "issuer": "alice",
        "audience": AUDIENCE,
        "tool_name": TOOL,
        "tool_digest": TOOL_DIGEST,
        "args_digest": ARGS_DIGEST,
        "requester": REQUESTER,
        "ttl_s": 300,
        "now": NOW,
    }
    key = overrides.pop("key", ALICE)
    params.update(overrides)
    return mint(key, **params)


def claims(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "iss": "alice",
        "aud": AUDIENCE,
        "sub": TOOL,
        "tool_digest": TOOL_DIGEST,
        "args_digest": ARGS_DIGEST,
        "requester": REQUESTER,
        "iat": NOW,
        "exp": NOW + 300,
        "jti": "A" * 22,
    }
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def craft(
    payload: dict[str, Any],
    header: dict[str, Any] | None = None,
    sign: Callable[[bytes], bytes] | None = ALICE.sign,
) -> str:
    """A compact JWS built by hand, so any header or claim can be wrong."""
    head = header if header is not None else {"alg": ALGORITHM, "typ": TOKEN_TYPE}
    signing_input = f"{b64url(json.dumps(head).encode())}.{b64url(json.dumps(payload).encode())}"
    signature = b64url(sign(signing_input.encode())) if sign is not None else ""
    return f"{signing_input}.{signature}"


def tampered() -> str:
    """Alice approved other arguments; the attacker rewrites args_digest and
    keeps her signature."""
    head, _, sig = good(args_digest=digest({**ARGS, "path": "/etc/passwd"})).split(".")
    forged = claims(args_digest=ARGS_DIGEST)
    return f"{head}.{b64url(json.dumps(forged).encode())}.{sig}"


def hs256_with_public_key() -> str:
    """The classic confusion attack: HMAC keyed with the server's public key."""
    return craft(
        claims(),
        header={"alg": "HS256", "typ": TOKEN_TYPE},
        sign=lambda data: hmac.new(ALICE_RAW_PUBLIC, data, hashlib.sha256).digest(),
    )


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[], str]
    rejected: str | None  # None: accepted; else a substring of the reason


CASES = [
    Case("valid", lambda: good(), None),
    Case("valid from another approver", lambda: good(key=BOB, issuer="bob"), None),
    Case("expired", lambda: good(now=NOW - 2_000), "token expired"),
    Case("expired within leeway still accepted", lambda: good(now=NOW - 310), None),
    Case(
        "lifetime beyond the policy maximum",
        lambda: good(ttl_s=7_200),
        "lifetime 7200s exceeds the policy maximum 900s",
    ),
    Case("iat in the future", lambda: good(now=NOW + 600), "issued in the future (iat)"),
    Case("iat in the future within leeway", lambda: good(now=NOW + 10), None),
    Case("wrong audience", lambda: good(audience="toolreg-other"), "wrong audience"),
    Case(
        "wrong tool",
        lambda: good(tool_name="delete_file"),
        "token is for tool 'delete_file', not 'write_file'",
    ),
    Case(
        "tool redefined after approval",
        lambda: good(tool_digest=hashlib.sha256(b"write_file definition v2").hexdigest()),
        "tool definition changed since approval (tool_digest)",
    ),
    Case(
        "arguments changed by one character",
        lambda: good(args_digest=digest({**ARGS, "content": "hellO"})),
        "arguments do not match (args_digest)",
    ),
    Case(
        "arguments re-ordered: same canonical JSON",
        lambda: good(args_digest=digest({"content": "hello", "path": "/workspace/notes.txt"})),
        None,
    ),
    Case(
        "approval for another client's call",
        lambda: good(requester="agent-2"),
        "token approves a call by 'agent-2', not by 'agent-1'",
    ),
    Case("no requester claim", lambda: craft(claims(requester=None)), "missing claim 'requester'"),
    Case(
        "key not in the policy",
        lambda: good(key=MALLORY, issuer="mallory"),
        "unknown approver 'mallory'",
    ),
    Case("approver's name, another key", lambda: good(key=MALLORY), "bad signature"),
    Case("approver's name, bob's key", lambda: good(key=BOB), "bad signature"),
    Case(
        "EdDSA with an Ed448 key",
        lambda: craft(claims(), sign=Ed448PrivateKey.generate().sign),
        "bad signature",
    ),
    Case(
        "alg none",
        lambda: craft(claims(), header={"alg": "none", "typ": TOKEN_TYPE}, sign=None),
        "algorithm 'none' is not allowed (only EdDSA)",
    ),
    Case(
        "alg HS256 keyed with the public key",
        hs256_with_public_key,
        "algorithm 'HS256' is not allowed (only EdDSA)",
    ),
    Case("no alg", lambda: craft(claims(), header={"typ": TOKEN_TYPE}), "no algorithm"),
    Case("tampered payload", tampered, "bad signature"),
    Case(
        "signature stripped",
        lambda: good().rsplit(".", 1)[0] + ".",
        "bad signature",
    ),
    Case(
        "wrong typ",
        lambda: craft(claims(), header={"alg": ALGORITHM, "typ": "JWT"}),
        "wrong token type",
    ),
    Case(
        "unsupported header field",
        lambda: craft(claims(), header={"alg": ALGORITHM, "typ": TOKEN_TYPE, "jku": "http://x"}),
        "unsupported header field 'jku'",
    ),
    Case("missing jti", lambda: craft(claims(jti=None)), "missing claim 'jti'"),
    Case("missing args_digest", lambda: craft(claims(args_digest=None)), "missing claim"),
    Case("missing exp", lambda: craft(claims(exp=None)), "missing claim 'exp'"),
    Case("short jti", lambda: craft(claims(jti="abc123")), "jti too short"),
    Case("jti not base64url", lambda: craft(claims(jti="!" * 24)), "base64url"),
    Case("jti not a string", lambda: craft(claims(jti=12345)), "jti"),
    Case("iat not an integer", lambda: craft(claims(iat=NOW + 0.5)), "'iat' must be an integer"),
    Case("exp as a string", lambda: craft(claims(exp=str(NOW + 300))), "'exp' must be an integer"),
    Case("exp before iat", lambda: craft(claims(exp=NOW - 1)), "exp is not after iat"),
    Case("aud as a list", lambda: craft(claims(aud=[AUDIENCE])), "wrong audience"),
    Case("iss not a string", lambda: craft(claims(iss=["alice"])), "claim 'iss' must be a string"),
    Case("req not a string", lambda: craft(claims(req=7)), "claim 'req' must be"),
    Case("req with a lone surrogate", lambda: craft(claims(req="\ud800")), "claim 'req' must be"),
    Case(
        "digest with a lone surrogate", lambda: craft(claims(args_digest="\ud800")), "args_digest"
    ),
    Case("non-ASCII token", lambda: good()[:-1] + "\ud800", "not a JWT"),
    Case("garbage", lambda: "garbage", "not a JWT"),
    Case("two parts", lambda: "e30.e30", "not a JWT"),
    Case("empty", lambda: "", "not a JWT"),
    Case("bad base64", lambda: "!!!.@@@.###", "not a JWT"),
    Case("payload not an object", lambda: craft([1, 2]), "not a JWT"),  # type: ignore[arg-type]
    Case("huge", lambda: "a" * 100_000 + ".b.c", "not a JWT"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_verify(case: Case) -> None:
    token = case.build()
    try:
        approval = verify(
            token,
            keys=KEYS,
            audience=AUDIENCE,
            tool_name=TOOL,
            tool_digest=TOOL_DIGEST,
            args_digest=ARGS_DIGEST,
            requester=REQUESTER,
            max_ttl_s=MAX_TTL_S,
            now=NOW,
        )
    except TokenRejected as exc:
        assert case.rejected is not None, f"rejected: {exc.reason}"
        assert case.rejected in exc.reason
        assert str(exc) == exc.reason
        assert _no_secret(exc.reason)
        return
    assert case.rejected is None, f"accepted, expected {case.rejected!r}"
    assert isinstance(approval, VerifiedApproval)
    assert approval.approver in KEYS


def _no_secret(text: str) -> bool:
    body = "".join(ALICE_PEM.decode().splitlines()[1:-1])
    return body not in text and body[:16] not in text and "PRIVATE" not in text


def test_verified_approval_carries_the_claims() -> None:
    token = good(request_id="req-42", ttl_s=600)
    approval = verify(
        token, keys=KEYS, audience=AUDIENCE, tool_name=TOOL, tool_digest=TOOL_DIGEST,
        args_digest=ARGS_DIGEST, requester=REQUESTER, max_ttl_s=MAX_TTL_S, now=NOW,
    )  # fmt: skip
    assert approval.approver == "alice"
    assert approval.issued_at == NOW and approval.expires_at == NOW + 600
    assert approval.request_id == "req-42"
    assert len(approval.jti) * 6 >= MIN_JTI_BITS
    assert peek_issuer(token) == "alice"


def test_minted_header_and_claims() -> None:
    token = good()
    head, payload, _ = token.split(".")
    assert json.loads(unb64url(head)) == {"alg": "EdDSA", "typ": TOKEN_TYPE}
    body = json.loads(unb64url(payload))
    assert set(body) == {
        "iss", "aud", "sub", "tool_digest", "args_digest", "requester", "iat", "exp", "jti",
    }  # fmt: skip
    assert body["exp"] - body["iat"] == 300


def test_every_minted_jti_is_fresh() -> None:
    jtis = {peek_jti(good()) for _ in range(200)}
    assert len(jtis) == 200
    assert min(len(j) for j in jtis) >= 22


def peek_jti(token: str) -> str:
    jti: str = json.loads(unb64url(token.split(".")[1]))["jti"]
    return jti


@dataclass(frozen=True)
class Request:  # what an approver's client reads from GetApprovalRequest
    id: str = "req-7"
    audience: str = AUDIENCE
    tool_name: str = TOOL
    tool_digest: str = TOOL_DIGEST
    arguments_digest: str = ARGS_DIGEST
    requested_by: str = REQUESTER
    max_token_ttl_s: int = 0


@pytest.mark.parametrize(
    ("request_ttl", "ttl", "bind", "lifetime", "request_id"),
    [
        (0, None, False, 300, None),  # neither says: the default
        (120, None, True, 120, "req-7"),  # the request's maximum
        (120, 60, False, 60, None),  # the approver's choice
    ],
)
def test_mint_for_signs_what_the_request_names(
    request_ttl: int, ttl: int | None, bind: bool, lifetime: int, request_id: str | None
) -> None:
    req = Request(max_token_ttl_s=request_ttl)
    token = mint_for(ALICE, issuer="alice", request=req, ttl_s=ttl, bind_request=bind)
    body = json.loads(unb64url(token.split(".")[1]))
    approval = verify(
        token, keys=KEYS, audience=AUDIENCE, tool_name=TOOL, tool_digest=TOOL_DIGEST,
        args_digest=ARGS_DIGEST, requester=REQUESTER, max_ttl_s=MAX_TTL_S,
        now=body["iat"],
    )  # fmt: skip
    assert approval.expires_at - approval.issued_at == lifetime
    assert approval.request_id == request_id


def test_mint_refuses_a_non_positive_lifetime() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        good(ttl_s=0)


def test_peek_issuer_of_garbage_is_none() -> None:
    assert peek_issuer("garbage") is None
    assert peek_issuer(craft(claims(iss=None))) is None


# ------------------------------------------------------------------------ keys


def test_generate_keypair_round_trip() -> None:
    private_pem, public_text = generate_keypair()
    assert private_pem.startswith(b"-----BEGIN PRIVATE KEY-----")
    private_key = load_private_key(private_pem)
    public_key = public_key_from_text(public_text)
    assert public_key_text(private_key.public_key()) == public_text
    assert len(base64.b64decode(public_text)) == 32
    token = mint(
        private_key, issuer="carol", audience=AUDIENCE, tool_name=TOOL,
        tool_digest=TOOL_DIGEST, args_digest=ARGS_DIGEST, requester=REQUESTER, ttl_s=60, now=NOW,
    )  # fmt: skip
    approval = verify(
        token, keys={"carol": public_key}, audience=AUDIENCE, tool_name=TOOL,
        tool_digest=TOOL_DIGEST, args_digest=ARGS_DIGEST, requester=REQUESTER, max_ttl_s=60,
        now=NOW,
    )  # fmt: skip
    assert approval.approver == "carol"


def test_public_key_from_text_accepts_pem_raw_base64_and_base64url() -> None:
    key = ALICE.public_key()
    pem = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()
    raw_b64 = public_key_text(key)
    raw_b64url = base64.urlsafe_b64encode(ALICE_RAW_PUBLIC).decode().rstrip("=")
    for text in (pem, raw_b64, raw_b64url, f"  {raw_b64}\n"):
        assert public_key_text(public_key_from_text(text)) == raw_b64


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty"),
        ("not a key at all!", "neither PEM nor base64"),
        (base64.b64encode(b"x" * 31).decode(), "decodes to 31 bytes"),
        (base64.b64encode(b"x" * 64).decode(), "decodes to 64 bytes"),
        ("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----", "unreadable PEM"),
        (ALICE_PEM.decode(), "PRIVATE key"),
    ],
)
def test_public_key_from_text_rejects_junk(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match="not an Ed25519 public key") as info:
        public_key_from_text(text)
    assert reason in str(info.value)
    assert _no_secret(str(info.value).replace("PRIVATE key", ""))


def test_public_key_from_text_rejects_another_key_type() -> None:
    from cryptography.hazmat.primitives.asymmetric import ec

    pem = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )
    with pytest.raises(ValueError, match="not an Ed25519 public key"):
        public_key_from_text(pem)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"junk",
        ALICE_PEM.replace(b"PRIVATE KEY-----\n", b"PRIVATE KEY-----\nAAAA", 1),
        Ed448PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        ),
    ],
    ids=["empty", "junk", "corrupted", "ed448", "encrypted"],
)
def test_load_private_key_errors_never_quote_the_key(data: bytes) -> None:
    # an encrypted key without its passphrase: PassphraseRequired, a ValueError
    with pytest.raises(
        ValueError, match=r"not an Ed25519 private key|passphrase is needed"
    ) as info:
        load_private_key(data)
    message = str(info.value)
    lines = [line for line in data.decode(errors="replace").splitlines() if "-----" not in line]
    assert all(line[:16] not in message for line in lines if line)


def test_any_one_character_changed_is_rejected_never_crashes() -> None:
    token = good()
    for index, char in enumerate(token):
        replacement = "A" if char != "A" else "B"
        mutated = token[:index] + replacement + token[index + 1 :]
        with pytest.raises(TokenRejected):
            verify(
                mutated, keys=KEYS, audience=AUDIENCE, tool_name=TOOL, tool_digest=TOOL_DIGEST,
                args_digest=ARGS_DIGEST, requester=REQUESTER, max_ttl_s=MAX_TTL_S, now=NOW,
            )  # fmt: skip
