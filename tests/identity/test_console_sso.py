"""The approval console's SSO sign-in against real parts: the test IdP
(oidc-provider, its own login page), a real `toolreg serve` that trusts it, a
real `toolreg console` that is its OAuth client (authorization code, PKCE,
state, nonce, the registry as the resource), and headless Chromium.

An approver clicks "Sign in with SSO", signs in on the provider's page, lands
back signed in as the client its groups make (testidp.alice), sees a pending
request and approves it with its key file; the registry takes the person's
own access token. Over plain HTTP (the browser played with httpx): forged,
replayed, missing and other browsers' states are refused, a person whose
groups grant no approve role is refused, a pinned subject is its policy
client, failures are throttled, and the console's log names every refusal
without a code, a state or a token. The ID token checks (nonce, audience,
key, subject) run against the provider's real published keys.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode, urljoin, urlsplit

import httpx
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from selenium.webdriver.common.by import By

from registry_server.api.auth.jwks import HttpFetcher
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.idp_tokens import TokenAnswer
from registry_server.client.registry_client import RegistryClient
from registry_server.console.sso import (
    OidcClient,
    PendingLogin,
    SsoRefused,
)
from registry_server.policy.loader import load_policy
from registry_server.signing.keys import generate_keypair
from tests.browser.conftest import (
    CALL_TIMEOUT_S,
    ConsoleProcess,
    Page,
    open_browsers,
    spawn_console,
    wait_for,
    write_tools,
)
from tests.browser.test_console_browser import csp_violations
from tests.factories import sha
from tests.identity.idp_world import RESOURCE, IdP, SigningKey, free_port

ROOT = Path(__file__).resolve().parents[2]
CONSOLE_CLIENT = "toolreg-console"  # the console's confidential client at the IdP
AGENT_TOKEN = "console-sso-agent-5f0c2b"
APPROVER_GROUP = "console-approvers"  # the IdP group the policy maps to the approve role
PERSONS = {  # login at the IdP -> its groups
    "alice": [APPROVER_GROUP],  # group-mapped: client and approver testidp.alice
    "dave": ["staff"],  # no mapped group: no approve role
    "carol-sso": [],  # pinned to the policy client carol (an approver by its own entry)
}


@dataclass
class World:
    idp: IdP
    server: ServerProcess
    console: ConsoleProcess
    keys: dict[str, Path]  # approver id -> its private key file
    policy: Path
    secret: str  # the console's client secret (must never show up)

    def agent(self) -> RegistryClient:
        return RegistryClient.connect(self.server.address, token=AGENT_TOKEN)

    def log(self, *lines: str) -> str:
        """The console's log once it holds every one of ``lines``: a thread reads
        its stderr, so a line it wrote reaches the test a moment later."""
        time.sleep(0.3)  # its latest lines a moment, for what must not be in them
        wait_for(
            f"{lines} in the console's log",
            lambda: all(line in "".join(self.console.log) for line in lines),
        )
        return "".join(self.console.log)


def write_policy(path: Path, idp: IdP, public: dict[str, str]) -> None:
    policy = {
        "audience": "toolreg-console-sso-test",
        "approvers": [
            {"id": "testidp.alice", "public_key": public["testidp.alice"], "groups": ["security"]},
            {"id": "carol", "public_key": public["carol"], "groups": ["security"]},
        ],
        "approval_rules": [{"match": {"tool": "deploy_note"}, "approvals_required": 1,
                            "groups": ["security"], "max_token_ttl_s": 600}],
        "clients": [
            {"id": "agent", "token_sha256": sha(AGENT_TOKEN), "roles": ["execute"],
             "max_safety_level": "dangerous"},
            {"id": "carol", "idp": {"provider": "testidp", "subject": "carol-sso"},
             "roles": ["approve"]},
        ],
        "identity_providers": [{
            "id": "testidp", "issuer": idp.issuer, "audiences": [RESOURCE],
            "algorithms": ["ES256", "RS256"], "ca_file": str(idp.ca_file),
            "groups": [{"group": APPROVER_GROUP, "roles": ["approve"]}],
        }],
    }  # fmt: skip
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


@pytest.fixture(scope="module")
def world(idp: IdP, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("console-sso")
    port = free_port()
    secret = idp.add_login_client(
        CONSOLE_CLIENT, [f"http://127.0.0.1:{port}/auth/callback"], public=False
    )
    for login, groups in PERSONS.items():
        idp.add_person(login, groups)
    keys: dict[str, Path] = {}
    public: dict[str, str] = {}
    for who in ("testidp.alice", "carol"):
        private, public[who] = generate_keypair()
        keys[who] = tmp / f"{who}.key"
        keys[who].write_bytes(private)
    policy = tmp / "policy.yaml"
    write_policy(policy, idp, public)
    secret_file = tmp / "console-secret"
    secret_file.write_text(secret + "\n")
    server = spawn_server(
        tmp / "data", "--tools", str(write_tools(tmp / "tools")), "--policy", str(policy),
        cwd=ROOT,
    )  # fmt: skip
    console = None
    try:
        console = spawn_console(
            server.address, "--policy", str(policy), "--sso-provider", "testidp",
            "--sso-client-id", CONSOLE_CLIENT, "--sso-client-secret-file", str(secret_file),
            listen=f"127.0.0.1:{port}",
        )  # fmt: skip
        yield World(idp, server, console, keys, policy, secret)
    finally:
        if console is not None:
            assert console.stop() == 0, "".join(console.log[-30:])
        server.stop()


# ------------------------------------------------------------------ HTTP


class Browser:
    """A browser played with httpx: the console's cookies in one jar, the
    provider's in another, redirects followed by hand so each hop is seen."""

    def __init__(self, world: World, local_address: str = "127.0.0.1") -> None:
        self.world = world
        self.console = httpx.Client(
            base_url=world.console.origin, timeout=30,
            transport=httpx.HTTPTransport(local_address=local_address),
        )  # fmt: skip
        self.provider = world.idp.http()

    def start(self) -> str:
        """GET /auth/login: the authorization URL it sends the browser to."""
        answer = self.console.get("/auth/login")
        assert answer.status_code == 303, answer.text
        return answer.headers["location"]

    def login_at_provider(self, authorization_url: str, login: str) -> str:
        """Through the provider's own login form: the callback URL it sends back."""
        answer = self.provider.get(authorization_url)
        assert answer.status_code == 303, answer.text
        interaction = answer.headers["location"]
        answer = self.provider.post(
            interaction, data={"prompt": "login", "login": login, "password": "any"}
        )
        while answer.status_code in (302, 303):
            target = urljoin(str(answer.url), answer.headers["location"])
            if target.startswith(self.world.console.origin):
                return target
            answer = self.provider.get(target)
        raise AssertionError(f"the provider did not send the browser back: {answer.text[:300]}")

    def callback(self, url: str) -> httpx.Response:
        return self.console.get(url.removeprefix(self.world.console.origin))

    def sign_in(self, login: str) -> tuple[httpx.Response, str]:
        callback_url = self.login_at_provider(self.start(), login)
        return self.callback(callback_url), callback_url

    def whoami(self) -> httpx.Response:
        return self.console.get("/api/session")

    def close(self) -> None:
        self.console.close()
        self.provider.close()


