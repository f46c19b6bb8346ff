"""A person signs in with `toolreg login`, and clients use the identity
provider's tokens, end to end: the real OpenID Provider (oidc-provider, over
TLS with the run's CA), a real `toolreg serve` that trusts it, the CLI as a
subprocess. The test plays the person's browser with httpx: it opens the URL
the CLI printed, signs in on the provider's login page and follows the
redirect to the CLI's loopback callback.

Also here: the TypeScript client's ``clientCredentials`` provider against the
same provider and server (clients/typescript/test/idp/, run alone with node).
"""

from __future__ import annotations

import html
import json
import os
import re
import ssl
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urljoin, urlsplit

import httpx
import pytest
import yaml

from registry_server._proto.toolregistry.v1 import registry_pb2 as pb
from registry_server._proto.toolregistry.v1 import registry_pb2_grpc as pb_grpc
from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import open_channel
from registry_server.domain.models import parse_definition
from registry_server.wire import convert
from tests.factories import sha
from tests.identity.idp_world import RESOURCE, SCOPE, IdP
from tests.integration.test_typescript_client import PACKAGE, check_built

ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "login-admin-secret"
CLI_CLIENT = "toolreg-cli"
AGENT_CLIENT = "ts-cc-agent"
PERSON = "alice"
TOOL = "login_echo"
CLI_TIMEOUT_S = 60  # seconds for one CLI command
NODE_TIMEOUT_S = 60  # seconds for the TypeScript test


@dataclass
class World:
    idp: IdP
    server: ServerProcess
    config_home: Path  # the person's $XDG_CONFIG_HOME

    @property
    def address(self) -> str:
        return self.server.address

    def token_file(self) -> Path:
        return self.config_home / "toolreg" / "logins" / f"{self.address.replace(':', '%3A')}.json"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLREG_")}
        env["XDG_CONFIG_HOME"] = str(self.config_home)
        return env

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "registry_server.cli", *args],
            cwd=ROOT, env=self.env(), capture_output=True, text=True, timeout=CLI_TIMEOUT_S,
        )  # fmt: skip

    def start_login(self, *extra: str) -> tuple[subprocess.Popen[str], str]:
        """`toolreg login --no-browser` running, and the URL it printed."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "registry_server.cli", "login", "--no-browser",
             "--address", self.address, "--issuer", self.idp.issuer, "--client-id", CLI_CLIENT,
             "--resource", RESOURCE, "--scope", SCOPE, "--ca-file", str(self.idp.ca_file),
             "--timeout", "60", *extra],
            cwd=ROOT, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("  https://"):
                return proc, line.strip()
        proc.wait(10)
        pytest.fail(f"toolreg login printed no URL (exit {proc.returncode}):\n{''.join(seen)}")

    def stored(self) -> dict[str, Any]:
        return dict(json.loads(self.token_file().read_text()))

    def store(self, data: dict[str, Any]) -> None:
        path = self.token_file()
        path.write_text(json.dumps(data))
        path.chmod(0o600)


@pytest.fixture(scope="module")
def world(idp: IdP, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    if CLI_CLIENT not in idp.clients:
        idp.add_login_client(CLI_CLIENT, ["http://127.0.0.1/callback"], public=True, native=True)
    idp.add_person(PERSON, groups=["toolreg-people"])
    if AGENT_CLIENT not in idp.clients:
        idp.add_client(AGENT_CLIENT, groups=["toolreg-agents"])
    tmp = tmp_path_factory.mktemp("login")
    policy_file = tmp / "policy.yaml"
    policy = {
        "audience": "toolreg-login-test",
        "clients": [
            {"id": "admin", "token_sha256": sha(ADMIN_TOKEN), "roles": ["admin", "register"]},
        ],
        "identity_providers": [{
            "id": "testidp", "issuer": idp.issuer, "audiences": [RESOURCE],
            "algorithms": ["ES256", "RS256"], "ca_file": str(idp.ca_file),
            "client_claim": "sub", "groups_claim": "groups",
            "groups": [
                {"group": "toolreg-people", "roles": ["execute"], "max_safety_level": "safe"},
                {"group": "toolreg-agents", "roles": ["execute"], "max_safety_level": "safe"},
            ],
        }],
    }  # fmt: skip
    policy_file.write_text(yaml.safe_dump(policy, sort_keys=False))
    server = spawn_server(tmp / "data", "--policy", str(policy_file), cwd=ROOT)
    try:
        tool = parse_definition({
            "name": TOOL, "description": "echoes its input", "parameters": {"type": "object"},
            "safety_level": "safe", "sandbox": {"image": "toolreg/base", "command": ["cat"]},
        })  # fmt: skip
        stub = pb_grpc.ToolRegistryStub(open_channel(server.address, token=ADMIN_TOKEN))
        stub.RegisterTool(pb.RegisterToolRequest(tool=convert.tool_to_pb(tool)), timeout=20)
        yield World(idp, server, tmp / "config")
    finally:
        server.stop()


def play_browser(idp: IdP, url: str, login: str) -> httpx.Response:
    """What the person's browser does: open the URL, sign in on the provider's
    page, follow the redirects; the loopback callback's answer."""
    tls = ssl.create_default_context(cafile=str(idp.ca_file))
    with httpx.Client(verify=tls, timeout=10, follow_redirects=False) as browser:
        answer = browser.get(url)
        for _ in range(12):
            if answer.is_redirect:
                location = urljoin(str(answer.url), answer.headers["location"])
                if location.startswith("http://127.0.0.1:"):
                    return httpx.get(location, timeout=10)  # the CLI's listener
                answer = browser.get(location)
                continue
            form = re.search(r'<form[^>]*action="([^"]+)"', answer.text)
            prompt = re.search(r'name="prompt" value="([a-z]+)"', answer.text)
            assert form and prompt, f"no form: HTTP {answer.status_code} {answer.text[:500]}"
            fields = {"prompt": prompt.group(1)}  # "login", then "consent" (offline_access)
            if fields["prompt"] == "login":
                fields |= {"login": login, "password": "any password"}
            answer = browser.post(
                urljoin(str(answer.url), html.unescape(form.group(1))), data=fields
            )
    pytest.fail("the provider never redirected to the callback")


