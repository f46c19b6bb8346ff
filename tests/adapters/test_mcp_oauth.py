"""The MCP bridge's OAuth parts as logic (mcp/oauth.py): the token
exchange's cache and errors, the people's connections, the 401's scope; the
identity provider and the real flow: tests/identity/test_mcp_oauth.py."""

from __future__ import annotations

import urllib.parse
from typing import Any

import httpx
import pytest

from registry_server.client.idp_tokens import TokenError
from registry_server.mcp.http_settings import OAuthSettings
from registry_server.mcp.oauth import (
    MAX_PEOPLE,
    People,
    TokenExchange,
)
from registry_server.policy.identity import IdentityProvider

PROVIDER = IdentityProvider("corp", "https://idp.example.test", ("https://registry.example.test",))
SETTINGS = OAuthSettings(
    provider=PROVIDER, resource_url="https://mcp.example.test/mcp", scopes=("mcp:tools",),
    client_id="toolreg-mcp", client_secret="bridge-secret",
    registry_resource="https://registry.example.test",
)  # fmt: skip


class FakeIdP:
    def __init__(self) -> None:
        self.forms: list[dict[str, list[str]]] = []
        self.answer: tuple[int, dict[str, Any]] | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        form = urllib.parse.parse_qs(request.content.decode())
        self.forms.append(form)
        if self.answer is not None:
            return httpx.Response(self.answer[0], json=self.answer[1])
        token = "registry-token-for-" + form["subject_token"][0]
        return httpx.Response(200, json={"access_token": token, "expires_in": 300})


@pytest.fixture
def idp() -> FakeIdP:
    return FakeIdP()


def exchange(idp: FakeIdP, now: list[float]) -> TokenExchange:
    made = TokenExchange(SETTINGS, clock=lambda: now[0])
    made._http = httpx.Client(transport=httpx.MockTransport(idp))
    made._endpoint = "https://idp.example.test/token"
    return made


def test_a_persons_token_is_exchanged_once_until_near_expiry(idp: FakeIdP) -> None:
    now = [1000.0]
    tokens = exchange(idp, now)
    assert tokens.registry_token("host-a") == "registry-token-for-host-a"
    assert tokens.registry_token("host-a") == "registry-token-for-host-a"
    assert len(idp.forms) == 1
    form = idp.forms[0]
    assert form["grant_type"] == ["urn:ietf:params:oauth:grant-type:token-exchange"]
    assert form["resource"] == ["https://registry.example.test"]
    assert form["subject_token_type"] == ["urn:ietf:params:oauth:token-type:access_token"]
    now[0] += 300 - 29  # within the margin of its expiry: exchanged again
    tokens.registry_token("host-a")
    assert len(idp.forms) == 2
    tokens.registry_token("host-b")  # another host token, another exchange
    assert len(idp.forms) == 3


def test_a_refused_exchange_names_the_status_never_a_token(idp: FakeIdP) -> None:
    idp.answer = (400, {"error": "invalid_grant", "error_description": "host-a is bad"})
    with pytest.raises(TokenError) as caught:
        exchange(idp, [0.0]).registry_token("host-a")
    assert str(caught.value) == "token endpoint refused: HTTP 400 (invalid_grant)"
    idp.answer = (200, {"token_type": "Bearer"})
    with pytest.raises(TokenError, match="no usable access_token"):
        exchange(idp, [0.0]).registry_token("host-a")


class FakeClient:
    def __init__(self, token: Any) -> None:
        self.token = token
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_people_get_one_connection_each_asking_for_their_latest_token(idp: FakeIdP) -> None:
    made: list[FakeClient] = []

    def connect(token: Any) -> Any:
        made.append(FakeClient(token))
        return made[-1]

    people = People(exchange(idp, [0.0]), connect)
    alice = people.client_for("corp.alice", "host-a1")
    assert people.client_for("corp.alice", "host-a2") is alice  # one connection per person
    assert alice.token() == "registry-token-for-host-a2"  # the latest host token is exchanged
    for n in range(MAX_PEOPLE):
        people.client_for(f"corp.p{n}", f"host-{n}")
    assert alice.closed  # the least recently used went first
    assert len(made) == MAX_PEOPLE + 1
