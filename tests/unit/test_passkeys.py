"""Passkey approvals (signing/passkeys.py, docs/how-to/approvals.md "Passkeys"): the
envelope's parsing and size cap, the claims and their challenge, what
py_webauthn's real verification refuses (made by a software authenticator,
tests/passkey_authenticator.py), the counter rule in the decision, at
submission and in the store, and the policy's passkey entries.

Against ``Approvals`` with the in-memory store and a policy loaded from
YAML, as tests/unit/test_approval_decisions.py; no server."""

from __future__ import annotations

import base64
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import rfc8785

from registry_server.approvals.service import Approvals, Approved, Call, Denied, Replayed, Required
from registry_server.catalog.registry import Registry
from registry_server.domain.arguments import arguments_digest
from registry_server.domain.errors import PermissionDenied
from registry_server.domain.outcome import ApprovalRequestView
from registry_server.policy.loader import PolicyError, load_policy
from registry_server.signing import passkeys
from registry_server.signing.keys import generate_keypair
from registry_server.signing.tokens import TokenRejected
from registry_server.store.memory import MemoryStore
from tests.factories import policy_of, sha
from tests.factories import tool as make_tool
from tests.passkey_authenticator import (
    FLAG_BE,
    FLAG_BS,
    FLAG_UP,
    FLAG_UV,
    ORIGIN,
    RP_ID,
    SoftAuthenticator,
)

AUDIENCE = "toolreg-test"
ALICE = SoftAuthenticator("alice")
BOB = SoftAuthenticator("bob")
MALLORY = SoftAuthenticator("mallory")  # a passkey the policy does not know
CAROL_PUBLIC = generate_keypair()[1]

POLICY = f"""\
audience: {AUDIENCE}
webauthn:
  rp_id: {RP_ID}
  origins: ["{ORIGIN}"]
approvers:
  - id: alice
    groups: [security]
    passkeys:
      - {ALICE.policy_entry()}
  - id: bob
    groups: [security]
    passkeys:
      - {BOB.policy_entry()}
  - id: carol
    public_key: "{CAROL_PUBLIC}"
    groups: [security]
approval_rules:
  - match: {{tool: write_file}}
    approvals_required: 2
    groups: [security]
    max_token_ttl_s: 900
clients:
  - id: agent-1
    token_sha256: "{sha("agent-1-secret")}"
    roles: [execute]
    max_safety_level: dangerous
"""

ARGS: dict[str, Any] = {"path": "notes/plan.txt", "content": "ship it"}


@dataclass
class Env:
    store: MemoryStore
    approvals: Approvals
    call: Call
    request: ApprovalRequestView


def call_of(registry: Registry, args: dict[str, Any]) -> Call:
    return Call(
        registry.get("write_file"), rfc8785.dumps(args).decode(), arguments_digest(args), "agent-1"
    )


@pytest.fixture
def env() -> Env:
    store = MemoryStore()
    registry = Registry(store)
    registry.register(make_tool(name="write_file", safety_level="dangerous", categories=["files"]))
    approvals = Approvals(store, policy_of(POLICY), registry)
    call = call_of(registry, ARGS)
    decision = approvals.decide(call, (), "")
    assert isinstance(decision, Required)
    return Env(store, approvals, call, decision.request)


def verify(env: Env, token: str) -> Any:
    policy = env.approvals.policy
    return passkeys.verify(
        token, credentials=policy.passkey_credentials(), webauthn=policy.webauthn,
        audience=AUDIENCE, tool_name="write_file", tool_digest=env.call.tool.digest,
        args_digest=env.call.arguments_digest, requester="agent-1", max_ttl_s=900,
    )  # fmt: skip


def refused(env: Env, token: str) -> str:
    with pytest.raises(TokenRejected) as info:
        verify(env, token)
    reason = info.value.reason
    body = token[len(passkeys.PREFIX) :]
    assert body[:40] not in reason and token not in reason  # never echoes the envelope
    return reason


def rewrap(token: str, **changes: Any) -> str:
    """The envelope with some of its JSON fields replaced (None: removed)."""
    body = token[len(passkeys.PREFIX) :]
    value = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    for key, item in changes.items():
        if item is None:
            value.pop(key)
        else:
            value[key] = item
    return passkeys.PREFIX + passkeys.b64url(json.dumps(value).encode())


# ------------------------------------------------------------------ claims


