"""The approval console against real processes: `toolreg serve` with a written
policy (real SQLite, the real engine: dangerous calls run under gVisor),
`toolreg console` as its own process in front of it, and Debian's headless
Chromium driven through its own chromedriver by Selenium (no browser or
driver download: the paths are given, so Selenium Manager never runs)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from registry_server.cli.launcher import ServerProcess, spawn_server, spawn_until
from registry_server.client.registry_client import CallResult, RegistryClient
from registry_server.signing.keys import generate_keypair
from tests.factories import sha

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1200,1100",
)  # fmt: skip
SCREENSHOTS_ENV = "TOOLREG_SCREENSHOTS"  # a folder: the tests save the docs' screenshots there
CONSOLE_SERVING = re.compile(r"serving the approval console on (\S+)")
WAIT_S = 30  # seconds for the page to show what a test waits for
CALL_TIMEOUT_S = 120  # seconds for a dangerous call: a cold gVisor start, generously
AUDIENCE = "toolreg-console-test"
TOKENS = {
    "agent": "console-agent-4c1d9e",  # executes up to dangerous
    "alice": "console-alice-8a27f0",  # approver, group security
    "bob": "console-bob-1e6b53",  # approver, group security
    "carol": "console-carol-d39a42",  # approver, group ops
    "viewer": "console-viewer-70b5c8",  # executes safe tools; no approve role
}
APPROVERS = {"alice": "security", "bob": "security", "carol": "ops"}
# Dangerous tools on toolreg/base: each echoes its arguments back (cat reads them on stdin).
TOOLS = {
    "deploy_note": "needs 2 approvals from security",
    "restart_service": "needs 1 approval from ops",
}


def write_policy(path: Path, public_keys: dict[str, str]) -> None:
    policy = {
        "audience": AUDIENCE,
        "approvers": [
            {"id": who, "public_key": public_keys[who], "groups": [group]}
            for who, group in APPROVERS.items()
        ],
        "approval_rules": [
            {
                "match": {"tool": "deploy_note"},
                "approvals_required": 2,
                "groups": ["security"],
                "max_token_ttl_s": 600,
            },
            {
                "match": {"tool": "restart_service"},
                "approvals_required": 1,
                "groups": ["ops"],
                "max_token_ttl_s": 600,
            },
        ],
        "clients": [
            {
                "id": "agent",
                "token_sha256": sha(TOKENS["agent"]),
                "roles": ["execute"],
                "max_safety_level": "dangerous",
            },
            *(
                {"id": who, "token_sha256": sha(TOKENS[who]), "roles": ["approve"]}
                for who in APPROVERS
            ),
            {"id": "viewer", "token_sha256": sha(TOKENS["viewer"]), "roles": ["execute"]},
        ],
    }
    path.write_text(yaml.safe_dump(policy, sort_keys=False))


def write_tools(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, what in TOOLS.items():
        manifest = {
            "name": name,
            "description": f"Records a note ({what}); a test tool.",
            "safety_level": "dangerous",
            "parameters": {
                "type": "object",
                "properties": {"note": {"type": "string"}},
                "required": ["note"],
            },
            "sandbox": {"image": "toolreg/base", "command": ["sh", "-c", "cat"]},
        }
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    return folder


@dataclass
class ConsoleProcess:
    proc: subprocess.Popen[str]
    url: str  # ends in "/"
    log: list[str]  # every line it wrote to stderr

    @property
    def origin(self) -> str:
        return self.url.rstrip("/")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout=30)


def console_env() -> dict[str, str]:
    # The console must not pick up a token from the test runner's environment.
    return {k: v for k, v in os.environ.items() if k != "TOOLREG_TOKEN"}


def spawn_console(address: str, *args: str, listen: str = "127.0.0.1:0") -> ConsoleProcess:
    """`toolreg console --address A --http LISTEN ARGS...` as a process."""
    argv = [sys.executable, "-m", "registry_server.cli", "console", "--address", address,
            "--http", listen, *args]  # fmt: skip
    proc, url, log = spawn_until(
        argv, CONSOLE_SERVING, what="toolreg console", cwd=ROOT, env=console_env()
    )
    return ConsoleProcess(proc, url, log)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "registry_server.cli", *args],
        capture_output=True, text=True, cwd=ROOT, env=console_env(), timeout=60,
    )  # fmt: skip


@dataclass
class Deployment:
    server: ServerProcess
    console: ConsoleProcess
    data_dir: Path
    policy: Path
    keys: dict[str, Path]  # approver id (and "mallory", whom no policy trusts) -> PEM file
    _agent: RegistryClient | None = field(default=None, repr=False)

    @property
    def agent(self) -> RegistryClient:
        if self._agent is None:
            self._agent = RegistryClient.connect(self.server.address, token=TOKENS["agent"])
        return self._agent

    def ask(self, tool: str, note: str) -> str:
        """The agent calls a dangerous tool; the id of the approval request it gets."""
        result = self.agent.execute_tool(tool, {"note": note}, timeout=CALL_TIMEOUT_S)
        assert result.needs_approval and result.approval_request is not None, result
        return result.approval_request.id

    def call(self, tool: str, note: str, request_id: str) -> CallResult:
        return self.agent.execute_tool(
            tool, {"note": note}, approval_request_id=request_id, timeout=CALL_TIMEOUT_S
        )

    def as_client(self, who: str) -> RegistryClient:
        return RegistryClient.connect(self.server.address, token=TOKENS[who])


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    base = tmp_path_factory.mktemp("console")
    keys: dict[str, Path] = {}
    public: dict[str, str] = {}
    for who in (*APPROVERS, "mallory"):
        private, public[who] = generate_keypair()
        keys[who] = base / f"{who}.key"
        keys[who].write_bytes(private)
    policy = base / "policy.yaml"
    write_policy(policy, public)
    data = base / "data"
    server = spawn_server(
        data, "--tools", str(write_tools(base / "tools")), "--policy", str(policy), cwd=ROOT
    )
    console = None
    try:
        console = spawn_console(server.address, "--policy", str(policy))
        deployment = Deployment(server, console, data, policy, keys)
        yield deployment
        if deployment._agent is not None:
            deployment._agent.close()
    finally:
        if console is not None:
            code = console.stop()
            assert code == 0, "the console did not stop cleanly:\n" + "".join(console.log[-30:])
        server.stop()


# ------------------------------------------------------------------ HTTP


class Api:
    """A signed-in session of the console's API, as the page holds it (cookie
    plus CSRF token), over plain HTTP."""

    def __init__(self, console: ConsoleProcess, token: str) -> None:
        self.console = console
        self.http = httpx.Client(base_url=console.origin, timeout=30)
        answer = self.http.post(
            "/api/session",
            headers={"Authorization": f"Bearer {token}", "Origin": console.origin},
        )
        assert answer.status_code == 200, answer.text
        self.csrf = answer.json()["csrf"]

    def post(self, path: str, body: Any, **headers: str) -> httpx.Response:
        sent = {"Origin": self.console.origin, "X-Toolreg-Csrf": self.csrf, **headers}
        return self.http.post(path, json=body, headers=sent)

    def close(self) -> None:
        self.http.close()


# --------------------------------------------------------------- browser


def save_screenshot(driver: webdriver.Chrome, name: str) -> None:
    """For docs/images, only when TOOLREG_SCREENSHOTS names a folder: a test
    run never changes a tracked file by itself."""
    folder = os.environ.get(SCREENSHOTS_ENV)
    if folder:
        target = (ROOT / folder).resolve()
        target.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(target / name)), name


class Page:
    """One approver's browser on the console: its own Chromium profile, the
    network requests it made (Chrome's performance log), and the page's
    controls as an approver uses them."""

    def __init__(self, driver: webdriver.Chrome, console: ConsoleProcess) -> None:
        self.driver = driver
        self.console = console
        self._sent: list[dict[str, Any]] = []

    def wait(self, what: str, condition: Callable[[webdriver.Chrome], Any]) -> Any:
        try:
            return WebDriverWait(self.driver, WAIT_S, poll_frequency=0.1).until(condition)
        except TimeoutException:
            status = self.driver.find_element(By.ID, "status").text
            raise AssertionError(
                f"the page never showed {what} (its status: {status!r}); the console's last"
                " lines:\n" + "".join(self.console.log[-10:])
            ) from None

    def by_id(self, element_id: str) -> WebElement:
        return self.driver.find_element(By.ID, element_id)

    def sign_in(self, who: str) -> None:
        self.driver.get(self.console.url)
        self.wait("the sign-in form", lambda d: self.by_id("token").is_displayed())
        self.by_id("token").send_keys(TOKENS[who])
        self.driver.find_element(By.CSS_SELECTOR, "#sign-in-form button").click()
        self.wait("the console", lambda d: self.by_id("console").is_displayed())
        self.wait("a live feed", lambda d: self.by_id("status").text.startswith("Live"))

    def choose_key(self, path: Path) -> None:
        self.by_id("key-file").send_keys(str(path))  # the file input, as an approver picks it

    def card(self, request_id: str) -> WebElement:
        """The request's card, once its detail (fields and checks) has loaded."""
        selector = f'article[data-request-id="{request_id}"]'

        def loaded(driver: webdriver.Chrome) -> WebElement | None:
            found = driver.find_elements(By.CSS_SELECTOR, selector)
            if found and found[0].find_elements(By.CSS_SELECTOR, ".fields tr"):
                return found[0]
            return None

        card: WebElement = self.wait(f"request {request_id}", loaded)
        return card

    def card_ids(self) -> list[str]:
        cards = self.driver.find_elements(By.CSS_SELECTOR, "article[data-request-id]")
        return [c.get_attribute("data-request-id") or "" for c in cards]

    def fields(self, request_id: str) -> dict[str, str]:
        rows = self.card(request_id).find_elements(By.CSS_SELECTOR, ".fields tr")
        return {
            r.find_element(By.TAG_NAME, "th").text: r.find_element(By.TAG_NAME, "td").text
            for r in rows
        }

    def outcome(self, request_id: str, *, expect: str) -> str:
        """The card's outcome line once it says ``expect`` (or anything, for "")."""
        card = self.card(request_id)
        self.wait(
            f"an outcome {expect!r} on {request_id}",
            lambda d: (
                expect in card.find_element(By.CSS_SELECTOR, ".outcome").text
                and "Signing" not in card.find_element(By.CSS_SELECTOR, ".outcome").text
            ),
        )
        return str(card.find_element(By.CSS_SELECTOR, ".outcome").text)

    def approve(self, request_id: str) -> None:
        button = self.card(request_id).find_element(By.CSS_SELECTOR, "button.approve")
        self.wait("an enabled Approve button", lambda d: button.is_enabled())
        button.click()

    def reject(self, request_id: str, reason: str) -> None:
        card = self.card(request_id)
        card.find_element(By.CSS_SELECTOR, "input.reason").send_keys(reason)
        card.find_element(By.CSS_SELECTOR, "button.reject").click()

    def state_of(self, request_id: str, state: str) -> None:
        card = self.card(request_id)
        self.wait(
            f"{request_id} in state {state}",
            lambda d: card.find_element(By.CSS_SELECTOR, ".badge").text == state,
        )

    def sent(self) -> list[dict[str, Any]]:
        """Every request the browser has sent so far: URL, method, headers
        (those Chrome adds on the wire included) and body."""
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            params = message.get("params", {})
            if message["method"] == "Network.requestWillBeSent":
                request = params["request"]
                self._sent.append({
                    "url": request["url"], "method": request["method"],
                    "headers": request.get("headers", {}),
                    "body": request.get("postData", ""),
                    "has_body": bool(request.get("hasPostData")),
                })  # fmt: skip
            elif message["method"] == "Network.requestWillBeSentExtraInfo":
                self._sent.append({
                    "url": "", "method": "", "headers": params.get("headers", {}),
                    "body": "", "has_body": False,
                })  # fmt: skip
        return list(self._sent)

    def screenshot(self, name: str) -> None:
        self.driver.execute_script("window.scrollTo(0, 0)")  # the newest card is at the top
        save_screenshot(self.driver, name)


@pytest.fixture
def browsers(tmp_path: Path, deployment: Deployment) -> Iterator[Callable[[], Page]]:
    """Opens approvers' browsers, each a fresh profile; all are closed after the test."""
    yield from open_browsers(tmp_path, deployment.console)


def open_browsers(
    tmp_path: Path, console: ConsoleProcess, extra_flags: tuple[str, ...] = ()
) -> Iterator[Callable[[], Page]]:
    """The ``browsers`` fixture's body, for other tiers' fixtures (a console of
    their own, more Chromium flags)."""
    for path, what in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not path.is_file():
            pytest.fail(f"{path} is missing: the browser tests need Debian's {what}"
                        " (make test installs it: scripts/ensure_chromium.sh)")  # fmt: skip
    opened: list[webdriver.Chrome] = []

    def open_page() -> Page:
        options = webdriver.ChromeOptions()
        options.binary_location = str(CHROMIUM)
        for flag in (*CHROMIUM_FLAGS, *extra_flags):
            options.add_argument(flag)
        profile = tmp_path / f"chromium-profile-{len(opened)}"
        options.add_argument(f"--user-data-dir={profile}")
        options.set_capability("goog:loggingPrefs", {"performance": "ALL", "browser": "ALL"})
        driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
        opened.append(driver)
        return Page(driver, console)

    yield open_page
    for driver in opened:
        driver.quit()


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
