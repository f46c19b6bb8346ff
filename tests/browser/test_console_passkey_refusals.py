"""Passkey approvals that must not count, made in headless Chromium with its
virtual authenticator against the real console and registry (the approvals
that do count: test_console_passkeys.py; the same refusals from a software
authenticator over gRPC: tests/security/test_passkey_approvals.py):

* an assertion for other arguments: the page is made to hand its passkey
  claims whose arguments digest is another call's, as a compromised page or
  extension would; the passkey signs them, and the registry refuses them;
* a cloned passkey, whose signature counter goes back: the credential's
  private key copied into a fresh authenticator with its counter at 0;
* no user verification: the authenticator cannot verify the person, so the
  browser gives the page no assertion at all (the page asks for "required"),
  and nothing reaches the console.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from selenium.webdriver.common.by import By
from selenium.webdriver.common.virtual_authenticator import Credential

from registry_server.client.registry_client import RegistryClient
from tests.browser.conftest import CALL_TIMEOUT_S, TOKENS, Page
from tests.browser.test_console_passkeys import (  # noqa: F401 (fixtures)
    World,
    approvers_with_passkeys,
    browsers,
    trust_passkeys,
    world,
)

OTHER_DIGEST = hashlib.sha256(b'{"note":"something else entirely"}').hexdigest()
# The page's claims, changed on their way to the page: another call's arguments digest.
TAMPER = """
const other = arguments[0];
const original = window.fetch;
window.fetch = async (url, init) => {
  const answer = await original(url, init);
  if (!String(url).endsWith('/passkey-claims')) return answer;
  const data = await answer.json();
  data.claims = data.claims.replace(/"args_digest":"[0-9a-f]{64}"/, `"args_digest":"${other}"`);
  return new Response(JSON.stringify(data), {status: 200, headers: {'content-type': 'application/json'}});
};
"""


def press_passkey(page: Page, request_id: str) -> str:
    """Approve with passkey; the card's outcome once it has one."""
    card = page.card(request_id)
    button = card.find_element(By.CSS_SELECTOR, "button.approve-passkey")
    page.wait("an enabled passkey button", lambda d: button.is_displayed() and button.is_enabled())
    button.click()
    page.wait(
        "an outcome",
        lambda d: (text := card.find_element(By.CSS_SELECTOR, ".outcome").text)
        and "Asking" not in text and "Signing" not in text,
    )  # fmt: skip
    return str(card.find_element(By.CSS_SELECTOR, ".outcome").text)


def posted(page: Page, request_id: str) -> list[dict[str, Any]]:
    return [s for s in page.sent() if s["url"].endswith(f"/{request_id}/approve-passkey")]


def test_other_arguments_a_cloned_passkey_and_no_user_verification_are_refused(
    world: World,  # noqa: F811
    browsers: Callable[[], Page],  # noqa: F811
) -> None:
    alice, bob, enrolled = approvers_with_passkeys(world, browsers)
    trust_passkeys(world, enrolled, alice, bob)

    agent = RegistryClient.connect(world.server.address, token=TOKENS["agent"])
    first = agent.execute_tool("deploy_note", {"note": "first"}, timeout=CALL_TIMEOUT_S)
    second = agent.execute_tool("deploy_note", {"note": "second"}, timeout=CALL_TIMEOUT_S)
    agent.close()
    assert first.approval_request is not None and second.approval_request is not None
    one, two = first.approval_request.id, second.approval_request.id

    # 1. Other arguments: signed by the real passkey, refused by the registry.
    alice.driver.execute_script(TAMPER, OTHER_DIGEST)
    outcome = press_passkey(alice, one)
    assert "Approved" not in outcome and "args" in outcome.lower(), outcome
    assert len(posted(alice, one)) == 1  # the assertion was made and sent: the server said no
    assert alice.fields(one)["approvals"].startswith("0 of 2"), alice.fields(one)

    # The same passkey, untampered (a fresh page): it counts.
    alice.driver.get(alice.console.url)  # a fresh page: the session cookie signs it in
    alice.wait("a live feed", lambda d: alice.by_id("status").text.startswith("Live"))
    assert "1 of 2 approvals" in press_passkey(alice, one)

    # 2. A clone: alice's private key in a fresh authenticator, its counter back at 0.
    (credential,) = alice.driver.get_credentials()
    assert credential.sign_count >= 1
    alice.driver.remove_all_credentials()
    alice.driver.add_credential(Credential.from_dict({**credential.to_dict(), "signCount": 0}))
    outcome = press_passkey(alice, two)
    assert "Approved" not in outcome and "counter" in outcome.lower(), outcome
    assert alice.fields(two)["approvals"].startswith("0 of 2")

    # 3. No user verification: the browser makes no assertion; nothing is sent.
    bob.driver.set_user_verified(False)
    outcome = press_passkey(bob, two)
    assert "Approved" not in outcome, outcome
    assert posted(bob, two) == []
    assert bob.fields(two)["approvals"].startswith("0 of 2")
