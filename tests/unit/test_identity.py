"""IdP access tokens as pure logic: the policy's identity providers (loading,
every rejection naming file and line), the claim mapping, and the verifier
against an in-memory JWKS (no network: the real provider is tests/identity)."""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import hmac
import json
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from registry_server.api.auth import Authenticator, AuthError
from registry_server.api.auth.access_tokens import AccessTokens, TokenRefused
from registry_server.api.auth.jwks import FetchError, ProviderKeys
from registry_server.domain.models import SafetyLevel
from registry_server.policy.clients import Role
from registry_server.policy.identity import IdentityProvider
from registry_server.policy.live import LivePolicy
from registry_server.policy.loader import load_policy
from registry_server.policy.model import Policy, PolicyError
from registry_server.policy.seen import Sighting
from registry_server.signing.keys import generate_keypair
from tests.factories import sha

ISSUER = "https://idp.example.test/realms/acme"
AUDIENCE = "https://registry.example.test"
KEY_A = generate_keypair()[1]


def provider_yaml(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": "corp",
        "issuer": ISSUER,
        "audiences": [AUDIENCE],
        "algorithms": ["ES256", "RS256"],
        "groups": [
            {"group": "agents", "roles": ["execute"], "max_safety_level": "cautious",
             "quotas": {"max_concurrent": 2}},
            {"group": "builders", "roles": ["register", "execute"],
             "register": {"max_safety_level": "cautious", "images": ["toolreg/*"]}},
            {"group": "ops", "roles": ["execute"], "max_safety_level": "dangerous",
             "quotas": {"max_concurrent": 9}},
        ],
        "denied_subjects": ["fired-person"],
    }  # fmt: skip
    base.update(overrides)
    return base


def write(
    tmp_path: Path, providers: list[dict[str, Any]], clients: list[Any] | None = None
) -> Path:
    path = tmp_path / "policy.yaml"
    policy = {
        "audience": "toolreg-test",
        "approvers": [{"id": "corp.alice", "public_key": KEY_A}],
        "clients": clients
        if clients is not None
        else [
            {"id": "admin", "token_sha256": sha("admin-secret"), "roles": ["admin"]},
            {
                "id": "ci-bot",
                "idp": {"provider": "corp", "subject": "svc-ci"},
                "roles": ["register"],
            },
        ],
        "identity_providers": providers,
    }
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    return path


def load(tmp_path: Path, **overrides: Any) -> Policy:
    return load_policy(write(tmp_path, [provider_yaml(**overrides)]))


# ----------------------------------------------------------------- the policy


def test_a_provider_loads_with_its_mappings(tmp_path: Path) -> None:
    policy = load(tmp_path)
    (provider,) = policy.identity_providers
    assert provider.id == "corp" and provider.client_id_prefix == "corp."
    assert provider.algorithms == ("ES256", "RS256")
    assert policy.client_by_idp("corp", "svc-ci") is not None
    assert policy.client_by_idp("corp", "svc-ci").id == "ci-bot"  # type: ignore[union-attr]
    assert policy.client_by_idp("corp", "someone-else") is None
    assert "line" in provider.where


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"algorithms": ["HS256"]}, "only asymmetric algorithms"),
        ({"algorithms": ["none"]}, "only asymmetric algorithms"),
        ({"issuer": "http://idp.example.test"}, "must use https"),
        ({"issuer": "http://127.0.0.1:8080"}, "allow_http_loopback"),
        ({"issuer": "https://user:pw@idp.example.test"}, "must not carry a user"),
        ({"jwks_uri": "http://idp.example.test/jwks"}, "must use https"),
        ({"audiences": []}, "audiences"),
        ({"client_id_prefix": ""}, "does not start a valid client id"),
        ({"client_id_prefix": "Corp:"}, "does not start a valid client id"),
        ({"clock_skew_s": 3600}, "clock_skew_s"),
        ({"groups_claim": "a b"}, "not a valid claim name"),
        ({"id": "Corp"}, "not a valid identity provider id"),
        ({"surprise": 1}, "surprise"),
        ({"groups": [{"group": "a", "roles": ["owner"]}]}, "unknown role"),
        ({"groups": [{"group": "a", "register": {}}]}, "without the register role"),
        ({"groups": [{"group": "a"}, {"group": "a"}]}, "repeats group 'a'"),
    ],
)
def test_a_bad_provider_is_refused_naming_the_file_line_and_rule(
    tmp_path: Path, overrides: dict[str, Any], needle: str
) -> None:
    with pytest.raises(PolicyError) as caught:
        load(tmp_path, **overrides)
    message = str(caught.value)
    assert needle in message
    assert "policy.yaml line" in message and "identity_providers" in message