@pytest.fixture
def browser(world: World) -> Iterator[Browser]:
    b = Browser(world)
    yield b
    b.close()


def refused_with(answer: httpx.Response, key: str) -> None:
    assert answer.status_code == 303, answer.text
    assert answer.headers["location"] == f"/#sso-error={key}"
    assert "toolreg_console=" not in answer.headers.get("set-cookie", "")


def secrets_of(callback_url: str) -> list[str]:
    query = parse_qs(urlsplit(callback_url).query)
    return [query["code"][0], query["state"][0]]


def test_a_group_mapped_person_signs_in_and_its_state_is_good_once(
    world: World, browser: Browser
) -> None:
    answer, callback_url = browser.sign_in("alice")
    assert answer.status_code == 303 and answer.headers["location"] == "/", answer.headers
    cookies = answer.headers.get_list("set-cookie")
    assert any(c.startswith("toolreg_console=") and "SameSite=Strict" in c for c in cookies)
    assert any(c.startswith("toolreg_sso=;") and "Max-Age=0" in c for c in cookies)
    who = browser.whoami().json()
    assert (who["client"], who["approver"], who["sso"]) == ("testidp.alice", "testidp.alice", True)
    # The same callback again: its state was used.
    refused_with(browser.callback(callback_url), "state")
    log = world.log(
        "testidp.alice signed in to the console (SSO)", "SSO: unknown, used or expired state"
    )
    assert "testidp.alice signed in to the console (SSO)" in log
    assert "SSO: unknown, used or expired state" in log
    for value in [*secrets_of(callback_url), world.secret]:
        assert value not in log