def secrets_of(data: dict[str, Any]) -> list[str]:
    return [data["access_token"], data["refresh_token"]]


def test_a_person_signs_in_and_the_cli_uses_refreshes_and_forgets_the_sign_in(
    world: World,
) -> None:
    before = world.cli("tools", "list", "--address", world.address)
    assert before.returncode == 1 and "UNAUTHENTICATED" in before.stderr  # no sign-in yet

    proc, url = world.start_login()
    query = parse_qs(urlsplit(url).query)
    assert query["code_challenge_method"] == ["S256"] and query["resource"] == [RESOURCE]
    assert set(query["scope"][0].split()) == {"openid", "offline_access", SCOPE}
    redirect = urlsplit(query["redirect_uri"][0])
    assert (redirect.scheme, redirect.hostname, redirect.path) == ("http", "127.0.0.1", "/callback")
    assert redirect.port and redirect.port != 80  # an ephemeral port; the provider allows any
    callback = play_browser(world.idp, url, PERSON)
    out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 0, err
    assert callback.status_code == 200 and "Signed in" in callback.text
    assert out == f"signed in to {world.address} as {PERSON} (kept in {world.token_file()})\n"

    path = world.token_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE((world.config_home / "toolreg").stat().st_mode) == 0o700
    first = world.stored()
    assert first["issuer"] == world.idp.issuer and first["resource"] == RESOURCE
    assert first["refresh_token"] and first["expires_at"] > time.time() + 60
    for secret in secrets_of(first):
        assert secret not in out + err

    listed = world.cli("tools", "list", "--address", world.address)
    assert listed.returncode == 0, listed.stderr
    assert TOOL in listed.stdout
    assert world.stored() == first  # a fresh token is used as it is

    # Forced refresh: the stored access token is made to look expired.
    tokens_before = world.idp.requests_to("/token")
    world.store({**first, "expires_at": time.time() - 5})
    listed = world.cli("tools", "list", "--address", world.address)
    assert listed.returncode == 0, listed.stderr
    assert TOOL in listed.stdout
    assert world.idp.requests_to("/token") == tokens_before + 1
    second = world.stored()
    assert second["access_token"] != first["access_token"]
    assert second["refresh_token"] != first["refresh_token"]  # rotated, written back
    assert second["expires_at"] > time.time() + 60
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for secret in secrets_of(first) + secrets_of(second):
        assert secret not in listed.stdout + listed.stderr

    # A spent refresh token: one line, sign in again; no secret shown.
    world.store({**second, "refresh_token": first["refresh_token"], "expires_at": 0})
    failed = world.cli("tools", "list", "--address", world.address)
    assert failed.returncode == 1
    assert failed.stdout == ""
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("run toolreg login again"), failed.stderr
    assert "invalid_grant" in lines[0]
    for secret in secrets_of(first) + secrets_of(second):
        assert secret not in failed.stderr

    # Sign in again (the options are remembered), then out: the file goes.
    world.store(second)
    proc, url = world.start_login()
    assert play_browser(world.idp, url, PERSON).status_code == 200
    assert proc.wait(CLI_TIMEOUT_S) == 0
    third = world.stored()
    logout = world.cli("logout", "--address", world.address)
    assert logout.returncode == 0 and logout.stdout == f"signed out of {world.address}\n"
    assert not path.exists()
    after = world.cli("tools", "list", "--address", world.address)
    assert after.returncode == 1 and "UNAUTHENTICATED" in after.stderr
    # Its refresh token was revoked at the provider.
    world.store({**third, "expires_at": 0})
    revoked = world.cli("tools", "list", "--address", world.address)
    assert revoked.returncode == 1 and "run toolreg login again" in revoked.stderr
    world.token_file().unlink()


