"""`toolreg mcp --http` as an OAuth 2.1 resource server, end to end: the MCP
Python SDK's own OAuth client connects from nothing (401, RFC 9728 metadata,
authorization server discovery, PKCE, the provider's login page, a token for
the bridge's resource) through to a `tools/call` that runs in a real
container; the bridge exchanges the person's token for a registry token
(RFC 8693) and the registry's audit names the person and the bridge.

The person's browser is played with httpx: it follows the authorization URL,
posts oidc-provider's own login form and hands the redirect's code back to the
SDK, as a browser on the redirect URI would.
"""

from __future__ import annotations

import json
import re
import ssl
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urljoin, urlsplit

import anyio
import httpx
import httpx2
import pytest
import yaml
from mcp import ClientSession
from mcp.client.auth import OAuthClientProvider
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import (
    AuthorizationCodeResult,
    OAuthClientInformationFull,
    OAuthClientMetadata,
    OAuthToken,
)

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.cli.launcher import ServerProcess, spawn_server, spawn_until
from registry_server.client.registry_client import open_channel
from registry_server.domain.models import parse_definition
from registry_server.wire import convert
from tests import store_file
from tests.factories import sha
from tests.identity.idp_world import RESOURCE, IdP, free_port

ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "mcp-oauth-admin-secret"
BRIDGE_CLIENT = "toolreg-mcp"  # the bridge's own confidential client at the IdP
HOST_CLIENT = "mcp-host"  # the MCP host's public client (as a host would register it)
MCP_SCOPE = "mcp:tools"
SERVING = re.compile(r"serving MCP on (\S+)")
CALL_TIMEOUT_S = 120
LOG_WAIT_S = 30  # seconds for a line a process wrote to reach its log reader thread


@dataclass
class World:
    idp: IdP
    server: ServerProcess
    bridge: Any  # the bridge process
    bridge_log: list[str]
    resource_url: str
    redirect_uri: str
    data_dir: Path
    bridge_secret: str
    seen_secrets: list[str] = field(default_factory=list)  # codes and tokens the host got


@pytest.fixture(scope="module")
def world(idp: IdP, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("mcp-oauth")
    port = free_port()
    resource_url = f"http://127.0.0.1:{port}/mcp"
    redirect_uri = "http://127.0.0.1:1/callback"  # never served: the test reads the redirect
    idp.add_resource(resource_url, MCP_SCOPE)
    idp.add_login_client(HOST_CLIENT, [redirect_uri], public=True)
    secret = idp.add_exchanger(BRIDGE_CLIENT, resource_url, [RESOURCE])
    idp.add_person("alice", groups=["toolreg-agents"])
    idp.add_person("mallory", groups=["toolreg-visitors"])
    policy = tmp / "policy.yaml"
    policy.write_text(yaml.safe_dump({
        "audience": "toolreg-mcp-oauth-test",
        "clients": [{"id": "admin", "token_sha256": sha(ADMIN_TOKEN), "roles": ["admin", "register"]}],
        "identity_providers": [{
            "id": "testidp", "issuer": idp.issuer, "audiences": [RESOURCE],
            "algorithms": ["ES256", "RS256"], "ca_file": str(idp.ca_file),
            "actors": [BRIDGE_CLIENT],
            "groups": [{"group": "toolreg-agents", "roles": ["execute"]}],
        }],
    }, sort_keys=False))  # fmt: skip
    data = tmp / "data"
    server = spawn_server(data, "--policy", str(policy), "--log-level", "DEBUG", cwd=ROOT)
    tool = parse_definition({
        "name": "echo_back", "description": "echoes its input",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
        "sandbox": {"image": "toolreg/base", "command": ["cat"]},
    })  # fmt: skip
    stub = pb_grpc.ToolRegistryStub(open_channel(server.address, token=ADMIN_TOKEN))
    stub.RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool)), timeout=30)
    argv = [sys.executable, "-m", "registry_server.cli", "mcp",
            "--address", server.address, "--http", f"127.0.0.1:{port}",
            "--policy", str(policy), "--oauth-provider", "testidp",
            "--resource-url", resource_url, "--oauth-scope", MCP_SCOPE,
            "--oauth-client-id", BRIDGE_CLIENT, "--log-level", "DEBUG"]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "TOOLREG_OAUTH_CLIENT_SECRET": secret}
    proc, _url, log = spawn_until(argv, SERVING, what="toolreg mcp --http", cwd=ROOT, env=env)
    yield World(idp, server, proc, log, resource_url, redirect_uri, data, secret)
    proc.terminate()
    proc.wait(30)
    server.stop()


class Memory:
    """The SDK's TokenStorage, in memory, with the host's client registered
    beforehand (as an operator registers a host's client at the IdP)."""

    def __init__(self, redirect_uri: str) -> None:
        self.tokens: OAuthToken | None = None
        self.client = OAuthClientInformationFull(
            client_id=HOST_CLIENT, redirect_uris=[redirect_uri],  # type: ignore[list-item]
            token_endpoint_auth_method="none",
            grant_types=["authorization_code", "refresh_token"], response_types=["code"],
        )  # fmt: skip

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client = client_info


