"""A person's stored sign-in (`toolreg login`): the token store's files and
modes, the refresh of its access token against a token endpoint on loopback
(a real HTTP server, the refresh-token grant's answers scripted), the PKCE
request and its callback's checks, and how CLI verbs pick the stored sign-in
up or end with one line when its refresh fails."""

from __future__ import annotations

import json
import re
import stat
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import httpx
import pytest
from typer.testing import CliRunner

from registry_server.cli import app
from registry_server.cli.idp_login import (
    CallbackListener,
    Discovery,
    LoginError,
    Request,
    signed_in_as,
)
from registry_server.client.idp_tokens import StoredLoginTokens, TokenError
from registry_server.client.token_store import (
    StoredLogin,
    StoreError,
    TokenStore,
    config_dir,
)

ADDRESS = "registry.example:50051"
NOWHERE = "127.0.0.1:1"  # no server: a verb that got its token fails to connect


class TokenEndpoint:
    """A token endpoint on loopback: records each form, answers the next
    scripted (status, body)."""

    def __init__(self) -> None:
        self.forms: list[dict[str, str]] = []
        self.answers: list[tuple[int, dict[str, Any]]] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's name
                length = int(self.headers["Content-Length"])
                form = parse_qs(self.rfile.read(length).decode())
                endpoint.forms.append({k: v[0] for k, v in form.items()})
                status, body = endpoint.answers.pop(0)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/token"
        threading.Thread(target=self.server.serve_forever, args=(0.01,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint() -> Iterator[TokenEndpoint]:
    e = TokenEndpoint()
    yield e
    e.close()


@pytest.fixture
def store(tmp_path: Path) -> TokenStore:
    return TokenStore(tmp_path / "config" / "toolreg" / "logins")


def a_login(token_endpoint: str = "https://idp.example/token", **changes: Any) -> StoredLogin:
    values: dict[str, Any] = {
        "address": ADDRESS, "issuer": "https://idp.example", "client_id": "toolreg-cli",
        "resource": "https://registry.example", "token_endpoint": token_endpoint,
        "access_token": "access-1", "expires_at": time.time() + 300,
        "refresh_token": "refresh-1",
    }  # fmt: skip
    values.update(changes)
    return StoredLogin(**values)


# -- the store ----------------------------------------------------------------


def test_config_dir_follows_xdg_config_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert config_dir() == tmp_path / "toolreg"
    monkeypatch.setenv("XDG_CONFIG_HOME", "relative/ignored")  # the spec: absolute only
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert config_dir() == tmp_path / "home" / ".config" / "toolreg"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert TokenStore().directory == tmp_path / "home" / ".config" / "toolreg" / "logins"


def test_a_saved_sign_in_is_0600_in_0700_directories_and_reads_back(store: TokenStore) -> None:
    login = a_login()
    path = store.save(login)
    assert path == store.path_for(ADDRESS)
    assert path.name == "registry.example%3A50051.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700
    assert stat.S_IMODE(store.directory.parent.stat().st_mode) == 0o700
    assert store.load(ADDRESS) == login
    assert [p.name for p in store.directory.iterdir()] == [path.name]  # no temporary left
    assert "access-1" not in repr(login) and "refresh-1" not in repr(login)
    store.save(a_login(access_token="access-2"))  # replaced whole
    loaded = store.load(ADDRESS)
    assert loaded is not None and loaded.access_token == "access-2"
    assert store.delete(ADDRESS) and not store.delete(ADDRESS)
    assert store.load(ADDRESS) is None


def test_a_too_open_store_directory_is_closed_again(store: TokenStore) -> None:
    store.directory.mkdir(parents=True)
    store.directory.chmod(0o755)
    store.save(a_login())
    assert stat.S_IMODE(store.directory.stat().st_mode) == 0o700


@pytest.mark.parametrize(
    "text",
    ["not json", "[]", json.dumps({"address": ADDRESS}),
     json.dumps({**json.loads(a_login().to_json()), "expires_at": "soon"}),
     json.dumps({**json.loads(a_login().to_json()), "address": "other:1"})],
)  # fmt: skip
def test_a_file_that_is_no_sign_in_of_the_address_is_refused(store: TokenStore, text: str) -> None:
    store.save(a_login())
    store.path_for(ADDRESS).write_text(text.replace("access-1", "access-secret"))
    with pytest.raises(StoreError) as caught:
        store.load(ADDRESS)
    assert "access-secret" not in str(caught.value)


# -- refreshing ---------------------------------------------------------------


def test_a_fresh_token_is_used_as_stored(store: TokenStore, endpoint: TokenEndpoint) -> None:
    store.save(a_login(endpoint.url))
    tokens = StoredLoginTokens(store, ADDRESS)
    assert [tokens(), tokens()] == ["access-1", "access-1"]
    assert endpoint.forms == [] and tokens.refreshes == 0


def test_a_token_near_expiry_is_refreshed_once_and_the_rotated_one_written_back(
    store: TokenStore, endpoint: TokenEndpoint
) -> None:
    store.save(a_login(endpoint.url, expires_at=time.time() + 10))  # inside the margin
    endpoint.answers.append(
        (200, {"access_token": "access-2", "refresh_token": "refresh-2", "expires_in": 300})
    )
    tokens = StoredLoginTokens(store, ADDRESS)
    assert [tokens(), tokens()] == ["access-2", "access-2"]
    assert endpoint.forms == [{
        "grant_type": "refresh_token", "refresh_token": "refresh-1",
        "client_id": "toolreg-cli", "resource": "https://registry.example",
    }]  # fmt: skip
    saved = store.load(ADDRESS)
    assert saved is not None
    assert (saved.access_token, saved.refresh_token) == ("access-2", "refresh-2")
    assert saved.expires_at == pytest.approx(time.time() + 300, abs=5)
    assert stat.S_IMODE(store.path_for(ADDRESS).stat().st_mode) == 0o600


def test_an_answer_without_a_refresh_token_keeps_the_old_one(
    store: TokenStore, endpoint: TokenEndpoint
) -> None:
    store.save(a_login(endpoint.url, expires_at=0))
    endpoint.answers.append((200, {"access_token": "access-2", "expires_in": 300}))
    assert StoredLoginTokens(store, ADDRESS)() == "access-2"
    saved = store.load(ADDRESS)
    assert saved is not None and saved.refresh_token == "refresh-1"


def test_a_refresh_another_process_made_is_used_not_repeated(
    store: TokenStore, endpoint: TokenEndpoint
) -> None:
    clock = [time.time()]
    store.save(a_login(endpoint.url, expires_at=clock[0] + 100))
    tokens = StoredLoginTokens(store, ADDRESS, clock=lambda: clock[0])
    assert tokens() == "access-1"
    # Another command refreshed it (and spent refresh-1) meanwhile.
    store.save(a_login(endpoint.url, access_token="access-9", expires_at=clock[0] + 600,
                       refresh_token="refresh-9"))  # fmt: skip
    clock[0] += 90  # this process's copy is due now
    assert tokens() == "access-9"
    assert endpoint.forms == []


def test_a_refused_refresh_names_the_error_code_only(
    store: TokenStore, endpoint: TokenEndpoint
) -> None:
    store.save(a_login(endpoint.url, expires_at=0))
    endpoint.answers.append(
        (400, {"error": "invalid_grant", "error_description": "refresh-1 was used already"})
    )
    with pytest.raises(TokenError) as caught:
        StoredLoginTokens(store, ADDRESS)()
    assert str(caught.value) == "token endpoint refused: HTTP 400 (invalid_grant)"
    saved = store.load(ADDRESS)
    assert saved is not None and saved.access_token == "access-1"  # left as it was


def test_an_expired_token_without_a_refresh_token_or_a_sign_in_is_an_error(
    store: TokenStore,
) -> None:
    with pytest.raises(TokenError, match="no sign-in is stored"):
        StoredLoginTokens(store, ADDRESS)()
    store.save(a_login(expires_at=0, refresh_token=None))
    with pytest.raises(TokenError, match="no refresh token"):
        StoredLoginTokens(store, ADDRESS)()
    store.save(a_login("http://idp.example/token", expires_at=0))  # not https, not loopback
    with pytest.raises(TokenError, match="https"):
        StoredLoginTokens(store, ADDRESS)()


# -- the sign-in request and its callback --------------------------------------

PROVIDER = Discovery(
    issuer="https://idp.example", authorization_endpoint="https://idp.example/auth",
    token_endpoint="https://idp.example/token", iss_parameter=True,
)  # fmt: skip


def test_the_authorization_request_asks_for_s256_pkce_and_the_resource() -> None:
    # RFC 7636, appendix B
    request = Request(state="st", verifier="dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk")
    assert request.challenge == "E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM"
    url = httpx.URL(request.url(PROVIDER, "cli", "http://127.0.0.1:5/callback",
                                scope="openid offline_access", resource="https://reg"))  # fmt: skip
    assert dict(url.params) == {
        "response_type": "code", "client_id": "cli", "redirect_uri": "http://127.0.0.1:5/callback",
        "scope": "openid offline_access", "state": "st", "code_challenge": request.challenge,
        "code_challenge_method": "S256", "resource": "https://reg",
    }  # fmt: skip
    fresh = Request.new(), Request.new()
    assert fresh[0].state != fresh[1].state and len(fresh[0].verifier) >= 43


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("code=c&state=other&iss=https%3A%2F%2Fidp.example", "state is not this sign-in's"),
        ("code=c&iss=https%3A%2F%2Fidp.example", "state is not this sign-in's"),
        ("code=c&state=st&iss=https%3A%2F%2Fevil.example", "another issuer"),
        ("code=c&state=st", "another issuer"),  # the provider said it sends iss
        ("error=access_denied&state=st&iss=https%3A%2F%2Fidp.example", "(access_denied)"),
        ("state=st&iss=https%3A%2F%2Fidp.example", "no authorization code"),
    ],
)
def test_a_callback_is_refused_unless_it_is_this_sign_ins(query: str, message: str) -> None:
    with pytest.raises(LoginError, match=re.escape(message)):
        Request(state="st", verifier="v" * 43).code_from(query, PROVIDER)


