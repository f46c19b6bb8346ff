"""Approvals as MCP input requests, end to end: the MCP Python SDK's
Streamable HTTP client calls a dangerous tool through `toolreg mcp --http
--console-url`, gets an InputRequiredResult whose URL-mode elicitation is the
console page of the approval request, two approvers approve it there in
headless Chromium, the client retries with the sealed requestState and the
tool runs exactly once. Then each way a requestState is refused, and what a
pending or rejected request answers (docs/how-to/mcp.md, "Approvals in the
host")."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio
import httpx2
import mcp.types as types
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from registry_server.cli.launcher import spawn_until
from tests import store_file
from tests.browser.conftest import (
    ROOT,
    TOKENS,
    Deployment,
    Page,
    console_env,
)

SERVING = re.compile(r"serving MCP on (\S+)")
CALL_TIMEOUT_S = 120  # seconds: a cold gVisor start, generously
INPUT_KEY = "toolreg_approval"
T = TypeVar("T")


class Bridge:
    def __init__(self, deployment: Deployment, *extra: str) -> None:
        argv = [sys.executable, "-m", "registry_server.cli", "mcp",
                "--address", deployment.server.address, "--http", "127.0.0.1:0",
                "--policy", str(deployment.policy), "--console-url", deployment.console.url,
                *extra]  # fmt: skip
        self.proc, self.url, self.log = spawn_until(
            argv, SERVING, what="toolreg mcp --http", cwd=ROOT, env=console_env()
        )

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def bridge(deployment: Deployment) -> Iterator[Bridge]:
    process = Bridge(deployment)
    yield process
    process.stop()


def modern(url: str, who: str, body: Callable[[ClientSession], Awaitable[T]]) -> T:
    """A 2026-07-28 session (server/discover, no handshake) as `who`."""

    async def run() -> T:
        headers = {"Authorization": f"Bearer {TOKENS[who]}"}
        with anyio.fail_after(CALL_TIMEOUT_S * 2):
            async with (
                httpx2.AsyncClient(headers=headers, timeout=CALL_TIMEOUT_S) as http,
                streamable_http_client(url, http_client=http) as (read, write),
                ClientSession(read, write) as session,
            ):
                found = await session.discover()
                assert "2026-07-28" in found.supported_versions
                return await body(session)

    return anyio.run(run)


def call(
    url: str, who: str, note: str, state: str | None = None, action: str = "accept"
) -> types.CallToolResult | types.InputRequiredResult | MCPError:
    """One tools/call of deploy_note: its result, input request or JSON-RPC error."""

    async def body(session: ClientSession) -> Any:
        responses: Any = None
        if state is not None:
            responses = {INPUT_KEY: types.ElicitResult(action=action)}  # type: ignore[arg-type]
        try:
            return await session.call_tool(
                "deploy_note", {"note": note}, read_timeout_seconds=CALL_TIMEOUT_S,
                allow_input_required=True, input_responses=responses, request_state=state,
            )  # fmt: skip
        except MCPError as err:
            return err

    result: types.CallToolResult | types.InputRequiredResult | MCPError = modern(url, who, body)
    return result


def asked(result: object) -> tuple[types.ElicitRequestURLParams, str]:
    """The URL elicitation and the requestState of an input request."""
    assert isinstance(result, types.InputRequiredResult), result
    assert result.input_requests is not None and result.request_state
    ask = result.input_requests[INPUT_KEY]
    assert isinstance(ask, types.ElicitRequest)
    assert isinstance(ask.params, types.ElicitRequestURLParams)
    return ask.params, result.request_state


def request_of(page: types.ElicitRequestURLParams) -> str:
    """The approval request a page is of (2026-07-28 drops elicitationId)."""
    return page.url.rsplit("/", 1)[1]


def executions(deployment: Deployment, request_id: str) -> list[dict[str, Any]]:
    """The audit's executions of a call approved under this request that ran."""
    rows = store_file.audit_rows(deployment.data_dir, "execution")
    records = [json.loads(r) for _, _k, r in rows]
    return [r for r in records if r["approval_request_id"] == request_id and r["status"] == "OK"]


def test_the_host_is_asked_two_approvers_approve_in_chromium_and_the_call_runs_once(
    deployment: Deployment, bridge: Bridge, browsers: Callable[[], Page]
) -> None:
    note = "release 3.1 through an MCP host"
    page, state = asked(call(bridge.url, "agent", note))
    request_id = request_of(page)
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    # The console page of this request; no credential in it.
    assert page.url == f"{deployment.console.url.rstrip('/')}/#/requests/{request_id}"
    assert page.mode == "url"
    assert "deploy_note" in page.message and "2 approval(s) needed" in page.message
    assert "security" in page.message  # the rule's approvers
    assert all(token not in page.url + state for token in TOKENS.values())

    # Still pending: the retry is asked again, for the same request.
    again, state = asked(call(bridge.url, "agent", note, state))
    assert request_of(again) == request_id
    assert executions(deployment, request_id) == []

    for who in ("alice", "bob"):
        approver = browsers()
        approver.sign_in(who)
        approver.driver.get(page.url)  # the page the host showed its user
        approver.choose_key(deployment.keys[who])
        approver.approve(request_id)
        approver.outcome(request_id, expect="Approved as")

    done = call(bridge.url, "agent", note, state)
    assert isinstance(done, types.CallToolResult) and not done.is_error, done
    assert json.loads(done.content[0].text) == {"note": note}  # type: ignore[union-attr]
    # The same state again: the approval is used up, the tool does not run twice.
    replay = call(bridge.url, "agent", note, state)
    assert not (isinstance(replay, types.CallToolResult) and not replay.is_error), replay
    assert len(executions(deployment, request_id)) == 1

    log = "".join(bridge.log)
    assert "Traceback" not in log
    assert all(token not in log for token in TOKENS.values()) and state not in log


