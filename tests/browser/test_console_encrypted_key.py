"""An approver whose key file is encrypted with a passphrase (`toolreg keys
generate --encrypt`) signs in the console: the page asks for the passphrase,
decrypts the key in the browser with WebCrypto (PBKDF2, AES-CBC) and signs;
a wrong passphrase, a missing one and an encryption the page does not read
are each refused in the page, and nothing is sent for them. Headless Chromium
against a real `toolreg serve`, as in test_console_browser.py."""

from __future__ import annotations

import base64
import json
import textwrap
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from selenium.webdriver.common.by import By

from registry_server.signing.keys import load_private_key
from tests.browser.conftest import Deployment, Page
from tests.browser.test_console_browser import key_forms

PASSPHRASE = "carol's passphrase: five words long"
WRONG = "carol's passphrase, misremembered"
AES_256_CBC = bytes.fromhex("060960864801650304012a")  # the OID the page reads
AES_192_CBC = bytes.fromhex("0609608648016503040116")  # same length; WebCrypto has no AES-192


def encrypted(plain_pem: Path, folder: Path, *, cipher_oid: bytes = AES_256_CBC) -> Path:
    """The same key, as `toolreg keys generate --encrypt` writes it (with its
    cipher's OID swapped for ``cipher_oid``, to make one the page cannot read)."""
    key = load_private_key(plain_pem.read_bytes())
    der = key.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(PASSPHRASE.encode()),
    )
    assert der.count(AES_256_CBC) == 1
    body = textwrap.fill(base64.b64encode(der.replace(AES_256_CBC, cipher_oid)).decode(), 64)
    path = folder / f"carol-{cipher_oid.hex()[-2:]}.key"
    path.write_text(
        f"-----BEGIN ENCRYPTED PRIVATE KEY-----\n{body}\n-----END ENCRYPTED PRIVATE KEY-----\n"
    )
    return path


def carol_asked(
    deployment: Deployment, browsers: Callable[[], Page], note: str
) -> tuple[str, Page]:
    """The agent asks for restart_service (1 approval from ops); carol, signed
    in in a browser of her own, sees it. The request's id and her page."""
    request_id = deployment.ask("restart_service", note)
    carol = browsers()
    carol.sign_in("carol")
    return request_id, carol


def type_passphrase(page: Page, passphrase: str) -> None:
    field = page.by_id("key-passphrase")
    field.clear()
    field.send_keys(passphrase)


def test_an_encrypted_key_signs_with_its_passphrase_and_a_wrong_one_is_refused(
    deployment: Deployment, browsers: Callable[[], Page], tmp_path: Path
) -> None:
    request_id, carol = carol_asked(deployment, browsers, "restart the billing queue")
    key_file = encrypted(deployment.keys["carol"], tmp_path)
    assert key_file.read_text().startswith("-----BEGIN ENCRYPTED PRIVATE KEY-----")

    # No passphrase typed: the page says the file needs one.
    carol.choose_key(key_file)
    carol.approve(request_id)
    assert "encrypted: type its passphrase" in carol.outcome(request_id, expect="encrypted")

    # A wrong one: refused in the page, the request untouched.
    type_passphrase(carol, WRONG)
    carol.approve(request_id)
    assert carol.outcome(request_id, expect="Wrong") == "Wrong passphrase for this key file."
    assert carol.fields(request_id)["approvals"].startswith("0 of 1")

    # The right one: signed in the browser, and the agent's call runs.
    type_passphrase(carol, PASSPHRASE)
    carol.approve(request_id)
    outcome = carol.outcome(request_id, expect="Approved as")
    assert "1 of 1 approvals, state APPROVED" in outcome
    result = deployment.call("restart_service", "restart the billing queue", request_id)
    assert result.success, result.error
    carol.state_of(request_id, "CONSUMED")

    # Only the one approval went out, and neither the key (in any form, the
    # encrypted file's included) nor the passphrase was in any request or log.
    sent = carol.sent()
    approvals = [s for s in sent if s["url"].endswith(f"/api/requests/{request_id}/approve")]
    assert len(approvals) == 1 and '"token"' in approvals[0]["body"]
    secrets = [*key_forms(deployment.keys["carol"]), key_file.read_text(), PASSPHRASE, WRONG]
    secrets += ["".join(key_file.read_text().splitlines()[1:-1])]
    for request in sent:
        wire = request["url"] + json.dumps(request["headers"]) + request["body"]
        assert [s[:12] for s in secrets if s in wire] == [], request["url"]
    logged = [str(entry["message"]) for entry in carol.driver.get_log("browser")]
    assert [m for m in logged if PASSPHRASE in m or WRONG in m] == []
    assert [m for m in logged if "Content Security Policy" in m or "Trusted" in m] == []
    storage = "return [localStorage.length, sessionStorage.length, document.cookie]"
    assert carol.driver.execute_script(storage) == [0, 0, ""]


def test_an_encryption_the_page_cannot_read_is_named(
    deployment: Deployment, browsers: Callable[[], Page], tmp_path: Path
) -> None:
    request_id, carol = carol_asked(deployment, browsers, "restart the mail queue")
    carol.choose_key(encrypted(deployment.keys["carol"], tmp_path, cipher_oid=AES_192_CBC))
    type_passphrase(carol, PASSPHRASE)
    carol.approve(request_id)
    outcome = carol.outcome(request_id, expect="cannot decrypt")
    assert "AES-192-CBC" in outcome and "AES-256-CBC" in outcome
    card = carol.card(request_id)
    assert card.find_element(By.CSS_SELECTOR, ".badge").text == "PENDING"
    assert not [s for s in carol.sent() if s["url"].endswith("/approve")]