def test_a_callback_of_this_sign_in_gives_its_code() -> None:
    query = "code=the-code&state=st&iss=https%3A%2F%2Fidp.example"
    assert Request(state="st", verifier="v" * 43).code_from(query, PROVIDER) == "the-code"


def test_the_listener_ignores_other_paths_and_answers_the_callback_once() -> None:
    listener = CallbackListener()
    request = Request(state="st", verifier="v" * 43)
    answers: list[httpx.Response] = []

    def browser() -> None:
        with httpx.Client(timeout=5) as http:
            answers.append(http.get(f"http://127.0.0.1:{listener.port}/favicon.ico"))
            answers.append(http.get(f"{listener.redirect_uri}?code=c&state=wrong"))

    thread = threading.Thread(target=browser)
    thread.start()
    try:
        with pytest.raises(LoginError, match="state"):
            listener.wait(5, lambda q: request.code_from(q, PROVIDER))
    finally:
        listener.close()
    thread.join(5)
    assert [a.status_code for a in answers] == [404, 400]
    assert answers[1].headers["cache-control"] == "no-store"
    assert "toolreg login again" in answers[1].text


def test_the_listener_gives_up_after_its_timeout() -> None:
    listener = CallbackListener()
    try:
        started = time.monotonic()
        with pytest.raises(LoginError, match=r"no sign-in came back in 0\.05 s"):
            listener.wait(0.05, lambda q: "never")
        assert time.monotonic() - started < 2
    finally:
        listener.close()