class Browser:
    """The person at the provider's login page (oidc-provider's own)."""

    def __init__(self, idp: IdP, login: str) -> None:
        self.http = httpx.Client(verify=ssl.create_default_context(cafile=str(idp.ca_file)))
        self.login = login
        self.seen: list[str] = []
        self.result: AuthorizationCodeResult | None = None

    def authorize(self, url: str) -> None:
        self.seen.append(url)
        answer = self.http.get(url)
        for _ in range(10):
            if answer.is_redirect:
                location = urljoin(str(answer.url), answer.headers["location"])
                if location.startswith("http://127.0.0.1:1/"):
                    query = parse_qs(urlsplit(location).query)
                    self.result = AuthorizationCodeResult(
                        code=query["code"][0], state=query.get("state", [None])[0],
                        iss=query.get("iss", [None])[0],
                    )  # fmt: skip
                    return
                answer = self.http.get(location)
                continue
            form = re.search(r'<form[^>]*action="([^"]+)"', answer.text)
            assert form is not None, answer.text[:500]
            hidden = re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', answer.text)
            fields = dict(hidden)
            if fields.get("prompt") == "login":
                fields |= {"login": self.login, "password": "any"}
            answer = self.http.post(urljoin(str(answer.url), form.group(1)), data=fields)
        raise AssertionError("no redirect back to the host")


