"""The approval console as approvers use it: headless Chromium on the page,
each approver in a browser of its own, picking its own key file; a real
`toolreg serve` behind it that runs the approved call in a gVisor sandbox.

With TOOLREG_SCREENSHOTS=docs/images these tests also write the screenshots
docs/how-to/approvals.md shows."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from cryptography.hazmat.primitives import serialization
from selenium.webdriver.common.by import By

from registry_server.domain.outcome import Status
from registry_server.policy.loader import load_policy
from registry_server.signing.keys import load_private_key
from registry_server.signing.tokens import mint_for, verify
from tests import store_file
from tests.browser.conftest import TOKENS, Api, Deployment, Page


def key_forms(pem_file: Path) -> list[str]:
    """Every way a page could leak the key: the PEM, and its PKCS#8 DER and
    its 32 raw bytes in base64, base64url, hex, and all of those URL-encoded."""
    pem = pem_file.read_bytes()
    key = load_private_key(pem)
    der = key.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    raw = key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    forms = [pem.decode(), "".join(pem.decode().splitlines()[1:-1])]
    for blob in (der, raw):
        b64 = base64.b64encode(blob).decode()
        forms += [b64, b64.rstrip("="), base64.urlsafe_b64encode(blob).decode().rstrip("=")]
        forms += [blob.hex(), blob.hex().upper()]
    return sorted({*forms, *(quote(f, safe="") for f in forms)})


def csp_violations(page: Page) -> list[str]:
    return [
        str(entry["message"])
        for entry in page.driver.get_log("browser")
        if "Content Security Policy" in entry["message"] or "Trusted" in entry["message"]
    ]


def test_two_approvers_approve_from_their_browsers_and_the_call_runs(
    deployment: Deployment, browsers: Callable[[], Page]
) -> None:
    note = "ship release 2.4 to production"
    request_id = deployment.ask("deploy_note", note)
    alice, bob = browsers(), browsers()
    alice.sign_in("alice")
    bob.sign_in("bob")

    # Alice reads what `toolreg approvals show` shows, checked by the console.
    fields = alice.fields(request_id)
    assert fields["request"] == request_id
    assert fields["state"] == "PENDING"
    assert fields["tool"].startswith("deploy_note (digest ")
    assert fields["asked by"].startswith("agent at ")
    assert fields["approvals"] == "0 of 2 (nobody yet); 2 more needed"
    assert fields["level"] == "dangerous"
    assert fields["image"] == "toolreg/base"
    assert fields["command"] == '["sh", "-c", "cat"]'
    assert fields["egress"] == "none (no network)"
    assert fields["definition"] == "matches the digest signed"
    card = alice.card(request_id)
    assert json.loads(card.find_element(By.CSS_SELECTOR, ".arguments").text) == {"note": note}
    assert "match the digests you sign" in card.find_element(By.CSS_SELECTOR, ".check").text
    alice.screenshot("console-request.png")

    alice.choose_key(deployment.keys["alice"])
    alice.approve(request_id)
    assert "1 of 2 approvals, state PENDING" in alice.outcome(request_id, expect="Approved as")

    # Bob's page follows live, and he signs with his own key in his own browser.
    bob.wait(
        "alice's approval on bob's page",
        lambda d: bob.fields(request_id)["approvals"].startswith("1 of 2 (alice)"),
    )
    bob.choose_key(deployment.keys["bob"])
    bob.approve(request_id)
    assert "2 of 2 approvals, state APPROVED" in bob.outcome(request_id, expect="Approved as")
    alice.state_of(request_id, "APPROVED")
    bob.wait(
        "the approved request in full",
        lambda d: bob.fields(request_id)["approvals"].startswith("2 of 2 (alice, bob)"),
    )
    approve_button = bob.card(request_id).find_element(By.CSS_SELECTOR, "button.approve")
    assert not approve_button.is_enabled()  # nothing left to sign
    bob.screenshot("console-approved.png")

    # The agent's call now runs, once, in its sandbox.
    result = deployment.call("deploy_note", note, request_id)
    assert result.success, result.error
    assert result.data == {"note": note}
    alice.state_of(request_id, "CONSUMED")
    assert csp_violations(alice) == [] and csp_violations(bob) == []


def test_the_private_key_never_leaves_the_page(
    deployment: Deployment, browsers: Callable[[], Page]
) -> None:
    request_id = deployment.ask("deploy_note", "watch the wire while alice signs")
    alice = browsers()
    alice.sign_in("alice")
    alice.choose_key(deployment.keys["alice"])
    alice.approve(request_id)
    alice.outcome(request_id, expect="Approved as")

    sent = alice.sent()
    # Every request to the network goes to the console (chrome:// pages are the browser's own).
    network = [s["url"] for s in sent if s["url"].startswith(("http:", "https:", "ws:", "wss:"))]
    assert network and [u for u in network if not u.startswith(deployment.console.url)] == []
    approvals = [s for s in sent if s["url"].endswith(f"/api/requests/{request_id}/approve")]
    assert len(approvals) == 1 and '"token"' in approvals[0]["body"]  # bodies are captured
    assert all(s["body"] for s in sent if s["has_body"])
    forms = key_forms(deployment.keys["alice"])
    for request in sent:
        wire = request["url"] + json.dumps(request["headers"]) + request["body"]
        leaked = [form[:12] for form in forms if form in wire]
        assert leaked == [], f"{request['method']} {request['url']} carries the key"

    # The token is the one the CLI mints: same header and claims, and the
    # server's own verify accepts it for this request.
    token = json.loads(approvals[0]["body"])["token"]
    request = deployment.as_client("alice").approval_request(request_id)
    header_b64, claims_b64, _ = token.split(".")
    cli_token = mint_for(
        load_private_key(deployment.keys["alice"].read_bytes()),
        issuer="alice", request=request, bind_request=True,
    )  # fmt: skip

    def part(text: str) -> dict[str, object]:
        decoded: dict[str, object] = json.loads(base64.urlsafe_b64decode(text + "=="))
        return decoded

    assert part(header_b64) == part(cli_token.split(".")[0])
    assert part(claims_b64).keys() == part(cli_token.split(".")[1]).keys()
    policy = load_policy(deployment.policy)
    verified = verify(
        token, keys=policy.approver_keys(), audience=request.audience,
        tool_name=request.tool_name, tool_digest=request.tool_digest,
        args_digest=request.arguments_digest, requester=request.requested_by,
        max_ttl_s=request.max_token_ttl_s,
    )  # fmt: skip
    assert verified.approver == "alice" and verified.request_id == request_id

    # Nothing is kept in the browser: no storage, and the session cookie is HttpOnly.
    kept = alice.driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "indexedDB.databases().then((dbs) => done([localStorage.length, sessionStorage.length,"
        " dbs.length, document.cookie]));"
    )
    assert kept == [0, 0, 0, ""]


def test_a_definition_that_does_not_match_its_digest_cannot_be_signed(
    deployment: Deployment, browsers: Callable[[], Page]
) -> None:
    request_id = deployment.ask("deploy_note", "the tool you see is not the tool you sign")
    # Behind the server's back, the request's stored definition becomes a
    # harmless-looking one; its tool_digest still names the real tool.
    manifest = json.loads(store_file.request_manifest(deployment.data_dir, request_id))
    manifest["sandbox"]["command"] = ["sh", "-c", "echo harmless"]
    store_file.set_request_manifest(deployment.data_dir, request_id, json.dumps(manifest))

    alice = browsers()
    alice.sign_in("alice")
    alice.choose_key(deployment.keys["alice"])
    card = alice.card(request_id)
    fields = alice.fields(request_id)
    assert fields["command"] == '["sh", "-c", "echo harmless"]'
    assert fields["definition"] == "DOES NOT match tool_digest"
    assert "DOES NOT match tool_digest" in card.find_element(By.CSS_SELECTOR, ".check").text
    assert not card.find_element(By.CSS_SELECTOR, "button.approve").is_enabled()
    assert "signing is disabled" in card.find_element(By.CSS_SELECTOR, ".not-signable").text
    alice.screenshot("console-mismatch.png")

    # Past the page, the console refuses it too: a token for that digest is not submitted.
    registry = deployment.as_client("alice")
    request = registry.approval_request(request_id)
    token = mint_for(
        load_private_key(deployment.keys["alice"].read_bytes()),
        issuer="alice", request=request, bind_request=True,
    )  # fmt: skip
    api = Api(deployment.console, TOKENS["alice"])
    try:
        answer = api.post(f"/api/requests/{request_id}/approve", {"token": token})
    finally:
        api.close()
    assert answer.status_code == 409, answer.text
    assert "does not match tool_digest" in answer.json()["error"]
    assert list(registry.approval_request(request_id).approved_by) == []
    registry.close()


def test_a_key_the_policy_does_not_trust_is_refused(
    deployment: Deployment, browsers: Callable[[], Page]
) -> None:
    request_id = deployment.ask("deploy_note", "signed with a key nobody trusts")
    alice = browsers()
    alice.sign_in("alice")
    alice.choose_key(deployment.keys["mallory"])  # a well-formed key the policy does not hold
    alice.approve(request_id)
    outcome = alice.outcome(request_id, expect="PERMISSION_DENIED")
    assert "bad signature" in outcome, outcome
    registry = deployment.as_client("alice")
    assert list(registry.approval_request(request_id).approved_by) == []
    registry.close()


def test_an_approver_sees_no_request_outside_its_groups(
    deployment: Deployment, browsers: Callable[[], Page]
) -> None:
    for_security = deployment.ask("deploy_note", "for the security group only")
    for_ops = deployment.ask("restart_service", "for the ops group only")
    carol, alice = browsers(), browsers()
    carol.sign_in("carol")
    alice.sign_in("alice")
    carol.card(for_ops)
    alice.card(for_security)
    assert for_security not in carol.card_ids()
    assert for_ops not in alice.card_ids()

    # One asked while both watch reaches alice's page only.
    later = deployment.ask("deploy_note", "asked while carol watches")
    alice.card(later)
    time.sleep(1)  # the same event would have reached carol's page by now
    assert later not in carol.card_ids() and for_security not in carol.card_ids()

    # Asking the console for it directly is refused as the registry refuses it.
    api = Api(deployment.console, TOKENS["carol"])
    try:
        answer = api.http.get(f"/api/requests/{for_security}")
    finally:
        api.close()
    assert answer.status_code in (403, 404), answer.text


def test_a_rejection_with_its_reason_reaches_the_agent(
    deployment: Deployment, browsers: Callable[[], Page]
) -> None:
    note = "drop the staging database"
    request_id = deployment.ask("deploy_note", note)
    alice = browsers()
    alice.sign_in("alice")
    alice.reject(request_id, "Not during the release freeze")
    assert "Rejected as alice" in alice.outcome(request_id, expect="Rejected as")
    alice.state_of(request_id, "REJECTED")
    alice.wait(
        "the rejection in the card",
        lambda d: (
            alice.fields(request_id).get("rejected") == "by alice: Not during the release freeze"
        ),
    )
    alice.screenshot("console-rejected.png")

    result = deployment.call("deploy_note", note, request_id)
    assert result.status is Status.APPROVAL_DENIED, result
    assert "Not during the release freeze" in result.error


def test_a_webhook_link_marks_the_request_it_names(
    deployment: Deployment, browsers: Callable[[], Page]
) -> None:
    other = deployment.ask("deploy_note", "not the one the link names")
    linked = deployment.ask("deploy_note", "the one a webhook linked to")
    alice = browsers()
    # As an approver arrives from a webhook's link: <console_url>/#/requests/<id>.
    alice.driver.get(f"{alice.console.url.rstrip('/')}/#/requests/{linked}")
    alice.wait("the sign-in form", lambda d: alice.by_id("token").is_displayed())
    alice.by_id("token").send_keys(TOKENS["alice"])
    alice.driver.find_element(By.CSS_SELECTOR, "#sign-in-form button").click()
    card = alice.card(linked)
    alice.wait("the linked request marked", lambda d: "linked" in str(card.get_attribute("class")))
    assert "linked" not in str(alice.card(other).get_attribute("class"))
    # Another link, as a second webhook would give, moves the mark.
    alice.driver.execute_script(f"window.location.hash = '#/requests/{other}'")
    alice.wait(
        "the mark moved", lambda d: "linked" in str(alice.card(other).get_attribute("class"))
    )
    assert "linked" not in str(alice.card(linked).get_attribute("class"))
    # Anything else in the hash marks nothing.
    alice.driver.execute_script("window.location.hash = '#/requests/<img src=x>'")
    alice.wait("no mark", lambda d: not d.find_elements(By.CSS_SELECTOR, "article.linked"))