def test_plain_http_to_loopback_only_with_the_explicit_setting(tmp_path: Path) -> None:
    policy = load(tmp_path, issuer="http://127.0.0.1:8080", allow_http_loopback=True)
    assert policy.identity_providers[0].issuer == "http://127.0.0.1:8080"
    with pytest.raises(PolicyError, match="must use https"):
        load(tmp_path, issuer="http://10.0.0.1:8080", allow_http_loopback=True)


def test_provider_ids_can_never_take_a_file_clients_id(tmp_path: Path) -> None:
    clients = [{"id": "corp.bob", "token_sha256": sha("x"), "roles": ["execute"]}]
    with pytest.raises(PolicyError, match="client_id_prefix"):
        load_policy(write(tmp_path, [provider_yaml()], clients))
    two = [
        provider_yaml(),
        provider_yaml(id="other", issuer="https://b.test", client_id_prefix="corp.x"),
    ]
    with pytest.raises(PolicyError, match="starts with identity_providers\\[0\\]'s prefix"):
        load_policy(write(tmp_path, two, []))


def test_pinned_subjects_name_a_known_provider_once(tmp_path: Path) -> None:
    pinned = {"id": "a", "idp": {"provider": "nope", "subject": "s"}, "roles": ["execute"]}
    with pytest.raises(PolicyError, match="unknown identity provider 'nope'"):
        load_policy(write(tmp_path, [provider_yaml()], [pinned]))
    twice = [
        {"id": "a", "idp": {"provider": "corp", "subject": "s"}},
        {"id": "b", "idp": {"provider": "corp", "subject": "s"}},
    ]
    with pytest.raises(PolicyError, match="same subject as clients\\[0\\]"):
        load_policy(write(tmp_path, [provider_yaml()], twice))


# ----------------------------------------------------------------- the mapping


def test_groups_map_onto_a_client_union_of_roles_highest_level_first_grant(
    tmp_path: Path,
) -> None:
    provider = load(tmp_path).identity_providers[0]
    client = provider.client_for("bob", frozenset({"agents", "builders", "ops", "unmapped"}))
    assert client is not None
    assert client.id == "corp.bob"
    assert client.roles == {Role.EXECUTE, Role.REGISTER}
    assert client.max_safety_level is SafetyLevel.DANGEROUS
    assert client.register.max_level is SafetyLevel.CAUTIOUS
    assert client.quota.max_concurrent == 2  # agents comes first in the file
    nobody = provider.client_for("bob", frozenset({"unmapped"}))
    assert nobody is not None and nobody.roles == frozenset()
    assert provider.client_for("Bob With Spaces", frozenset()) is None


@pytest.mark.parametrize(
    ("path", "claims", "groups"),
    [
        ("groups", {"groups": ["a", "b", 3, None]}, {"a", "b"}),
        ("groups", {"groups": "a b"}, {"a", "b"}),
        ("realm_access.roles", {"realm_access": {"roles": ["a"]}}, {"a"}),
        ("realm_access.roles", {"realm_access": ["a"]}, set()),
        ("groups", {"groups": {"a": 1}}, set()),
        ("groups", {}, set()),
    ],
)
def test_the_groups_claim_in_the_shapes_providers_use(
    path: str, claims: dict[str, Any], groups: set[str]
) -> None:
    provider = IdentityProvider("p", ISSUER, (AUDIENCE,), groups_claim=path)
    assert provider.groups_of(claims) == groups