def test_claims_are_the_request_bound_with_a_fresh_jti(env: Env) -> None:
    first = passkeys.claims_for(env.request, now=1_000)
    second = passkeys.claims_for(env.request, now=1_000)
    assert first["jti"] != second["jti"] and len(first["jti"]) >= 22  # 128 bits, base64url
    assert {k: v for k, v in first.items() if k != "jti"} == {
        "typ": "toolreg-passkey-approval", "aud": AUDIENCE, "sub": "write_file",
        "tool_digest": env.call.tool.digest, "args_digest": env.call.arguments_digest,
        "requester": "agent-1", "req": env.request.id, "iat": 1_000, "exp": 1_900,
    }  # fmt: skip
    # The challenge is the SHA-256 of the RFC 8785 bytes, whatever the key order.
    shuffled = dict(reversed(list(first.items())))
    assert passkeys.challenge_for(shuffled) == passkeys.challenge_for(first)
    assert passkeys.canonical(first) == rfc8785.dumps(first)


def test_a_valid_assertion_verifies_with_its_evidence(env: Env) -> None:
    claims = passkeys.claims_for(env.request)
    token = ALICE.approve(claims, flags=FLAG_UP | FLAG_UV | FLAG_BE | FLAG_BS, counter=7)
    approval = verify(env, token)
    assert (approval.approver, approval.jti, approval.request_id) == (
        "alice", claims["jti"], env.request.id,
    )  # fmt: skip
    assert approval.passkey.credential_id == ALICE.credential_id
    assert approval.passkey.sign_count == 7
    assert approval.passkey.flags() == {"UP": True, "UV": True, "BE": True, "BS": True}


# --------------------------------------------------------- what is refused


def test_an_assertion_for_other_arguments_is_refused(env: Env) -> None:
    claims = passkeys.claims_for(env.request)
    other = {**claims, "args_digest": arguments_digest({"path": "x", "content": "evil"})}
    # Signed for other arguments, presented as such: the claims do not match the call.
    assert "arguments do not match" in refused(env, ALICE.approve(other))
    # Signed for other arguments, presented as this call's claims: wrong challenge.
    assert "not made for these claims" in refused(env, ALICE.approve(claims, signed_claims=other))


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"flags": FLAG_UP}, "UV flag not set"),
        ({"flags": FLAG_UV}, "UP flag not set"),
        ({"origin": "http://localhost:9999"}, "origin the policy does not allow"),
        ({"origin": "https://evil.example"}, "origin the policy does not allow"),
        ({"rp_id": "evil.example"}, "another relying party"),
        ({"client_type": "webauthn.create"}, "not of type webauthn.get"),
    ],
)
def test_what_py_webauthn_refuses_has_a_fixed_reason(
    env: Env, options: dict[str, Any], reason: str
) -> None:
    token = ALICE.approve(passkeys.claims_for(env.request), **options)
    shown = refused(env, token)
    assert reason in shown
    assert "evil" not in shown and "9999" not in shown  # nothing of the envelope quoted


def test_a_signature_by_another_key_is_refused(env: Env) -> None:
    claims = passkeys.claims_for(env.request)
    forged = MALLORY.approve(claims)
    assert "unknown passkey" in refused(env, forged)
    # Mallory's signature under Alice's credential id
    stolen_id = rewrap(forged, credential_id=ALICE.credential_id)
    assert refused(env, stolen_id) == "passkey assertion refused: bad signature"


def test_claims_checks_apply_only_after_the_signature(env: Env) -> None:
    claims = passkeys.claims_for(env.request)
    token = rewrap(ALICE.approve(claims), claims={**claims, "aud": "elsewhere"})
    assert "not made for these claims" in refused(env, token)  # not "wrong audience"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"iat": 0, "exp": 100}, "expired"),
        ({"exp_offset": 3600}, "exceeds the policy maximum 900s"),
        ({"jti": "short"}, "jti too short"),
        ({"requester": "agent-2"}, "approves a call by 'agent-2'"),
        ({"sub": "other_tool"}, "token is for tool 'other_tool'"),
    ],
)
def test_claims_follow_the_token_rules(env: Env, change: dict[str, Any], reason: str) -> None:
    claims = passkeys.claims_for(env.request)
    offset = change.pop("exp_offset", None)
    if offset is not None:
        claims["exp"] = claims["iat"] + offset
    claims.update(change)
    assert reason in refused(env, ALICE.approve(claims))


