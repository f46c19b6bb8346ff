"""The sign-in throttle as an approver's browser meets it, in headless
Chromium on the real page: wrong tokens typed into the sign-in form are
answered, then refused with the throttle's message; a flood of 300 wrong
sign-ins from the page's own origin is throttled; the right token waits out
the window, and then signs in. (The HTTP-level details, other sources and
the log: test_console_signin_throttle.py.)"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from selenium.webdriver.common.by import By

from registry_server.console.throttle import MAX_FAILURES_PER_SOURCE
from tests.browser.conftest import TOKENS, ConsoleProcess, Page, open_browsers
from tests.browser.test_console_signin_throttle import WINDOW_S, console, policy  # noqa: F401

FLOOD = 300  # wrong sign-ins from the page's origin


@pytest.fixture
def browser(
    tmp_path: Path,
    console: ConsoleProcess,  # noqa: F811
) -> Iterator[Callable[[], Page]]:
    yield from open_browsers(tmp_path, console)


def submit(page: Page, token: str) -> str:
    """Type a token into the sign-in form and submit; the page's answer."""
    field = page.by_id("token")
    field.clear()
    field.send_keys(token)
    # The last answer off the page first, so the next one is seen (it may read the same).
    page.driver.execute_script("document.getElementById('sign-in-error').textContent = ''")
    page.driver.find_element(By.CSS_SELECTOR, "#sign-in-form button").click()
    page.wait(
        "an answer to the sign-in",
        lambda d: page.by_id("console").is_displayed() or page.by_id("sign-in-error").text,
    )
    return "signed in" if page.by_id("console").is_displayed() else page.by_id("sign-in-error").text


# Timed against the console's 4 s window: the flood and the right token must both fall
# in it, which a machine busy with other tests' work cannot promise (it once took longer).
@pytest.mark.serial
def test_a_browser_meets_the_throttle_and_waits_it_out(browser: Callable[[], Page]) -> None:
    page = browser()
    page.driver.get(page.console.url)
    page.wait("the sign-in form", lambda d: page.by_id("token").is_displayed())
    answers = [submit(page, f"wrong-{n}-{secrets.token_hex(8)}") for n in range(3)]
    assert all("your address" not in a and a != "signed in" for a in answers), answers
    # The page's own origin, as its script signs in: a flood of wrong tokens.
    statuses = page.driver.execute_async_script(
        """
        const [count, done] = arguments;
        const statuses = [];
        for (let i = 0; i < count; i++) {
          const answer = await fetch('/api/session', {method: 'POST',
            headers: {'Authorization': 'Bearer flood-' + i + '-' + Math.random()}});
          statuses.push(answer.status);
        }
        done(statuses);
        """,
        FLOOD,
    )
    allowed = MAX_FAILURES_PER_SOURCE - len(answers)
    assert statuses == [401] * allowed + [429] * (FLOOD - allowed)
    # The right token, typed by the approver during the window: refused, with why.
    started = time.monotonic()
    refused = submit(page, TOKENS["alice"])
    assert "your address" in refused, refused
    page.screenshot("console-throttled.png")
    time.sleep(max(0.0, WINDOW_S + 0.3 - (time.monotonic() - started)))
    assert submit(page, TOKENS["alice"]) == "signed in"