def test_a_seen_client_is_found_by_id_as_the_policy_maps_it_now(tmp_path: Path) -> None:
    path = write(tmp_path, [provider_yaml()])
    live = LivePolicy(lambda: load_policy(path))
    live.current.seen.saw("corp.bob", Sighting("corp", "bob", frozenset({"agents"})))
    assert live.current.client("corp.bob").max_safety_level is SafetyLevel.CAUTIOUS  # type: ignore[union-attr]
    assert live.current.quota_for("corp.bob").max_concurrent == 2
    # The operator maps "agents" to dangerous: the next lookup sees it, no new token needed.
    changed = provider_yaml()
    changed["groups"][0]["max_safety_level"] = "dangerous"
    write(tmp_path, [changed])
    live.reload()
    assert live.current.client("corp.bob").max_safety_level is SafetyLevel.DANGEROUS  # type: ignore[union-attr]
    # A denied subject is nobody at once, whatever it was seen as.
    write(tmp_path, [provider_yaml(denied_subjects=["bob"])])
    live.reload()
    assert live.current.client("corp.bob") is None
    assert live.current.grant_of("corp.bob") is None


# ----------------------------------------------------------------- the verifier


@functools.cache
def _provider_keys() -> tuple[ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey]:
    """The provider's signing keys, made once: an RSA key takes tens of
    milliseconds, and keys are immutable (a test that rotates makes its own)."""
    return ec.generate_private_key(ec.SECP256R1()), rsa.generate_private_key(
        public_exponent=65537, key_size=2048
    )


class Keys:
    """An in-memory provider: its keys, its JWKS, and a count of fetches."""

    def __init__(self) -> None:
        self.ec, self.rsa = _provider_keys()
        self.jwks: dict[str, Any] = {"keys": [self.public_jwk(self.ec, "ec-1"),
                                              self.public_jwk(self.rsa, "rsa-1")]}  # fmt: skip
        self.fetched: list[str] = []
        self.down = False

    @staticmethod
    def public_jwk(key: Any, kid: str) -> dict[str, Any]:
        algorithm = ECAlgorithm if isinstance(key, ec.EllipticCurvePrivateKey) else RSAAlgorithm
        return {**algorithm.to_jwk(key.public_key(), as_dict=True), "kid": kid, "use": "sig"}

    def fetch(self, url: str) -> dict[str, Any]:
        self.fetched.append(url)
        if self.down:
            raise FetchError("ConnectError: no usable answer")
        if url.endswith("/.well-known/openid-configuration"):
            return {"issuer": ISSUER, "jwks_uri": ISSUER + "/jwks"}
        return self.jwks

    def token(self, key: Any = None, alg: str = "ES256", kid: str = "ec-1",
              header: dict[str, Any] | None = None, **claims: Any) -> str:  # fmt: skip
        now = int(time.time())
        body: dict[str, Any] = {"iss": ISSUER, "aud": AUDIENCE, "sub": "bob", "iat": now,
                                "exp": now + 300, "groups": ["agents"]}  # fmt: skip
        body.update(claims)
        body = {k: v for k, v in body.items() if v is not None}
        return jwt.encode(body, key or self.ec, algorithm=alg,
                          headers={"kid": kid, "typ": "at+jwt", **(header or {})})  # fmt: skip


@pytest.fixture
def idp() -> Keys:
    return Keys()


@pytest.fixture
def policy(tmp_path: Path) -> Policy:
    return load(tmp_path, min_refresh_interval_s=30)


def test_a_good_token_is_the_client_its_groups_make(idp: Keys, policy: Policy) -> None:
    verified = AccessTokens(fetcher_for=lambda _p: idp.fetch).verify(policy, idp.token())
    assert verified.client.id == "corp.bob" and verified.subject == "bob"
    assert verified.client.roles == {Role.EXECUTE}
    assert policy.client("corp.bob") == verified.client  # seen: lookups by id agree
    rsa_token = idp.token(idp.rsa, "RS256", "rsa-1")
    assert AccessTokens(fetcher_for=lambda _p: idp.fetch).verify(policy, rsa_token).subject == "bob"


def test_a_pinned_subject_is_its_file_client(idp: Keys, policy: Policy) -> None:
    verified = AccessTokens(fetcher_for=lambda _p: idp.fetch).verify(
        policy, idp.token(sub="svc-ci")
    )
    assert verified.client.id == "ci-bot" and verified.client.roles == {Role.REGISTER}