def test_the_authorization_request_has_pkce_state_nonce_and_the_resource(
    browser: Browser,
) -> None:
    url = browser.start()
    query = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    assert query["code_challenge_method"] == "S256"
    assert len(query["code_challenge"]) == 43 and "code_verifier" not in query
    assert len(query["state"]) >= 43 and len(query["nonce"]) >= 43
    assert query["resource"] == RESOURCE
    assert query["scope"] == "openid groups" and query["client_id"] == CONSOLE_CLIENT
    sso_cookie = browser.console.cookies.get("toolreg_sso")
    assert sso_cookie and sso_cookie not in (query["state"], query["nonce"])


def test_forged_missing_and_other_browsers_states_are_refused(
    world: World, browser: Browser
) -> None:
    # The provider's real code, with a state the console never made.
    callback_url = browser.login_at_provider(browser.start(), "alice")
    code = parse_qs(urlsplit(callback_url).query)["code"][0]
    refused_with(browser.callback(f"/auth/callback?code={code}&state=forged"), "state")
    refused_with(browser.callback(f"/auth/callback?code={code}"), "state")
    # A login started in one browser and finished in another (login CSRF).
    other = Browser(world)
    try:
        refused_with(other.callback(callback_url), "state")
        assert other.whoami().status_code == 401
    finally:
        other.close()
    # ... and the state is gone for the browser that started it, too.
    refused_with(browser.callback(callback_url), "state")
    assert browser.whoami().status_code == 401
    log = world.log("SSO: no state in the callback", "SSO: state bound to another browser")
    assert "SSO: no state in the callback" in log
    assert "SSO: state bound to another browser" in log
    for value in [code, *secrets_of(callback_url), world.secret]:
        assert value not in log


def test_a_person_whose_groups_grant_no_approve_role_is_refused(
    world: World, browser: Browser
) -> None:
    answer, callback_url = browser.sign_in("dave")
    refused_with(answer, "not-approver")
    assert browser.whoami().status_code == 401
    log = world.log("SSO: not an approver (client testidp.dave)")
    assert "SSO: not an approver (client testidp.dave)" in log
    for value in secrets_of(callback_url):
        assert value not in log


def test_a_pinned_subject_signs_in_as_its_policy_client(browser: Browser) -> None:
    answer, _ = browser.sign_in("carol-sso")
    assert answer.headers["location"] == "/"
    who = browser.whoami().json()
    assert (who["client"], who["approver"]) == ("carol", "carol")


def test_the_provider_saying_no_is_refused(world: World, browser: Browser) -> None:
    url = browser.start()
    state = parse_qs(urlsplit(url).query)["state"][0]
    refused_with(browser.callback(f"/auth/callback?error=access_denied&state={state}"), "idp")
    denied = "SSO: the provider answered access_denied"
    assert denied in world.log(denied)


