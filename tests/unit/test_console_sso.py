"""The console's SSO bookkeeping without a provider (console/sso.py):
pending sign-ins (state single use and bound to its browser, expiry, caps),
the PKCE challenge, the settings' refusals, the client claims make, and the
access token kept fresh with the refresh token."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import pytest

from registry_server.client.idp_tokens import TokenAnswer, s256
from registry_server.console.settings import (
    SSO_SECRET_ENV,
    ConsoleSettings,
    SsoSettings,
    sso_could_sign_in,
)
from registry_server.console.sso import (
    EXCHANGE,
    STATE,
    UNAVAILABLE,
    PendingLogins,
    SsoBearer,
    SsoRefused,
    identity,
)
from registry_server.domain.errors import ConfigError
from registry_server.policy.clients import Client, Role
from registry_server.policy.identity import GroupGrant, IdentityProvider
from registry_server.policy.model import Approver, Policy
from registry_server.signing.keys import generate_keypair, public_key_from_text


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_state_is_good_once_and_only_in_the_browser_it_was_started_in() -> None:
    pending = PendingLogins(clock=Clock())
    started = pending.begin("10.0.0.1")
    assert started.state != started.browser and len(started.state) >= 43
    with pytest.raises(SsoRefused, match="another browser") as caught:
        pending.take(started.state, "some other cookie")
    assert caught.value.kind == STATE and caught.value.failure
    # Taken even by the wrong browser: the right one cannot use it after.
    with pytest.raises(SsoRefused, match="unknown, used or expired"):
        pending.take(started.state, started.browser)
    again = pending.begin("10.0.0.1")
    login = pending.take(again.state, again.browser)
    assert login is again.login and len(pending) == 0
    with pytest.raises(SsoRefused, match="unknown, used or expired"):
        pending.take(again.state, again.browser)  # replayed
    for state, browser in ((None, again.browser), ("", None)):
        with pytest.raises(SsoRefused, match="no state"):
            pending.take(state, browser)
    with pytest.raises(SsoRefused, match="unknown"):
        pending.take("forged", again.browser)


def test_pending_sign_ins_expire() -> None:
    clock = Clock()
    pending = PendingLogins(ttl_s=600, clock=clock)
    started = pending.begin("10.0.0.1")
    clock.now += 599
    kept = pending.begin("10.0.0.1")
    clock.now += 2
    with pytest.raises(SsoRefused, match="unknown, used or expired"):
        pending.take(started.state, started.browser)
    assert pending.take(kept.state, kept.browser) is kept.login


def test_pending_sign_ins_are_capped_per_source_and_overall() -> None:
    clock = Clock()
    pending = PendingLogins(max_pending=5, per_source=2, clock=clock)
    first = pending.begin("10.0.0.1")
    second = pending.begin("10.0.0.1")
    third = pending.begin("10.0.0.1")  # this source's oldest makes room
    assert len(pending) == 2
    with pytest.raises(SsoRefused):
        pending.take(first.state, first.browser)
    for started in (second, third):
        assert pending.take(started.state, started.browser) is started.login
    # Full: room is made from the source holding the most, never refused.
    mine = pending.begin("10.0.9.9")  # one sign-in of a person
    flood = [pending.begin(f"10.0.1.{n % 2}") for n in range(40)]  # two sources, many each
    assert len(pending) == 5
    assert pending.take(mine.state, mine.browser) is mine.login  # still there
    assert pending.take(flood[-1].state, flood[-1].browser) is flood[-1].login
    for n in range(5):  # five sources of one each: the oldest goes
        pending.begin(f"10.0.3.{n}")
    newest = pending.begin("10.0.2.1")
    assert len(pending) == 5 and pending.take(newest.state, newest.browser) is newest.login


def test_the_verifier_and_nonce_stay_here_and_the_challenge_is_s256() -> None:
    started = PendingLogins().begin("::1")
    verifier = started.login.verifier
    assert 43 <= len(verifier) <= 128
    expected = base64.urlsafe_b64encode(hashlib.sha256(verifier.encode()).digest())
    assert s256(verifier) == expected.rstrip(b"=").decode()
    # RFC 7636 appendix B's example
    assert s256("dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk") == (
        "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"
    )
    shown = repr(started.login)
    assert verifier not in shown and started.login.nonce not in shown


# ------------------------------------------------------------ settings

_, KEY = generate_keypair()
PROVIDER = IdentityProvider(
    id="corp", issuer="https://idp.example.com", audiences=("https://registry.example.com",),
    client_id_prefix="corp.",
    groups=(GroupGrant("approvers", frozenset({Role.APPROVE})), GroupGrant("staff")),
    denied_subjects=frozenset({"eve"}),
)  # fmt: skip
POLICY = Policy(
    audience="sso-unit",
    approvers=(Approver("corp.alice", public_key_from_text(KEY), ("security",)),
               Approver("carol", public_key_from_text(KEY), ("security",))),
    clients=(Client("carol", frozenset({Role.APPROVE}), idp_subject=("corp", "carol-sub")),),
    identity_providers=(PROVIDER,),
)  # fmt: skip


def sso(**changes: Any) -> SsoSettings | None:
    options: dict[str, Any] = {"provider_id": "corp", "client_id": "console"}
    return SsoSettings.from_options(POLICY, **{**options, **changes})


def test_sso_settings_are_checked_and_the_secret_never_comes_from_argv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SSO_SECRET_ENV, raising=False)
    assert SsoSettings.from_options(POLICY, provider_id=None, client_id=None) is None
    with pytest.raises(ConfigError, match=r"no such identity provider .*corp"):
        sso(provider_id="other")
    with pytest.raises(ConfigError, match="needs --sso-client-id"):
        sso(client_id=None)
    with pytest.raises(ConfigError, match="need --sso-provider"):
        sso(provider_id=None)
    with pytest.raises(ConfigError, match=f"set \\${SSO_SECRET_ENV}"):
        sso()
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    made = sso(secret_file=secret)
    assert made is not None and made.client_secret == "s3cret"
    assert made.resource == "https://registry.example.com" and made.scopes == ("groups",)
    assert "s3cret" not in repr(made)
    monkeypatch.setenv(SSO_SECRET_ENV, "from-env")
    with pytest.raises(ConfigError, match="not both"):
        sso(secret_file=secret)
    made = sso(scopes="groups offline_access")
    assert made is not None and made.client_secret == "from-env"
    assert made.scopes == ("groups", "offline_access")
    with pytest.raises(ConfigError, match="not an audience"):
        dataclasses.replace(made, resource="https://other.example.com").check()
    for uri in ("https://console.example.com/elsewhere", "http://console.example.com/auth/callback",
                "https://console.example.com/auth/callback?x=1"):  # fmt: skip
        with pytest.raises(ConfigError, match="--sso-redirect-uri"):
            dataclasses.replace(made, redirect_uri=uri).check()
    dataclasses.replace(made, redirect_uri="http://127.0.0.1:8780/auth/callback").check()
    with pytest.raises(ConfigError, match="No such file"):
        monkeypatch.delenv(SSO_SECRET_ENV)
        sso(secret_file=tmp_path / "missing")


def test_with_sso_a_policy_needs_no_token_holding_approver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SSO_SECRET_ENV, "x")
    settings = ConsoleSettings("127.0.0.1", 8780, POLICY)
    with pytest.raises(ConfigError, match="no client could sign in"):
        settings.check()
    dataclasses.replace(settings, sso=sso()).check()
    assert sso_could_sign_in(POLICY, PROVIDER)
    nobody = dataclasses.replace(PROVIDER, groups=(GroupGrant("staff"),))
    bare = dataclasses.replace(POLICY, clients=(), identity_providers=(nobody,))
    assert not sso_could_sign_in(bare, nobody)


def test_claims_make_the_client_as_the_registry_maps_an_access_token() -> None:
    alice = identity(POLICY, PROVIDER, {"sub": "alice", "groups": ["approvers", "x"]})
    assert alice.id == "corp.alice" and alice.may(Role.APPROVE)
    assert POLICY.approver_identity(alice) == "corp.alice"
    dave = identity(POLICY, PROVIDER, {"sub": "dave", "groups": ["staff"]})
    assert dave.id == "corp.dave" and not dave.roles
    pinned = identity(POLICY, PROVIDER, {"sub": "carol-sub", "groups": []})
    assert pinned.id == "carol"
    for claims, reason in (({"sub": "eve", "groups": ["approvers"]}, "denied"),
                           ({"groups": ["approvers"]}, "claim sub missing"),
                           ({"sub": "Not An Id!"}, "not a usable client id")):  # fmt: skip
        with pytest.raises(SsoRefused, match=reason):
            identity(POLICY, PROVIDER, claims)


# ------------------------------------------------------------ the bearer


class FakeOidc:
    def __init__(self, answers: list[TokenAnswer | SsoRefused]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    def refresh(self, refresh_token: str) -> TokenAnswer:
        self.asked.append(refresh_token)
        answer = self.answers.pop(0)
        if isinstance(answer, SsoRefused):
            raise answer
        return answer


def test_the_access_token_is_refreshed_before_it_expires_and_lost_once() -> None:
    clock = Clock()
    oidc = FakeOidc([TokenAnswer("at-2", 300, "rt-2", None), TokenAnswer("at-3", 300, None, None),
                     SsoRefused(UNAVAILABLE, "down", failure=False), TokenAnswer("at-4", 300, None, None),
                     SsoRefused(EXCHANGE, "token endpoint refused: HTTP 400 (invalid_grant)")])  # fmt: skip
    lost: list[bool] = []
    bearer = SsoBearer(oidc, TokenAnswer("at-1", 300, "rt-1", "id"),  # type: ignore[arg-type]
                       on_lost=lambda: lost.append(True), clock=clock)  # fmt: skip
    assert bearer() == "at-1" and oidc.asked == []
    clock.now += 269  # 31 s left: still good
    assert bearer() == "at-1"
    clock.now += 2  # within the margin
    assert bearer() == "at-2" and oidc.asked == ["rt-1"]
    clock.now += 280
    assert bearer() == "at-3" and oidc.asked[-1] == "rt-2"  # the rotated one
    clock.now += 280
    assert bearer() == "at-3" and not lost  # the provider is down: try again next call
    assert bearer() == "at-4" and oidc.asked[-1] == "rt-2"  # kept when none is rotated
    clock.now += 280
    assert bearer() == "at-4" and lost == [True]  # refused: the person must sign in again
    assert bearer() == "at-4" and lost == [True] and len(oidc.asked) == 5  # told once
    bearer.forget()
    assert bearer() == ""