def test_the_name_shown_comes_from_the_id_token() -> None:
    def id_token(claims: dict[str, Any]) -> str:
        import base64

        body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
        return f"e30.{body}.sig"

    assert signed_in_as(id_token({"sub": "s1", "preferred_username": "alice"})) == "alice"
    assert signed_in_as(id_token({"sub": "s1"})) == "s1"
    assert signed_in_as(id_token({"sub": "bad\x1b[0m"})) is None
    assert signed_in_as("not a jwt") is None and signed_in_as(None) is None


# -- the CLI --------------------------------------------------------------------


def cli(tmp_path: Path, *args: str, token: str | None = None) -> Any:
    env = {"XDG_CONFIG_HOME": str(tmp_path / "config"), "TOOLREG_TOKEN": token,
           "TOOLREG_ADDRESS": None}  # fmt: skip
    return CliRunner().invoke(app, list(args), env=env)


def test_a_verb_whose_refresh_fails_says_to_sign_in_again_in_one_line(
    tmp_path: Path, endpoint: TokenEndpoint
) -> None:
    store = TokenStore(tmp_path / "config" / "toolreg" / "logins")
    store.save(a_login(endpoint.url, address=NOWHERE, expires_at=0))
    endpoint.answers.append((400, {"error": "invalid_grant"}))
    result = cli(tmp_path, "tools", "list", "--address", NOWHERE)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines == [
        f"toolreg: the sign-in for {NOWHERE} cannot be used (token endpoint refused:"
        " HTTP 400 (invalid_grant)); run toolreg login again"
    ]
    assert "refresh-1" not in result.output and "access-1" not in result.output


def test_a_verb_uses_the_stored_sign_in_unless_a_token_is_given(
    tmp_path: Path, endpoint: TokenEndpoint
) -> None:
    store = TokenStore(tmp_path / "config" / "toolreg" / "logins")
    store.save(a_login(endpoint.url, address=NOWHERE, expires_at=0))
    endpoint.answers.append((200, {"access_token": "access-2", "expires_in": 300}))
    result = cli(tmp_path, "tools", "list", "--address", NOWHERE)
    assert "cannot reach the toolreg server" in result.output  # the token was there
    assert len(endpoint.forms) == 1
    store.save(a_login(endpoint.url, address=NOWHERE, expires_at=0))
    result = cli(tmp_path, "tools", "list", "--address", NOWHERE, token="static")
    assert "cannot reach the toolreg server" in result.output
    assert len(endpoint.forms) == 1  # --token/TOOLREG_TOKEN: the stored sign-in is not used


def test_logout_forgets_the_sign_in(tmp_path: Path) -> None:
    store = TokenStore(tmp_path / "config" / "toolreg" / "logins")
    store.save(a_login(address=NOWHERE))
    result = cli(tmp_path, "logout", "--address", NOWHERE)
    assert result.exit_code == 0 and result.output == f"signed out of {NOWHERE}\n"
    assert store.load(NOWHERE) is None
    result = cli(tmp_path, "logout", "--address", NOWHERE)
    assert result.output == f"not signed in to {NOWHERE}\n"


def test_login_without_an_issuer_says_which_option_is_needed(tmp_path: Path) -> None:
    result = cli(tmp_path, "login", "--address", NOWHERE, "--client-id", "c", "--resource", "r")
    assert result.exit_code == 2
    assert (
        result.output == f"toolreg: --issuer is needed (the first sign-in to {NOWHERE} names it)\n"
    )