def _b64(data: dict[str, Any]) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def bad_tokens(idp: Keys) -> dict[str, str]:
    now = int(time.time())
    public_pem = idp.rsa.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    header = {"alg": "HS256", "kid": "rsa-1", "typ": "at+jwt"}
    claims = {"iss": ISSUER, "aud": AUDIENCE, "sub": "bob", "iat": now, "exp": now + 300}
    signing_input = f"{_b64(header)}.{_b64(claims)}"
    mac = hmac.new(public_pem, signing_input.encode(), hashlib.sha256).digest()
    hs256_with_public_key = (
        signing_input + "." + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
    )
    return {
        "alg none": f"{_b64({'alg': 'none', 'kid': 'ec-1'})}.{_b64(claims)}.",
        "HS256 signed with the public key": hs256_with_public_key,
        "wrong iss": idp.token(iss="https://evil.example.test"),
        "wrong aud": idp.token(aud="https://another-service.test"),
        "expired": idp.token(iat=now - 900, exp=now - 600),
        "not yet valid": idp.token(nbf=now + 600),
        "issued in the future": idp.token(iat=now + 600, exp=now + 900),
        "no exp": idp.token(exp=None),
        "no sub": idp.token(sub=None),
        "no aud": idp.token(aud=None),
        "lifetime above the cap": idp.token(exp=now + 10 * 86_400),
        "an ID token's typ": idp.token(header={"typ": "id_token+jwt"}),
        "signed by another key": idp.token(ec.generate_private_key(ec.SECP256R1())),
        "RSA key's kid on an ES256 token": idp.token(kid="rsa-1"),
        "a denied subject": idp.token(sub="fired-person"),
        "iat a string": idp.token(iat=str(now)),
        "exp a boolean": idp.token(exp=True),
        "an ID token (nonce)": idp.token(nonce="n-1"),
        "an ID token (at_hash)": idp.token(at_hash="abc"),
        "not a JWT": "eyJhbGciOiJFUzI1NiJ9.not-base64!.x",
        "huge": "eyJ" + "a" * 9000 + ".b.c",
    }


@pytest.mark.parametrize("case", list(bad_tokens(Keys())))
def test_every_bad_token_is_refused(idp: Keys, policy: Policy, case: str) -> None:
    token = bad_tokens(idp)[case]
    with pytest.raises(TokenRefused) as caught:
        AccessTokens(fetcher_for=lambda _p: idp.fetch).verify(policy, token)
    assert caught.value.answer in ("invalid access token", "access token expired")
    assert token not in caught.value.reason


def test_the_interceptor_answers_unauthenticated_and_permission_denied(
    idp: Keys, policy: Policy
) -> None:
    auth = Authenticator(policy, AccessTokens(fetcher_for=lambda _p: idp.fetch))
    bearer = lambda t: (("authorization", f"Bearer {t}"),)  # noqa: E731
    assert auth.identify(bearer(idp.token()), {}).id == "corp.bob"
    with pytest.raises(AuthError) as caught:
        auth.identify(bearer(idp.token(aud="https://x.test")), {})
    assert caught.value.code.name == "UNAUTHENTICATED"
    with pytest.raises(AuthError) as caught:
        auth.identify(bearer(idp.token(groups=["unmapped"])), {})
    assert caught.value.code.name == "PERMISSION_DENIED"
    assert "none of its groups is mapped" in caught.value.message
    assert auth.identify(bearer("admin-secret"), {}).id == "admin"  # static tokens still work


def test_forged_kids_cost_at_most_one_fetch_per_interval(idp: Keys, policy: Policy) -> None:
    now = [1000.0]
    provider = policy.identity_providers[0]
    keys = ProviderKeys(provider, idp.fetch, clock=lambda: now[0])
    assert keys.key_for("ec-1", "ES256") is not None
    first = len(idp.fetched)
    for n in range(1000):
        assert keys.key_for(f"forged-{n}", "ES256") is None
    assert len(idp.fetched) == first  # within the interval: no fetch at all
    now[0] += provider.min_refresh_interval_s
    for n in range(1000):
        keys.key_for(f"forged-again-{n}", "ES256")
    assert len(idp.fetched) == first + 1  # one JWKS fetch (the jwks_uri is kept)


def test_keys_stay_while_the_provider_is_down_and_none_means_closed(
    idp: Keys, policy: Policy
) -> None:
    now = [1000.0]
    provider = dataclasses.replace(policy.identity_providers[0], jwks_refresh_s=60)
    keys = ProviderKeys(provider, idp.fetch, clock=lambda: now[0])
    assert keys.key_for("ec-1", "ES256") is not None
    idp.down = True
    now[0] += 3600  # long past the refresh time: a refresh is tried and fails
    assert keys.key_for("ec-1", "ES256") is not None
    cold = ProviderKeys(provider, idp.fetch, clock=lambda: now[0])
    assert cold.key_for("ec-1", "ES256") is None