def test_a_request_state_is_refused_when_tampered_replayed_or_for_other_arguments(
    deployment: Deployment, bridge: Bridge
) -> None:
    note = "a state that must not travel"
    page, state = asked(call(bridge.url, "agent", note))
    request_id = request_of(page)
    last = state[-1]
    tampered = state[:-1] + ("A" if last != "A" else "B")
    refusals = {
        "tampered": call(bridge.url, "agent", note, tampered),
        "another principal": call(bridge.url, "viewer", note, state),
        "other arguments": call(bridge.url, "agent", note + " and more", state),
    }
    for what, refused in refusals.items():
        assert isinstance(refused, MCPError), (what, refused)
        assert refused.error.code == types.INVALID_PARAMS, what
        assert refused.error.message == "Invalid or expired requestState", what
    # Nothing ran, and the genuine state still works for its own caller.
    assert isinstance(call(bridge.url, "agent", note, state), types.InputRequiredResult)
    assert executions(deployment, request_id) == []


def test_an_expired_request_state_is_refused(deployment: Deployment) -> None:
    short = Bridge(deployment, "--approval-state-ttl-s", "1")
    try:
        _page, state = asked(call(short.url, "agent", "a state that ages"))
        time.sleep(1.5)
        refused = call(short.url, "agent", "a state that ages", state)
    finally:
        short.stop()
    assert isinstance(refused, MCPError), refused
    assert refused.error.code == types.INVALID_PARAMS
    assert refused.error.message == "Invalid or expired requestState"


def test_a_rejected_request_answers_the_approvers_reason(
    deployment: Deployment, bridge: Bridge, browsers: Callable[[], Page]
) -> None:
    note = "drop the production database"
    page, state = asked(call(bridge.url, "agent", note))
    request_id = request_of(page)
    alice = browsers()
    alice.sign_in("alice")
    alice.driver.get(page.url)
    alice.reject(request_of(page), "not during the freeze")
    alice.state_of(request_of(page), "REJECTED")
    refused = call(bridge.url, "agent", note, state)
    assert isinstance(refused, types.CallToolResult) and refused.is_error, refused
    text = refused.content[0].text  # type: ignore[union-attr]
    assert text.startswith("APPROVAL_DENIED") and "not during the freeze" in text, text
    assert executions(deployment, request_id) == []


def test_a_declined_page_is_an_error_and_nothing_runs(
    deployment: Deployment, bridge: Bridge
) -> None:
    note = "the person said no"
    page, state = asked(call(bridge.url, "agent", note))
    request_id = request_of(page)
    declined = call(bridge.url, "agent", note, state, action="decline")
    assert isinstance(declined, types.CallToolResult) and declined.is_error, declined
    assert "declined" in declined.content[0].text  # type: ignore[union-attr]
    assert executions(deployment, request_id) == []


def legacy(
    url: str, who: str, body: Callable[[ClientSession], Awaitable[T]], elicit: Any = None
) -> T:
    """A 2025-11-25 session (initialize) as `who`; with `elicit`, the client
    declares elicitation (form and URL) and answers with it."""

    async def run() -> T:
        headers = {"Authorization": f"Bearer {TOKENS[who]}"}
        with anyio.fail_after(CALL_TIMEOUT_S * 2):
            async with (
                httpx2.AsyncClient(headers=headers, timeout=CALL_TIMEOUT_S) as http,
                streamable_http_client(url, http_client=http) as (read, write),
                ClientSession(read, write, elicitation_callback=elicit) as session,
            ):
                init = await session.initialize()
                assert init.protocol_version == "2025-11-25"
                return await body(session)

    return anyio.run(run)


def test_on_2025_11_25_a_client_with_url_elicitation_is_sent_the_page(
    deployment: Deployment, bridge: Bridge
) -> None:
    note = "the older revision asks too"
    shown: list[types.ElicitRequestURLParams] = []

    async def approve_then_accept(_ctx: Any, params: Any) -> types.ElicitResult:
        assert isinstance(params, types.ElicitRequestURLParams)
        shown.append(params)
        request_id = request_of(params)
        for who in ("alice", "bob"):  # approvers act while the host waits
            done = await anyio.run_process(
                [sys.executable, "-m", "registry_server.cli", "--token", TOKENS[who],
                 "approvals", "approve", request_id, "--key", str(deployment.keys[who])],
                check=False, env={**console_env(), "TOOLREG_ADDRESS": deployment.server.address},
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
        return types.ElicitResult(action="accept")

    async def body(session: ClientSession) -> types.CallToolResult:
        return await session.call_tool(
            "deploy_note", {"note": note}, read_timeout_seconds=CALL_TIMEOUT_S
        )

    result = legacy(bridge.url, "agent", body, elicit=approve_then_accept)
    assert not result.is_error, result
    (page,) = shown
    assert page.mode == "url" and page.url.startswith(deployment.console.url.rstrip("/"))
    assert page.elicitation_id == request_of(page)
    assert len(executions(deployment, request_of(page))) == 1

    # A client that declares no elicitation keeps the text answer.
    plain = legacy(bridge.url, "agent", body)
    assert plain.is_error
    assert plain.content[0].text.startswith("APPROVAL_REQUIRED")  # type: ignore[union-attr]