def test_failed_sso_sign_ins_are_throttled_and_logged_without_secrets(world: World) -> None:
    """From 127.0.0.2, so the other tests' source is not locked out."""
    flood = Browser(world, local_address="127.0.0.2")
    try:
        url = flood.login_at_provider(flood.start(), "alice")  # a real code, kept for later
        for n in range(10):
            refused_with(flood.callback(f"/auth/callback?code=guess{n}&state=guess{n}"), "state")
        answer = flood.callback(url)  # the right state and code: refused before they are read
        refused_with(answer, "throttled")
        assert int(answer.headers["retry-after"]) > 0
        refused_with(flood.console.get("/auth/login"), "throttled")
        assert flood.whoami().status_code == 401
    finally:
        flood.close()
    throttled = "sign-in refused from 127.0.0.2: SSO: throttled (source)"
    log = world.log(throttled)
    assert throttled in log
    for value in secrets_of(url):
        assert value not in log


# -------------------------------------------------- the ID token's checks


@pytest.fixture
def oidc(world: World) -> Iterator[OidcClient]:
    provider = load_policy(world.policy).identity_provider("testidp")
    assert provider is not None
    client = OidcClient(
        provider, client_id=CONSOLE_CLIENT, client_secret=world.secret,
        redirect_uri="http://127.0.0.1:1/auth/callback", scopes=("groups",), resource=RESOURCE,
        endpoint=HttpFetcher(provider),
    )  # fmt: skip
    yield client
    client.close()


def id_token(idp: IdP, key: SigningKey | None = None, **overrides: Any) -> str:
    now = int(time.time())
    claims = {"iss": idp.issuer, "aud": CONSOLE_CLIENT, "sub": "alice", "iat": now,
              "exp": now + 300, "nonce": "the-nonce", "groups": [APPROVER_GROUP]}  # fmt: skip
    claims.update(overrides)
    return (key or idp.keys[0]).sign({k: v for k, v in claims.items() if v is not None},
                                     typ="JWT")  # fmt: skip


def test_id_tokens_are_checked_against_the_providers_real_keys(
    world: World, oidc: OidcClient
) -> None:
    idp = world.idp
    login = PendingLogin(verifier="v" * 64, nonce="the-nonce", browser=b"", source="x", started=0)
    access = idp.forge(sub="alice")

    def tokens(token: str, access_token: str = access) -> TokenAnswer:
        return TokenAnswer(access_token, 300, None, token)

    claims = oidc.verify_id_token(tokens(id_token(idp)), login)
    assert claims["sub"] == "alice" and claims["groups"] == [APPROVER_GROUP]
    now = int(time.time())
    bad: dict[str, tuple[TokenAnswer, str]] = {
        "another nonce": (tokens(id_token(idp, nonce="not-the-nonce")), "nonce mismatch"),
        "no nonce": (tokens(id_token(idp, nonce=None)), "nonce mismatch"),
        "another audience": (tokens(id_token(idp, aud="someone-else")), "audience"),
        "the registry's audience": (tokens(id_token(idp, aud=RESOURCE)), "audience"),
        "several audiences, no azp": (
            tokens(id_token(idp, aud=[CONSOLE_CLIENT, "other"])), "azp"),
        "another issuer": (tokens(id_token(idp, iss="https://127.0.0.1:1")), "issuer"),
        "expired": (tokens(id_token(idp, iat=now - 900, exp=now - 600)), "expired"),
        "an unpublished key": (tokens(id_token(idp, SigningKey("ES256"))), "no known key"),
        "alg none": (tokens(_unsigned(id_token(idp))), "algorithm not allowed"),
        "another person's access token": (
            tokens(id_token(idp), idp.forge(sub="mallory")), "access token subject"),
        "no ID token": (TokenAnswer(access, 300), "no usable ID token"),
    }  # fmt: skip
    for case, (given, reason) in bad.items():
        with pytest.raises(SsoRefused) as refused:
            oidc.verify_id_token(given, login)
        assert reason in refused.value.reason, case
        assert refused.value.failure, case


def _unsigned(token: str) -> str:
    header = base64.urlsafe_b64encode(b'{"alg":"none","typ":"JWT"}').rstrip(b"=").decode()
    return f"{header}.{token.split('.')[1]}."