def test_a_rotated_key_is_picked_up_on_its_first_token(idp: Keys, policy: Policy) -> None:
    now = [1000.0]
    keys = ProviderKeys(policy.identity_providers[0], idp.fetch, clock=lambda: now[0])
    assert keys.key_for("ec-1", "ES256") is not None
    new = ec.generate_private_key(ec.SECP256R1())
    idp.jwks["keys"].insert(0, Keys.public_jwk(new, "ec-2"))
    now[0] += policy.identity_providers[0].min_refresh_interval_s
    assert keys.key_for("ec-2", "ES256") is not None


def test_a_jwks_with_private_or_symmetric_keys_keeps_only_public_ones(
    idp: Keys, policy: Policy
) -> None:
    private = {**ECAlgorithm.to_jwk(idp.ec, as_dict=True), "kid": "leaked"}
    idp.jwks["keys"] += [private, {"kty": "oct", "k": "c2VjcmV0", "kid": "hmac"}]
    keys = ProviderKeys(policy.identity_providers[0], idp.fetch)
    assert keys.key_for("leaked", "ES256") is None
    assert keys.key_for("hmac", "HS256") is None
    assert keys.key_for("ec-1", "ES256") is not None


def test_discovery_must_name_the_issuer_exactly(idp: Keys, policy: Policy) -> None:
    def lying(url: str) -> dict[str, Any]:
        if url.endswith("openid-configuration"):
            return {"issuer": "https://evil.test", "jwks_uri": ISSUER + "/jwks"}
        return idp.jwks

    keys = ProviderKeys(policy.identity_providers[0], lying)
    assert keys.key_for("ec-1", "ES256") is None