def connect_and_call(world: World, login: str) -> tuple[Any, Browser, list[int]]:
    browser = Browser(world.idp, login)
    statuses: list[int] = []

    async def redirect(url: str) -> None:
        await anyio.to_thread.run_sync(browser.authorize, url)

    async def callback() -> AuthorizationCodeResult:
        assert browser.result is not None
        return browser.result

    async def record(response: httpx2.Response) -> None:
        if response.url.path == "/mcp":
            statuses.append(response.status_code)

    storage = Memory(world.redirect_uri)
    provider = OAuthClientProvider(
        server_url=world.resource_url,
        client_metadata=OAuthClientMetadata(
            redirect_uris=[world.redirect_uri],  # type: ignore[list-item]
            token_endpoint_auth_method="none",
            grant_types=["authorization_code", "refresh_token"], response_types=["code"],
        ),
        storage=storage,
        redirect_handler=redirect,
        callback_handler=callback,
    )  # fmt: skip

    async def run() -> Any:
        tls = ssl.create_default_context(cafile=str(world.idp.ca_file))
        async with (
            httpx2.AsyncClient(
                auth=provider, verify=tls, timeout=60, event_hooks={"response": [record]}
            ) as http,
            streamable_http_client(world.resource_url, http_client=http) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            tools = await session.list_tools()
            assert [t.name for t in tools.tools] == ["echo_back"]
            return await session.call_tool("echo_back", {"text": "hello from alice"})

    try:
        return anyio.run(run), browser, statuses
    finally:
        if browser.result is not None:
            world.seen_secrets.append(browser.result.code)
        if storage.tokens is not None:
            world.seen_secrets += [storage.tokens.access_token, storage.tokens.refresh_token or ""]


def test_the_sdks_oauth_client_connects_from_nothing_to_a_tool_call(world: World) -> None:
    # 401 with where to go: the metadata URL and the scope.
    bare = httpx.post(world.resource_url, json={}, timeout=10)
    assert bare.status_code == 401
    challenge = bare.headers["www-authenticate"]
    assert 'resource_metadata="http://127.0.0.1:' in challenge
    assert "/.well-known/oauth-protected-resource/mcp" in challenge
    assert f'scope="{MCP_SCOPE}"' in challenge
    metadata_url = re.search(r'resource_metadata="([^"]+)"', challenge).group(1)  # type: ignore[union-attr]
    metadata = httpx.get(metadata_url, timeout=10).json()
    assert metadata["resource"] == world.resource_url
    assert metadata["authorization_servers"] == [world.idp.issuer + "/"] or metadata[
        "authorization_servers"
    ] == [world.idp.issuer]

    exchanges_before = world.idp.requests_to("/token")
    result, browser, statuses = connect_and_call(world, "alice")
    assert not result.is_error, result
    assert json.loads(result.content[0].text) == {"text": "hello from alice"}
    assert statuses[0] == 401  # from nothing
    (url,) = browser.seen
    query = parse_qs(urlsplit(url).query)
    assert query["code_challenge_method"] == ["S256"]
    assert query["resource"] == [world.resource_url]
    # one code exchange by the host, one token exchange by the bridge
    assert world.idp.requests_to("/token") - exchanges_before == 2
    records = [json.loads(r) for _, k, r in store_file.audit_rows(world.data_dir)
               if k == "execution"]  # fmt: skip
    mine = [r for r in records if r["tool"] == "echo_back"]
    assert mine and mine[-1]["caller"] == "testidp.alice"
    assert mine[-1]["actor"] == f"testidp:{BRIDGE_CLIENT}"
    log = "".join(world.bridge_log)
    assert browser.result is not None and browser.result.code not in log


def test_a_token_for_another_resource_is_refused_at_the_bridge(world: World) -> None:
    if "agent-x" not in world.idp.clients:
        world.idp.add_client("agent-x", groups=["toolreg-agents"])
    registry_token = world.idp.client_credentials("agent-x")
    # A real token of the same IdP, for the registry (not the bridge): refused here.
    answer = httpx.post(
        world.resource_url, json={}, timeout=10,
        headers={"authorization": f"Bearer {registry_token}"},
    )  # fmt: skip
    assert answer.status_code == 401
    # And the bridge's own audience without the scope: 403 insufficient_scope.
    no_scope = world.idp.forge(aud=world.resource_url, scope="", sub="alice")
    answer = httpx.post(
        world.resource_url, json={}, timeout=10, headers={"authorization": f"Bearer {no_scope}"}
    )
    assert answer.status_code == 403
    assert 'error="insufficient_scope"' in answer.headers["www-authenticate"]


def test_a_person_the_policy_grants_nothing_gets_no_tools(world: World) -> None:
    # mallory signs in at the IdP (a real person there), but none of her groups
    # is mapped: the registry refuses the exchanged token's every call.
    with pytest.raises(BaseException) as caught:
        connect_and_call(world, "mallory")
    assert "testidp.mallory" in repr(caught.value) or "no role" in repr(caught.value), caught


def test_no_token_code_or_secret_reaches_a_log(world: World) -> None:
    """Both processes ran at DEBUG through every flow above (the metadata, the
    provider's discovery and JWKS, the token exchange, refused tokens)."""
    time.sleep(0.5)  # the logs are read as the processes write them
    bridge_log = "".join(world.bridge_log)
    server_log = "".join(world.server.log)
    assert "token exchange" in bridge_log or "OAuth tokens of identity provider" in bridge_log
    assert world.seen_secrets, "the flows above gave the host a code and tokens"
    for secret in [world.bridge_secret, *filter(None, world.seen_secrets)]:
        assert secret not in bridge_log and secret not in server_log
    for log in (bridge_log, server_log):
        assert "eyJ" not in log  # no JWT of any kind: access, exchanged, ID token
        assert "/token" not in log and "/jwks" not in log  # library URL lines stay out


def test_a_refused_token_exchange_is_a_clear_call_error(world: World) -> None:
    """A bridge whose client at the IdP lacks the RFC 8693 grant: the real
    provider refuses every exchange. The host's tools/call gets an error result
    naming the provider; the bridge logs which provider refused and why, with
    no traceback and no token."""
    port = free_port()
    resource_url = f"http://127.0.0.1:{port}/mcp"
    world.idp.add_resource(resource_url, MCP_SCOPE)
    secret = world.idp.add_client("no-exchange-grant")  # client credentials only
    policy = world.data_dir.parent / "policy.yaml"
    argv = [sys.executable, "-m", "registry_server.cli", "mcp",
            "--address", world.server.address, "--http", f"127.0.0.1:{port}",
            "--policy", str(policy), "--oauth-provider", "testidp",
            "--resource-url", resource_url, "--oauth-scope", MCP_SCOPE,
            "--oauth-client-id", "no-exchange-grant", "--log-level", "DEBUG"]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "TOOLREG_OAUTH_CLIENT_SECRET": secret}
    proc, _url, log = spawn_until(argv, SERVING, what="toolreg mcp --http", cwd=ROOT, env=env)
    host_token = world.idp.forge(
        aud=resource_url, scope=MCP_SCOPE, sub="alice", client_id=HOST_CLIENT,
        groups=["toolreg-agents"],
    )  # fmt: skip

    async def run() -> Any:
        headers = {"authorization": f"Bearer {host_token}"}
        async with (
            httpx2.AsyncClient(headers=headers, timeout=60) as http,
            streamable_http_client(resource_url, http_client=http) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            return await session.call_tool("echo_back", {"text": "never runs"})

    refused = "token exchange at identity provider testidp failed: token endpoint refused"
    try:
        result = anyio.run(run)
        time.sleep(0.5)  # its latest lines a moment, for what must not be in them
        # A thread reads its stderr: the refusal's line reaches `log` a moment later.
        deadline = time.monotonic() + LOG_WAIT_S
        while refused not in "".join(log) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)
    assert result.is_error
    text = result.content[0].text
    assert text.startswith("UNAUTHENTICATED: identity provider testidp refused the token exchange")
    assert "not made" in text
    bridge_log = "".join(log)
    assert refused in bridge_log, f"not in the bridge's log after {LOG_WAIT_S} s: {refused}"
    assert "Traceback" not in bridge_log
    assert host_token not in bridge_log and secret not in bridge_log and "eyJ" not in bridge_log
    audit = [json.loads(r) for _, k, r in store_file.audit_rows(world.data_dir)
             if k == "execution"]  # fmt: skip
    assert not any(r.get("arguments", {}) == {"text": "never runs"} for r in audit)