# --------------------------------------------------------------- browser


def _spki_pin(cert_pem: bytes) -> str:
    """Chromium's --ignore-certificate-errors-spki-list entry for the IdP's
    certificate (made for the run by the test CA): only that key is trusted."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    spki = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


@pytest.fixture
def browsers(tmp_path: Path, world: World) -> Iterator[Callable[[], Page]]:
    pin = _spki_pin((world.idp.workdir / "idp-cert.pem").read_bytes())
    yield from open_browsers(
        tmp_path, world.console, (f"--ignore-certificate-errors-spki-list={pin}",)
    )


def test_an_approver_signs_in_with_sso_and_approves_in_chromium(
    world: World, browsers: Callable[[], Page]
) -> None:
    with world.agent() as agent:
        result = agent.execute_tool("deploy_note", {"note": "sso"}, timeout=CALL_TIMEOUT_S)
        assert result.needs_approval and result.approval_request is not None
        request_id = result.approval_request.id
        page = browsers()
        page.driver.get(world.console.url)
        page.wait("the SSO button", lambda d: page.by_id("sso-sign-in").is_displayed())
        page.by_id("sso-sign-in").click()
        # The provider's own login page (oidc-provider's development interaction).
        page.wait("the provider's login form",
                  lambda d: d.find_elements(By.NAME, "login"))  # fmt: skip
        assert page.driver.current_url.startswith(world.idp.issuer)
        page.driver.find_element(By.NAME, "login").send_keys("alice")
        page.driver.find_element(By.NAME, "password").send_keys("any password")
        page.driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        page.wait("the console", lambda d: page.by_id("console").is_displayed())
        page.wait("a live feed", lambda d: page.by_id("status").text.startswith("Live"))
        assert page.by_id("who-client").text == "testidp.alice"
        assert page.by_id("who-approver").text == "testidp.alice"
        assert page.driver.current_url == world.console.url  # no code or state left in it
        page.card(request_id)
        page.screenshot("console-sso.png")
        page.choose_key(world.keys["testidp.alice"])
        page.approve(request_id)
        assert "Approved as testidp.alice" in page.outcome(request_id, expect="Approved")
        wait_for("the approval to land",
                 lambda: list(agent.approval_request(request_id).approved_by)
                 == ["testidp.alice"])  # fmt: skip
        done = agent.execute_tool(
            "deploy_note", {"note": "sso"}, approval_request_id=request_id,
            timeout=CALL_TIMEOUT_S,
        )  # fmt: skip
        assert done.success, done
        assert csp_violations(page) == []
    log = world.log("testidp.alice approved request")
    assert "testidp.alice approved request" in log
    assert world.secret not in log


def test_a_refused_sso_sign_in_is_shown_on_the_page(
    world: World, browsers: Callable[[], Page]
) -> None:
    page = browsers()
    page.driver.get(world.console.origin + f"/auth/callback?state={secrets.token_urlsafe(8)}")
    page.wait("the refusal", lambda d: "not started in this browser"
              in page.by_id("sign-in-error").text)  # fmt: skip
    assert page.by_id("sso").is_displayed()
    assert "#" not in page.driver.current_url
    assert csp_violations(page) == []


def test_an_authorization_request_with_another_nonce_is_refused_at_the_callback(
    world: World, browser: Browser
) -> None:
    """Someone between the console and the provider swaps the nonce in the
    authorization request: the provider then issues a real ID token, signed
    with its real key, carrying that other nonce; the console refuses it."""
    url = browser.start()
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    query["nonce"] = "swapped-" + query["nonce"][8:]
    tampered = parts._replace(query=urlencode(query)).geturl()
    callback_url = browser.login_at_provider(tampered, "alice")
    answer = browser.callback(callback_url)
    refused_with(answer, "token")
    assert browser.whoami().status_code == 401
    # (The refusal's own log line may be summed up: this module's earlier
    # refusals can use the minute's log budget. Nothing secret is in it either way.)
    log = world.log()
    for value in secrets_of(callback_url):
        assert value not in log
