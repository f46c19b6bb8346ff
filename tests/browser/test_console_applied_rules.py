"""Approvers see which approval rules apply to a request and why (issue 28):
a policy whose rule `sre-prod` needs 2 approvals from group sre only when
`args.env == "prod"`, beside an unconditional rule for the same tool. The
console's page lists each rule on the request's card (its name, its
condition in a code element, the approvals and groups), and `toolreg
approvals show` prints one `needs` line per rule. A real `toolreg serve` and
`toolreg console`, headless Chromium, as in test_console_browser.py.

With TOOLREG_SCREENSHOTS=docs/images this also writes console-rules.png."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from selenium.webdriver.common.by import By

from registry_server.cli.launcher import ServerProcess, spawn_server
from registry_server.client.registry_client import RegistryClient
from registry_server.signing.keys import generate_keypair
from tests.browser.conftest import (
    CALL_TIMEOUT_S,
    ROOT,
    TOKENS,
    ConsoleProcess,
    Page,
    open_browsers,
    run_cli,
    spawn_console,
    write_policy,
    write_tools,
)
from tests.browser.test_console_browser import csp_violations

CONDITION = 'args.env == "prod"'
SRE = ("alice", "bob")  # approvers in group sre (besides their own group)
RELEASE = {  # a dangerous tool whose calls name their environment
    "name": "release",
    "description": "Records a release note for an environment; a test tool.",
    "safety_level": "dangerous",
    "parameters": {
        "type": "object",
        "properties": {"env": {"type": "string"}, "note": {"type": "string"}},
        "required": ["env", "note"],
    },
    "sandbox": {"image": "toolreg/base", "command": ["sh", "-c", "cat"]},
}
RULES = [  # after write_policy's two (rules 1 and 2)
    {
        "name": "sre-prod",
        "match": {"tool": "release"},
        "when": CONDITION,
        "approvals_required": 2,
        "groups": ["sre"],
        "max_token_ttl_s": 600,
    },
    {"match": {"tool": "release"}, "approvals_required": 1, "groups": ["ops"]},  # rule 4
]


@dataclass
class World:
    server: ServerProcess
    console: ConsoleProcess
    agent: RegistryClient

    def ask(self, env: str, note: str) -> str:
        """The agent calls release; the id of the approval request it gets."""
        args = {"env": env, "note": note}
        result = self.agent.execute_tool("release", args, timeout=CALL_TIMEOUT_S)
        assert result.needs_approval and result.approval_request is not None, result
        return result.approval_request.id


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("console-rules")
    policy = base / "policy.yaml"
    write_policy(policy, {who: generate_keypair()[1] for who in ("alice", "bob", "carol")})
    text: dict[str, Any] = yaml.safe_load(policy.read_text())
    for approver in text["approvers"]:
        if approver["id"] in SRE:
            approver["groups"].append("sre")
    text["approval_rules"] += RULES
    policy.write_text(yaml.safe_dump(text, sort_keys=False))
    tools = write_tools(base / "tools")
    (tools / "release.yaml").write_text(yaml.safe_dump(RELEASE, sort_keys=False))
    server = spawn_server(base / "data", "--tools", str(tools), "--policy", str(policy), cwd=ROOT)
    console = agent = None
    try:
        console = spawn_console(server.address, "--policy", str(policy))
        agent = RegistryClient.connect(server.address, token=TOKENS["agent"])
        yield World(server, console, agent)
    finally:
        if agent is not None:
            agent.close()
        if console is not None:
            console.stop()
        server.stop()


@pytest.fixture
def browsers(tmp_path: Path, world: World) -> Iterator[Callable[[], Page]]:
    yield from open_browsers(tmp_path, world.console)


def shown_rules(page: Page, request_id: str) -> list[dict[str, str]]:
    """The card's rules as the approver reads them: each item's whole text,
    its name and its condition (the code element's text, "" without one)."""
    box = page.card(request_id).find_element(By.CSS_SELECTOR, ".rules")
    assert box.is_displayed()
    shown = []
    for item in box.find_elements(By.CSS_SELECTOR, "li.rule"):
        names = item.find_elements(By.CSS_SELECTOR, "strong.rule-name")
        conditions = item.find_elements(By.CSS_SELECTOR, "code.rule-condition")
        shown.append({
            "text": item.text,
            "name": names[0].text if names else "",
            "condition": conditions[0].text if conditions else "",
        })  # fmt: skip
    return shown


def test_the_page_shows_which_rules_apply_and_why(
    world: World, browsers: Callable[[], Page]
) -> None:
    staging = world.ask("staging", "release 2.4 to staging")
    prod = world.ask("prod", "release 2.4 to production")  # the newest: the top card
    alice = browsers()
    alice.sign_in("alice")

    assert shown_rules(alice, prod) == [
        {
            "text": f"2 approval(s) from sre: rule sre-prod, when {CONDITION}",
            "name": "sre-prod",
            "condition": CONDITION,
        },
        {
            "text": "1 approval(s) from ops: rule 4 (tool release)",
            "name": "rule 4",
            "condition": "",
        },
    ]
    # The condition does not hold for staging: only the unconditional rule
    # applies, and carol (ops) is who may approve it.
    carol = browsers()
    carol.sign_in("carol")
    assert shown_rules(carol, staging) == [
        {
            "text": "1 approval(s) from ops: rule 4 (tool release)",
            "name": "rule 4",
            "condition": "",
        },
    ]
    assert carol.fields(staging)["approvals"] == "0 of 1 (nobody yet); 1 more needed"

    alice.screenshot("console-rules.png")
    assert csp_violations(alice) == [] and csp_violations(carol) == []


def test_approvals_show_prints_each_rule_that_applies(world: World) -> None:
    request_id = world.ask("prod", "release 2.5 to production")
    shown = run_cli(
        "--token", TOKENS["alice"], "approvals", "show", request_id,
        "--address", world.server.address,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    needs = [line for line in shown.stdout.splitlines() if line.startswith("needs ")]
    assert needs == [
        f"needs     2 approval(s) from sre — rule sre-prod (when {CONDITION})",
        "needs     1 approval(s) from ops — rule 4 (tool release)",
    ]
