"""Passkeys in the approval console (docs/how-to/approvals.md, "Passkeys"), in
headless Chromium with its virtual WebAuthn authenticator (CTAP2, internal,
resident keys, user verification): two approvers enrol a passkey each, the
test adds the policy lines the page printed and reloads the policy, then
both approve a 2-of-2 request with their passkeys and the agent's call runs
in its sandbox. A real `toolreg serve` and `toolreg console` behind it.

The page must be on http://localhost:PORT: WebAuthn takes no IP address as
its relying party, so the console listens on a port chosen here and the
policy's webauthn.origins names it."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from selenium.webdriver.common.by import By
from selenium.webdriver.common.virtual_authenticator import VirtualAuthenticatorOptions

from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import RegistryClient
from registry_server.signing.keys import generate_keypair
from tests import store_file
from tests.browser.conftest import (
    CALL_TIMEOUT_S,
    ROOT,
    TOKENS,
    ConsoleProcess,
    Page,
    open_browsers,
    save_screenshot,
    spawn_console,
    write_policy,
    write_tools,
)
from tests.factories import sha

ADMIN_TOKEN = "console-admin-5f02aa"  # reloads the policy once passkeys are added


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class World:
    server: ServerProcess
    console: ConsoleProcess
    port: int
    policy: Path
    data: Path

    def restart_console(self) -> None:
        """The console reads the policy at its start: it learns the new passkeys."""
        assert self.console.stop() == 0
        self.console = start_console(self.server.address, self.policy, self.port)


def start_console(address: str, policy: Path, port: int) -> ConsoleProcess:
    console = spawn_console(address, "--policy", str(policy), listen=f"127.0.0.1:{port}")
    # The page is opened by name: WebAuthn refuses an IP address as relying party.
    console.url = f"http://localhost:{port}/"
    return console


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("console-passkeys")
    port = free_port()
    policy = base / "policy.yaml"
    write_policy(policy, {who: generate_keypair()[1] for who in ("alice", "bob", "carol")})
    text: dict[str, Any] = yaml.safe_load(policy.read_text())
    text["webauthn"] = {"rp_id": "localhost", "origins": [f"http://localhost:{port}"]}
    text["clients"].append({"id": "admin", "token_sha256": sha(ADMIN_TOKEN), "roles": ["admin"]})
    policy.write_text(yaml.safe_dump(text, sort_keys=False))
    data = base / "data"
    server = spawn_server(
        data, "--tools", str(write_tools(base / "tools")), "--policy", str(policy), cwd=ROOT
    )
    world = None
    try:
        world = World(server, start_console(server.address, policy, port), port, policy, data)
        yield world
    finally:
        if world is not None:
            world.console.stop()
        server.stop()


@pytest.fixture
def browsers(tmp_path: Path, world: World) -> Iterator[Callable[[], Page]]:
    yield from open_browsers(tmp_path, world.console)


def with_authenticator(page: Page) -> Page:
    page.driver.add_virtual_authenticator(
        VirtualAuthenticatorOptions(
            protocol="ctap2",
            transport="internal",
            has_resident_key=True,
            has_user_verification=True,
            is_user_verified=True,
        )
    )
    return page


def enrol(page: Page) -> dict[str, str]:
    """Enrols a passkey on the page; the passkeys entry it printed, parsed."""
    page.by_id("passkey-enrol").click()
    page.wait("the policy lines", lambda d: page.by_id("passkey-lines").text.strip() != "")
    lines = page.by_id("passkey-lines").text
    assert "Passkey created" in page.by_id("passkey-status").text
    entries = yaml.safe_load("\n".join(line for line in lines.splitlines() if line.strip()))
    (entry,) = entries
    (passkey,) = entry["passkeys"]
    return {"approver": entry["id"], **passkey}


def approve_with_passkey(page: Page, request_id: str) -> str:
    card = page.card(request_id)
    button = card.find_element(By.CSS_SELECTOR, "button.approve-passkey")
    page.wait("an enabled passkey button", lambda d: button.is_displayed() and button.is_enabled())
    button.click()
    return page.outcome(request_id, expect="Approved with a passkey")


def approvers_with_passkeys(
    world: World, browsers: Callable[[], Page]
) -> tuple[Page, Page, dict[str, dict[str, str]]]:
    """alice's and bob's browsers, each with a virtual authenticator, signed
    in, each having enrolled a passkey: the pages and what each printed."""
    alice, bob = with_authenticator(browsers()), with_authenticator(browsers())
    for page, who in ((alice, "alice"), (bob, "bob")):
        page.console = world.console
        page.sign_in(who)
        page.wait("the passkey panel", lambda d, p=page: p.by_id("passkey-panel").is_displayed())
    return alice, bob, {e["approver"]: e for e in (enrol(alice), enrol(bob))}


def trust_passkeys(world: World, enrolled: dict[str, dict[str, str]], *pages: Page) -> None:
    """The operator adds the printed lines and reloads the policy; the console
    restarts to read it, and the pages sign in to it again."""
    policy: dict[str, Any] = yaml.safe_load(world.policy.read_text())
    for approver in policy["approvers"]:
        if approver["id"] in enrolled:
            entry = enrolled[approver["id"]]
            approver["passkeys"] = [{"id": entry["id"], "public_key": entry["public_key"]}]
    world.policy.write_text(yaml.safe_dump(policy, sort_keys=False))
    with RegistryClient.connect(world.server.address, token=ADMIN_TOKEN) as admin:
        admin.reload_policy()
    world.restart_console()
    for page, who in zip(pages, ("alice", "bob")[: len(pages)], strict=True):
        page.console = world.console
        page.sign_in(who)


def test_two_approvers_enrol_passkeys_approve_and_the_call_runs(
    world: World, browsers: Callable[[], Page]
) -> None:
    alice, bob, enrolled = approvers_with_passkeys(world, browsers)
    assert set(enrolled) == {"alice", "bob"}
    assert enrolled["alice"]["id"] != enrolled["bob"]["id"]

    # Enrolment stored nothing: before the policy lists them, the passkeys
    # approve nothing (the button is not even offered).
    agent = RegistryClient.connect(world.server.address, token=TOKENS["agent"])
    first = agent.execute_tool("deploy_note", {"note": "before"}, timeout=CALL_TIMEOUT_S)
    assert first.needs_approval and first.approval_request is not None
    card = alice.card(first.approval_request.id)
    assert not card.find_element(By.CSS_SELECTOR, "button.approve-passkey").is_displayed()

    # The operator adds the printed lines and reloads the policy.
    trust_passkeys(world, enrolled)

    note = "rotate the signing certificate"
    result = agent.execute_tool("deploy_note", {"note": note}, timeout=CALL_TIMEOUT_S)
    assert result.needs_approval and result.approval_request is not None
    request_id = result.approval_request.id
    for page, who in ((alice, "alice"), (bob, "bob")):
        page.console = world.console
        page.sign_in(who)
    assert "1 of 2 approvals, state PENDING" in approve_with_passkey(alice, request_id)
    bob.wait(
        "alice's approval on bob's page",
        lambda d: bob.fields(request_id)["approvals"].startswith("1 of 2 (alice)"),
    )
    assert "2 of 2 approvals, state APPROVED" in approve_with_passkey(bob, request_id)
    # The card's buttons and outcome in view: the passkey next to the key file.
    actions = bob.card(request_id).find_element(By.CSS_SELECTOR, ".actions")
    bob.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", actions)
    save_screenshot(bob.driver, "console-passkey.png")

    done = agent.execute_tool(
        "deploy_note", {"note": note}, approval_request_id=request_id, timeout=CALL_TIMEOUT_S
    )
    assert done.success, done.error
    assert done.data == {"note": note}
    agent.close()

    # What the page sent is an assertion, wrapped by the console: the audit
    # names both passkeys with the flags their authenticator set.
    sent = [s for s in alice.sent() if s["url"].endswith(f"/{request_id}/approve-passkey")]
    assert len(sent) == 1
    body = json.loads(sent[0]["body"])
    assert set(body) == {"claims", "credential_id", "authenticator_data", "client_data_json",
                         "signature"}  # fmt: skip
    assert json.loads(body["claims"])["req"] == request_id
    records = [json.loads(r) for _, _, r in store_file.audit_rows(world.data, "execution")]
    started = [r for r in records if r.get("approval_request_id") == request_id and "passkeys" in r]
    assert len(started) == 1
    used = {p["approver"]: p for p in started[0]["passkeys"]}
    assert used["alice"]["credential_id"] == enrolled["alice"]["id"]
    assert used["bob"]["flags"]["UV"] is True and used["bob"]["flags"]["UP"] is True
    for page in (alice, bob):
        logs = page.driver.get_log("browser")
        assert [e for e in logs if "Content Security Policy" in e["message"]
                or "Trusted" in e["message"]] == []  # fmt: skip