def test_refusals_are_logged_by_reason_never_with_the_token(
    idp: Keys, policy: Policy, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = AccessTokens(fetcher_for=lambda _p: idp.fetch)
    bad = idp.token(aud="https://x.test")
    with caplog.at_level("INFO"):
        for _ in range(50):
            with pytest.raises(TokenRefused):
                tokens.verify(policy, bad)
    lines = [r.getMessage() for r in caplog.records if "access token refused" in r.getMessage()]
    assert lines == ["access token refused: provider corp: audience not accepted"]
    assert bad not in caplog.text and bad.split(".")[2] not in caplog.text


def test_an_exchanged_token_names_its_actor_only_if_the_policy_does(
    idp: Keys, tmp_path: Path
) -> None:
    exchanged = idp.token(act={"sub": "toolreg-mcp"})
    refused = load(tmp_path)  # names no actor
    with pytest.raises(TokenRefused) as caught:
        AccessTokens(fetcher_for=lambda _p: idp.fetch).verify(refused, exchanged)
    assert "does not name" in caught.value.reason
    allowed = load(tmp_path, actors=["toolreg-mcp"])
    verified = AccessTokens(fetcher_for=lambda _p: idp.fetch).verify(allowed, exchanged)
    assert (verified.client.id, verified.actor) == ("corp.bob", "corp:toolreg-mcp")
    for bad_act in ({"sub": "someone-else"}, "toolreg-mcp", {"sub": 7}):
        with pytest.raises(TokenRefused):
            AccessTokens(fetcher_for=lambda _p: idp.fetch).verify(allowed, idp.token(act=bad_act))


def test_mixed_case_subjects_can_be_hashed_into_ids(tmp_path: Path) -> None:
    verbatim = load(tmp_path).identity_providers[0]
    assert verbatim.client_for("0oaAbC123", frozenset({"agents"})) is None
    hashed = load(tmp_path, subject_ids="sha256").identity_providers[0]
    one = hashed.client_for("0oaAbC123", frozenset({"agents"}))
    other = hashed.client_for("0oaabc123", frozenset({"agents"}))
    assert one is not None and other is not None and one.id != other.id
    assert one.id.startswith("corp.") and len(one.id) == len("corp.") + 24
    with pytest.raises(PolicyError, match="subject_ids"):
        load(tmp_path, subject_ids="lowercase")


def test_idp_groups_give_a_seen_approver_its_rule_groups_now(tmp_path: Path) -> None:
    groups = provider_yaml()["groups"] + [
        {"group": "sre-oncall", "roles": ["approve"], "approver_groups": ["sre"]}
    ]
    path = tmp_path / "policy.yaml"
    policy_doc = {
        "audience": "toolreg-test",
        "approvers": [{"id": "corp.alice", "public_key": KEY_A}],
        "approval_rules": [
            {"match": {"level": "dangerous"}, "approvals_required": 1, "groups": ["sre"]}
        ],
        "identity_providers": [provider_yaml(groups=groups)],
    }
    path.write_text(yaml.safe_dump(policy_doc))
    live = LivePolicy(lambda: load_policy(path))  # "sre" is known only through the mapping
    rule = live.current.rule_for(tool_name="t", categories=(), level=SafetyLevel.DANGEROUS)
    assert not live.current.eligible("corp.alice", rule)  # not seen: the file's groups only
    live.current.seen.saw("corp.alice", Sighting("corp", "alice", frozenset({"sre-oncall"})))
    assert live.current.eligible("corp.alice", rule)
    assert live.current.approver("corp.alice").groups == ("sre",)  # type: ignore[union-attr]
    assert rule.missing([live.current.approver("corp.alice")]) == 0  # type: ignore[list-item]
    # Taken away at the IdP (the next token's groups), or denied here: not eligible.
    live.current.seen.saw("corp.alice", Sighting("corp", "alice", frozenset({"agents"})))
    assert not live.current.eligible("corp.alice", rule)
    live.current.seen.saw("corp.alice", Sighting("corp", "alice", frozenset({"sre-oncall"})))
    policy_doc["identity_providers"] = [provider_yaml(groups=groups, denied_subjects=["alice"])]
    path.write_text(yaml.safe_dump(policy_doc))
    live.reload()
    assert not live.current.eligible("corp.alice", rule)
    # Without the mapping, the rule's group is nobody's: refused at load, naming it.
    policy_doc["identity_providers"] = [provider_yaml()]
    path.write_text(yaml.safe_dump(policy_doc))
    with pytest.raises(PolicyError, match="unknown group 'sre'"):
        load_policy(path)


def test_static_tokens_and_mtls_subjects_keep_working_beside_providers(
    idp: Keys, tmp_path: Path
) -> None:
    clients = [
        {"id": "admin", "token_sha256": sha("admin-secret"), "roles": ["admin"]},
        {"id": "svc", "mtls_subject": "CN=svc,O=Acme", "roles": ["execute"]},
    ]
    policy = load_policy(write(tmp_path, [provider_yaml()], clients))
    auth = Authenticator(policy, AccessTokens(fetcher_for=lambda _p: idp.fetch))
    assert auth.identify((("authorization", "Bearer admin-secret"),), {}).id == "admin"
    tls = {"transport_security_type": [b"ssl"], "x509_subject": [b"CN=svc,O=Acme"]}
    assert auth.identify((), tls).id == "svc"
    assert auth.identify((("authorization", f"Bearer {idp.token()}"),), tls).id == "corp.bob"
    assert idp.fetched  # only the JWT needed the provider's keys
    with pytest.raises(AuthError) as caught:  # a static-looking unknown token is never a JWT
        auth.identify((("authorization", "Bearer nobody-secret"),), {})
    assert caught.value.message == "unknown bearer token"


def test_a_verified_token_is_not_checked_again_but_who_it_is_is_decided_anew(
    idp: Keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = AccessTokens(fetcher_for=lambda _p: idp.fetch)
    checks: list[str] = []
    real = tokens._checked_claims
    monkeypatch.setattr(tokens, "_checked_claims", lambda *a: checks.append("x") or real(*a))
    policy = load(tmp_path)
    token = idp.token()
    first = tokens.verify(policy, token)
    assert tokens.verify(policy, token) == first and len(checks) == 1  # the signature once
    # A reload that denies the subject holds at once, cached or not.
    assert load(tmp_path, denied_subjects=["bob"]).identity_providers[0].denied_subjects
    with pytest.raises(TokenRefused, match="denied"):
        tokens.verify(load(tmp_path, denied_subjects=["bob"]), token)
    # Changed provider settings (another audience list): checked again, and refused.
    with pytest.raises(TokenRefused, match="audience"):
        tokens.verify(load(tmp_path, audiences=["https://elsewhere.test"]), token)
    # The key withdrawn at the provider: once its keys are refreshed (they are
    # due: jwks_refresh_s has passed), the token is nobody, cached or not.
    tokens.verify(policy, token)
    idp.jwks["keys"] = [k for k in idp.jwks["keys"] if k["kid"] != "ec-1"]
    keys = tokens.keys(policy.identity_providers[0])
    keys._fetched_at = keys._attempted_at = -1e9
    tokens.verify(policy, token)  # still the cached keys; the refresh starts behind it
    assert keys._background is not None
    keys._background.join(10)
    with pytest.raises(TokenRefused, match="no known key"):
        tokens.verify(policy, token)


def test_an_older_token_never_replaces_a_newer_ones_groups_and_they_end_with_it(
    idp: Keys, tmp_path: Path
) -> None:
    groups = provider_yaml()["groups"] + [
        {"group": "sre-oncall", "roles": ["approve"], "approver_groups": ["sre"]}
    ]
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({
        "audience": "toolreg-test",
        "approvers": [{"id": "corp.alice", "public_key": KEY_A}],
        "approval_rules": [{"match": {"level": "dangerous"}, "approvals_required": 1,
                            "groups": ["sre"]}],
        "identity_providers": [provider_yaml(groups=groups)],
    }))  # fmt: skip
    policy = load_policy(path)
    rule = policy.rule_for(tool_name="t", categories=(), level=SafetyLevel.DANGEROUS)
    tokens = AccessTokens(fetcher_for=lambda _p: idp.fetch)
    now = int(time.time())
    old = idp.token(sub="alice", groups=["sre-oncall"], iat=now - 600, exp=now + 600)
    new = idp.token(sub="alice", groups=["agents"], iat=now - 10, exp=now + 600)
    tokens.verify(policy, old)
    assert policy.eligible("corp.alice", rule)
    tokens.verify(policy, new)  # the IdP took her out of sre-oncall
    assert not policy.eligible("corp.alice", rule)
    tokens.verify(policy, old)  # her older token, still valid, does not put her back
    assert not policy.eligible("corp.alice", rule)
    # Groups shown by a token count only while it is valid.
    policy.seen.saw("corp.alice", Sighting("corp", "alice", frozenset({"sre-oncall"}),
                                           now, now - 1))  # fmt: skip
    assert not policy.eligible("corp.alice", rule)


def test_a_cached_token_whose_key_was_replaced_under_its_kid_is_checked_again(
    idp: Keys, tmp_path: Path
) -> None:
    policy = load(tmp_path)
    tokens = AccessTokens(fetcher_for=lambda _p: idp.fetch)
    token = idp.token()
    tokens.verify(policy, token)
    other = ec.generate_private_key(ec.SECP256R1())
    idp.jwks["keys"] = [Keys.public_jwk(other, "ec-1")]  # the same kid, another key
    keys = tokens.keys(policy.identity_providers[0])
    keys._fetched_at = keys._attempted_at = -1e9  # the keys are due for a refresh
    tokens.verify(policy, token)  # answered from the cache while the refresh runs
    assert keys._background is not None
    keys._background.join(10)
    with pytest.raises(TokenRefused, match="bad signature"):
        tokens.verify(policy, token)


def test_a_client_pinned_to_a_subject_is_the_approver_of_that_subject(tmp_path: Path) -> None:
    clients = [{"id": "alice-agent", "idp": {"provider": "corp", "subject": "alice"},
                "roles": ["execute"]}]  # fmt: skip
    policy = load_policy(write(tmp_path, [provider_yaml()], clients))
    assert policy.same_person("corp.alice", "alice-agent")
    assert not policy.same_person("corp.bob", "alice-agent")


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:1@evil.example/token", "http://evil.example/token",
     "https://user:pw@idp.example.test/token", "http://localhost.evil.example:80/token"],
)  # fmt: skip
def test_client_side_endpoints_are_parsed_not_prefix_matched(url: str) -> None:
    from registry_server.client.idp_tokens import check_endpoint

    with pytest.raises(ValueError):
        check_endpoint(url, "token_endpoint")
    check_endpoint("http://127.0.0.1:8080/token", "token_endpoint")
    check_endpoint("https://idp.example.test/token", "token_endpoint")