@pytest.mark.parametrize(
    ("mangle", "reason"),
    [
        (lambda t: t + "A" * passkeys.MAX_ENVELOPE_CHARS, "longer than 8192 characters"),
        (lambda t: t + "!", "not base64url after its prefix"),
        (lambda t: passkeys.PREFIX + passkeys.b64url(b"[1, 2]"), "not base64url of a JSON object"),
        (lambda t: passkeys.PREFIX + passkeys.b64url(b'{"a":1,"a":2}'), "JSON object"),
        (lambda t: rewrap(t, signature=None), "lacks 'signature'"),
        (lambda t: rewrap(t, extra="x"), "unknown field"),
        (lambda t: rewrap(t, credential_id="abc"), "shorter than 16 bytes"),
        (lambda t: rewrap(t, signature="***"), "signature is not base64url"),
        (lambda t: rewrap(t, claims={"typ": "toolreg-passkey-approval"}), "missing claim"),
        (lambda t: rewrap(t, claims=[]), "claims are not a JSON object"),
    ],
)
def test_a_malformed_envelope_is_refused_by_name(env: Env, mangle: Any, reason: str) -> None:
    token = mangle(ALICE.approve(passkeys.claims_for(env.request)))
    assert reason in refused(env, token)


def test_claims_of_another_kind_or_with_more_claims_are_refused(env: Env) -> None:
    claims = passkeys.claims_for(env.request)
    assert "claim 'typ'" in refused(env, ALICE.approve({**claims, "typ": "toolreg-approval+jwt"}))
    assert "not an approval's" in refused(env, ALICE.approve({**claims, "admin": True}))
    no_req = {k: v for k, v in claims.items() if k != "req"}
    assert "missing claim 'req'" in refused(env, ALICE.approve(no_req))
    assert "'req' is required" in refused(env, ALICE.approve({**claims, "req": ""}))


# --------------------------------------------------- the decision and counters


def test_two_passkey_approvers_approve_a_2_of_2_call(env: Env) -> None:
    tokens = tuple(a.approve(passkeys.claims_for(env.request)) for a in (ALICE, BOB))
    decision = env.approvals.decide(env.call, tokens, env.request.id)
    assert isinstance(decision, Approved)
    assert sorted(a.approver for a in decision.approvals) == ["alice", "bob"]
    assert len(decision.fresh_passkeys) == 2
    env.approvals.spend(decision, "exec-1", {"event": "test"})
    with env.store.reading() as reads:
        record = json.loads(reads.audit_entries()[-1].record)
        assert reads.passkey_counter(ALICE.credential_id) == ALICE.counter
    assert {p["approver"]: p["credential_id"] for p in record["passkeys"]} == {
        "alice": ALICE.credential_id, "bob": BOB.credential_id,
    }  # fmt: skip
    assert record["passkeys"][0]["flags"] == {"UP": True, "UV": True, "BE": False, "BS": False}
    # The same envelopes again: replayed jti.
    with pytest.raises(Replayed):
        env.approvals.decide(env.call, tokens, "")


def test_the_same_passkey_counts_once_and_one_approver_needs_another(env: Env) -> None:
    tokens = tuple(ALICE.approve(passkeys.claims_for(env.request)) for _ in range(2))
    assert isinstance(env.approvals.decide(env.call, tokens, env.request.id), Required)


def test_a_counter_that_goes_back_is_refused_at_submission(env: Env) -> None:
    first = ALICE.approve(passkeys.claims_for(env.request), counter=10)
    env.approvals.submit(env.request.id, first, "alice")
    clone = ALICE.approve(passkeys.claims_for(env.request), counter=9)
    with pytest.raises(PermissionDenied, match="counter 9, not above 10 already seen"):
        env.approvals.submit(env.request.id, clone, "alice")
    same = ALICE.approve(passkeys.claims_for(env.request), counter=10)
    with pytest.raises(PermissionDenied, match="signature counter went back"):
        env.approvals.submit(env.request.id, same, "alice")
    # Inline, the same rule holds.
    with pytest.raises(Denied, match="counter went back"):
        env.approvals.decide(env.call, (clone,), env.request.id)
    # A stored approval was checked when it came: later uses of the passkey
    # do not void it, and it still counts with Bob's.
    env.approvals.submit(
        env.request.id, ALICE.approve(passkeys.claims_for(env.request), counter=11), "alice"
    )
    env.approvals.submit(env.request.id, BOB.approve(passkeys.claims_for(env.request)), "bob")
    decision = env.approvals.decide(env.call, (), env.request.id)
    assert isinstance(decision, Approved) and decision.fresh_passkeys == ()