def test_a_callback_with_another_state_is_refused_and_nothing_stored(world: World) -> None:
    proc, url = world.start_login()
    redirect_uri = parse_qs(urlsplit(url).query)["redirect_uri"][0]
    forged = httpx.get(f"{redirect_uri}?code=forged-code&state=not-this-one", timeout=10)
    out, err = proc.communicate(timeout=CLI_TIMEOUT_S)
    assert forged.status_code == 400 and "Not signed in" in forged.text
    assert proc.returncode == 1
    assert err.strip().splitlines()[-1] == (
        "toolreg: the callback's state is not this sign-in's; nothing was stored"
    )
    assert out == "" and "forged-code" not in err
    assert not world.token_file().exists()


def test_the_typescript_client_credentials_provider_fetches_one_token(world: World) -> None:
    node = check_built()
    test_file = PACKAGE / "dist-test" / "test" / "idp" / "client-credentials.test.js"
    assert test_file.is_file(), "run `make ts-client`"
    env = {
        **os.environ,
        "TOOLREG_ADDRESS": world.address,
        "TOOLREG_IDP_TOKEN_ENDPOINT": f"{world.idp.issuer}/token",
        "TOOLREG_IDP_CLIENT_ID": AGENT_CLIENT,
        "TOOLREG_IDP_CLIENT_SECRET": world.idp.clients[AGENT_CLIENT],
        "TOOLREG_IDP_RESOURCE": RESOURCE,
        "TOOLREG_IDP_SCOPE": SCOPE,
        "TOOLREG_IDP_CA_FILE": str(world.idp.ca_file),
        "TOOLREG_TOOL_NAME": TOOL,
    }
    before = world.idp.requests_to("/token")
    done = subprocess.run(
        [node, "--test", str(test_file.relative_to(PACKAGE))],
        cwd=PACKAGE, env=env, capture_output=True, text=True, timeout=NODE_TIMEOUT_S,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert re.search(r"^# pass 1$", output, re.MULTILINE) and "# fail 0" in output, output
    assert world.idp.requests_to("/token") == before + 1  # the provider's own count agrees
    assert world.idp.clients[AGENT_CLIENT] not in output