def test_an_inline_counter_is_advanced_when_spent_and_a_race_loses(env: Env) -> None:
    tokens = (
        ALICE.approve(passkeys.claims_for(env.request), counter=5),
        BOB.approve(passkeys.claims_for(env.request), counter=5),
    )
    decision = env.approvals.decide(env.call, tokens, env.request.id)
    assert isinstance(decision, Approved)
    # Meanwhile the same passkey was used with a higher count elsewhere.
    with env.store.unit_of_work() as uow:
        assert uow.advance_passkey_counter(ALICE.credential_id, "alice", 6, 0.0)
    with pytest.raises(Denied, match="counter 5, not above 6"):
        env.approvals.spend(decision, "exec-1", {"event": "test"})
    with env.store.reading() as reads:  # nothing of the refused spend was kept
        assert not reads.jti_used(decision.approvals[0].jti)
        assert reads.passkey_counter(BOB.credential_id) is None


def test_an_authenticator_that_does_not_count_stays_at_zero(env: Env) -> None:
    for _ in range(2):
        token = ALICE.approve(passkeys.claims_for(env.request), counter=0)
        env.approvals.submit(env.request.id, token, "alice")
    env.approvals.submit(
        env.request.id, ALICE.approve(passkeys.claims_for(env.request), counter=1), "alice"
    )
    back_to_zero = ALICE.approve(passkeys.claims_for(env.request), counter=0)
    with pytest.raises(PermissionDenied, match="counter 0, not above 1"):
        env.approvals.submit(env.request.id, back_to_zero, "alice")


@pytest.mark.parametrize(
    ("last", "new", "ok"),
    [(None, 0, True), (None, 5, True), (0, 0, True), (0, 1, True), (4, 5, True),
     (5, 5, False), (5, 4, False), (5, 0, False)],
)  # fmt: skip
def test_counter_rule(last: int | None, new: int, ok: bool) -> None:
    assert passkeys.counter_advances(last, new) is ok
    store = MemoryStore()
    with store.unit_of_work() as uow:
        if last is not None:
            assert uow.advance_passkey_counter("cred", "alice", last, 0.0)
        assert uow.advance_passkey_counter("cred", "alice", new, 0.0) is ok


# ------------------------------------------------------------------ policy


def load(text: str) -> str:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory, "policy.yaml")
        path.write_text(text)
        with pytest.raises(PolicyError) as info:
            load_policy(path)
    return str(info.value)


def test_policy_holds_passkeys_by_credential_id() -> None:
    policy = policy_of(POLICY)
    credentials = policy.passkey_credentials()
    assert credentials[ALICE.credential_id].approver == "alice"
    assert credentials[ALICE.credential_id].public_key == ALICE.cose_public_key()
    assert set(policy.approver_keys()) == {"carol"}  # the Ed25519 keys only
    assert policy.webauthn is not None and policy.webauthn.origins == (ORIGIN,)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda p: p.replace(f"  rp_id: {RP_ID}\n  origins: [\"{ORIGIN}\"]\n", "  rp_id: x\n  origins: []\n"),
         "webauthn.origins"),
        (lambda p: p.split("webauthn:")[0] + "approvers:" + p.split("approvers:")[1],
         "approvers[0].passkeys: passkeys need the policy's webauthn"),
        (lambda p: p.replace(BOB.credential_id, ALICE.credential_id),
         "approvers[1].passkeys[0].id: same passkey id as approvers[0].passkeys[0] ('alice')"),
        (lambda p: p.replace(passkeys.b64url(BOB.cose_public_key()), passkeys.b64url(ALICE.cose_public_key())),
         "approvers[1].passkeys[0].public_key: same passkey public_key"),
        (lambda p: p.replace(passkeys.b64url(BOB.cose_public_key()), "AAAA"),
         "not a COSE key"),
        (lambda p: p.replace(BOB.credential_id, "abc"), "shorter than 16 bytes"),
        (lambda p: p.replace(f'    public_key: "{CAROL_PUBLIC}"\n', ""),
         "an approver needs a public_key, passkeys, or both"),
        (lambda p: p.replace(f"rp_id: {RP_ID}", "rp_id: 127.0.0.1"), "not a relying party id"),
        (lambda p: p.replace(ORIGIN, "http://example.com"), "http is allowed only on localhost"),
        (lambda p: p.replace(f"rp_id: {RP_ID}", "rp_id: example.com").replace(ORIGIN, "https://evil.com"),
         "its host is not 'example.com' nor under it"),
    ],
)  # fmt: skip
def test_policy_refuses_bad_passkey_entries(edit: Any, message: str) -> None:
    assert message in load(edit(POLICY))


def test_an_ed25519_key_and_passkeys_may_be_held_together() -> None:
    both = POLICY.replace(
        "  - id: alice\n    groups: [security]\n",
        f'  - id: alice\n    public_key: "{generate_keypair()[1]}"\n    groups: [security]\n',
    )
    assert set(policy_of(both).approver_keys()) == {"alice", "carol"}
